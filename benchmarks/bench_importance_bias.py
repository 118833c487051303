"""Bias of the MPT estimate of log p(x) with self-normalised importance conditionals, plain
against jackknife-corrected, on two 1-D latent models whose conditionals are known exactly.

* ``linear-gaussian``: ``z ~ N(0, 1)``, ``x_j | z ~ N(a_j z, s_j^2)``, D=8, with the
  mismatched proposal ``q = N(0, 1.5^2)``; exact conditionals and ``log p(x)`` in closed form.
* ``bernoulli``: ``x_j | z ~ Bernoulli(sigmoid(w_j z + b_j))``, D=8, with the prior as the
  proposal and with a Gaussian fitted roughly to each ``p(z | x_R)`` (the grid's moments,
  the scale widened by 1.3); exact conditionals and ``log p(x)`` by a fine grid in ``z``.

Each of N observations drawn from its model gets D masks, one of each size (the uniform
rate, stratified), drawn once. For S in {4, 16, 64} each replicate draws fresh samples for
every mask and observation and computes the MPT estimate ``D (1/M) sum_{j in mask} log
p(x_j | x_R)`` averaged over the masks, with
:func:`~pyro_mpt.ops.self_normalised_importance.plain_importance_log_conditionals` and with
:func:`~pyro_mpt.ops.jackknife_importance.jackknife_importance_log_conditionals`. Its error is
taken against the same masks' estimate with the exact conditionals, whose expectation is
log p(x) exactly, so the mean error is the bias against log p(x) without the masks' own
spread; the ``check`` column shows the exact-conditional estimate minus the exact log p(x)
(mean and SE over observations). The IWAE columns are the same for ``log p(x)`` itself
(``importance_log_marginal`` against ``jackknife_importance_log_marginal``). Each error is
the mean per observation over R replicates, with its standard error over the replicates.

Then forward and forward + backward of both conditionals are timed on the largest S.

Usage::

    python benchmarks/bench_importance_bias.py [--smoke] [--threads 1] [--json PATH]

Without ``--json`` the figures are written to ``results/importance_bias.json`` (ignored by
git).
"""

import math
import pathlib
import sys

import torch
from _common import (
    benchmark_main,
    constants,
    dtype_name,
    make_report,
    medians,
    print_results,
    set_default_dtype,
    time_calls,
)
from torch.nn.functional import logsigmoid

from pyro_mpt.ops.estimators import mpt_estimate
from pyro_mpt.ops.jackknife_importance import (
    jackknife_importance_log_conditionals,
    jackknife_importance_log_marginal,
)
from pyro_mpt.ops.mask_rates import UniformRate
from pyro_mpt.ops.masks import sample_masks
from pyro_mpt.ops.self_normalised_importance import (
    importance_log_marginal,
    plain_importance_log_conditionals,
)

__all__ = ["main", "print_report", "run"]

NUM_FEATURES = 8
NUM_SAMPLES = (4, 16, 64)
NUM_OBSERVATIONS = 400
NUM_REPLICATES = 100
GAUSSIAN_PROPOSAL_SCALE = 1.5
FITTED_SCALE_FACTOR = 1.3
GRID_SIZE, GRID_HALF_WIDTH = 1601, 8.0
SMOKE = dict(num_observations=50, num_replicates=10, grid_size=801)
DEFAULT_JSON = pathlib.Path(__file__).resolve().parents[1] / "results" / "importance_bias.json"

ESTIMATORS = {
    "plain": (plain_importance_log_conditionals, importance_log_marginal),
    "jackknife": (jackknife_importance_log_conditionals, jackknife_importance_log_marginal),
}


def _normal_log_prob(value, loc, scale):
    return -0.5 * ((value - loc) / scale) ** 2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)


