"""Importance conditionals measure their MPT estimate against an importance-sampling estimate
of ``log p(x)`` with the guide on the whole observation (``checked_gap``), in both
directions where that estimate's weights are reliable: checked against the exact
``log p(x)`` of a linear-Gaussian model, whose posterior given any context is known."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss, log_marginal, mpt_curve
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.errors import ImportanceAccuracyWarning, UnmeasuredAccuracyWarning

NUM_OBS, NUM_FEATURES = 20, 6


def _problem(noise):
    """A one-latent linear-Gaussian model, its data, its exact ``log p(x)``, and two guides:
    the exact posterior given the whole observation whatever it is given (an encoder
    fitted to complete data, reading none of the masked input), and the exact posterior
    given the visible entries (a perfect proposal for every context)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(NUM_FEATURES, generator=generator, dtype=torch.float64)
    bias = torch.randn(NUM_FEATURES, generator=generator, dtype=torch.float64)
    z = torch.randn(NUM_OBS, 1, generator=generator, dtype=torch.float64)
    noise_draws = torch.randn(NUM_OBS, NUM_FEATURES, generator=generator, dtype=torch.float64)
    data = bias + weight * z + noise * noise_draws

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            latent = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))
            pyro.sample(
                "x", dist.Normal(bias + weight * latent.unsqueeze(-1), noise).to_event(1), obs=x
            )

    def posterior(x, seen):
        precision = 1 + (seen * weight**2).sum(-1) / noise**2
        mean = (seen * (x - bias) * weight).sum(-1) / noise**2 / precision
        return mean, precision.rsqrt()

    def whole_observation_guide(x):
        mean, scale = posterior(data, torch.ones_like(data))
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(mean, scale))

    def context_guide(x, hidden=None):
        seen = torch.ones_like(x) if hidden is None else (~hidden).to(x.dtype)
        mean, scale = posterior(x, seen)
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(mean, scale))

    covariance = torch.outer(weight, weight) + noise**2 * torch.eye(NUM_FEATURES)
    exact = dist.MultivariateNormal(bias, covariance).log_prob(data)
    return model, data, exact, whole_observation_guide, context_guide


def _reference_warnings(caught):
    """The warnings of the check against the whole-observation reference, of any kind."""
    return [
        w
        for w in caught
        if "importance-sampling estimate of it" in str(w.message)
        or issubclass(w.category, UnmeasuredAccuracyWarning)
    ]


