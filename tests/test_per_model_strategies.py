"""The functions of the package keep a strategy given by name with its model: a second call
on the same model and argument shapes reads nothing again, and gives what a fresh strategy
gives."""

import gc
import math
import warnings
import weakref

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

from pyro_mpt import MPTLoss, impute, log_marginal, mpt_curve
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.conditionals.per_model import (
    _STRATEGIES,
    MAX_KEPT_MODELS,
    conditionals_for,
    forget_strategies,
)
from pyro_mpt.errors import NotApplicableError
from tests.helpers import CountedCalls

WEIGHT = torch.tensor([[1.0, 0.5], [-0.3, 0.8], [0.2, -1.1], [0.7, 0.1]])
NOISE = 0.4


def _linear_gaussian(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ WEIGHT.T, NOISE).to_event(1), obs=x)


def _closed_form(x):
    covariance = WEIGHT @ WEIGHT.T + NOISE**2 * torch.eye(4)
    return dist.MultivariateNormal(torch.zeros(4), covariance).log_prob(x)


def test_a_second_log_marginal_reads_nothing_again():
    model = CountedCalls(_linear_gaussian)
    first, second = torch.randn(10, 4), torch.randn(10, 4)
    torch.testing.assert_close(log_marginal(model, first), _closed_form(first))
    runs_of_first = model.calls
    model.calls = 0
    got = log_marginal(model, second)
    torch.testing.assert_close(got, _closed_form(second))
    # The structure is not read again: one run at the probe points (the first call also
    # traced the model and checked it at points).
    assert model.calls == 1 < runs_of_first
    fresh = CountedCalls(_linear_gaussian)
    torch.testing.assert_close(log_marginal(fresh, second, conditionals=Exact()), got)


def test_auto_decides_on_every_call_with_the_structures_it_read_kept():
    def bernoulli(x):
        weight = pyro.param("weight", lambda: torch.linspace(-1, 1, 10).reshape(5, 2))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ weight.T).to_event(1), obs=x)

    model = CountedCalls(bernoulli)
    x = torch.bernoulli(torch.full((6, 5), 0.4))
    missing = torch.zeros(6, 5, dtype=torch.bool)
    missing[:, 0] = True
    impute(model, x, missing=missing, num_samples=3)
    # Sharper weights: the search runs again (a rule accurate before may not be now), with
    # fewer runs than a model seen for the first time (no structure read, no check at points).
    pyro.get_param_store()["weight"] = 4 * torch.linspace(-1, 1, 10).reshape(5, 2)
    fresh_model = CountedCalls(bernoulli)
    pyro.set_rng_seed(4)
    fresh = impute(fresh_model, x, missing=missing, num_samples=3)
    model.calls = 0
    auto = conditionals_for("auto", model)
    assert auto.chosen is None
    pyro.set_rng_seed(4)
    again = impute(model, x, missing=missing, num_samples=3, conditionals=auto)
    assert 0 < model.calls < fresh_model.calls
    assert isinstance(auto.chosen, Quadrature)
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)


def test_strategies_are_kept_per_model_and_name_for_the_models_used_last():
    model = CountedCalls(_linear_gaussian)
    other = CountedCalls(_linear_gaussian)
    exact = conditionals_for("exact", model)
    assert conditionals_for("exact", model) is exact
    assert conditionals_for("exact", other) is not exact
    assert conditionals_for("auto", model) is not conditionals_for("auto", model)
    given = Exact()
    assert conditionals_for(given, model) is given
    # A method's strategies are kept with its object, one per method.
    holder = _Holder()
    assert conditionals_for("exact", holder.model) is conditionals_for("exact", holder.model)
    assert conditionals_for("exact", holder.model) is not conditionals_for("exact", holder.other)
    # A model used in a call is held until MAX_KEPT_MODELS others have been used since.
    log_marginal(holder.model, torch.randn(5, 4))
    alive = weakref.ref(holder)
    del holder
    gc.collect()
    assert alive() is not None
    for _ in range(MAX_KEPT_MODELS):
        conditionals_for("exact", CountedCalls(_linear_gaussian))
    gc.collect()
    assert alive() is None
    assert len(_STRATEGIES) == MAX_KEPT_MODELS
    forget_strategies()
    assert conditionals_for("exact", model) is not exact
    assert len(_STRATEGIES) == 1


