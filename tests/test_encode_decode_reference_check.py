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
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.ops.masks import UniformRate, mask_scores, sample_masks

NUM_FEATURES, LATENT_DIM, NUM_DATA, NOISE = 6, 2, 20, 0.5


def _setup(
    seed,
    guide_scale,
    num_features=NUM_FEATURES,
    latent_dim=LATENT_DIM,
    noise_scale=NOISE,
    num_data=NUM_DATA,
):
    """A linear-Gaussian model, data drawn from it, a guide that is its exact posterior with
    ``guide_scale`` times its Cholesky factor, and the exact ``log p(x)``."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_features, latent_dim, generator=generator)
    bias = 0.3 * torch.randn(num_features, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(latent_dim), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, noise_scale).to_event(1), obs=x)

    precision = torch.eye(latent_dim) + weight.T @ weight / noise_scale**2
    covariance = torch.linalg.inv(precision)
    cholesky = torch.linalg.cholesky(covariance)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            mean = (x - bias) @ weight @ covariance.T / noise_scale**2
            pyro.sample("z", dist.MultivariateNormal(mean, scale_tril=guide_scale * cholesky))

    latents = torch.randn(num_data, latent_dim, generator=generator)
    noise = noise_scale * torch.randn(num_data, num_features, generator=generator)
    x = latents @ weight.T + bias + noise
    covariance_x = weight @ weight.T + noise_scale**2 * torch.eye(num_features)
    return model, guide, x, dist.MultivariateNormal(bias, covariance_x).log_prob(x)


def _shortfall(prepared, log_p, num_masks=256):
    """How far the conditionals' uniform-rate estimate lies below the exact log p(x), per
    observation on the batch's mean, from many masks, and its standard error."""
    num_features = prepared.observed.value.shape[-1]
    masks, sizes = sample_masks(UniformRate(), num_masks, log_p.shape, num_features)
    per_mask = num_features * mask_scores(prepared.log_prob(masks), masks, sizes)
    stderr = float((per_mask.var(0) / num_masks).sum().sqrt()) / log_p.numel()
    return float((log_p - per_mask.mean(0)).mean()), stderr


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
    shortfall, stderr = _shortfall(prepared, log_p)
    assert shortfall > 1.5  # the case: a bias of nats per observation (0.5 to 1 on others)
    assert compared_with == "importance"
    assert gap.mean > 0.0
    # A lower bound of the shortfall: the reference lies below log p(x), and four standard
    # errors are taken off.
    assert gap.mean <= shortfall + 4 * stderr


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


def test_a_guide_whose_parameters_turn_nan_on_the_filled_copies_is_told_so():
    # torch names the invalid parameter but prints its values on lines of their own: the
    # error says the guide's parameters, not the data or the plates, are at fault.
    model, _, x, _ = _setup(0, 1.0)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            loc = torch.log(x.sum(-1, keepdim=True) - 1e3).expand(x.shape[:-1] + (LATENT_DIM,))
            pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))

    pyro.clear_param_store()
    with pytest.raises(NotApplicableError, match=r"NaN or infinite parameters.*copies are finite"):
        EncodeDecode().prepare(model, guide, (x,), {})


def test_one_observation_far_below_a_one_draw_reference_counts_past_its_own_noise():
    # A guide at 0.3 times the posterior's scale under sharp noise leaves most of the batch's
    # shortfall on one observation whose reference rests on one draw, and whose 16 masks'
    # estimates spread by tens of nats: its shortfall counts past that noise, so the
    # figure stays a lower bound of the batch's shortfall.
    pyro.clear_param_store()
    torch.manual_seed(1)
    model, guide, x, log_p = _setup(
        1, 0.3, num_features=16, latent_dim=1, noise_scale=0.3, num_data=10
    )
    strategy = EncodeDecode()
    prepared = strategy.prepare(model, guide, (x,), {})
    gap, _ = strategy.checked_gap(prepared, model, guide, (x,), {})
    shortfall, stderr = _shortfall(prepared, log_p, num_masks=1024)
    assert gap.mean <= shortfall + 4 * stderr