def test_an_estimate_too_high_for_a_narrow_proposal_is_warned_of_with_its_size():
    """A proposal fitted to whole observations is too narrow for masked contexts: the
    conditionals come out too high, which the check sizes from below (it subtracts four
    standard errors) and within a factor of about two."""
    pyro.set_rng_seed(0)
    model, data, exact, guide, _ = _problem(noise=0.1)
    loss = MPTLoss(conditionals=ImportanceSampling(64), num_masks=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = loss.estimate(model, guide, data)
        figure = loss.rule_check["mean_gap"]
        errors = [first] + [loss.estimate(model, guide, data) for _ in range(15)]
    errors = torch.stack([e.detach() for e in errors]) - exact
    per_call = errors.mean(-1)  # each call's error per observation
    true_error = float(per_call.mean())
    stderr = float(per_call.std()) / len(per_call) ** 0.5
    assert true_error > 1.0  # too high by nats: the case the check is for
    assert loss.rule_check["compared_with"] == "importance above"
    assert 0.4 * true_error < figure < true_error + 4 * stderr
    found = _reference_warnings(caught)
    assert found and all(issubclass(w.category, ImportanceAccuracyWarning) for w in found)
    assert "above an importance-sampling estimate" in str(found[0].message)
    assert "(step 1;" in str(found[0].message)  # a strategy the user gave: from the 1st call


def test_a_proposal_good_for_every_context_passes_the_check():
    pyro.set_rng_seed(0)
    model, data, exact, _, guide = _problem(noise=0.5)
    loss = MPTLoss(conditionals=ImportanceSampling(64), num_masks=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimates = torch.stack([loss.estimate(model, guide, data).detach() for _ in range(16)])
    assert not _reference_warnings(caught)
    assert loss.rule_check["step"] == 16 and loss.rule_check["mean_gap"] < 0.1
    # The estimate is indeed accurate, so a quiet check is right.
    per_call = (estimates - exact).mean(-1)
    stderr = float(per_call.std()) / len(per_call) ** 0.5
    assert abs(float(per_call.mean())) < 0.1 + 4 * stderr


def test_the_mpt_curve_checks_itself_and_log_marginal_does_not():
    """``mpt_curve`` rests on the conditionals and warns; ``log_marginal`` returns the
    whole-observation estimate, which the weights' own figures judge, and makes no such
    check."""
    pyro.set_rng_seed(0)
    model, data, exact, guide, _ = _problem(noise=0.1)
    strategy = ImportanceSampling(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpt_curve(model, data, conditionals=strategy, guide=guide, num_masks=2)
    assert _reference_warnings(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = log_marginal(model, data, conditionals=strategy, guide=guide)
    assert not _reference_warnings(caught)
    # The proposal is the exact posterior given the whole observation: exact weights.
    torch.testing.assert_close(value, exact)


def test_pooled_draws_are_checked_with_the_loss_s_masks_per_observation():
    """Pooled draws' estimate depends on the masks per observation: ``MPTLoss`` checks it
    with its own ``num_masks``; ``mpt_curve``, whose masks per observation vary by size, does
    not check it."""
    pyro.set_rng_seed(0)
    model, data, exact, guide, _ = _problem(noise=0.1)
    strategy = ImportanceSampling(16, share_samples=True, num_proposals=2)
    loss = MPTLoss(conditionals=strategy, num_masks=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = torch.stack([loss.estimate(model, guide, data).detach() for _ in range(8)])
        figure = loss.rule_check["mean_gap"]
    per_call = (errors - exact).mean(-1)
    true_error = float(per_call.mean())
    stderr = float(per_call.std()) / len(per_call) ** 0.5
    assert true_error > 1.0
    assert loss.rule_check["compared_with"] == "importance above"
    assert 0.3 * true_error < figure < true_error + 4 * stderr
    assert _reference_warnings(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpt_curve(model, data, conditionals=strategy, guide=guide, num_masks=2)
    assert not _reference_warnings(caught)


def test_every_mask_is_refused_before_a_check_of_drawn_masks_spends_runs():
    """The check measures drawn masks' estimate: with ``num_masks="all"`` (which these
    conditionals refuse, their masks drawing samples of their own) none is made."""
    pyro.set_rng_seed(0)
    model, data, _, guide, _ = _problem(noise=0.1)
    loss = MPTLoss(conditionals=ImportanceSampling(16), num_masks="all")
    with pytest.raises(ValueError, match="closed form only when all masks weight the same"):
        loss.estimate(model, guide, data)
    assert loss.rule_check is None


def _poisson_problem(num_obs=200, scale=0.8):
    """A one-latent Poisson model (loadings of size ``scale``) whose counts reach the hundreds
    on a few observations, its data, its ``log p(x)`` on a fine grid (exact to far below the
    tolerances here), and the prior as guide: a valid proposal that misses the sharp
    posteriors of those few."""
    generator = torch.Generator().manual_seed(0)
    weight = scale * torch.randn(NUM_FEATURES, generator=generator, dtype=torch.float64)
    bias = 0.5 * torch.randn(NUM_FEATURES, generator=generator, dtype=torch.float64)
    z = torch.randn(num_obs, generator=generator, dtype=torch.float64)
    data = torch.poisson(torch.exp(z[:, None] * weight + bias), generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            latent = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))
            rate = torch.exp(latent.unsqueeze(-1) * weight + bias)
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)

    def prior_guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))

    grid = torch.linspace(-12, 12, 24001, dtype=torch.float64)
    log_joint = dist.Normal(0.0, 1.0).log_prob(grid)[:, None] + dist.Poisson(
        torch.exp(grid[:, None, None] * weight + bias)
    ).log_prob(data).sum(-1)
    exact = torch.logsumexp(log_joint, 0) + torch.log(grid[1] - grid[0])
    return model, data, exact, prior_guide


def test_a_few_observations_whose_posteriors_the_guide_misses_are_warned_of():
    """Two or three observations of 200 whose estimates rest on one draw of the guide, too
    few for the weights' share-based tests, put the batch's estimate nats per observation
    low; their spread hides it from the batch's mean and its standard error. The check
    counts those observations apart: it warns, with a figure below the true error."""
    pyro.set_rng_seed(0)
    model, data, exact, guide = _poisson_problem()
    loss = MPTLoss(conditionals=ImportanceSampling(64), num_masks=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = loss.estimate(model, guide, data)
        figure, kind = loss.rule_check["mean_gap"], loss.rule_check["compared_with"]
        errors = [first] + [loss.estimate(model, guide, data) for _ in range(7)]
    per_call = (torch.stack([e.detach() for e in errors]) - exact).mean(-1)
    true_error = float(per_call.mean())
    stderr = float(per_call.std()) / len(per_call) ** 0.5
    assert true_error < -1.0  # nats per observation too low: the case the check is for
    assert kind == "importance, one draw"
    assert 0.1 < figure < -true_error + 4 * stderr
    found = [w for w in _reference_warnings(caught) if "(step 1;" in str(w.message)]
    assert found and issubclass(found[0].category, ImportanceAccuracyWarning)
    assert "rests on one draw of the guide" in str(found[0].message)


def test_observations_whose_reference_rests_wholly_on_one_draw_are_said_unmeasured():
    """Counts in the thousands under the prior as guide: a few observations' estimates are
    thousands of nats low, and so are their references, so no comparison shows it, while the
    conditionals' own weights pass their share-based tests. The check says that it cannot
    measure those observations, and shows their estimates beside the batch's median."""
    model, data, exact, guide = _poisson_problem(num_obs=50, scale=1.0)
    assert data.max() > 1000
    for seed in range(4):
        pyro.set_rng_seed(seed)
        loss = MPTLoss(conditionals=ImportanceSampling(64), num_masks=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = float((loss.estimate(model, guide, data).detach() - exact).mean())
        assert error < -10.0  # nats per observation: the case the warning is for
        found = [w for w in caught if issubclass(w.category, UnmeasuredAccuracyWarning)]
        assert found, f"seed {seed}: no word of {error:.1f} nats per observation"
        message = str(found[0].message)
        assert "cannot measure" in message and "against a median of" in message