class _Holder:
    def model(self, x):
        _linear_gaussian(x)

    def other(self, x):
        _linear_gaussian(x)


def test_kept_strategy_with_a_guide_leaves_the_param_store_as_it_found_it():
    # log_marginal removes the parameters it created; the kept strategy reads the guide's
    # new ones on the next call, and both calls agree with a fresh strategy.
    def guide(x):
        loc = pyro.param("guide_loc", lambda: torch.zeros(x.shape[-2], 2))
        scale = pyro.param(
            "guide_scale", lambda: torch.ones(x.shape[-2], 2), constraint=constraints.positive
        )
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    x = torch.randn(8, 4)
    rule = "quadrature"
    values = []
    for _ in range(2):
        values.append(log_marginal(_linear_gaussian, x, guide=guide, conditionals=rule))
        assert len(pyro.get_param_store()) == 0
    torch.testing.assert_close(values[0], values[1])
    fresh = log_marginal(_linear_gaussian, x, guide=guide, conditionals=Quadrature())
    torch.testing.assert_close(values[1], fresh)


def test_mpt_curve_twice_on_the_same_model():
    model = CountedCalls(_linear_gaussian)
    x = torch.randn(12, 4)
    mpt_curve(model, x, num_masks=2)
    model.calls = 0
    curve = mpt_curve(model, x, num_masks=2)
    assert model.calls == 1
    # Every feature masked: each scores its marginal log p(x_j), a Normal of variance
    # (W W^T + noise^2 I)_jj; the curve averages them over features and observations.
    variance = (WEIGHT**2).sum(-1) + NOISE**2
    marginals = dist.Normal(torch.zeros(4), variance.sqrt()).log_prob(x)
    assert math.isclose(float(curve.scores[-1]), float(marginals.mean()), rel_tol=1e-9)


class _Switchable:
    """A linear-Gaussian model whose observed entries and annealing factor are attributes:
    changes that its argument shapes do not show."""

    weight = torch.tensor([[0.8], [-0.5], [0.3], [1.1], [0.2]])
    observed = None
    beta = 1.0

    def model(self, x):
        with pyro.plate("data", x.shape[-2]), poutine.scale(scale=self.beta):
            z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
            likelihood = dist.Normal(z @ self.weight.T, 0.5)
            if self.observed is not None:
                likelihood = likelihood.mask(self.observed)
            pyro.sample("x", likelihood.to_event(1), obs=x)

    def guide(self, x):
        # The exact posterior of z given the observed entries: every importance weight is
        # p(x_observed), so importance sampling is exact.
        w = self.weight[:, 0]
        seen = torch.ones_like(x) if self.observed is None else self.observed.to(x.dtype)
        precision = 1 + (seen * w**2).sum(-1, keepdim=True) / 0.25
        loc = (seen * x * w).sum(-1, keepdim=True) / 0.25 / precision
        with pyro.plate("data", x.shape[-2]), poutine.scale(scale=self.beta):
            pyro.sample("z", dist.Normal(loc, precision**-0.5).to_event(1))


def test_a_mask_added_to_a_kept_importance_model_is_scored():
    switchable = _Switchable()
    x = torch.randn(12, 5)
    observed = torch.rand(12, 5) > 0.4
    observed[:, 0] = True
    log_marginal(switchable.model, x, guide=switchable.guide, conditionals="importance")
    switchable.observed = observed
    got = log_marginal(switchable.model, x, guide=switchable.guide, conditionals="importance")
    # The closed form of each observation's observed entries.
    w = switchable.weight
    covariance = w @ w.T + 0.25 * torch.eye(5)
    expected = torch.stack(
        [
            dist.MultivariateNormal(torch.zeros(int(o.sum())), covariance[o][:, o]).log_prob(r[o])
            for r, o in zip(x, observed)
        ]
    )
    # Exact up to rounding (the proposal is the posterior); scoring the masked entries too
    # would be off by nats.
    torch.testing.assert_close(got, expected)


