"""The check that ``MPTLoss`` makes of encode-decode conditionals against an importance-sampling
lower bound of ``log p(x)``: its standard error comes from each observation's own noise, so a
bias of a few nats on every observation of a small batch is found, and exact conditionals
pass it. References: the closed-form ``log p(x)`` and exact conditionals of a
linear-Gaussian model whose guide is its exact posterior (scaled)."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt.conditionals import EncodeDecode, Exact
from pyro_mpt.conditionals.reference_check import mpt_gap_to_reference
from pyro_mpt.ops.masks import UniformRate, mpt_estimate, sample_masks

NUM_FEATURES, LATENT_DIM, NUM_DATA, NOISE = 6, 2, 20, 0.5


def _setup(seed, guide_scale):
    """A linear-Gaussian model, data drawn from it, a guide that is its exact posterior with
    ``guide_scale`` times its Cholesky factor, and the exact ``log p(x)``."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(NUM_FEATURES, LATENT_DIM, generator=generator)
    bias = 0.3 * torch.randn(NUM_FEATURES, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(LATENT_DIM), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, NOISE).to_event(1), obs=x)

    precision = torch.eye(LATENT_DIM) + weight.T @ weight / NOISE**2
    covariance = torch.linalg.inv(precision)
    cholesky = torch.linalg.cholesky(covariance)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            mean = (x - bias) @ weight @ covariance.T / NOISE**2
            pyro.sample("z", dist.MultivariateNormal(mean, scale_tril=guide_scale * cholesky))

    latents = torch.randn(NUM_DATA, LATENT_DIM, generator=generator)
    noise = NOISE * torch.randn(NUM_DATA, NUM_FEATURES, generator=generator)
    x = latents @ weight.T + bias + noise
    marginal = dist.MultivariateNormal(bias, weight @ weight.T + NOISE**2 * torch.eye(NUM_FEATURES))
    return model, guide, x, marginal.log_prob(x)


def _shortfall(prepared, log_p, num_masks=256):
    """How far the conditionals' uniform-rate estimate lies below the exact log p(x), per
    observation on the batch's mean, from many masks."""
    masks, sizes = sample_masks(UniformRate(), num_masks, log_p.shape, NUM_FEATURES)
    estimate = mpt_estimate(prepared.log_prob(masks), masks, sizes=sizes)
    return float((log_p - estimate).mean())


@pytest.mark.parametrize("seed", [0, 1, 4, 6, 7])
def test_a_bias_of_a_few_nats_on_a_small_batch_is_found_and_not_overstated(seed):
    # With the exact posterior as the guide, encode-decode's estimate is nats below log p(x)
    # on every observation; the spread of that bias between observations had hidden it
    # from a standard error taken between observations.
    pyro.clear_param_store()
    torch.manual_seed(seed)
    model, guide, x, log_p = _setup(seed, guide_scale=1.0)
    strategy = EncodeDecode()
    prepared = strategy.prepare(model, guide, (x,), {})
    gap, compared_with = strategy.checked_gap(prepared, model, guide, (x,), {})
    shortfall = _shortfall(prepared, log_p)
    assert shortfall > 1.5  # the case: a bias of nats per observation (0.5 to 1 on others)
    assert compared_with == "importance"
    assert gap.mean > 0.0
    # A lower bound of the shortfall: the reference lies below log p(x), and four standard
    # errors are taken off. The shortfall from 256 masks has a standard error of about 0.3.
    assert gap.mean <= shortfall + 4 * 0.3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("guide_scale", [1.0, 3.0])
def test_exact_conditionals_pass_the_check_with_their_own_noise(seed, guide_scale):
    # Exact conditionals' estimate is unbiased for log p(x), and the reference lies below it:
    # nothing is found, whatever the guide that makes the reference.
    pyro.clear_param_store()
    torch.manual_seed(seed)
    model, guide, x, _ = _setup(seed, guide_scale)
    prepared = Exact().prepare(model, guide, (x,), {})
    gap, _ = mpt_gap_to_reference(
        prepared, model, guide, (x,), {}, above=False, num_masks=16, own_noise=True
    )
    assert gap.mean == 0.0
