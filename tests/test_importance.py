"""Importance-sampled conditionals against exact Gaussian conditionals and quadrature.

Over 300 lines because it covers the strategy end to end: the tensor kernel, agreement with
the exact and quadrature references, gradients and training, auto's choice, the guide as a
proposal, and the errors.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature, as_conditionals
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.models import PPCA, LinearVAE
from pyro_mpt.ops import self_normalised_importance
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.self_normalised_importance import (
    fill_masked,
    importance_log_conditionals,
    importance_log_marginal,
    plain_importance_log_conditionals,
)


def _ppca(num_features=6, latent_dim=2, noise_scale=0.7, num_data=8):
    """A PPCA model with random weights, data drawn from it, and the exact posterior."""
    pyro.clear_param_store()  # PyroModules share parameters by name
    ppca = PPCA(num_features, latent_dim, noise_scale=noise_scale)
    with torch.no_grad():
        ppca.weight.copy_(0.8 * torch.randn(num_features, latent_dim))
        ppca.loc.copy_(0.5 * torch.randn(num_features))
    w, var = ppca.weight.detach(), ppca.noise_scale.detach() ** 2
    precision = w.T @ w + var * torch.eye(latent_dim)
    encoder = torch.linalg.solve(precision, w.T)  # A = (W^T W + s^2 I)^-1 W^T
    posterior_cov = var * torch.linalg.inv(precision)
    return ppca, ppca.sample(num_data), encoder, posterior_cov


def _amortized_guide(ppca):
    """PPCA's amortized Gaussian encoder, written to broadcast over leading dims of x."""

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            loc = (x - ppca.loc) @ ppca.encoder_weight.T + ppca.encoder_bias
            pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=ppca.encoder_scale_tril))

    return guide


def _replicates(prepared, masks, num_replicates):
    """Independent estimates for the same masks (repeated along the mask dim), stacked on a
    leading dim and restricted to the masked features."""
    repeated = masks.repeat((num_replicates,) + (1,) * (masks.dim() - 1))
    with torch.no_grad():
        estimates = prepared.log_prob(repeated)
    return estimates.reshape((num_replicates,) + masks.shape)[:, masks]


def _assert_within_monte_carlo_error(estimates, expected):
    """The mean of the replicates is within 6 standard errors of ``expected``, plus
    ``sd^2``: the order of the bias of a log ratio estimate (a ratio of two means)."""
    sd = estimates.std(0)
    tolerance = 6 * sd / math.sqrt(estimates.shape[0]) + sd**2
    assert ((estimates.mean(0) - expected).abs() < tolerance).all()
    return sd


def test_ops_reduce_to_quadrature_with_equal_weights():
    ll = torch.randn(50, 3, 4, 5)  # (S, P, N, D)
    context = torch.rand(3, 4, 5) > 0.4
    got = importance_log_conditionals(torch.zeros(50, 3, 4), ll, context)
    per_mask = [
        quadrature_log_conditionals(torch.full((50,), -math.log(50)), ll[:, p], context[p : p + 1])
        for p in range(3)
    ]
    torch.testing.assert_close(got, torch.cat(per_mask))
    log_w = torch.randn(50, 4)
    expected = (log_w.exp().mean(0)).log()
    torch.testing.assert_close(importance_log_marginal(log_w), expected)


@pytest.mark.parametrize("shared_masks", [False, True])
def test_ops_values_and_gradients_against_logsumexp(shared_masks):
    num_samples, num_masks, num_obs, num_features = 7, 3, 4, 5
    log_w = torch.randn(num_samples, num_masks, num_obs, requires_grad=True)
    ll = (10 * torch.randn(num_samples, num_masks, num_obs, num_features)).requires_grad_()
    context = torch.rand(num_masks, 1 if shared_masks else num_obs, num_features) > 0.4
    got = importance_log_conditionals(log_w, ll, context)
    # The definition: two log-sum-exps over samples.
    log_joint = log_w + torch.where(context, ll, 0.0).sum(-1)
    expected = (
        torch.logsumexp(log_joint.unsqueeze(-1) + ll, 0) - torch.logsumexp(log_joint, 0)[..., None]
    )
    plain = plain_importance_log_conditionals(log_w, ll, context)
    upstream = torch.randn(got.shape)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (log_w, ll))
    for value in (got, plain):  # the hand-written passes (the CPU's route) and the plain one
        torch.testing.assert_close(value, expected, atol=1e-12, rtol=0)
        grads = torch.autograd.grad((value * upstream).sum(), (log_w, ll))
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


