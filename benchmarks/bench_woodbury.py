"""Woodbury conditionals against dense Schur complements.

For ``u ~ N(0, I_K)``, ``x = W u + b + N(0, diag(psi))`` with D=512, K=10 and a batch of
N=256 observations, each with its own mask (mask sizes uniform on ``1..D``), the
conditionals ``p(x_j | x_R)`` of the masked features are computed three ways:

* ``woodbury``: :func:`pyro_mpt.ops.gaussian.latent_gaussian_conditionals`, through the
  K-dimensional latent posterior, ``O(D K^2 + K^3)`` per mask;
* ``dense batched``: :func:`pyro_mpt.ops.gaussian.dense_gaussian_conditionals` on
  ``S = W W^T + diag(psi)``, one bordered ``D x D`` Cholesky per mask, all masks batched
  (the library's dense path);
* ``dense loop``: a Python loop over masks that gathers ``S_RR``, ``S_MR`` by index and
  calls :func:`torch.linalg.solve` for ``S_MR S_RR^{-1}``.

The dense timings include forming ``S``. The script prints the largest disagreement between
the methods on masked features, then the timings and the speed-up of Woodbury.

Usage::

    python benchmarks/bench_woodbury.py [--device cuda] [--steps 10] [--json out.json]
"""

import torch
from _common import (
    DTYPES,
    benchmark_main,
    constants,
    dtype_name,
    format_table,
    make_report,
    medians,
    print_results,
    set_default_dtype,
    time_calls,
)

from pyro_mpt.ops.gaussian import dense_gaussian_conditionals, latent_gaussian_conditionals
from pyro_mpt.ops.mask_rates import UniformRate
from pyro_mpt.ops.masks import sample_masks

__all__ = ["dense_loop_conditionals", "main", "print_report", "run"]

NUM_FEATURES = 512
LATENT_DIM = 10
BATCH = 256
MASKS_PER_OBSERVATION = 1
TARGET_SPEEDUP = 20.0


def dense_loop_conditionals(x, loc, covariance, context):
    """Conditionals of the masked features by one ``torch.linalg.solve`` per observation.

    :param torch.Tensor x: ``(N, D)``.
    :param torch.Tensor loc: ``(D,)``.
    :param torch.Tensor covariance: ``(D, D)``.
    :param torch.Tensor context: boolean ``(N, D)``, True where observed.
    :returns: ``(mean, var)`` of shape ``(N, D)``; context entries hold ``loc`` and 1.
    """
    mean = loc.expand(x.shape).clone()
    var = torch.ones_like(x)
    diag = covariance.diagonal()
    for n in range(x.shape[0]):
        observed = context[n].nonzero().squeeze(-1)
        masked = (~context[n]).nonzero().squeeze(-1)
        if observed.numel() == 0:
            var[n, masked] = diag[masked]
            continue
        cov_rr = covariance[observed][:, observed]
        cov_rm = covariance[observed][:, masked]
        rhs = torch.cat([(x[n, observed] - loc[observed]).unsqueeze(-1), cov_rm], dim=-1)
        solved = torch.linalg.solve(cov_rr, rhs)  # S_RR^{-1} [x_R - mu_R, S_RM]
        mean[n, masked] = loc[masked] + cov_rm.T @ solved[:, 0]
        var[n, masked] = diag[masked] - (cov_rm * solved[:, 1:]).sum(0)
    return mean, var


def _problem(device, dtype, seed):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).to(device)

    weight = randn(NUM_FEATURES, LATENT_DIM)
    bias = randn(NUM_FEATURES)
    uniform = torch.rand(NUM_FEATURES, generator=generator, dtype=dtype).to(device)
    noise_var = 0.5 + uniform
    x = randn(BATCH, LATENT_DIM) @ weight.T + bias + noise_var.sqrt() * randn(BATCH, NUM_FEATURES)
    torch.manual_seed(seed)
    masks, sizes = sample_masks(
        UniformRate(), MASKS_PER_OBSERVATION, (BATCH,), NUM_FEATURES, device=device
    )
    return x, weight, bias, noise_var, ~masks[0], sizes[0]


def _max_diff(a, b, masked):
    return (a - b).abs()[masked].max().item()


