"""One SVI step of ``MPTLoss`` against one of ``Trace_ELBO`` on PPCA.

The model is ``pyro_mpt.models.PPCA(num_features=512, latent_dim=10,
guide_covariance="diagonal", subsample_size=256)`` on N=4096 observations, so each step
sees a mini-batch of 256 through the data plate's subsampling. ``MPTLoss(rate="uniform",
num_masks=1)`` integrates the latent out exactly (Woodbury conditionals); ``Trace_ELBO``
uses the model's mean-field amortized guide. Both losses drive the same module, each with its
own Adam optimiser, and their steps are timed in interleaved blocks.

A second table splits ``differentiable_loss`` into its forward pass and ``backward()``.

Usage::

    python benchmarks/bench_svi_step.py [--device cuda] [--steps 20] [--json out.json]
"""

import itertools

import pyro
import torch
from _common import (
    DTYPES,
    benchmark_main,
    constants,
    dtype_name,
    make_report,
    median_ms,
    print_results,
    set_default_dtype,
    time_svi_steps,
)
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.models import PPCA

__all__ = ["main", "print_report", "run"]

NUM_DATA = 4096
NUM_FEATURES = 512
LATENT_DIM = 10
SUBSAMPLE_SIZE = 256
TARGET_RATIO = 2.0


def _make_data(num_data, num_features, latent_dim, device, dtype):
    """Data from a PPCA with unit-scale loadings and noise scale 0.5."""
    weight = torch.randn(num_features, latent_dim, device=device, dtype=dtype)
    z = torch.randn(num_data, latent_dim, device=device, dtype=dtype)
    noise = torch.randn(num_data, num_features, device=device, dtype=dtype)
    return z @ weight.T + 0.5 * noise


def run_dtype(dtype, device="cpu", steps=20, repeats=5, warmup=5, seed=0):
    """Times both losses in one dtype; returns a dict of milliseconds and the ratio."""
    device = torch.device(device)
    with set_default_dtype(dtype), torch.device(device):
        pyro.clear_param_store()
        torch.manual_seed(seed)
        data = _make_data(NUM_DATA, NUM_FEATURES, LATENT_DIM, device, dtype)
        ppca = PPCA(
            num_features=NUM_FEATURES,
            latent_dim=LATENT_DIM,
            guide_covariance="diagonal",
            subsample_size=SUBSAMPLE_SIZE,
        )
        losses = {"elbo": Trace_ELBO(), "mpt": MPTLoss(rate="uniform", num_masks=1)}
        batches = itertools.repeat(data)
        calls = steps * repeats
        times, splits = time_svi_steps(ppca, losses, batches, device, steps, repeats, warmup, calls)
        pyro.clear_param_store()
    (mpt_fwd, mpt_bwd), (elbo_fwd, elbo_bwd) = splits["mpt"], splits["elbo"]
    elbo_ms = median_ms(times["elbo"])
    mpt_ms = median_ms(times["mpt"])
    return {
        "dtype": dtype_name(dtype),
        "elbo_step_ms": elbo_ms,
        "mpt_step_ms": mpt_ms,
        "ratio_mpt_over_elbo": mpt_ms / elbo_ms,
        "elbo_step_ms_repeats": times["elbo"],
        "mpt_step_ms_repeats": times["mpt"],
        "mpt_forward_ms": mpt_fwd,
        "mpt_backward_ms": mpt_bwd,
        "elbo_forward_ms": elbo_fwd,
        "elbo_backward_ms": elbo_bwd,
    }


def run(device="cpu", steps=20, repeats=5, warmup=5, dtypes=("float32", "float64"), seed=0):
    """Runs the benchmark for each dtype.

    :returns: ``{"config": ..., "environment": ..., "results": [one dict per dtype]}``.
    """
    results = [run_dtype(DTYPES[name], device, steps, repeats, warmup, seed) for name in dtypes]
    config = constants(
        globals(), "NUM_DATA", "NUM_FEATURES", "LATENT_DIM", "SUBSAMPLE_SIZE", "TARGET_RATIO"
    )
    return make_report(device, results, config, steps=steps, repeats=repeats, warmup=warmup)


def print_report(report):
    """Prints the step table and the forward/backward table."""
    print_results(
        report,
        "dtype: {dtype} | ELBO ms/step: {elbo_step_ms:.2f} | MPT ms/step: {mpt_step_ms:.2f} | "
        "MPT/ELBO: {ratio_mpt_over_elbo:.2f}x | target: <= {target_ratio:.0f}x",
        "SVI step, PPCA D={num_features} K={latent_dim} N={num_data} batch={subsample_size} "
        "({device}, {threads} threads; median of {repeats} x {steps} steps)",
    )
    print()
    split = [
        f"{loss.upper()} {part[0]}wd: {{{loss}_{part}_ms:.2f}}"
        for loss in ("mpt", "elbo")
        for part in ("forward", "backward")
    ]
    title = "differentiable_loss split (median ms per call)"
    print_results(report, " | ".join(["dtype: {dtype}"] + split), title)


def main(argv=None):
    warmup = ("--warmup", {"type": int, "default": 5, "help": "untimed steps first"})
    return benchmark_main(__doc__, argv, run, print_report, steps=20, repeats=5, options=[warmup])


if __name__ == "__main__":
    main()
