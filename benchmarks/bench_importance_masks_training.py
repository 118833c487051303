"""What a deep VAE trained by MPT with importance-sampled conditionals gains from more
masks per image and from more draws, and what each costs: a K=16 Bernoulli VAE on MNIST
trained by ``Trace_ELBO``, by the IWAE bound and by ``MPTLoss(guide_loss="wake")`` with
``ImportanceSampling(S, share_samples=True, num_proposals=Q)`` and ``P`` masks per image.

``Q`` masks per image draw ``S`` samples each from the guide; all ``P`` masks weight the
``S * Q`` pooled draws toward their own context (the model runs ``S * Q`` times per image,
as the IWAE bound with ``k = S * Q`` does). Masks that draw nothing cost matrix products
only, and average more stages of the chain rule per image, the main noise of the MPT
gradient. Rows marked ``+unmasked`` pass ``unmasked_proposal=True``: the guide on the
unmasked image draws ``S`` more, pooled with the masks' draws; ``Q=0+unmasked``: only the
guide on the unmasked image draws (``num_proposals=0``); ``shared masks``: the images of a
batch share their ``P`` masks (``share_masks=True``). Every run starts from the
same initialisation per seed and sees the same batches; held-out LML per image by the IWAE
bound with each run's own encoder and ``eval_samples`` draws (the same procedure for every
row). Step: the median over interleaved rounds of one optimiser step on a batch, against a
``Trace_ELBO`` step in the same rounds.

``--long`` trains the ELBO, IWAE (k=8) and three MPT rows (P=16, Q=4, S=2; P=16,
Q=1+unmasked, S=4; P=12, Q=0+unmasked, S=8; all with eight draws per image) five times as
long, 100 epochs, with
the held-out LML every 5 epochs, to show where each stands once the ELBO has levelled off:
whether MPT only trains slower, or levels off lower.

Usage::

    python benchmarks/bench_importance_masks_training.py [--smoke | --long] [--seeds 2]
        [--threads 1] [--json PATH]

The figures that docs/deep_vae.rst renders are in
``docs/results/importance-masks-training.json`` and
``docs/results/importance-masks-long.json``, written by
``python -m experiments.render --rerun importance-masks-training importance-masks-long``
(this script with ``--threads 1``, and with ``--long``; 2 seeds, about 40 and 16 minutes).
"""

import statistics
import sys

import pyro
import torch
from _common import benchmark_main, make_report, median_ms, print_results, time_calls
from pyro.infer import RenyiELBO, Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import VAE

#: Sizes: images, held-out images, hidden units, latent size, epochs, batch, Adam's rate,
#: draws of the held-out IWAE bound, epochs between held-out figures, timing rounds and
#: steps per round, and the rows trained (None: all of :data:`ROWS`).
SIZES = {
    "default": dict(N=2000, N_test=100, hidden=200, latent=16, epochs=20, batch=100, lr=3e-3,
                    eval_samples=1000, eval_every=1, timing_rounds=5, timing_steps=5,
                    rows=None),
    "long": dict(N=2000, N_test=100, hidden=200, latent=16, epochs=100, batch=100, lr=3e-3,
                 eval_samples=1000, eval_every=5, timing_rounds=5, timing_steps=5,
                 rows=["Trace_ELBO", "IWAE, k=8", "MPT, P=16, Q=4, S=2",
                       "MPT, P=16, Q=1+unmasked, S=4", "MPT, P=12, Q=0+unmasked, S=8"]),
    "smoke": dict(N=64, N_test=16, hidden=16, latent=4, epochs=2, batch=32, lr=1e-2,
                  eval_samples=32, eval_every=1, timing_rounds=1, timing_steps=1, rows=None),
}  # fmt: skip

#: Rows: label -> (loss kind, masks P, proposals Q, draws S per proposal, whether the guide
#: on the unmasked input proposes too: ``unmasked_proposal=True``, one more proposal).
ROWS = {
    "Trace_ELBO": ("elbo", None, None, 1, False),
    "IWAE, k=8": ("iwae", None, None, 8, False),
    "IWAE, k=32": ("iwae", None, None, 32, False),
    "MPT, P=4, Q=4, S=2": ("mpt", 4, 4, 2, False),
    "MPT, P=16, Q=4, S=2": ("mpt", 16, 4, 2, False),
    "MPT, P=64, Q=4, S=2": ("mpt", 64, 4, 2, False),
    "MPT, P=16, Q=4, S=4": ("mpt", 16, 4, 4, False),
    "MPT, P=16, Q=4, S=8": ("mpt", 16, 4, 8, False),
    "MPT, P=16, Q=4+unmasked, S=2": ("mpt", 16, 4, 2, True),
    "MPT, P=16, Q=1+unmasked, S=4": ("mpt", 16, 1, 4, True),
    "MPT, P=8, Q=0+unmasked, S=8": ("mpt", 8, 0, 8, True),
    "MPT, P=12, Q=0+unmasked, S=8": ("mpt", 12, 0, 8, True),
    "MPT, P=16, Q=0+unmasked, S=8": ("mpt", 16, 0, 8, True),
    "MPT, P=16, Q=0+unmasked, S=8, shared masks": ("mpt", 16, 0, 8, True),
}

#: Rows whose masks are shared by the images of a batch (``MPTLoss(share_masks=True)``).
SHARED_MASKS = {"MPT, P=16, Q=0+unmasked, S=8, shared masks"}