def run_dtype(dtype, device="cpu", steps=10, repeats=5, seed=0, loop=True):
    """Checks agreement and times the three methods in one dtype."""
    device = torch.device(device)
    with set_default_dtype(dtype):
        x, weight, bias, noise_var, context, sizes = _problem(device, dtype, seed)
        masked = ~context

        def woodbury():
            return latent_gaussian_conditionals(x, weight, bias, noise_var, context)

        def dense_batched():
            covariance = weight @ weight.T + torch.diag(noise_var)
            return dense_gaussian_conditionals(x, bias, covariance, context)

        def dense_loop():
            covariance = weight @ weight.T + torch.diag(noise_var)
            return dense_loop_conditionals(x, bias, covariance, context)

        with torch.no_grad():
            reference = woodbury()
            others = {"dense_batched": dense_batched()}
            if loop:
                others["dense_loop"] = dense_loop()
            diffs = {}
            for name, (mean, var) in others.items():
                diffs[name] = {
                    "mean": _max_diff(reference[0], mean, masked),
                    "var": _max_diff(reference[1], var, masked),
                }
            # The Woodbury path is fast: time it in blocks of `steps` calls; the dense
            # paths one call at a time.
            fast = time_calls({"woodbury": woodbury}, device, steps, repeats, warmup=3)
            slow_fns = {"dense_batched": dense_batched}
            if loop:
                slow_fns["dense_loop"] = dense_loop
            slow = time_calls(slow_fns, device, 1, repeats, warmup=1)
    times = {**fast, **slow}
    ms = medians(times)
    result = {
        "dtype": dtype_name(dtype),
        "mean_mask_size": sizes.double().mean().item(),
        "max_abs_diff": diffs,
        "ms": ms,
        "ms_repeats": times,
        "speedup_vs_dense_batched": ms["dense_batched"] / ms["woodbury"],
    }
    if loop:
        result["speedup_vs_dense_loop"] = ms["dense_loop"] / ms["woodbury"]
    return result


def run(device="cpu", steps=10, repeats=5, dtypes=("float32", "float64"), seed=0, loop=True):
    """Runs the benchmark for each dtype.

    :returns: ``{"config": ..., "environment": ..., "results": [one dict per dtype]}``.
    """
    results = [run_dtype(DTYPES[name], device, steps, repeats, seed, loop) for name in dtypes]
    names = "NUM_FEATURES", "LATENT_DIM", "BATCH", "MASKS_PER_OBSERVATION", "TARGET_SPEEDUP"
    return make_report(device, results, constants(globals(), *names), steps=steps, repeats=repeats)


def _speedup(key):
    return lambda r: f"{r[key]:.3g}x" if key in r else "-"


def print_report(report):
    """Prints the agreement table and the timing table."""
    rows = [
        (r["dtype"], f"woodbury vs {name}", f"{diff['mean']:.2e}", f"{diff['var']:.2e}")
        for r in report["results"]
        for name, diff in r["max_abs_diff"].items()
    ]
    print(
        "Conditionals p(x_j | x_R), D={num_features} K={latent_dim} N={batch}, one uniform-size "
        "mask per observation ({device}, {threads} threads; median of {repeats})".format_map(
            {**report["environment"], **report["config"]}
        )
    )
    print(format_table(["dtype", "comparison", "max |d mean|", "max |d var|"], rows))
    print()
    print_results(
        report,
        "dtype: {dtype} | woodbury ms: {ms[woodbury]:.2f} | "
        "dense batched ms: {ms[dense_batched]:.1f} | dense loop ms: {loop_ms} | "
        "vs batched: {vs_batched} | vs loop: {vs_loop} | target: >= {target_speedup:.0f}x",
        loop_ms=lambda r: f"{r['ms']['dense_loop']:.1f}" if "dense_loop" in r["ms"] else "-",
        vs_batched=_speedup("speedup_vs_dense_batched"),
        vs_loop=_speedup("speedup_vs_dense_loop"),
    )


def main(argv=None):
    no_loop = (
        "--no-loop",
        {"dest": "loop", "action": "store_false", "help": "skip the per-mask Python loop"},
    )
    return benchmark_main(__doc__, argv, run, print_report, steps=10, repeats=5, options=[no_loop])


if __name__ == "__main__":
    main()
