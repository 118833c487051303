"""Guides with ``MPTLoss``: every standard autoguide and an amortized encoder, from a fresh
guide, under every strategy; point-mass guides as importance proposals; and
``guide_loss="elbo"``."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoNormal,
)

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature

NUM_OBS, NUM_FEATURES = 8, 6


def _model(latent_dim, likelihood):
    """``z ~ N(0, I_K)`` per observation and a likelihood with trainable weights."""

    def model(x):
        weight = pyro.param(
            "weight",
            lambda: (
                0.3 * torch.ones(x.shape[-1], latent_dim) + 0.1 * torch.eye(x.shape[-1], latent_dim)
            ),
        )
        bias = pyro.param("bias", lambda: torch.zeros(x.shape[-1]))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
            loc = z @ weight.T + bias
            if likelihood == "normal":
                fn = dist.Normal(loc, 0.8)
            elif likelihood == "bernoulli":
                fn = dist.Bernoulli(logits=loc)
            else:
                fn = dist.Poisson(torch.exp(loc))
            pyro.sample("x", fn.to_event(1), obs=x)

    return model


def _data(likelihood):
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(NUM_OBS, NUM_FEATURES, generator=generator)
    if likelihood == "normal":
        return base
    if likelihood == "bernoulli":
        return (base > 0).to(torch.get_default_dtype())
    return torch.floor(base.abs() * 2)


def _encoder(latent_dim):
    """An amortized guide: ``q(z | x) = N(A x, s)`` with trainable ``A`` and ``s``."""

    def encoder(x):
        weight = pyro.param("enc_weight", lambda: 0.1 * torch.ones(latent_dim, x.shape[-1]))
        scale = pyro.param(
            "enc_scale", lambda: torch.ones(latent_dim), constraint=dist.constraints.positive
        )
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(x @ weight.T, scale).to_event(1))

    return encoder


GUIDES = {
    "AutoNormal": AutoNormal,
    "AutoDiagonalNormal": AutoDiagonalNormal,
    "AutoLowRankMultivariateNormal": lambda model: AutoLowRankMultivariateNormal(model, rank=2),
    "AutoDelta": AutoDelta,
    "encoder": None,
}


def _guide(name, model, latent_dim):
    return _encoder(latent_dim) if name == "encoder" else GUIDES[name](model)


# (strategy, likelihood, latent dim, the strategy auto must pick)
SETTINGS = {
    "exact": (lambda: Exact(), "normal", 2, None),
    "quadrature": (lambda: Quadrature(num_points=12), "bernoulli", 2, None),
    "importance": (lambda: ImportanceSampling(num_samples=16), "bernoulli", 2, None),
    "auto-exact": (lambda: "auto", "normal", 2, Exact),
    "auto-quadrature": (lambda: "auto", "poisson", 1, Quadrature),
    "auto-importance": (lambda: "auto", "poisson", 5, ImportanceSampling),
    "auto-importance-bernoulli": (lambda: "auto", "bernoulli", 5, ImportanceSampling),
}


def _refuses_point_masses(guide_name, setting):
    """ImportanceSampling cannot propose from point masses; auto has nothing else for K=5."""
    return guide_name == "AutoDelta" and setting in (
        "importance",
        "auto-importance",
        "auto-importance-bernoulli",
    )


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("guide_name", list(GUIDES))
def test_fresh_guide_first_svi_step(guide_name, setting):
    strategy, likelihood, latent_dim, auto_choice = SETTINGS[setting]
    model = _model(latent_dim, likelihood)
    guide = _guide(guide_name, model, latent_dim)
    x = _data(likelihood)
    loss = MPTLoss(rate="uniform", conditionals=strategy())
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss)
    if _refuses_point_masses(guide_name, setting):
        with pytest.raises(ValueError, match=r"AutoDelta|point mass"):
            svi.step(x)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # guide_loss hint under exact/quadrature
        first = svi.step(x)
        second = svi.step(x)
    assert math.isfinite(first) and math.isfinite(second)
    # The model's parameters were created by the first step and trained by both.
    assert not torch.equal(
        pyro.param("weight").detach(), _model_initial_weight(NUM_FEATURES, latent_dim)
    )
    if auto_choice is not None:
        assert isinstance(loss.conditionals.chosen, auto_choice), loss.conditionals.chosen


def _model_initial_weight(num_features, latent_dim):
    return 0.3 * torch.ones(num_features, latent_dim) + 0.1 * torch.eye(num_features, latent_dim)


@pytest.mark.parametrize("guide_name", list(GUIDES))
def test_importance_estimates_are_finite_and_reach_the_guide(guide_name):
    """ImportanceSampling conditionals with each proposal: finite per-observation estimates, and a
    gradient into the guide through the reparameterised samples."""
    if guide_name == "AutoDelta":
        pytest.skip("point masses are refused as proposals (see the step test)")
    model = _model(2, "bernoulli")
    guide = _guide(guide_name, model, 2)
    x = _data("bernoulli")
    guide(x)  # creates the guide's parameters
    loss = MPTLoss(rate="uniform", conditionals=ImportanceSampling(num_samples=16))
    estimate = loss.estimate(model, guide, x)
    assert estimate.shape == (NUM_OBS,) and bool(torch.isfinite(estimate).all())
    guide_params = [
        p for name, p in pyro.get_param_store().items() if name not in ("weight", "bias")
    ]
    grads = torch.autograd.grad(estimate.sum(), guide_params, allow_unused=True)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_auto_with_a_point_mass_guide_uses_exact_or_quadrature():
    for likelihood, latent_dim, expected in (("normal", 2, Exact), ("bernoulli", 2, Quadrature)):
        pyro.clear_param_store()
        model = _model(latent_dim, likelihood)
        loss = MPTLoss(conditionals="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            svi = SVI(model, AutoDelta(model), pyro.optim.Adam({"lr": 0.01}), loss)
            assert math.isfinite(svi.step(_data(likelihood)))
        assert isinstance(loss.conditionals.chosen, expected)


@pytest.mark.parametrize("strategy", ["exact", "quadrature"])
def test_unused_guide_parameters_warn_once(strategy):
    likelihood = "normal" if strategy == "exact" else "bernoulli"
    model = _model(2, likelihood)
    guide = _encoder(2)
    x = _data(likelihood)
    guide(x)  # the guide has parameters before the first step
    conditionals = Exact() if strategy == "exact" else Quadrature(num_points=12)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), MPTLoss(conditionals=conditionals))
    with pytest.warns(UserWarning, match=r"guide_loss='elbo'"):
        svi.step(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step(x)
    assert not [w for w in caught if "guide_loss='elbo'" in str(w.message)]


def test_guide_loss_none_with_a_parameter_free_guide_does_not_warn():
    model = _model(2, "normal")
    x = _data("normal")

    def guide(x):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), MPTLoss(conditionals="exact")).step(x)
    assert not [w for w in caught if "guide_loss" in str(w.message)]


@pytest.mark.parametrize("strategy", ["exact", "quadrature"])
@pytest.mark.parametrize("guide_name", ["AutoNormal", "encoder"])
def test_guide_loss_elbo_trains_the_guide_and_leaves_the_model_gradient(strategy, guide_name):
    likelihood = "normal" if strategy == "exact" else "bernoulli"
    x = _data(likelihood)

    def conditionals():
        return Exact() if strategy == "exact" else Quadrature(num_points=12)

    def model_grads(guide_loss):
        pyro.clear_param_store()
        model = _model(2, likelihood)
        guide = _guide(guide_name, model, 2)
        guide(x)  # create the guide's parameters
        model(x)
        loss = MPTLoss(
            rate="uniform", num_masks=2, conditionals=conditionals(), guide_loss=guide_loss
        )
        params = dict(pyro.get_param_store().named_parameters())
        for p in params.values():
            p.grad = None
        pyro.set_rng_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            value = loss.loss_and_grads(model, guide, x)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        return value, grads

    value_none, grads_none = model_grads(None)
    value_elbo, grads_elbo = model_grads("elbo")
    for name in ("weight", "bias"):
        torch.testing.assert_close(grads_elbo[name], grads_none[name])
    guide_names = [n for n in grads_elbo if n not in ("weight", "bias")]
    assert guide_names
    assert all(grads_none[n] is None or bool((grads_none[n] == 0).all()) for n in guide_names)
    assert any(
        grads_elbo[n] is not None and bool(grads_elbo[n].abs().sum() > 0) for n in guide_names
    )
    assert math.isfinite(value_none) and math.isfinite(value_elbo)


@pytest.mark.parametrize("guide_name", ["AutoNormal", "AutoDiagonalNormal", "encoder"])
def test_guide_loss_elbo_moves_the_guide_in_svi(guide_name):
    model = _model(2, "normal")
    guide = _guide(guide_name, model, 2)
    x = _data("normal")
    svi = SVI(
        model,
        guide,
        pyro.optim.Adam({"lr": 0.05}),
        MPTLoss(conditionals="exact", guide_loss="elbo"),
    )
    svi.step(x)
    store = pyro.get_param_store()
    before = {n: p.detach().clone() for n, p in store.items() if n not in ("weight", "bias")}
    assert before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step(x)
    assert not [w for w in caught if "guide_loss" in str(w.message)]
    assert any(not torch.equal(store[n].detach(), v) for n, v in before.items())


def test_an_autoguide_list_with_a_joint_gaussian_member_is_a_proposal():
    """An ``AutoGuideList`` whose member draws some latents jointly for all observations
    (``AutoMultivariateNormal``) weighs them by that member's per-observation marginals:
    importance sampling then agrees with the closed form of a linear-Gaussian model within
    4 standard errors over seeds."""
    from pyro import poutine
    from pyro.infer.autoguide import AutoGuideList, AutoMultivariateNormal

    from pyro_mpt import log_marginal

    generator = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(4, generator=generator), torch.randn(4, generator=generator)
    x = torch.randn(5, 4, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(x.new_zeros(()), 1.0))
            z2 = pyro.sample("z2", dist.Normal(0.5 * z1, 1.0))
            loc = z1.unsqueeze(-1) * w1 + z2.unsqueeze(-1) * w2
            pyro.sample("x", dist.Normal(loc, 0.8).to_event(1), obs=x)

    pyro.clear_param_store()
    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=["z1"]), init_scale=1.0))
    guide.append(AutoMultivariateNormal(poutine.block(model, expose=["z2"]), init_scale=1.0))
    guide(x)
    # x = z1 w1 + z2 w2 + noise with z2 = 0.5 z1 + e: x ~ N(0, a a^T + w2 w2^T + 0.64 I).
    along = w1 + 0.5 * w2
    covariance = torch.outer(along, along) + torch.outer(w2, w2) + 0.64 * torch.eye(4)
    exact = dist.MultivariateNormal(torch.zeros(4), covariance).log_prob(x)
    values = []
    for seed in range(8):
        pyro.set_rng_seed(seed)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values.append(
                log_marginal(model, x, conditionals=ImportanceSampling(2048), guide=guide)
            )
    values = torch.stack(values)
    stderr = values.std(0) / math.sqrt(len(values))
    assert ((values.mean(0) - exact).abs() < 4 * stderr + 1e-3).all()