def test_ops_impossible_masked_values():
    ll = torch.randn(6, 1, 2, 3)
    ll[:3, 0, 0, 1] = -math.inf  # impossible under half the samples
    ll[:, 0, 1, 2] = -math.inf  # impossible under every sample
    context = torch.tensor([[[True, False, True], [True, True, False]]])
    log_joint = torch.where(context, ll, 0.0).sum(-1)
    expected = (
        torch.logsumexp(log_joint.unsqueeze(-1) + ll, 0) - torch.logsumexp(log_joint, 0)[..., None]
    )
    # The CPU's route and the plain one that other devices take.
    for route in (importance_log_conditionals, plain_importance_log_conditionals):
        got = route(torch.zeros(6, 1, 2), ll, context)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        assert got[0, 1, 2] == -math.inf


def test_ops_off_the_cpu_take_the_plain_route(monkeypatch):
    # The per-sample loop pays on the CPU only; other devices (meta here) take the plain
    # whole-tensor operations.
    routes = []
    for name in ("plain_importance_log_conditionals", "_per_sample"):
        original = getattr(self_normalised_importance, name)

        def spy(*args, _name=name, _original=original):
            routes.append(_name)
            return _original(*args)

        monkeypatch.setattr(self_normalised_importance, name, spy)
    for device in ("meta", "cpu"):
        out = self_normalised_importance.importance_log_conditionals(
            torch.zeros(4, 1, 2, device=device),
            torch.zeros(4, 1, 2, 3, device=device),
            torch.ones(1, 2, 3, dtype=torch.bool, device=device),
        )
        assert out.shape == (1, 2, 3) and out.device.type == device
        # The conditionals' bias comes with them on either route (no read of the device).
        _, bias = self_normalised_importance.importance_log_conditionals(
            torch.zeros(4, 1, 2, device=device),
            torch.zeros(4, 1, 2, 3, device=device),
            torch.ones(1, 2, 3, dtype=torch.bool, device=device),
            with_bias=True,
        )
        assert bias.shape == (1, 2, 3) and bias.device.type == device
    assert routes == ["plain_importance_log_conditionals"] * 2 + ["_per_sample"] * 2


def test_fill_masked_zeros_and_means_without_the_masked_values():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    masks = torch.tensor([[[True, False], [False, False], [False, True]]])
    assert torch.equal(fill_masked(x, masks)[0], torch.tensor([[0.0, 2.0], [3.0, 4.0], [5.0, 0.0]]))
    filled = fill_masked(x, masks, "mean")[0]
    # Feature 0 is observed in rows 1 and 2 (mean 4), feature 1 in rows 0 and 1 (mean 3).
    assert torch.equal(filled, torch.tensor([[4.0, 2.0], [3.0, 4.0], [5.0, 3.0]]))
    with pytest.raises(ValueError, match=r"fill must be 'zeros' or 'mean', got 'median'"):
        fill_masked(x, masks, "median")


@pytest.mark.parametrize("fill", ["zeros", "mean"])
def test_importance_agrees_with_exact_within_its_monte_carlo_error(fill):
    ppca, x, encoder, _ = _ppca()
    # The guide family contains the exact posterior; its covariance is set to the prior's so
    # that the proposal covers p(z | x_R) for every mask.
    with torch.no_grad():
        ppca.encoder_weight.copy_(encoder)
    masks = masks_of_sizes(torch.randint(1, 7, (2, 8)), 6)
    exact = Exact().prepare(ppca.model, None, (x,), {}).log_prob(masks)[masks]
    prepared = ImportanceSampling(num_samples=4000, fill=fill).prepare(
        ppca.model, _amortized_guide(ppca), (x,), {}
    )
    sd = _assert_within_monte_carlo_error(_replicates(prepared, masks, 16), exact)
    assert sd.mean() < 0.05  # the tolerance is a few hundredths of a nat


def test_importance_error_shrinks_with_the_number_of_samples():
    ppca, x, encoder, _ = _ppca()
    with torch.no_grad():
        ppca.encoder_weight.copy_(encoder)
    masks = masks_of_sizes(torch.randint(1, 7, (2, 8)), 6)
    exact = Exact().prepare(ppca.model, None, (x,), {}).log_prob(masks)[masks]
    errors = {}
    for num_samples in (16, 1024):
        prepared = ImportanceSampling(num_samples).prepare(
            ppca.model, _amortized_guide(ppca), (x,), {}
        )
        estimates = _replicates(prepared, masks, 8)
        errors[num_samples] = (estimates - exact).abs().mean().item()
    # Monte Carlo error falls like 1/sqrt(S): 8 times from S=16 to S=1024.
    assert errors[1024] < errors[16] / 4


