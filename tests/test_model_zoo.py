"""The zoo of hand-written Pyro models in :mod:`experiments.zoo.models`, each checked against
an exact reference. Over 300 lines because each model class gets its own semantic checks.

Every model of the zoo is plain Pyro (no model of the package). A factory returns a
:class:`~experiments.zoo.models.ZooCase`: the model, its guide (or ``None``), its
arguments, and either a function computing the exact ``log p(x_i)`` of every observation
(closed-form Gaussian marginals, fine trapezoid grids in float64) or the error the package
must raise. The tests check

- ``log_marginal`` against the reference (``1e-8`` for exact, ``1e-3`` nats for quadrature);
- that ``MPTLoss(rate="uniform").estimate`` is unbiased for the reference, within 4.5
  standard errors over seeded draws;
- which strategy ``conditionals="auto"`` picks, and that it is right;
- that ``conditionals="exact"`` refuses models whose observation is not affine in the
  latents' standard noise, or whose scale depends on them;
- the semantics of masks, missing entries, ``poutine.scale``, subsampling,
  ``pyro.deterministic``, ``pyro.factor`` and ``poutine.reparam``;
- the clear errors for models no strategy may score.

``benchmarks/model_zoo_table.py`` runs the same factories through ``conditionals="auto"``.
"""

import logging
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO

from experiments.zoo.cases import (
    assert_mean_loss_matches,
    assert_unbiased,
    assert_uniform_estimate_unbiased,
    estimate_draws,
    factory_ids,
    log_marginal_and_reference,
)
from experiments.zoo.cases import seeded as _seeded
from experiments.zoo.models import (
    ZOO,
    _linear_gaussian_data,
    bernoulli_logistic,
    broad_guide,
    deterministic_and_factor,
    gumbel_feature_plate,
    hierarchical_latent_scale,
    hierarchical_nonlinear_mean,
    locscale_reparam,
    masked_observations,
    missing_entries_obs_mask,
    missing_entries_site_mask,
    numpy_data,
    scaled_observations,
    subsampled_plate,
    two_data_plates,
)
from experiments.zoo.references import mvn_log_prob
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature
from pyro_mpt.errors import NotApplicableError

SCORED = [f for f in ZOO if f().error is None]
CHECKED_LML = [f for f in SCORED if f().check_log_marginal]
REFUSED = [f for f in ZOO if f().error is not None]
NOT_EXACT = [f for f in SCORED if f().strategy is not Exact]


# --------------------------------------------------------------------------------------
# Generic checks over the zoo.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", CHECKED_LML, ids=factory_ids(CHECKED_LML))
def test_log_marginal_matches_reference(factory):
    case = factory()
    value, reference = log_marginal_and_reference(case, case.conditionals(), case.guide)
    assert value.numel() == reference.numel()
    torch.testing.assert_close(
        value.reshape(reference.shape), reference, atol=case.tol, rtol=case.tol / 10
    )


@pytest.mark.parametrize("factory", CHECKED_LML, ids=factory_ids(CHECKED_LML))
def test_uniform_estimate_is_unbiased(factory):
    case = factory()
    if case.strategy is ImportanceSampling:
        pytest.skip("importance conditionals are consistent, not unbiased: see the auto test")
    assert_uniform_estimate_unbiased(case, case.guide)


