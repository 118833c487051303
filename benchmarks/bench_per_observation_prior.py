"""One steady ``MPTLoss`` step under quadrature for a VAE whose prior is shared by the data
plate against the same VAE with its prior written per observation, as Pyro's VAE tutorial
writes it (``Normal(x.new_zeros((N, K)), x.new_ones((N, K)))``); both give the same loss.

The model: a Bernoulli decoder (one tanh hidden layer of 64) from a latent of size 2 to
D=80 binary features, N=64 random binary observations, no guide. The two prior styles are
timed in interleaved blocks in one run (``differentiable_loss`` and ``backward()``, after
warm-up steps that read the model's structure and, under ``"auto"``, choose the rule), and
the ratio per-observation / shared is printed. It should be close to 1.

Usage::

    python benchmarks/bench_per_observation_prior.py [--num-points 20] [--dtype float64]
"""

import sys

import pyro
import pyro.distributions as dist
import torch
from _common import (
    DTYPES,
    benchmark_main,
    constants,
    make_report,
    median_ms,
    print_results,
    time_calls,
)

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Quadrature

NUM_OBS, NUM_FEATURES, LATENT_DIM, HIDDEN_DIM = 64, 80, 2, 64
SEED = 0


def _models(device, dtype):
    """``{"shared": model, "per-observation": model}`` with one decoder between them, and
    the data."""
    torch.manual_seed(SEED)
    decoder = torch.nn.Sequential(
        torch.nn.Linear(LATENT_DIM, HIDDEN_DIM),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN_DIM, NUM_FEATURES),
    ).to(device=device, dtype=dtype)
    x = (torch.rand(NUM_OBS, NUM_FEATURES, device=device) < 0.3).to(dtype)

    def shared(x):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[-2]):
            prior = dist.Normal(x.new_zeros(LATENT_DIM), x.new_ones(LATENT_DIM))
            z = pyro.sample("latent", prior.to_event(1))
            pyro.sample("obs", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x)

    def per_observation(x):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[-2]):
            z_loc = x.new_zeros((x.shape[-2], LATENT_DIM))
            z_scale = x.new_ones((x.shape[-2], LATENT_DIM))
            z = pyro.sample("latent", dist.Normal(z_loc, z_scale).to_event(1))
            pyro.sample("obs", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x)

    return {"shared": shared, "per-observation": per_observation}, x


def run(device, steps=5, repeats=5, num_points=0, dtype="float32"):
    """Times a step of each prior style; ``num_points=0`` means ``conditionals="auto"``."""
    models, x = _models(device, DTYPES[dtype])
    losses, values, fns = {}, {}, {}
    for name, model in models.items():
        rule = "auto" if num_points == 0 else Quadrature(num_points=num_points)
        loss = MPTLoss(conditionals=rule)
        pyro.set_rng_seed(SEED)
        values[name] = float(loss.loss(model, None, x))
        losses[name] = loss

        def step(loss=loss, model=model):
            loss.differentiable_loss(model, None, x).backward()

        fns[name] = step
    times = time_calls(fns, device, steps, repeats)
    shared_ms = median_ms(times["shared"])
    results = [
        {
            "prior": name,
            "ms": median_ms(samples),
            "ratio": median_ms(samples) / shared_ms,
            "loss": values[name],
            "conditionals": repr(getattr(losses[name].conditionals, "chosen", None) or rule),
            "repeats_ms": samples,
        }
        for name, samples in times.items()
    ]
    config = constants(globals(), "NUM_OBS", "NUM_FEATURES", "LATENT_DIM", "HIDDEN_DIM", "SEED")
    return make_report(
        device, results, config, steps=steps, repeats=repeats, num_points=num_points, dtype=dtype
    )


def print_report(report):
    print_results(
        report,
        "prior: {prior} | conditionals: {conditionals} | ms per step: {ms:.2f} | "
        "ratio to shared: {ratio:.2f}x | loss (seeded): {loss:.6g}",
        title="MPTLoss step, N={num_obs}, D={num_features}, K={latent_dim}, {dtype}, "
        "{threads} threads on {device}",
    )


def main(argv=None):
    return benchmark_main(
        __doc__,
        argv,
        run,
        print_report,
        steps=5,
        repeats=5,
        options=(
            ("--num-points", {"type": int, "default": 0, "help": "Quadrature(n); 0: 'auto'"}),
            ("--dtype", {"choices": sorted(DTYPES), "default": "float32"}),
        ),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