def _loss(label):
    kind, masks, proposals, samples, unmasked = ROWS[label]
    if kind == "elbo":
        return Trace_ELBO(max_plate_nesting=1)
    if kind == "iwae":
        return RenyiELBO(
            alpha=0, num_particles=samples, vectorize_particles=True, max_plate_nesting=1
        )
    conditionals = ImportanceSampling(
        samples, share_samples=True, num_proposals=proposals, unmasked_proposal=unmasked
    )
    return MPTLoss(
        rate="uniform",
        num_masks=masks,
        share_masks=label in SHARED_MASKS,
        conditionals=conditionals,
        guide_loss="wake",
        max_plate_nesting=1,
    )


def _new_vae(cfg, seed, like):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    vae = VAE(784, latent_dim=cfg["latent"], hidden_dim=cfg["hidden"], likelihood="bernoulli")
    return vae.to(dtype=like.dtype, device=like.device)


def _held_out(vae, x_test, cfg):
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        conditionals = ImportanceSampling(cfg["eval_samples"])
        values = log_marginal(vae.model, x_test, conditionals=conditionals, guide=vae.guide)
    return float(values.mean())


def _train(label, x, x_test, cfg, seed):
    vae = _new_vae(cfg, seed, x)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    loss_fn = _loss(label)
    pyro.set_rng_seed(seed + 1)  # the same batches for every row of a seed
    curve = []
    for epoch in range(1, cfg["epochs"] + 1):
        for idx in torch.randperm(x.shape[0]).split(cfg["batch"]):
            optimizer.zero_grad()
            loss_fn.loss_and_grads(vae.model, vae.guide, x[idx])
            optimizer.step()
        if epoch % cfg["eval_every"] == 0 or epoch == cfg["epochs"]:
            curve.append(_held_out(vae, x_test, cfg))
    pyro.clear_param_store()
    return dict(held_out_curve=curve, held_out=curve[-1])


def _step_ratios(x, cfg, device, rows):
    """Median milliseconds of one step of each of ``rows``, timed in interleaved rounds."""
    vae = _new_vae(cfg, 0, x)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    batch = x[: cfg["batch"]]

    def step(loss_fn):
        def call():
            optimizer.zero_grad()
            loss_fn.loss_and_grads(vae.model, vae.guide, batch)
            optimizer.step()

        return call

    fns = {label: step(_loss(label)) for label in rows}
    times = time_calls(fns, device, cfg["timing_steps"], cfg["timing_rounds"])
    pyro.clear_param_store()
    return {label: median_ms(ms) for label, ms in times.items()}


def run(device, smoke=False, long=False, seeds=2):
    if smoke and long:
        raise ValueError("--smoke and --long exclude each other; pass one of them.")
    cfg = SIZES["smoke" if smoke else "long" if long else "default"]
    rows = cfg["rows"] or list(ROWS)
    x_all, _ = load_mnist(cfg["N"] + cfg["N_test"], binarize=True, seed=0, dtype=torch.float32)
    x, x_test = x_all[: cfg["N"]].to(device), x_all[cfg["N"] :].to(device)
    step_ms = _step_ratios(x, cfg, device, rows)
    runs = {label: [_train(label, x, x_test, cfg, 10 * s) for s in range(seeds)] for label in rows}
    elbo = [r["held_out"] for r in runs["Trace_ELBO"]]
    results = []
    for label, per_seed in runs.items():
        kind, masks, proposals, samples, unmasked = ROWS[label]
        values = [r["held_out"] for r in per_seed]
        gaps = [v - e for v, e in zip(values, elbo)]
        results.append(
            dict(
                row=label,
                draws_per_image=samples * ((1 if proposals is None else proposals) + unmasked),
                held_out=statistics.mean(values),
                held_out_per_seed=values,
                vs_elbo=statistics.mean(gaps),
                vs_elbo_per_seed=gaps,
                step_ms=step_ms[label],
                step_vs_elbo=step_ms[label] / step_ms["Trace_ELBO"],
                curves=[r["held_out_curve"] for r in per_seed],
            )
        )
    epochs = [e for e in range(1, cfg["epochs"] + 1) if e % cfg["eval_every"] == 0]
    if epochs[-1] != cfg["epochs"]:
        epochs.append(cfg["epochs"])
    return make_report(device, results, dict(cfg, seeds=seeds, rows=rows, curve_epochs=epochs))


def print_report(report):
    print_results(
        report,
        "row: {row} | draws: {draws_per_image} | held-out LML: {held_out:.2f} | "
        "vs ELBO: {vs_elbo:+.2f} | step: {step_vs_elbo:.2f}x ELBO",
        "Deep Bernoulli VAE, K={latent}: held-out LML (IWAE bound, own encoder) after {epochs} "
        "epochs, mean over {seeds} seeds ({device}, {threads} threads)",
        latent=report["config"]["latent"],
        epochs=report["config"]["epochs"],
        seeds=report["config"]["seeds"],
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    smoke = ("--smoke", {"action": "store_true", "help": "a few seconds: tiny sizes"})
    long = ("--long", {"action": "store_true", "help": "three rows, 100 epochs"})
    seeds = ("--seeds", {"type": int, "default": 2, "help": "seeds per row"})
    return benchmark_main(__doc__, argv, run, print_report, options=[smoke, long, seeds])


if __name__ == "__main__":
    main()
