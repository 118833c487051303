"""One training step of the active-set objective at ``|R| = 128`` against one of the exact
marginal likelihood, at ``N = 2048`` data points.

* ``exact GP``: a GPyTorch ``ExactGP`` (constant mean, scaled RBF kernel, 2-d inputs) with
  ``MaskedPredictiveLogLikelihood(rate=1 - 128/N)`` against ``ExactMarginalLogLikelihood``;
  target: the active set at least 10x faster;
* ``GP decoder``: :class:`pyro_mpt.models.GPDecoder` on ``D`` outputs with ``Q = 5`` codes,
  an SVI step of ``MPTLoss(rate=1 - 128/N, share_masks=True)`` against an Adam step on
  ``-log_marginal`` (one ``N x N`` Cholesky shared by the outputs). No target: with
  ``D = 784`` both steps are dominated by the ``O(N D)`` and ``O(N^2)`` work that the
  active set does not remove (the kernel matrix, the scores of every held-out pixel).

A step is forward, backward and an Adam update. Timings are medians over repeats of
interleaved blocks, so that the ratios come from one run on one machine state.

Usage::

    python benchmarks/bench_gp_active_set.py [--threads 2] [--json out.json]
"""

import gpytorch
import pyro
import torch
from _common import (
    benchmark_main,
    make_report,
    medians,
    print_results,
    set_default_dtype,
    time_calls,
)
from pyro.infer import SVI

from pyro_mpt import MPTLoss
from pyro_mpt.gp import MaskedPredictiveLogLikelihood
from pyro_mpt.models import GPDecoder

__all__ = ["main", "print_report", "run"]

NUM_DATA = 2048
CONTEXT = 128
TARGET_SPEEDUP = 10.0


class _GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _gp_steps(device):
    x = torch.rand(NUM_DATA, 2, device=device)
    y = torch.sin(6 * x[:, 0]) * x[:, 1] + 0.1 * torch.randn(NUM_DATA, device=device)
    steps = {}
    for name, make in (
        ("exact", gpytorch.mlls.ExactMarginalLogLikelihood),
        (
            "active set",
            lambda lik, m: MaskedPredictiveLogLikelihood(lik, m, 1 - CONTEXT / NUM_DATA),
        ),
    ):
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device)
        model = _GP(x, y, likelihood).to(device)
        model.train()
        mll = make(likelihood, model)
        optimizer = torch.optim.Adam(mll.parameters(), lr=0.01)

        def step(model=model, mll=mll, optimizer=optimizer):
            optimizer.zero_grad()
            (-mll(model(x), y)).backward()
            optimizer.step()

        steps[name] = step
    return steps


def _decoder_steps(device, num_outputs):
    y = torch.randn(NUM_DATA, num_outputs, device=device)
    steps = {}
    pyro.clear_param_store()
    # Both decoders read the same entries of Pyro's param store: same shapes, same work.
    mpt = GPDecoder(NUM_DATA, num_outputs, latent_dim=5).to(device)
    exact = GPDecoder(NUM_DATA, num_outputs, latent_dim=5).to(device)
    loss = MPTLoss(rate=1 - CONTEXT / NUM_DATA, share_masks=True)
    svi = SVI(mpt.model, mpt.guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    optimizer = torch.optim.Adam(exact.parameters(), lr=0.01)

    def exact_step():
        optimizer.zero_grad()
        (-exact.log_marginal(y)).backward()
        optimizer.step()

    steps["active set"] = lambda: svi.step(y)
    steps["exact"] = exact_step
    return steps


def _result(case, dtype, times, target):
    ms = medians(times)
    exact, active = ms["exact"], ms["active set"]
    speedup = exact / active
    return dict(
        case=case, dtype=dtype, exact_ms=exact, active_ms=active, speedup=speedup, target=target
    )


def run(device, steps=2, repeats=3, dtypes=("float64", "float32"), num_outputs=784):
    """Times the steps; returns ``{"config", "environment", "results"}``."""
    results = []
    for dtype in dtypes:
        with set_default_dtype(getattr(torch, dtype)):
            times = time_calls(_gp_steps(device), device, steps, repeats, warmup=1)
        results.append(_result("exact GP", dtype, times, TARGET_SPEEDUP))
    with set_default_dtype(torch.float32):
        times = time_calls(_decoder_steps(device, num_outputs), device, 1, repeats, warmup=1)
    results.append(_result(f"GP decoder D={num_outputs}", "float32", times, None))
    config = dict(num_data=NUM_DATA, context=CONTEXT, target_speedup=TARGET_SPEEDUP)
    return make_report(device, results, config, steps=steps, repeats=repeats)


def print_report(report):
    print_results(
        report,
        "case: {case} | dtype: {dtype} | exact ms: {exact_ms:.1f} | "
        "active set ms: {active_ms:.1f} | speed-up: {speedup:.1f}x | target: {target_text}",
        "Active set |R|={context} vs exact MLL at N={num_data}: ms per training step (median of "
        "{repeats} repeats)",
        target_text=lambda r: "-" if r["target"] is None else f">= {r['target']:.0f}x",
    )


def main(argv=None):
    outputs = ("--num-outputs", {"type": int, "default": 784, "help": "D of the GP decoder"})
    return benchmark_main(__doc__, argv, run, print_report, steps=2, repeats=3, options=[outputs])


if __name__ == "__main__":
    main()