def test_log_marginal_is_exact_with_the_exact_posterior_as_proposal():
    ppca, x, encoder, posterior_cov = _ppca()
    with torch.no_grad():
        ppca.encoder_weight.copy_(encoder)
    ppca.encoder_scale_tril = torch.linalg.cholesky(posterior_cov)
    guide = _amortized_guide(ppca)
    exact = log_marginal(ppca.model, x)
    # Every weight p(x, z) / q(z | x) equals p(x): zero variance.
    estimate = log_marginal(ppca.model, x, conditionals="importance", guide=guide)
    torch.testing.assert_close(estimate, exact, atol=1e-8, rtol=0)


def test_bernoulli_linear_vae_agrees_with_quadrature():
    vae = LinearVAE(num_features=8, latent_dim=2, init_scale=1.5)
    with torch.no_grad():
        vae.encoder_weight.copy_(0.3 * torch.randn(2, 16))  # reads x and its hidden mask
    x = vae.sample(6)
    masks = masks_of_sizes(torch.randint(1, 9, (2, 6)), 8)
    quad = Quadrature(num_points=40).prepare(vae.model, None, (x,), {}).log_prob(masks)[masks]
    prepared = as_conditionals("importance").prepare(vae.model, vae.guide, (x,), {})
    assert isinstance(prepared.log_prob(masks), torch.Tensor)
    prepared.num_samples = 4000
    _assert_within_monte_carlo_error(_replicates(prepared, masks, 16), quad)


def test_gradients_reach_every_encoder_and_decoder_parameter():
    vae = LinearVAE(num_features=7, latent_dim=3)
    x = vae.sample(5)
    masks = masks_of_sizes(torch.randint(1, 8, (2, 5)), 7)
    prepared = ImportanceSampling(num_samples=16).prepare(vae.model, vae.guide, (x,), {})
    params = list(vae.parameters())
    assert len(params) == 5  # weight, bias and three encoder parameters
    grads = torch.autograd.grad(prepared.log_prob(masks)[masks].sum(), params)
    assert all(g.abs().sum() > 0 for g in grads)


def test_svi_with_importance_reaches_the_lml_of_the_true_parameters():
    quad = Quadrature(num_points=20)

    def lml(vae):
        with torch.no_grad():
            return quad.prepare(vae.model, None, (x,), {}).log_marginal().mean().item()

    truth = LinearVAE(num_features=12, latent_dim=2, init_scale=2.5)
    x = truth.sample(150)
    target = lml(truth)
    pyro.clear_param_store()
    vae = LinearVAE(num_features=12, latent_dim=2)
    loss = MPTLoss(conditionals=ImportanceSampling(num_samples=16), num_masks=2)
    svi = pyro.infer.SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": 0.05}), loss)
    svi.step(x)
    before = lml(vae)
    for _ in range(100):
        svi.step(x)
    assert lml(vae) > before + 1.0
    assert lml(vae) > target - 0.25


def test_auto_picks_importance_for_a_large_latent_with_a_guide():
    vae = LinearVAE(num_features=6, latent_dim=5)
    x = vae.sample(4)
    loss = MPTLoss()
    loss.loss(vae.model, vae.guide, x)
    assert isinstance(loss.conditionals.chosen, ImportanceSampling)
    with pytest.raises(NotApplicableError, match=r"(?s)'importance'.*importance: .*no guide"):
        MPTLoss().loss(vae.model, None, x)


def test_guide_errors_name_the_fix():
    vae = LinearVAE(num_features=6, latent_dim=5)
    x = vae.sample(4)
    with pytest.raises(NotApplicableError, match=r"no guide was given.*amortized guide"):
        ImportanceSampling().prepare(vae.model, None, (x,), {})
    with pytest.raises(NotApplicableError, match=r"samples no site \['z'\]"):
        ImportanceSampling().prepare(vae.model, lambda data: None, (x,), {})
    ppca, x, _, _ = _ppca()

    def rigid_guide(data):
        # Sizes its plate with data.shape[0], so it cannot take a batch of filled copies.
        with pyro.plate("data", data.shape[0]):
            pyro.sample("z", dist.Normal(data[..., :2], 1.0).to_event(1))

    with pytest.raises(
        NotApplicableError, match=r"rigid_guide failed on a batch of filled copies.*x\.shape\[-2\]"
    ):
        ImportanceSampling().prepare(ppca.model, rigid_guide, (x,), {})


