"""``pyro_mpt.impute`` on PPCA against the closed-form conditional written out by hand.

PPCA with D=512 features, K=10 latents and N=256 observations, each with its own random set
of missing features (sizes uniform on ``1..D``); one joint draw of the missing features per
observation. Two ways:

* ``impute``: :func:`pyro_mpt.impute` with an :class:`~pyro_mpt.conditionals.Exact` strategy
  kept between calls (as in a loop), so each call runs the model once at ``K + 6`` points and
  then draws through the latent posterior;
* ``closed form``: the same draw written directly here, with no Pyro: the posterior of
  ``u`` given ``x_R`` (precision ``I + W_R^T W_R / sigma^2``) by a Cholesky factor, then
  ``x_S = W u + mu + sigma eps``.

Target: ``impute`` within 2x of the closed form. The script prints both timings and the
ratio from one run.

Usage::

    python benchmarks/bench_impute.py [--device cpu] [--steps 10] [--repeats 5]
"""

import pyro
import torch
from _common import benchmark_main, environment, medians, time_calls

from pyro_mpt import impute
from pyro_mpt.conditionals import Exact
from pyro_mpt.models import PPCA

NUM_FEATURES, LATENT_DIM, BATCH = 512, 10, 256
TARGET_RATIO = 2.0


def closed_form_impute(x, missing, weight, loc, noise_var):
    """One joint draw of ``x_S | x_R`` per row of a PPCA, through the latent posterior."""
    context = (~missing).to(x.dtype) / noise_var  # (N, D)
    weighted = weight * context.unsqueeze(-1)  # (N, D, K)
    precision = torch.eye(weight.shape[-1], dtype=x.dtype) + weighted.transpose(-1, -2) @ weight
    tril = torch.linalg.cholesky(precision)
    rhs = weighted.transpose(-1, -2) @ (x - loc).unsqueeze(-1)
    mean = torch.cholesky_solve(rhs, tril)
    noise = torch.randn_like(mean)
    u = mean + torch.linalg.solve_triangular(tril.transpose(-1, -2), noise, upper=True)
    draw = (weight @ u).squeeze(-1) + loc + noise_var.sqrt() * torch.randn_like(x)
    return torch.where(missing, draw, x)


def run(device="cpu", steps=10, repeats=5, seed=0):
    """Times both ways; returns ``{"config", "environment", "results"}``. The caller's
    random state is left as it was."""
    with torch.random.fork_rng():
        return _run(torch.device(device), steps, repeats, seed)


def _run(device, steps, repeats, seed):
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        ppca = PPCA(NUM_FEATURES, LATENT_DIM, init_scale=1.0, noise_scale=0.5).to(device)
        x = ppca.sample(BATCH)
        sizes = torch.randint(1, NUM_FEATURES + 1, (BATCH, 1), device=device)
        missing = torch.rand(BATCH, NUM_FEATURES, device=device).argsort(-1) < sizes
        weight, loc = ppca.weight.detach(), ppca.loc.detach()
        noise_var = ppca.noise_scale.detach() ** 2
    exact = Exact()
    fns = {
        "impute": lambda: impute(ppca.model, x, missing=missing, conditionals=exact),
        "closed form": lambda: closed_form_impute(x, missing, weight, loc, noise_var),
    }
    times = time_calls(fns, device, steps, repeats)
    ms = medians(times)
    config = dict(num_features=NUM_FEATURES, latent_dim=LATENT_DIM, batch=BATCH, steps=steps,
                  repeats=repeats, target_ratio=TARGET_RATIO)  # fmt: skip
    return dict(config=config, environment=environment(device), ms=ms,
                ratio=ms["impute"] / ms["closed form"])  # fmt: skip


def print_report(report):
    env, ms = report["environment"], report["ms"]
    print(
        f"impute on PPCA D={NUM_FEATURES} K={LATENT_DIM} N={BATCH}, one joint draw of each "
        f"row's missing features ({env['device']}, {env['threads']} threads)"
    )
    for name, value in ms.items():
        print(f"  {name:12s} {value:8.2f} ms")
    verdict = "within" if report["ratio"] <= TARGET_RATIO else "above"
    print(f"  ratio {report['ratio']:.2f}x ({verdict} the {TARGET_RATIO:g}x target)")


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report, steps=10, repeats=5)


if __name__ == "__main__":
    main()
