"""``ordering_log_likelihoods`` against D calls of ``log_marginal``: the cost of one chain-rule
ordering.

One ordering of D features scores D prefix masks, each a conditional of one feature; the
alternative a reader has in mind is D separate evaluations of the model's log-marginal
likelihood (one per prefix). Two models:

* ``PPCA``: :class:`pyro_mpt.models.PPCA` with D=32 features, K=4 latents, N=256
  observations, exact conditionals;
* ``quadrature``: a Bernoulli model with a 2-dimensional standard-normal latent (logits
  ``W z + b``), D=32 binary features, N=128, ``Quadrature(num_points=20)`` (400 nodes).

For each, the script times one ``log_marginal`` call, ``ordering_log_likelihoods`` with one
ordering, and with ``NUM_ORDERINGS`` orderings (divided by their number), in interleaved
blocks, and prints the ratio of the time per ordering to D ``log_marginal`` calls.

Target: at most 1 (one ordering costs at most D log-marginal calls).

Usage::

    python benchmarks/bench_coherence.py [--device cpu] [--steps 5] [--repeats 5]
"""

import pyro
import pyro.distributions as dist
import torch
from _common import (
    benchmark_main,
    constants,
    make_report,
    medians,
    print_results,
    set_default_dtype,
    time_calls,
)

from pyro_mpt import log_marginal, ordering_log_likelihoods
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.models import PPCA

__all__ = ["main", "print_report", "run"]

NUM_FEATURES = 32
PPCA_LATENT_DIM, PPCA_BATCH = 4, 256
QUADRATURE_POINTS, QUADRATURE_BATCH = 20, 128
NUM_ORDERINGS = 8
TARGET_RATIO = 1.0


def _ppca_problem(device, seed):
    pyro.clear_param_store()
    torch.manual_seed(seed)
    ppca = PPCA(NUM_FEATURES, PPCA_LATENT_DIM, noise_scale=0.5).to(device)
    with torch.no_grad():
        ppca.weight.copy_(torch.randn(NUM_FEATURES, PPCA_LATENT_DIM, device=device))
    return ppca.model, ppca.sample(PPCA_BATCH).to(device), Exact()


def _quadrature_problem(device, seed):
    torch.manual_seed(seed)
    weight = torch.randn(NUM_FEATURES, 2, device=device)
    bias = 0.5 * torch.randn(NUM_FEATURES, device=device)
    z = torch.randn(QUADRATURE_BATCH, 2, device=device)
    x = torch.bernoulli(torch.sigmoid(z @ weight.T + bias))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ weight.T + bias).to_event(1), obs=x)

    return model, x, Quadrature(num_points=QUADRATURE_POINTS)


def _time_model(name, model, x, conditionals, device, steps, repeats):
    fns = {
        "log_marginal": lambda: log_marginal(model, x, conditionals=conditionals),
        "one_ordering": lambda: ordering_log_likelihoods(
            model, x, num_orderings=1, conditionals=conditionals
        ),
        "orderings": lambda: ordering_log_likelihoods(
            model, x, num_orderings=NUM_ORDERINGS, conditionals=conditionals
        ),
    }
    with torch.no_grad():
        times = time_calls(fns, device, steps, repeats, warmup=2)
        check = ordering_log_likelihoods(model, x, num_orderings=2, conditionals=conditionals)
    ms = medians(times)
    d_calls = NUM_FEATURES * ms["log_marginal"]
    per_ordering = ms["orderings"] / NUM_ORDERINGS
    return {
        "model": name,
        "batch": x.shape[0],
        "ms": ms,
        "ms_repeats": times,
        "ms_per_ordering": per_ordering,
        "ratio_one_ordering": ms["one_ordering"] / d_calls,
        "ratio_per_ordering": per_ordering / d_calls,
        "max_gap": float(check.gap.abs().max()),
    }


def run(device="cpu", steps=5, repeats=5, seed=0, dtype="float64"):
    """Times both models.

    :returns: ``{"config": ..., "environment": ..., "results": [one dict per model]}``.
    """
    device = torch.device(device)
    results = []
    with set_default_dtype(getattr(torch, dtype)):
        for name, problem in (("PPCA", _ppca_problem), ("quadrature", _quadrature_problem)):
            model, x, conditionals = problem(device, seed)
            results.append(_time_model(name, model, x, conditionals, device, steps, repeats))
    names = (
        "NUM_FEATURES",
        "PPCA_LATENT_DIM",
        "PPCA_BATCH",
        "QUADRATURE_POINTS",
        "QUADRATURE_BATCH",
        "NUM_ORDERINGS",
        "TARGET_RATIO",
    )
    config = constants(globals(), *names)
    return make_report(device, results, config, steps=steps, repeats=repeats, dtype=dtype)


def print_report(report):
    """Prints one row per model."""
    print_results(
        report,
        "model: {model} | N: {batch} | log_marginal ms: {ms[log_marginal]:.2f} | "
        "1 ordering ms: {ms[one_ordering]:.2f} | "
        "per ordering ms: {ms_per_ordering:.2f} | "
        "1 ordering / D log_marginal: {ratio_one_ordering:.3f} | "
        "per ordering / D log_marginal: {ratio_per_ordering:.3f} | "
        "target: <= {target_ratio:.0f} | max |gap|: {max_gap:.1e}",
        title="ordering_log_likelihoods (1 and {num_orderings} orderings) vs D={num_features} "
        "log_marginal calls ({device}, {threads} threads, {dtype}; median of {repeats})",
    )


def main(argv=None):
    dtype = ("--dtype", {"default": "float64", "choices": ["float32", "float64"]})
    return benchmark_main(__doc__, argv, run, print_report, steps=5, repeats=5, options=[dtype])


if __name__ == "__main__":
    main()