def test_a_guide_that_ignores_the_data_is_a_valid_proposal():
    ppca, x, _, _ = _ppca(num_data=4)
    guide = AutoNormal(ppca.model)
    masks = masks_of_sizes(torch.tensor([[1, 3, 5, 6]]), 6)
    guide(x)  # set up its parameters on the full data
    prepared = ImportanceSampling(num_samples=32).prepare(ppca.model, guide, (x,), {})
    assert torch.isfinite(prepared.log_prob(masks)).all()


def _two_latents(x):
    """z1 -> z2 -> x, linear-Gaussian: x ~ N(0, (1 + 0.25) a a^T + 0.3^2 I)."""
    with pyro.plate("data", x.shape[-2]):
        z1 = pyro.sample("z1", dist.Normal(x.new_zeros(()), 1.0))
        z2 = pyro.sample("z2", dist.Normal(z1, 0.5))
        loc = z2.unsqueeze(-1) * torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)
        pyro.sample("x", dist.Normal(loc, 0.3).to_event(1), obs=x)


def test_guide_sites_without_a_match_in_the_model_are_refused():
    # Each site the guide samples enters q: a mixing variable (k, then z from its
    # component) shifted every weight by log q(k), here log 3 for every observation, with
    # healthy weights; a point-mass member of an AutoGuideList gave a value that no number
    # of samples corrected. AutoNormal's auxiliaries, which its point masses transform into
    # the latents, are kept, and its estimate matches the closed form.
    from pyro.infer.autoguide import AutoDelta, AutoGuideList

    x = torch.randn(6, 4, dtype=torch.float64)

    def mixture_guide(x):
        with pyro.plate("data", x.shape[-2]):
            k = pyro.sample("k", dist.Categorical(x.new_ones(3) / 3))
            z1 = pyro.sample("z1", dist.Normal(k.to(x.dtype) - 1.0, 1.0))
            pyro.sample("z2", dist.Normal(z1, 0.5))

    with pytest.raises(NotApplicableError, match=r"also samples \['k'\], which the model's"):
        log_marginal(_two_latents, x, guide=mixture_guide, conditionals=ImportanceSampling(64))
    guides = AutoGuideList(_two_latents)
    guides.append(AutoNormal(pyro.poutine.block(_two_latents, expose=["z1"])))
    guides.append(AutoDelta(pyro.poutine.block(_two_latents, expose=["z2"])))
    with pytest.raises(NotApplicableError, match=r"gives latent 'z2' the same value"):
        log_marginal(_two_latents, x, guide=guides, conditionals=ImportanceSampling(64))
    value = log_marginal(
        _two_latents, x, guide=AutoNormal(_two_latents), conditionals=ImportanceSampling(64)
    )
    assert torch.isfinite(value).all()


def test_a_guide_of_the_missing_entries_of_an_obs_mask_is_refused_with_the_fix():
    # AutoNormal on a model with obs_mask also samples x_unobserved, whose log q entered
    # the weights: 10 to 21 nats off at any number of samples. Built on the model with that
    # site hidden, it gives log p(x_observed) of the closed form.
    observed = torch.ones(6, 4, dtype=torch.bool)
    observed[0, 1] = observed[3, 2] = False

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0))
            loc = z * torch.linspace(0.5, 1.5, 4, dtype=x.dtype)
            with pyro.plate("features", 4, dim=-1):
                pyro.sample("x", dist.Normal(loc, 0.6), obs=x, obs_mask=observed)

    x = torch.randn(6, 4, dtype=torch.float64)
    strategy = ImportanceSampling(2000)
    with pytest.raises(NotApplicableError, match=r"poutine.block\(model, hide=\['x_unobserved'\]"):
        log_marginal(model, x, guide=AutoNormal(model), conditionals=strategy)
    guide = AutoNormal(pyro.poutine.block(model, hide=["x_unobserved"]))
    pyro.set_rng_seed(0)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    for _ in range(300):
        svi.step(x)
    value = log_marginal(model, x, guide=guide, conditionals=strategy)
    exact = log_marginal(model, x, conditionals="exact")
    assert (value - exact).abs().max() < 0.2