def test_annealing_with_poutine_scale_reaches_a_kept_importance_loss():
    # The loss of an MPTLoss whose strategy reads the model once scales with beta: the
    # estimate is beta-independent and the loss is -beta times its sum.
    switchable = _Switchable()
    x = torch.randn(12, 5)
    loss = MPTLoss(conditionals="importance")
    values = []
    for beta in (1.0, 0.1):
        switchable.beta = beta
        pyro.set_rng_seed(1)
        values.append(loss.loss(switchable.model, switchable.guide, x))
    pyro.set_rng_seed(1)
    fresh = MPTLoss(conditionals="importance").loss(switchable.model, switchable.guide, x)
    assert math.isclose(values[1], fresh, rel_tol=1e-9)
    assert math.isclose(values[1], 0.1 * values[0], rel_tol=1e-9)


def test_a_kept_model_that_turned_nonlinear_is_refused_with_validation_off():
    def model(x):
        a = pyro.param("a", torch.tensor(0.0))  # 0: linear-Gaussian
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
            loc = z @ WEIGHT[:, :1].T + a * torch.tanh(3 * z) ** 2
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    x = torch.randn(10, 4)
    pyro.enable_validation(False)
    with torch.no_grad():  # with a gradient, the form is refused at once (a's derivative)
        log_marginal(model, x)
    pyro.get_param_store()["a"] = torch.tensor(2.0)
    with pytest.raises(NotApplicableError, match="not affine"):
        log_marginal(model, x)
    # auto decides afresh: not exact.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = conditionals_for("auto", model)
        log_marginal(model, x, conditionals=auto)
    assert not isinstance(auto.chosen, Exact)


def test_a_model_fixed_after_a_refusal_is_read_again():
    likelihood = {"name": "bernoulli"}

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            loc = z @ WEIGHT.T
            if likelihood["name"] == "bernoulli":
                pyro.sample("x", dist.Bernoulli(logits=loc).to_event(1), obs=x)
            else:
                pyro.sample("x", dist.Normal(loc, NOISE).to_event(1), obs=x)

    x = torch.bernoulli(torch.full((6, 4), 0.5))
    with pytest.raises(NotApplicableError, match="Bernoulli"):
        log_marginal(model, x)
    likelihood["name"] = "normal"
    torch.testing.assert_close(log_marginal(model, x), _closed_form(x))


class _WithFactor:
    """A linear-Gaussian model that may add a constant ``pyro.factor`` (a penalty switched on
    after a warm-up) or scale its latent or its observation alone (a tempered likelihood)."""

    penalty = 0.0
    latent_scale = 1.0
    observed_scale = 1.0

    def model(self, x):
        if self.penalty:
            pyro.factor("penalty", torch.tensor(-self.penalty))
        with pyro.plate("data", x.shape[-2]):
            with poutine.scale(scale=self.latent_scale):
                z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            with poutine.scale(scale=self.observed_scale):
                pyro.sample("x", dist.Normal(z @ WEIGHT.T, NOISE).to_event(1), obs=x)

    def guide(self, x):
        pass


def test_a_factor_added_to_a_kept_model_reaches_the_loss():
    # The loss is minus the MPT estimate minus the factor: a kept read must not drop it.
    with_factor = _WithFactor()
    x = torch.randn(10, 4)
    loss = MPTLoss(conditionals="exact", num_masks=4)
    pyro.set_rng_seed(2)
    before = loss.loss(with_factor.model, with_factor.guide, x)
    with_factor.penalty = 100.0
    pyro.set_rng_seed(2)
    after = loss.loss(with_factor.model, with_factor.guide, x)
    assert math.isclose(after, before + 100.0, rel_tol=1e-9)
    with_factor.penalty = 0.0
    pyro.set_rng_seed(2)
    assert math.isclose(loss.loss(with_factor.model, with_factor.guide, x), before, rel_tol=1e-9)


@pytest.mark.parametrize("conditionals", ["exact", "quadrature"])
def test_a_latent_scaled_alone_is_refused_on_a_kept_read(conditionals):
    with_factor = _WithFactor()
    x = torch.randn(10, 4)
    loss = MPTLoss(conditionals=conditionals)
    loss.loss(with_factor.model, with_factor.guide, x)
    log_marginal(with_factor.model, x, conditionals=conditionals)
    for scale in (0.1, torch.full((10,), 0.1)):
        with_factor.latent_scale = scale
        with pytest.raises(ValueError, match="different scales"):
            loss.loss(with_factor.model, with_factor.guide, x)
        with pytest.raises(ValueError, match="different scales"):
            log_marginal(with_factor.model, x, conditionals=conditionals)