@pytest.mark.parametrize("factory", SCORED, ids=factory_ids(SCORED))
def test_auto_picks_the_expected_strategy_and_is_right(factory):
    case = factory()
    loss = MPTLoss(rate="uniform", num_masks=4)
    loss.loss(case.model, case.guide, *case.args, **case.kwargs)
    assert isinstance(loss.conditionals.chosen, case.strategy), loss.conditionals.chosen
    if not case.check_log_marginal:
        return  # subsampled and scaled models: see their own tests
    draws = estimate_draws(loss, case, case.guide, 60)
    with torch.no_grad():
        reference = case.reference()
    assert_unbiased(draws, reference, case.auto_tol)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_auto_logs_its_choice_once():
    case = bernoulli_logistic()
    loss = MPTLoss()
    logger = logging.getLogger("pyro_mpt")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        for _ in range(3):
            loss.loss(case.model, None, *case.args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    choices = [r for r in handler.records if "quadrature" in r.getMessage().lower()]
    assert len(choices) == 1, [r.getMessage() for r in handler.records]


@pytest.mark.parametrize("factory", NOT_EXACT, ids=factory_ids(NOT_EXACT))
def test_exact_refuses_models_outside_its_class(factory):
    case = factory()
    match = case.exact_error
    with pytest.raises(NotApplicableError, match=match):
        MPTLoss(conditionals="exact").loss(case.model, None, *case.args, **case.kwargs)
    with pytest.raises(NotApplicableError, match=match):
        log_marginal(case.model, *case.args, conditionals="exact", **case.kwargs)


@pytest.mark.parametrize("conditionals", ["auto", "exact", "quadrature", "importance"])
@pytest.mark.parametrize("factory", REFUSED, ids=factory_ids(REFUSED))
def test_refused_models_raise_a_clear_error(factory, conditionals):
    case = factory()
    error, match = case.error
    guide = case.guide or broad_guide(2)
    loss = MPTLoss(conditionals=conditionals)
    pyro.param("existing", torch.zeros(2))
    with pytest.raises(error, match=match):
        loss.loss(case.model, guide, *case.args, **case.kwargs)
    assert set(pyro.get_param_store().keys()) == {"existing"}


# --------------------------------------------------------------------------------------
# Semantics: masks, missing data, scale, subsampling, deterministic, factor, reparam.
# --------------------------------------------------------------------------------------


def _per_feature_marginals(x, mean, cov):
    """``sum_j log N(x_ij; mean_j, cov_jj)``: the estimate at rate 1 (every feature masked,
    no context), in closed form."""
    return dist.Normal(mean, cov.diagonal().sqrt()).log_prob(x).sum(-1)


@pytest.mark.parametrize(
    "factory", [masked_observations, missing_entries_site_mask, missing_entries_obs_mask]
)
def test_masked_out_observations_contribute_exactly_zero(factory):
    case = factory()
    (x,) = case.args
    reference = case.reference()
    empty = reference == 0
    assert bool(empty.any())
    loss = MPTLoss(rate="uniform", num_masks=2, conditionals="exact")
    draws = estimate_draws(loss, case, case.guide, 20).reshape(20, -1)
    assert bool((draws[:, empty] == 0).all())
    assert bool((draws[:, ~empty] != 0).all())
    assert torch.isfinite(draws).all()


def test_missing_entries_at_rate_one_score_observed_marginals():
    """With every observed entry masked, the estimate is the sum of the observed entries'
    marginals: the missing ones neither count nor give context."""
    case = missing_entries_site_mask()
    (x,) = case.args
    observed = x != 100.0
    _, bias, cov, _ = _linear_gaussian_data(6, 6, 0.4, (8,))
    ll = dist.Normal(bias, cov.diagonal().sqrt()).log_prob(x)
    expected = torch.where(observed, ll, 0.0).sum(-1)
    value = MPTLoss(rate=1.0, conditionals="exact").estimate(case.model, None, x)
    torch.testing.assert_close(value.detach(), expected)


def test_poutine_scale_scales_the_loss_like_trace_elbo():
    case = scaled_observations()
    (x,) = case.args
    scale = torch.linspace(0.5, 2.0, x.shape[0])
    _, bias, cov, _ = _linear_gaussian_data(1, 5, 0.36, (8,))
    # At rate 1 the estimate is deterministic: the per-feature marginals.
    loss = MPTLoss(rate=1.0, conditionals="exact")
    expected = -(scale * _per_feature_marginals(x, bias, cov)).sum()
    assert loss.loss(case.model, None, x) == pytest.approx(expected.item(), rel=1e-10)
    estimate = loss.estimate(case.model, None, x).detach()
    torch.testing.assert_close(estimate, _per_feature_marginals(x, bias, cov))
    # The uniform rate, in expectation: -sum_i scale_i log p(x_i).
    uniform = MPTLoss(rate="uniform", num_masks=4)
    with torch.no_grad():
        losses = torch.tensor([uniform.loss(case.model, None, x) for _ in range(150)])
    assert_mean_loss_matches(losses, -(scale * case.reference()).sum())


def test_subsampled_plate_is_unbiased_for_the_full_data_lml():
    case = subsampled_plate()
    (x,) = case.args
    loss = MPTLoss(rate="uniform", num_masks=2)
    with torch.no_grad():
        estimate = loss.estimate(case.model, None, x)
        assert estimate.shape == (4,)
        losses = torch.tensor([loss.loss(case.model, None, x) for _ in range(300)])
    assert_mean_loss_matches(losses, -case.reference().sum())


def test_subsampled_loss_is_the_scaled_sum_of_the_estimates():
    case = subsampled_plate()
    (x,) = case.args
    loss = MPTLoss(rate=1.0, conditionals="exact")  # deterministic given the subsample
    _, bias, cov, _ = _linear_gaussian_data(10, 5, 0.36, (12,))
    marginals = _per_feature_marginals(x, bias, cov)
    values = set()
    for _ in range(20):
        value = loss.loss(case.model, None, x)
        values.add(round(value, 8))
        # Every subsample of 4 scales its sum by 12 / 4.
        sums = torch.combinations(marginals, 4).sum(-1) * 3.0
        assert bool(((sums + value).abs() < 1e-8).any())
    assert len(values) > 1  # the subsample changes between calls


def test_deterministic_sites_are_ignored_and_global_factors_added():
    case = deterministic_and_factor()
    (x,) = case.args
    _, bias, cov, _ = _linear_gaussian_data(1, 5, 0.36, (8,))
    torch.testing.assert_close(log_marginal(case.model, x).detach(), case.reference())
    loss = MPTLoss(rate=1.0, conditionals="exact")
    factor = -0.5 * 0.25**2 / 0.1
    expected = -_per_feature_marginals(x, bias, cov).sum() - factor
    assert loss.loss(case.model, None, x) == pytest.approx(expected.item(), rel=1e-10)
    # Trace_ELBO adds the factor the same way.
    guide = broad_guide(2)
    elbo = Trace_ELBO().loss(case.model, guide, x)
    assert math.isfinite(elbo)
    # The factor's gradient reaches its parameter.
    loss.differentiable_loss(case.model, None, x).backward()
    shift = dict(pyro.get_param_store().named_parameters())["shift"]
    # d/dshift of -(sum log p(x | shift) + factor(shift)) at shift = 0.25.
    with torch.enable_grad():
        s = torch.tensor(0.25, requires_grad=True)
        total = dist.Normal(bias + s - 0.25, cov.diagonal().sqrt()).log_prob(x).sum()
        total = total - 0.5 * s**2 / 0.1
        (expected_grad,) = torch.autograd.grad(-total, s)
    torch.testing.assert_close(shift.grad, expected_grad)


def test_locscale_reparam_gives_the_centred_log_marginal():
    case = locscale_reparam()
    (x,) = case.args
    reparam = log_marginal(case.model, x).detach()
    centred = log_marginal(case.centred, x).detach()
    torch.testing.assert_close(reparam, centred)
    torch.testing.assert_close(reparam, case.reference())


def test_two_data_plates_give_one_estimate_per_cell():
    case = two_data_plates()
    (x,) = case.args
    estimate = MPTLoss().estimate(case.model, None, x)
    assert estimate.shape == (3, 4)
    torch.testing.assert_close(log_marginal(case.model, x).detach(), case.reference())


def test_feature_plate_gives_one_estimate_per_observation():
    case = gumbel_feature_plate()
    (x,) = case.args
    estimate = MPTLoss(conditionals=Quadrature(num_points=20)).estimate(case.model, None, x)
    assert estimate.numel() == x.shape[0]


@pytest.mark.parametrize("factory", [hierarchical_nonlinear_mean, hierarchical_latent_scale])
def test_hierarchical_latents_under_importance(factory):
    """Importance sampling with a broad guide integrates ``z2 | z1`` right: within Monte
    Carlo noise of the reference (seeded; at S=20000 about 0.03 nats per observation, while
    a prior of ``z2`` that ignored ``z1`` would be off by tenths to a whole nat)."""
    case = factory()
    (x,) = case.args

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z1", dist.Normal(0.0, 1.0))
            pyro.sample("z2", dist.Normal(0.5, 1.5))

    with torch.no_grad():
        value = log_marginal(
            case.model, x, conditionals=ImportanceSampling(num_samples=20000), guide=guide
        )
        reference = case.reference()
    assert value.shape == reference.shape
    assert (value - reference).abs().max() < 0.15
    assert (value - reference).mean().abs() < 0.05


def test_float32_parameters_with_float64_data():
    """float32 parameters and float64 data, as ``Trace_ELBO`` accepts them."""
    weight = torch.tensor([[1.0, 0.5], [-0.3, 0.8], [0.2, -1.1], [0.9, 0.1]], dtype=torch.float32)
    bias = torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float32)

    def model(x):
        w = pyro.param("w32", weight.clone())
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float32), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ w.T + bias, 0.5).to_event(1), obs=x)

    with _seeded(50):
        x32 = torch.randn(7, 4, dtype=torch.float32)
    x64 = x32.to(torch.float64)

    def guide32(x):
        loc = pyro.param("q_loc32", torch.zeros(2, dtype=torch.float32))
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))

    assert math.isfinite(Trace_ELBO().loss(model, guide32, x64))
    cov = (weight @ weight.T + 0.25 * torch.eye(4, dtype=torch.float32)).double()
    reference = mvn_log_prob(x64, bias.double(), cov)
    for x in (x32, x64):
        torch.testing.assert_close(
            log_marginal(model, x).detach().double(), reference, atol=1e-4, rtol=1e-5
        )
    loss = MPTLoss(rate="uniform", num_masks=3, conditionals="exact")
    pyro.set_rng_seed(3)
    value32 = loss.estimate(model, None, x32).detach()
    pyro.set_rng_seed(3)
    value64 = loss.estimate(model, None, x64).detach()
    torch.testing.assert_close(value64.double(), value32.double(), atol=1e-4, rtol=1e-5)


def test_numpy_observations_raise_in_log_marginal_too():
    case = numpy_data()
    assert isinstance(case.args[0], np.ndarray)
    with pytest.raises(TypeError, match=r"(?s)numpy.*torch\.as_tensor"):
        log_marginal(case.model, *case.args)
