"""Accuracy and cost of a quadrature rule by its number of nodes: a linear Bernoulli VAE
(K=2) trained by the ELBO on binarised MNIST, its log-marginal likelihood per image under
``Quadrature(n)`` against a much finer rule, and one ``MPTLoss`` loss-and-gradient
evaluation under ``Quadrature(n)`` against one of ``Trace_ELBO``.

The model is trained first (``Trace_ELBO``, the same seed every run), so that the integrals
are those of a fitted decoder, whose posteriors are narrower than at initialisation and so
harder for a rule centred at the prior. The error of each rule is the mean over the images
of ``log p(x)`` under it minus ``log p(x)`` under the reference rule (``reference_points``
per dimension). The evaluations take turns in interleaved rounds (median milliseconds),
on one batch, after warm-up calls.

Usage::

    python benchmarks/bench_quadrature_nodes.py [--smoke] [--threads 1] [--json PATH]

The figures that docs/performance.rst renders are in
``docs/results/quadrature-nodes.json``, written by
``python -m experiments.render --rerun quadrature-nodes`` (this script with
``--threads 1``; about ten seconds).
"""

import sys

import pyro
import torch
from _common import benchmark_main, make_report, median_ms, print_results, time_calls
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import LinearVAE

#: Sizes: images, training epochs, batch, Adam's rate, rules' points per dimension, the
#: reference rule's, images per ``log_marginal`` call, timing rounds and calls per round.
SIZES = {
    "default": dict(N=1000, epochs=30, batch=100, lr=1e-2, points=[5, 10, 15, 20, 40],
                    reference_points=80, chunk=100, timing_batch=128, timing_rounds=9,
                    timing_calls=10),
    "smoke": dict(N=64, epochs=2, batch=32, lr=1e-2, points=[5, 10], reference_points=20,
                  chunk=32, timing_batch=32, timing_rounds=1, timing_calls=1),
}  # fmt: skip


def _trained_vae(x, cfg):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    vae = LinearVAE(x.shape[-1], latent_dim=2).to(dtype=x.dtype, device=x.device)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    elbo = Trace_ELBO(max_plate_nesting=1)
    for _ in range(cfg["epochs"]):
        for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["batch"]):
            optimizer.zero_grad()
            elbo.loss_and_grads(vae.model, vae.guide, x[idx])
            optimizer.step()
    return vae


def _log_marginals(vae, x, num_points, chunk):
    """``log p(x)`` of every image under ``Quadrature(num_points)`` centred at the prior."""
    rule = Quadrature(num_points=num_points, center="prior")
    with torch.no_grad():
        parts = [log_marginal(vae.model, part, conditionals=rule) for part in x.split(chunk)]
    return torch.cat(parts).double()


def _no_guide(x):
    """A guide that samples nothing: quadrature conditionals do not use one."""


def _evaluation_ms(vae, batch, cfg, device):
    """Median milliseconds of one loss-and-gradient evaluation per rule and of
    ``Trace_ELBO``'s, timed in interleaved rounds."""

    def evaluation(loss_fn, guide):
        def call():
            vae.zero_grad(set_to_none=True)
            loss_fn.loss_and_grads(vae.model, guide, batch)

        return call

    losses = {"Trace_ELBO": Trace_ELBO(max_plate_nesting=1)}
    for n in cfg["points"]:
        rule = Quadrature(num_points=n, center="prior")
        losses[n] = MPTLoss(rate="uniform", conditionals=rule, max_plate_nesting=1)
    # Quadrature integrates the latents out without the guide: the MPT losses get none.
    fns = {
        name: evaluation(loss_fn, vae.guide if name == "Trace_ELBO" else _no_guide)
        for name, loss_fn in losses.items()
    }
    times = time_calls(fns, device, cfg["timing_calls"], cfg["timing_rounds"])
    return {name: median_ms(ms) for name, ms in times.items()}


def run(device, smoke=False):
    cfg = SIZES["smoke" if smoke else "default"]
    x, _ = load_mnist(cfg["N"], binarize=True, seed=0, dtype=torch.float32)
    x = x.to(device)
    vae = _trained_vae(x, cfg)
    reference = _log_marginals(vae, x, cfg["reference_points"], cfg["chunk"])
    pyro.set_rng_seed(1)
    ms = _evaluation_ms(vae, x[: cfg["timing_batch"]], cfg, device)
    results = []
    for n in cfg["points"]:
        error = _log_marginals(vae, x, n, cfg["chunk"]) - reference
        results.append(
            dict(
                num_points=n,
                nodes=n**2,
                mean_error=float(error.mean()),
                max_abs_error=float(error.abs().max()),
                evaluation_ms=ms[n],
                vs_elbo=ms[n] / ms["Trace_ELBO"],
            )
        )
    pyro.clear_param_store()
    config = dict(cfg, latent=2, dtype="float32", reference_log_marginal=float(reference.mean()))
    return make_report(device, results, config, elbo_ms=ms["Trace_ELBO"])


def print_report(report):
    print_results(
        report,
        "points: {num_points} | nodes: {nodes} | LML error: {mean_error:+.4f} nats/image "
        "(worst {max_abs_error:.3f}) | evaluation: {vs_elbo:.2f}x Trace_ELBO",
        "Linear Bernoulli VAE, K=2, N={N}: Quadrature(n) against {reference} points per "
        "dimension ({device}, {threads} threads)",
        N=report["config"]["N"],
        reference=report["config"]["reference_points"],
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    smoke = ("--smoke", {"action": "store_true", "help": "a few seconds: tiny sizes"})
    return benchmark_main(__doc__, argv, run, print_report, options=[smoke])


if __name__ == "__main__":
    main()