@pytest.mark.parametrize("conditionals", ["exact", "quadrature", "importance"])
def test_an_observation_scaled_alone_by_a_tensor_is_refused_on_a_kept_read(conditionals):
    # With validation off, tensor scales are not compared by value on a kept read (that
    # reads the device); a scale that became a tensor around one site since the read is
    # still caught: the model is read again, and the read refuses the tempered likelihood.
    with_factor = _WithFactor()
    x = torch.randn(10, 4)
    guide = AutoNormal(with_factor.model) if conditionals == "importance" else with_factor.guide
    loss = MPTLoss(conditionals=conditionals)
    with pyro.validation_enabled(False):
        loss.loss(with_factor.model, guide, x)
        with_factor.observed_scale = torch.full((10,), 0.1)
        with pytest.raises(ValueError, match="different scales"):
            loss.loss(with_factor.model, guide, x)
        with_factor.observed_scale = 1.0
        assert math.isfinite(loss.loss(with_factor.model, guide, x))


def test_obs_mask_added_to_a_kept_exact_model_is_read_afresh():
    # obs_mask splits the observed site in two: the kept structure no longer matches, and
    # the model is read again instead of failing on every later call.
    missing = {"mask": None}

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            likelihood = dist.Normal(z @ WEIGHT.T, NOISE).to_event(1)
            pyro.sample("x", likelihood, obs=x, obs_mask=missing["mask"])

    x = torch.randn(8, 4)
    observed = torch.ones(8, dtype=torch.bool)
    observed[:3] = False  # three observations missing entirely
    loss = MPTLoss(conditionals="exact", num_masks=4)
    loss.loss(model, _no_guide, x)
    log_marginal(model, x)
    missing["mask"] = observed
    pyro.set_rng_seed(3)
    kept = loss.loss(model, _no_guide, x)
    pyro.set_rng_seed(3)
    assert math.isclose(kept, MPTLoss(conditionals="exact", num_masks=4).loss(model, _no_guide, x))
    expected = torch.where(observed, _closed_form(x), torch.zeros(()))
    torch.testing.assert_close(log_marginal(model, x), expected)


def _no_guide(x):
    pass


class _SecondLatent:
    """A linear-Gaussian model that samples a second latent ``z2`` once ``extra`` is set (a
    change its argument shapes do not show), with the exact joint posterior as its guide:
    every importance weight is ``p(x)``."""

    loadings = torch.tensor([[0.8, 0.4], [-0.5, 0.9], [0.3, -0.6], [1.1, 0.2], [0.2, 0.7]])
    extra = False

    def _columns(self):
        return self.loadings if self.extra else self.loadings[:, :1]

    def model(self, x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
            loc = z * self.loadings[:, 0]
            if self.extra:
                z2 = pyro.sample("z2", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
                loc = loc + z2 * self.loadings[:, 1]
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    def guide(self, x):
        # p(z, z2 | x) = N(m, C): z from its marginal, z2 from its conditional given z.
        a = self._columns()
        covariance = torch.linalg.inv(torch.eye(a.shape[1]) + a.T @ a / 0.25)
        mean = x @ a / 0.25 @ covariance
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(mean[..., :1], covariance[0, 0].sqrt()).to_event(1))
            if self.extra:
                slope = covariance[1, 0] / covariance[0, 0]
                spread = (covariance[1, 1] - slope * covariance[1, 0]).sqrt()
                loc = mean[..., 1:] + slope * (z - mean[..., :1])
                pyro.sample("z2", dist.Normal(loc, spread).to_event(1))

    def log_marginal(self, x):
        a = self._columns()
        covariance = a @ a.T + 0.25 * torch.eye(5)
        return dist.MultivariateNormal(torch.zeros(5), covariance).log_prob(x)


@pytest.mark.parametrize("added", [True, False])
def test_a_latent_that_came_or_went_on_a_kept_importance_model_is_scored(added):
    # A latent the kept read does not have would be left out of the importance weights
    # (off by nats from p(x)); one it has that the model no longer samples would be missed.
    switchable = _SecondLatent()
    switchable.extra = not added
    x = torch.randn(12, 5)
    log_marginal(switchable.model, x, guide=switchable.guide, conditionals="importance")
    switchable.extra = added
    for _ in range(2):  # the call that reads the model again, and the one after
        got = log_marginal(switchable.model, x, guide=switchable.guide, conditionals="importance")
        torch.testing.assert_close(got, switchable.log_marginal(x))