def test_models_outside_its_scope_are_rejected():
    def global_latent(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("x", dist.Normal(w, 1.0).to_event(1), obs=x)

    def guide(x):
        pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    with pytest.raises(ValueError, match=r"Latent site 'w' is outside the data plate"):
        ImportanceSampling().prepare(global_latent, guide, (torch.zeros(4, 3),), {})

    def dense(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample(
                "x",
                dist.MultivariateNormal(z[..., None].expand(z.shape + (3,)), torch.eye(3)),
                obs=x,
            )

    with pytest.raises(NotApplicableError, match=r"site 'x'.*does not factorise over features"):
        ImportanceSampling().prepare(dense, guide, (torch.zeros(4, 3),), {})
    vae = LinearVAE(num_features=6, latent_dim=2, subsample_size=2)
    with pytest.raises(NotApplicableError, match=r"subsampled data plates are not supported"):
        ImportanceSampling().prepare(vae.model, vae.guide, (vae.sample(4),), {})
    # Data given by keyword: named as such, not as a subsampled plate.
    full = LinearVAE(num_features=6, latent_dim=2)
    with pytest.raises(
        NotApplicableError,
        match=r"got 'NoneType' \(the call passes only keywords, \['x'\]: pass the data first\)\.$",
    ):
        ImportanceSampling().prepare(full.model, full.guide, (), {"x": full.sample(4)})


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_samples must be at least 1, got 0"):
        ImportanceSampling(num_samples=0)
    with pytest.raises(
        TypeError, match=r"num_samples must be a positive integer, got 2.5 of type float"
    ):
        ImportanceSampling(num_samples=2.5)
    with pytest.raises(ValueError, match=r"fill must be 'zeros' or 'mean', got 'ones'"):
        ImportanceSampling(fill="ones")
    assert repr(ImportanceSampling()) == "ImportanceSampling(num_samples=64, fill='zeros')"


def test_ppca_guide_serves_importance_sampling():
    from pyro_mpt import log_marginal
    from pyro_mpt.conditionals import ImportanceSampling
    from pyro_mpt.models import PPCA

    ppca = PPCA(4, 1, init_scale=1.0, guide_covariance="diagonal")
    x = ppca.sample(5)
    exact = log_marginal(ppca.model, x)
    estimate = log_marginal(
        ppca.model, x, conditionals=ImportanceSampling(num_samples=20000), guide=ppca.guide
    )
    # The guide is at its initial values (a poor proposal): a loose but failing-when-broken bound.
    assert (estimate - exact).abs().max() < 0.1


def test_fast_bernoulli_log_prob_values_and_gradients():
    from pyro_mpt.ops.bernoulli import bernoulli_log_prob, observed_log_prob

    logits = torch.tensor([[-900.0, -30.0, -2.0, 0.0, 3.0, 40.0, 800.0]]).expand(3, 7)
    logits = (logits + torch.randn(3, 7)).requires_grad_()
    value = torch.bernoulli(torch.full((4, 1, 7), 0.5))
    fast = bernoulli_log_prob(logits, value)
    reference = dist.Bernoulli(logits=logits).log_prob(value)
    torch.testing.assert_close(fast, reference, atol=1e-12, rtol=0)
    upstream = torch.randn(fast.shape)
    (grad,) = torch.autograd.grad((fast * upstream).sum(), logits)
    (expected,) = torch.autograd.grad((reference * upstream).sum(), logits)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    # Logits above log(tiny) + 8 take log(sigmoid): the same values and gradients.
    moderate = (logits.detach().clamp(-30, 30) + 0.5).requires_grad_()
    fast = bernoulli_log_prob(moderate, value)
    reference = dist.Bernoulli(logits=moderate).log_prob(value)
    torch.testing.assert_close(fast, reference, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((fast * upstream).sum(), moderate)
    (expected,) = torch.autograd.grad((reference * upstream).sum(), moderate)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    # Values outside {0, 1} (accepted without validation) follow the same formula.
    grey = torch.rand(4, 1, 7)
    torch.testing.assert_close(
        bernoulli_log_prob(logits, grey),
        dist.Bernoulli(logits=logits, validate_args=False).log_prob(grey),
        atol=1e-12,
        rtol=0,
    )
    # Dispatch: the fast path for logits, the distribution's own for probs.
    moderate = logits.detach().clamp(-30, 30)
    torch.testing.assert_close(
        observed_log_prob(dist.Bernoulli(logits=moderate), value),
        dist.Bernoulli(logits=moderate).log_prob(value),
    )
    probs = torch.sigmoid(moderate)
    assert torch.equal(
        observed_log_prob(dist.Bernoulli(probs=probs), value),
        dist.Bernoulli(probs=probs).log_prob(value),
    )