class _LinearGaussian:
    """``z ~ N(0, 1)``, ``x_j | z ~ N(a_j z, s_j^2)``, its exact conditionals and marginal,
    and the fixed proposal ``N(0, 1.5^2)``."""

    name, proposal_name = "linear-gaussian", "N(0, 1.5^2)"

    def __init__(self, generator):
        self.loading = torch.randn(NUM_FEATURES, generator=generator)
        self.noise = 0.5 + 0.5 * torch.rand(NUM_FEATURES, generator=generator)

    def sample(self, num):
        z = torch.randn(num, 1)
        return self.loading * z + self.noise * torch.randn(num, NUM_FEATURES)

    def log_likelihoods(self, z, x):
        """``log p(x_j | z)``: ``z`` of shape ``T``, ``x`` broadcastable to ``T + (D,)``."""
        return _normal_log_prob(x, self.loading * z.unsqueeze(-1), self.noise)

    def exact(self, x, context):
        """Closed-form ``log p(x_j | x_R)`` (through ``p(z | x_R)``) and ``log p(x)``."""
        precision_terms = context * (self.loading / self.noise) ** 2
        precision = 1 + precision_terms.sum(-1, keepdim=True)
        mean = (context * self.loading * x / self.noise**2).sum(-1, keepdim=True) / precision
        scale = (self.loading**2 / precision + self.noise**2).sqrt()
        conditionals = _normal_log_prob(x, self.loading * mean, scale)
        covariance = torch.outer(self.loading, self.loading) + torch.diag(self.noise**2)
        marginal = torch.distributions.MultivariateNormal(
            torch.zeros(NUM_FEATURES), covariance
        ).log_prob(x)
        return conditionals, marginal

    def proposal(self, x, context):
        """``(loc, scale)`` of the proposal for each mask and observation."""
        scale = torch.tensor(GAUSSIAN_PROPOSAL_SCALE)
        return torch.zeros(context.shape[:-1]), scale.expand(context.shape[:-1])


class _Bernoulli:
    """``z ~ N(0, 1)``, ``x_j | z ~ Bernoulli(sigmoid(w_j z + b_j))``; exact conditionals,
    log-marginal and posterior moments on a uniform grid of ``z``."""

    name = "bernoulli"

    def __init__(self, generator, grid_size, fitted):
        self.weight = 1.5 * torch.randn(NUM_FEATURES, generator=generator)
        self.bias = 0.5 * torch.randn(NUM_FEATURES, generator=generator)
        self.grid = torch.linspace(-GRID_HALF_WIDTH, GRID_HALF_WIDTH, grid_size)
        spacing = self.grid[1] - self.grid[0]
        self.log_grid_weights = _normal_log_prob(self.grid, 0.0, torch.tensor(1.0)) + spacing.log()
        self.fitted = fitted
        self.proposal_name = f"fitted, scale x{FITTED_SCALE_FACTOR}" if fitted else "prior"

    def sample(self, num):
        z = torch.randn(num, 1)
        return torch.bernoulli(torch.sigmoid(self.weight * z + self.bias))

    def log_likelihoods(self, z, x):
        logits = self.weight * z.unsqueeze(-1) + self.bias
        return x * logsigmoid(logits) + (1 - x) * logsigmoid(-logits)

    def _grid_posterior(self, x, context):
        """Per mask: ``(G,) + batch`` log posterior weights, and ``(G,) + batch + (D,)``
        log-likelihoods on the grid."""
        ll = self.log_likelihoods(self.grid.reshape((-1,) + (1,) * (x.dim() - 1)), x)
        log_joint = self.log_grid_weights.reshape((-1,) + (1,) * (x.dim() - 1)) + (
            context * ll
        ).sum(-1)
        return log_joint, ll

    def exact(self, x, context):
        conditionals = []
        for mask_context in context:  # one mask at a time keeps (G, N, D) small
            log_joint, ll = self._grid_posterior(x, mask_context)
            numerator = torch.logsumexp(log_joint.unsqueeze(-1) + ll, 0)
            conditionals.append(numerator - torch.logsumexp(log_joint, 0).unsqueeze(-1))
        log_joint, _ = self._grid_posterior(x, torch.ones_like(x))
        return torch.stack(conditionals), torch.logsumexp(log_joint, 0)

    def proposal(self, x, context):
        if not self.fitted:
            return torch.zeros(context.shape[:-1]), torch.ones(context.shape[:-1])
        locs, scales = [], []
        for mask_context in context:
            log_joint, _ = self._grid_posterior(x, mask_context)
            posterior = torch.softmax(log_joint, 0)
            grid = self.grid.unsqueeze(-1)
            mean = (posterior * grid).sum(0)
            variance = (posterior * (grid - mean) ** 2).sum(0)
            locs.append(mean)
            scales.append(FITTED_SCALE_FACTOR * variance.sqrt())
        return torch.stack(locs), torch.stack(scales)


