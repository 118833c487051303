"""How much of MPT's slower training is the spread of its one-mask estimate: a deep
Bernoulli VAE with a 2-D latent trained by ``Trace_ELBO`` and by ``MPTLoss`` with
quadrature conditionals (no guide, nodes under the prior: conditionals as good as exact),
with 1 and 4 masks per image and step.

With exact conditionals the uniform-rate MPT estimate is unbiased for ``log p(x)``, so its
optimum is the maximum-likelihood model; what separates it from the ELBO at a fixed number
of steps is how noisy its gradient is. One mask per image scores one random stage of the
chain rule, scaled by D; several masks per image (``num_masks``, stratified sizes) average
several. The held-out LML of every run is computed by quadrature with 64 nodes per latent
dimension, which favours no run's encoder.

Usage::

    python benchmarks/bench_mpt_masks_training.py [--smoke] [--seeds 2] [--threads 1]
        [--json PATH]

Without ``--json`` the figures are written to ``benchmarks/results/mpt_masks_training.json``,
the committed file that docs/deep_vae.rst cites (2 seeds, 1 thread, about 20 minutes).
"""

import pathlib
import statistics
import sys
import time

import pyro
import torch
from _common import benchmark_main, make_report, print_results
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import VAE

DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "mpt_masks_training.json"

#: Sizes: images, held-out images, hidden units, epochs, batch, Adam's rate, quadrature
#: nodes per latent dimension for training and for the held-out LML.
SIZES = {
    "default": dict(N=2000, N_test=100, hidden=200, epochs=20, batch=100, lr=3e-3,
                    train_points=32, eval_points=64),
    "smoke": dict(N=64, N_test=16, hidden=16, epochs=2, batch=32, lr=1e-2,
                  train_points=8, eval_points=16),
}  # fmt: skip

#: Rows: label -> loss kind and masks per image.
ROWS = {
    "Trace_ELBO": ("elbo", None),
    "MPT, quadrature, 1 mask": ("mpt", 1),
    "MPT, quadrature, 4 masks": ("mpt", 4),
}


def _loss(kind, masks, cfg):
    if kind == "elbo":
        return Trace_ELBO(max_plate_nesting=1)
    return MPTLoss(
        rate="uniform",
        num_masks=masks,
        conditionals=Quadrature(cfg["train_points"]),
        guide_loss=None,
        max_plate_nesting=1,
    )


def _held_out(vae, x_test, cfg):
    with torch.no_grad():
        values = log_marginal(vae.model, x_test, conditionals=Quadrature(cfg["eval_points"]))
    return float(values.mean())


def _train(label, x, x_test, cfg, seed):
    kind, masks = ROWS[label]
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    vae = VAE(784, latent_dim=2, hidden_dim=cfg["hidden"], likelihood="bernoulli")
    vae = vae.to(dtype=x.dtype)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    loss_fn = _loss(kind, masks, cfg)
    pyro.set_rng_seed(seed + 1)  # the same batches for every row of a seed
    curve, start = [], time.perf_counter()
    for _ in range(cfg["epochs"]):
        for idx in torch.randperm(x.shape[0]).split(cfg["batch"]):
            optimizer.zero_grad()
            if kind == "mpt":
                # Guide-free: the encoder is not used and gets no gradient.
                loss_fn.loss_and_grads(vae.model, None, x[idx])
            else:
                loss_fn.loss_and_grads(vae.model, vae.guide, x[idx])
            optimizer.step()
        curve.append(_held_out(vae, x_test, cfg))
    seconds = time.perf_counter() - start
    pyro.clear_param_store()
    return dict(held_out_curve=curve, held_out=curve[-1], seconds=seconds)


def run(device, smoke=False, seeds=2):
    cfg = SIZES["smoke" if smoke else "default"]
    x_all, _ = load_mnist(cfg["N"] + cfg["N_test"], binarize=True, seed=0, dtype=torch.float32)
    x, x_test = x_all[: cfg["N"]].to(device), x_all[cfg["N"] :].to(device)
    runs = {label: [_train(label, x, x_test, cfg, 10 * s) for s in range(seeds)] for label in ROWS}
    elbo = [r["held_out"] for r in runs["Trace_ELBO"]]
    results = []
    for label, per_seed in runs.items():
        values = [r["held_out"] for r in per_seed]
        gaps = [v - e for v, e in zip(values, elbo)]
        results.append(
            dict(
                row=label,
                held_out=statistics.mean(values),
                held_out_per_seed=values,
                vs_elbo=statistics.mean(gaps),
                seconds_per_epoch=statistics.mean(r["seconds"] for r in per_seed) / cfg["epochs"],
                curves=[r["held_out_curve"] for r in per_seed],
            )
        )
    return make_report(device, results, dict(cfg, seeds=seeds, latent_dim=2))


def print_report(report):
    print_results(
        report,
        "row: {row} | held-out LML: {held_out:.2f} | vs ELBO: {vs_elbo:+.2f} | "
        "s/epoch: {seconds_per_epoch:.2f}",
        "Deep Bernoulli VAE, K=2: held-out LML by quadrature after {epochs} epochs, mean over "
        "{seeds} seeds ({device}, {threads} threads)",
        epochs=report["config"]["epochs"],
        seeds=report["config"]["seeds"],
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(arg == "--json" or arg.startswith("--json=") for arg in argv):
        DEFAULT_JSON.parent.mkdir(exist_ok=True)
        argv += ["--json", str(DEFAULT_JSON)]
    smoke = ("--smoke", {"action": "store_true", "help": "a few seconds: tiny sizes"})
    seeds = ("--seeds", {"type": int, "default": 2, "help": "seeds per row"})
    return benchmark_main(__doc__, argv, run, print_report, options=[smoke, seeds])


if __name__ == "__main__":
    main()
