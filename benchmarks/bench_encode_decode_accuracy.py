"""How far off ``EncodeDecode`` conditionals are, against exact ones, and what their own
per-call figures (the bias and spread of their draws) say of it.

The model is linear-Gaussian, ``z ~ N(0, I_K)``, ``x ~ N(W z + b, s^2 I_D)`` with fixed
random ``W`` and ``b`` and no learnable parameter, whose conditionals ``Exact()`` gives in
closed form. Three amortized guides ``q(z | x)``:

* ``exact posterior``: ``N(M^-1 W^T (x - b), s^2 M^-1)``, ``M = W^T W + s^2 I`` (PPCA's);
* ``untrained linear``: the same family with random weights of scale 0.1;
* ``untrained, hidden``: a guide told which entries are hidden (``hidden`` argument, as
  ``LinearVAE.guide``), with zero weights, so ``q`` is the prior.

For each model, guide and ``num_samples`` S, every observation gets ``REPS`` masks of each
size 1..D (the uniform rate, stratified); ``EncodeDecode(num_samples=S)`` and ``Exact()``
score the same masks, so the error column is the bias of the MPT estimate of ``log p(x)``
per observation (mean over observations), without the masks' own spread. The ``draw_bias``
and ``spread`` columns are ``EncodeDecodeDiagnostics.summary()["draw_bias"]`` and
``["mean_spread"]`` of the same call (none at S=1), and ``ms`` the time of that call.
Seeded; 1 thread recommended.

Usage::

    python benchmarks/bench_encode_decode_accuracy.py --threads 1 \\
        --json benchmarks/results/encode_decode_accuracy.json
"""

import sys
import time

import pyro
import pyro.distributions as dist
import torch
from _common import benchmark_main, constants, make_report, print_results

from pyro_mpt.conditionals import EncodeDecode, Exact
from pyro_mpt.ops.masks import masks_of_sizes, mpt_estimate

__all__ = ["main", "print_report", "run"]

#: (D, K, s): features, latent dimensions, observation noise.
MODELS = ((12, 2, 1.5), (12, 2, 0.7), (12, 2, 0.3), (12, 4, 0.3), (12, 2, 0.1))
GUIDES = ("exact posterior", "untrained linear", "untrained, hidden")
NUM_SAMPLES = (1, 2, 4, 16, 64)
NUM_OBSERVATIONS = 40
REPS = 4
SEED = 0


class _Gaussian:
    def __init__(self, num_features, latent_dim, noise):
        self.D, self.K, self.s = num_features, latent_dim, float(noise)
        self.W = torch.randn(num_features, latent_dim)
        self.b = 0.5 * torch.randn(num_features)
        precision = self.W.T @ self.W + self.s**2 * torch.eye(latent_dim)
        self.encoder = torch.linalg.solve(precision, self.W.T)
        self.scale_tril = torch.linalg.cholesky(self.s**2 * torch.linalg.inv(precision))
        self.random_encoder = 0.1 * torch.randn(latent_dim, num_features)

    def model(self, x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(self.K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ self.W.T + self.b, self.s).to_event(1), obs=x)

    def sample(self, num):
        z = torch.randn(num, self.K)
        return z @ self.W.T + self.b + self.s * torch.randn(num, self.D)

    def guide(self, kind):
        if kind == "untrained, hidden":
            weight = torch.zeros(self.K, 2 * self.D, requires_grad=True)

            def hidden_guide(x, hidden=None):
                if hidden is None:
                    hidden = torch.zeros_like(x, dtype=torch.bool)
                x, hidden = torch.broadcast_tensors(x, hidden)
                code = torch.cat([x.masked_fill(hidden, 0.0), hidden.to(x.dtype)], -1)
                with pyro.plate("data", x.shape[-2]):
                    pyro.sample("z", dist.Normal(code @ weight.T, 1.0).to_event(1))

            return hidden_guide
        encoder = self.encoder if kind == "exact posterior" else self.random_encoder
        scale_tril = self.scale_tril if kind == "exact posterior" else torch.eye(self.K)
        encoder = encoder.clone().requires_grad_(True)  # a path from x to q: amortized

        def linear_guide(x):
            with pyro.plate("data", x.shape[-2]):
                loc = (x - self.b) @ encoder.T
                pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=scale_tril))

        return linear_guide


def _one(gauss, guide, x, masks, num_samples):
    strategy = EncodeDecode(num_samples=num_samples)
    with torch.no_grad():
        prepared = strategy.prepare(gauss.model, guide, (x,), {})
        start = time.perf_counter()
        estimate = prepared.log_prob(masks)
        seconds = time.perf_counter() - start
        exact = Exact().prepare(gauss.model, guide, (x,), {}).log_prob(masks)
    error = mpt_estimate(estimate - exact, masks)  # per observation
    summary = prepared.diagnostics.summary()
    figure, spread = summary["draw_bias"], summary["mean_spread"]
    return dict(
        error=float(error.mean()),
        worst=float(error.min()),
        figure=None if figure != figure else figure,
        spread=None if spread != spread else spread,
        ms=1000 * seconds,
    )


def run(device, num_observations=NUM_OBSERVATIONS, reps=REPS):
    import warnings

    results = []
    for num_features, latent_dim, noise in MODELS:
        pyro.set_rng_seed(SEED)
        gauss = _Gaussian(num_features, latent_dim, noise)
        x = gauss.sample(num_observations)
        sizes = torch.arange(1, num_features + 1).repeat_interleave(reps)
        masks = masks_of_sizes(sizes[:, None].expand(-1, num_observations), num_features)
        for kind in GUIDES:
            guide = gauss.guide(kind)
            for num_samples in NUM_SAMPLES:
                pyro.set_rng_seed(SEED + 1)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the first use's warning
                    row = _one(gauss, guide, x, masks, num_samples)
                row.update(D=num_features, K=latent_dim, s=noise, guide=kind, S=num_samples)
                results.append(row)
                print(row, file=sys.stderr)
    config = constants(globals(), "MODELS", "GUIDES", "NUM_SAMPLES", "SEED")
    return make_report(device, results, config, num_observations=num_observations, reps=reps)


def print_report(report):
    print_results(
        report,
        "D: {D} | K: {K} | s: {s} | guide: {guide} | S: {S} | error (nats/obs): {error:.2f} "
        "| worst obs: {worst:.1f} | draw_bias: {figure_text} | spread: {spread_text} "
        "| ms: {ms:.1f}",
        title="EncodeDecode (T=5) against Exact, per observation",
        figure_text=lambda row: "-" if row["figure"] is None else f"{row['figure']:.2f}",
        spread_text=lambda row: "-" if row["spread"] is None else f"{row['spread']:.2f}",
    )


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report)


if __name__ == "__main__":
    main(sys.argv[1:])