def _importance_inputs(model, x, loc, scale, num_samples):
    """Samples from ``N(loc, scale^2)`` for each mask and observation: their
    ``log p(z) - log q(z)``, shape ``(S, P, N)``, and log-likelihoods ``(S, P, N, D)``."""
    z = loc + scale * torch.randn((num_samples,) + loc.shape)
    log_weights = _normal_log_prob(z, 0.0, torch.tensor(1.0)) - _normal_log_prob(z, loc, scale)
    return log_weights, model.log_likelihoods(z, x)


def _measure_model(model, num_observations, num_replicates, samples_list):
    """Rows of the bias table for one model and proposal."""
    x = model.sample(num_observations)
    masks, _ = sample_masks(UniformRate(), NUM_FEATURES, (num_observations,), NUM_FEATURES)
    context = (~masks).to(x.dtype)
    exact_conditionals, exact_marginal = model.exact(x, context)
    exact_mpt = mpt_estimate(exact_conditionals, masks)
    check = exact_mpt - exact_marginal
    check_mean, check_se = check.mean().item(), check.std().item() / math.sqrt(num_observations)
    loc, scale = model.proposal(x, context)
    full_loc, full_scale = model.proposal(x, torch.ones(1, num_observations, NUM_FEATURES))
    rows = []
    for num_samples in samples_list:
        errors = {name: {"mpt": [], "iwae": []} for name in ESTIMATORS}
        for _ in range(num_replicates):
            log_weights, ll = _importance_inputs(model, x, loc, scale, num_samples)
            full_log_weights, full_ll = _importance_inputs(
                model, x, full_loc[0], full_scale[0], num_samples
            )
            full_log_weights = full_log_weights + full_ll.sum(-1)
            for name, (conditionals, marginal) in ESTIMATORS.items():
                mpt = mpt_estimate(conditionals(log_weights, ll, context), masks)
                errors[name]["mpt"].append((mpt - exact_mpt).mean().item())
                iwae = marginal(full_log_weights) - exact_marginal
                errors[name]["iwae"].append(iwae.mean().item())
        for name, figures in errors.items():
            row = {"model": model.name, "proposal": model.proposal_name, "samples": num_samples}
            row["estimator"] = name
            for key, values in figures.items():
                values = torch.tensor(values)
                row[f"{key}_error"] = values.mean().item()
                row[f"{key}_se"] = values.std().item() / math.sqrt(num_replicates)
            row["check"], row["check_se"] = check_mean, check_se
            rows.append(row)
    return rows


def _time(num_samples, num_observations, device, dtype, steps, repeats, seed):
    """Forward and forward + backward milliseconds of both conditionals on random inputs
    of the benchmark's shape ``(S, P, N, D)``, interleaved."""
    torch.manual_seed(seed)
    shape = (num_samples, NUM_FEATURES, num_observations)
    log_weights = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    ll = torch.randn(shape + (NUM_FEATURES,), device=device, dtype=dtype, requires_grad=True)
    context = torch.rand(shape[1:] + (NUM_FEATURES,), device=device) < 0.5

    def forward(fn):
        def call():
            with torch.no_grad():
                fn(log_weights, ll, context)

        return call

    def forward_backward(fn):
        def call():
            fn(log_weights, ll, context).sum().backward()
            log_weights.grad = ll.grad = None

        return call

    fns = {}
    for name, (conditionals, _) in ESTIMATORS.items():
        fns[f"{name} forward"] = forward(conditionals)
        fns[f"{name} forward+backward"] = forward_backward(conditionals)
    ms = medians(time_calls(fns, device, steps, repeats, warmup=2))
    return [
        {
            "dtype": dtype_name(dtype),
            "pass": which,
            "plain_ms": ms[f"plain {which}"],
            "jackknife_ms": ms[f"jackknife {which}"],
            "ratio": ms[f"jackknife {which}"] / ms[f"plain {which}"],
        }
        for which in ("forward", "forward+backward")
    ]


def run(device="cpu", steps=5, repeats=5, smoke=False, seed=0):
    """Measures the bias table (float64, on the CPU) and the timings (on ``device``).

    :returns: ``{"config", "environment", "results", "timings"}``.
    """
    sizes = dict(
        num_observations=NUM_OBSERVATIONS, num_replicates=NUM_REPLICATES, grid_size=GRID_SIZE
    )
    if smoke:
        sizes.update(SMOKE)
    results = []
    with set_default_dtype(torch.float64):
        for make in (
            lambda g: _LinearGaussian(g),
            lambda g: _Bernoulli(g, sizes["grid_size"], fitted=False),
            lambda g: _Bernoulli(g, sizes["grid_size"], fitted=True),
        ):
            torch.manual_seed(seed)
            model = make(torch.Generator().manual_seed(seed))
            results += _measure_model(
                model, sizes["num_observations"], sizes["num_replicates"], NUM_SAMPLES
            )
    timings = []
    for dtype in (torch.float32, torch.float64):
        timings += _time(
            max(NUM_SAMPLES), sizes["num_observations"], device, dtype, steps, repeats, seed
        )
    names = "NUM_FEATURES", "NUM_SAMPLES", "GAUSSIAN_PROPOSAL_SCALE", "FITTED_SCALE_FACTOR"
    config = {**constants(globals(), *names, "GRID_HALF_WIDTH"), **sizes}
    report = make_report(device, results, config, steps=steps, repeats=repeats, smoke=smoke)
    report["timings"] = timings
    return report


def print_report(report):
    """Prints the bias table, then the timing table."""
    print_results(
        report,
        "model: {model} | proposal: {proposal} | S: {samples} | estimator: {estimator} | "
        "MPT error: {mpt_error:+.4f} | SE: {mpt_se:.4f} | IWAE error: {iwae_error:+.4f} | "
        "IWAE SE: {iwae_se:.4f} | check: {check:+.4f} +- {check_se:.4f}",
        "Mean error per observation of log p(x) estimates (nats), D={num_features}, "
        "N={num_observations} observations x D masks, {num_replicates} replicates; "
        "check: MPT with exact conditionals - exact log p(x)",
    )
    print()
    timing = {"config": report["config"], "environment": report["environment"]}
    timing["results"] = report["timings"]
    print_results(
        timing,
        "dtype: {dtype} | pass: {pass} | plain ms: {plain_ms:.2f} | "
        "jackknife ms: {jackknife_ms:.2f} | jackknife / plain: {ratio:.2f}x",
        "Cost of the conditionals at S={largest}, P=D={num_features}, N={num_observations} "
        "({device}, {threads} threads; median of {repeats} x {steps})",
        largest=max(report["config"]["num_samples"]),
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(arg == "--json" or arg.startswith("--json=") for arg in argv):
        DEFAULT_JSON.parent.mkdir(exist_ok=True)
        argv += ["--json", str(DEFAULT_JSON)]
    smoke = ("--smoke", {"action": "store_true", "help": "a few seconds: fewer observations"})
    seed = ("--seed", {"type": int, "default": 0, "help": "seed of models, data and samples"})
    return benchmark_main(
        __doc__, argv, run, print_report, steps=5, repeats=5, options=[smoke, seed]
    )


if __name__ == "__main__":
    main()
