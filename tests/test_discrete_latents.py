"""Discrete local latents (``Categorical``, ``Bernoulli``) are summed over every value by
quadrature: checked against closed forms of mixtures, written out by hand here."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, config_enumerate

from pyro_mpt import MPTLoss, impute, log_marginal
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.conditionals.quadrature import MAX_ENUMERATED
from pyro_mpt.errors import NotApplicableError


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    yield
    torch.set_default_dtype(previous)


def _gaussian_mixture(num_data=12, num_features=4):
    generator = torch.Generator().manual_seed(3)
    mus = 2.0 * torch.randn(3, num_features, generator=generator)
    weights = torch.tensor([0.5, 0.3, 0.2])
    x = torch.randn(num_data, num_features, generator=generator) * 2.0

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(mus[c], 0.8).to_event(1), obs=x)

    # log p(x_j | c) of every observation, component and feature: (N, C, D).
    log_lik = dist.Normal(mus, 0.8).log_prob(x[:, None, :])
    return model, x, weights.log(), log_lik, mus


def _mixture_conditionals(log_prior, log_lik, masks):
    """``log p(x_j | x_R)`` of a finite mixture by hand: ``(P, N, D)``."""
    context = (~masks).to(log_lik.dtype)
    log_joint = (log_lik[None] * context[:, :, None, :]).sum(-1) + log_prior  # (P, N, C)
    posterior = log_joint - log_joint.logsumexp(-1, keepdim=True)
    return torch.logsumexp(posterior[..., None] + log_lik[None], -2)


def test_gaussian_mixture_log_marginal_and_conditionals_match_the_sum_over_components():
    model, x, log_prior, log_lik, _ = _gaussian_mixture()
    reference = torch.logsumexp(log_lik.sum(-1) + log_prior, -1)
    for conditionals in ("auto", Quadrature(num_points=5)):
        value = log_marginal(model, x, conditionals=conditionals)
        torch.testing.assert_close(value, reference, atol=1e-10, rtol=0)
    masks = torch.rand(5, *x.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    prepared = Quadrature().prepare(model, None, (x,), {})
    expected = _mixture_conditionals(log_prior, log_lik, masks)
    torch.testing.assert_close(prepared.log_prob(masks)[masks], expected[masks])


def test_every_mask_average_and_training_loss_are_the_exact_log_marginal():
    model, x, log_prior, log_lik, _ = _gaussian_mixture()
    reference = torch.logsumexp(log_lik.sum(-1) + log_prior, -1)
    estimate = MPTLoss(num_masks="all").estimate(model, None, x)
    torch.testing.assert_close(estimate, reference, atol=1e-10, rtol=0)
    # With drawn masks: unbiased, within 4 standard errors over 400 draws.
    loss = MPTLoss(num_masks=4)
    pyro.set_rng_seed(0)
    draws = torch.stack([loss.estimate(model, None, x).sum() for _ in range(400)])
    error = abs(draws.mean() - reference.sum())
    assert error < 4 * draws.std() / math.sqrt(len(draws))


def test_a_vector_of_binary_latents_is_summed_over_all_its_combinations():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 3, generator=generator)
    x = torch.randn(7, 5, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Bernoulli(torch.full((3,), 0.3)).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.7).to_event(1), obs=x)

    combos = torch.tensor([[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)])
    log_prior = dist.Bernoulli(0.3).log_prob(combos.double()).sum(-1)  # (8,)
    log_lik = dist.Normal(combos.double() @ weight.T, 0.7).log_prob(x[:, None, :])  # (N, 8, D)
    reference = torch.logsumexp(log_lik.sum(-1) + log_prior, -1)
    torch.testing.assert_close(log_marginal(model, x, conditionals="auto"), reference)
    masks = torch.rand(3, 7, 5, generator=generator) < 0.4
    prepared = Quadrature().prepare(model, None, (x,), {})
    expected = _mixture_conditionals(log_prior, log_lik, masks)
    torch.testing.assert_close(prepared.log_prob(masks)[masks], expected[masks])


def test_hierarchical_discrete_latents_weigh_each_value_by_its_parents_value():
    transition = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    mus = torch.tensor([[[-2.0, 0.0], [1.0, 1.0]], [[0.5, -1.0], [3.0, 2.0]]])  # (c1, c2, D)
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(2))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c1 = pyro.sample("c1", dist.Bernoulli(0.4))
            c2 = pyro.sample("c2", dist.Categorical(transition[c1.long()]))
            pyro.sample("x", dist.Normal(mus[c1.long(), c2], 0.5).to_event(1), obs=x)

    terms = []
    for c1, p1 in ((0, 0.6), (1, 0.4)):
        for c2 in (0, 1):
            log_lik = dist.Normal(mus[c1, c2], 0.5).log_prob(x).sum(-1)
            terms.append(math.log(p1) + transition[c1, c2].log() + log_lik)
    reference = torch.logsumexp(torch.stack(terms), 0)
    torch.testing.assert_close(log_marginal(model, x, conditionals="auto"), reference)


def test_a_prior_that_depends_on_covariates_weighs_each_observation_apart():
    generator = torch.Generator().manual_seed(4)
    covariates, coefficients = torch.randn(9, 2, generator=generator), torch.randn(2, 3)
    mus = 2.0 * torch.randn(3, 4, generator=generator)
    x = torch.randn(9, 4, generator=generator)

    def model(x, covariates):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(logits=covariates @ coefficients))
            pyro.sample("x", dist.Normal(mus[c], 0.6).to_event(1), obs=x)

    log_prior = torch.log_softmax(covariates @ coefficients, -1)
    log_lik = dist.Normal(mus, 0.6).log_prob(x[:, None, :]).sum(-1)
    reference = torch.logsumexp(log_prior + log_lik, -1)
    value = log_marginal(model, x, covariates, conditionals="auto")
    torch.testing.assert_close(value, reference)


def test_bernoulli_mixture_through_the_tabulated_rule():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, generator=generator)
    weights = torch.tensor([0.2, 0.5, 0.3])
    x = torch.bernoulli(torch.full((10, 6), 0.5), generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(weights))
            pyro.sample("x", dist.Bernoulli(logits=logits[c]).to_event(1), obs=x)

    log_lik = dist.Bernoulli(logits=logits).log_prob(x[:, None, :])
    reference = torch.logsumexp(log_lik.sum(-1) + weights.log(), -1)
    torch.testing.assert_close(log_marginal(model, x, conditionals="auto"), reference)
    masks = torch.rand(4, 10, 6, generator=generator) < 0.5
    prepared = Quadrature().prepare(model, None, (x,), {})
    expected = _mixture_conditionals(weights.log(), log_lik, masks)
    torch.testing.assert_close(prepared.log_prob(masks)[masks], expected[masks])


def test_discrete_and_continuous_latents_together_match_the_mixture_of_gaussians():
    generator = torch.Generator().manual_seed(6)
    w, b = torch.randn(4, generator=generator), torch.randn(2, 4, generator=generator)
    m = torch.tensor([-1.0, 2.0])
    x = 2.0 * torch.randn(8, 4, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Bernoulli(0.3)).long()
            z = pyro.sample("z", dist.Normal(m[c], 1.0))
            pyro.sample("x", dist.Normal(z[..., None] * w + b[c], 0.5).to_event(1), obs=x)

    # Given c, x is Gaussian: N(m_c w + b_c, w w^T + 0.25 I).
    covariance = torch.outer(w, w) + 0.25 * torch.eye(4)
    terms = [
        math.log(p) + dist.MultivariateNormal(m[c] * w + b[c], covariance).log_prob(x)
        for c, p in ((0, 0.7), (1, 0.3))
    ]
    reference = torch.logsumexp(torch.stack(terms), 0)
    value = log_marginal(model, x, conditionals="auto")
    torch.testing.assert_close(value, reference, atol=2e-3, rtol=0)


def test_learned_mixture_weights_get_the_gradient_of_the_exact_log_marginal():
    model_x = _gaussian_mixture()[1]
    mus = 2.0 * torch.randn(3, 4, generator=torch.Generator().manual_seed(8))

    def model(x):
        weights = pyro.param(
            "weights", torch.tensor([0.2, 0.3, 0.5]), constraint=dist.constraints.simplex
        )
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(mus[c], 0.8).to_event(1), obs=x)

    loss = MPTLoss(num_masks="all").differentiable_loss(model, None, model_x)
    unconstrained = pyro.param("weights").unconstrained()
    (gradient,) = torch.autograd.grad(loss, unconstrained)
    weights = pyro.param("weights")
    log_lik = dist.Normal(mus, 0.8).log_prob(model_x[:, None, :]).sum(-1)
    exact = -torch.logsumexp(log_lik + weights.log(), -1).sum()
    (expected,) = torch.autograd.grad(exact, unconstrained)
    torch.testing.assert_close(loss, exact)
    torch.testing.assert_close(gradient, expected)


def test_svi_trains_a_mixture_by_the_exact_objective():
    model_x = _gaussian_mixture()[1]

    pyro.param("mus", torch.zeros(3, 4) + torch.arange(3.0)[:, None])

    def model(x):
        mus = pyro.param("mus")
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.ones(3) / 3))
            pyro.sample("x", dist.Normal(mus[c], 1.0).to_event(1), obs=x)

    def exact_loss():
        mus = pyro.param("mus").detach()
        log_lik = dist.Normal(mus, 1.0).log_prob(model_x[:, None, :]).sum(-1)
        return -torch.logsumexp(log_lik - math.log(3), -1).sum().item()

    svi = SVI(model, lambda x: None, pyro.optim.Adam({"lr": 0.05}), MPTLoss(num_masks="all"))
    losses = []
    for _ in range(30):
        before = exact_loss()
        losses.append(svi.step(model_x))
        assert losses[-1] == pytest.approx(before, abs=1e-8)
    assert losses[-1] < losses[0] - 1.0


def test_impute_draws_from_the_mixture_conditional():
    model, x, log_prior, log_lik, mus = _gaussian_mixture(num_data=5)
    missing = torch.zeros(x.shape, dtype=torch.bool)
    missing[:, :2] = True
    pyro.set_rng_seed(0)
    num_samples = 20000
    draws = impute(model, x, missing=missing, num_samples=num_samples, conditionals="auto")
    assert torch.equal(draws[:, :, 2:], x[None, :, 2:].expand(num_samples, -1, -1))
    log_joint = (log_lik * (~missing)[:, None, :]).sum(-1) + log_prior
    posterior = torch.softmax(log_joint, -1)  # (N, C)
    model_mus = mus
    mean = posterior @ model_mus[:, :2]
    second = posterior @ (model_mus[:, :2] ** 2 + 0.64)
    stderr = ((second - mean**2) / num_samples).sqrt()
    assert ((draws[..., :2].mean(0) - mean).abs() < 4.5 * stderr).all()
    # Jointly drawn: both features come from one component, so they covary as the mixture.
    cross = posterior @ (model_mus[:, 0] * model_mus[:, 1])
    covariance = cross - mean[:, 0] * mean[:, 1]
    centred = draws[..., :2] - draws[..., :2].mean(0)
    measured = (centred[..., 0] * centred[..., 1]).mean(0)
    spread = (centred[..., 0] * centred[..., 1]).std(0) / math.sqrt(num_samples)
    assert ((measured - covariance).abs() < 4.5 * spread).all()


def test_an_enumerated_model_needs_no_guide():
    _, x, log_prior, log_lik, loc = _gaussian_mixture()
    weights = log_prior.exp()

    @config_enumerate
    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(loc[c], 0.8).to_event(1), obs=x)

    reference = torch.logsumexp(log_lik.sum(-1) + log_prior, -1)
    value = MPTLoss(num_masks="all").estimate(model, lambda x: None, x)
    torch.testing.assert_close(value, reference)


def test_discrete_latents_are_refused_where_they_cannot_be_summed():
    model, x, *_ = _gaussian_mixture()
    with pytest.raises(NotApplicableError, match=r"(?s)\['c'\] are discrete.*Quadrature"):
        Exact().prepare(model, None, (x,), {})

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(torch.ones(3) / 3))

    with pytest.raises(NotApplicableError, match=r"center='guide'.*discrete"):
        Quadrature(center="guide").prepare(model, guide, (x,), {})

    num_binary = int(math.log2(MAX_ENUMERATED)) + 1

    def many(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Bernoulli(torch.full((num_binary,), 0.5)).to_event(1))
            pyro.sample("x", dist.Normal(z.sum(-1, keepdim=True), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match=rf"(?s)\['z'\].*{2**num_binary} combinations"):
        Quadrature().prepare(many, None, (x[:, :1],), {})

    def one_hot(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.OneHotCategorical(torch.ones(3) / 3))
            pyro.sample("x", dist.Normal(c @ torch.ones(3, 4), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match=r"(?s)'c'.*OneHotCategorical"):
        Quadrature().prepare(one_hot, None, (x,), {})

    def ten_classes(x):
        # Counted as ten continuous coordinates, it was refused as "K=10" latent dimensions.
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.OneHotCategorical(torch.ones(10) / 10))
            pyro.sample("x", dist.Normal(c @ torch.ones(10, 4), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match=r"OneHotCategorical prior, discrete with an"):
        Quadrature().prepare(ten_classes, None, (x,), {})


def test_a_categorical_sampled_before_a_continuous_latent_leaves_the_nodes_continuous():
    """The rule's nodes take the continuous latents' dtype, not the first latent's: an
    integer Categorical first used to cut the Gauss-Hermite nodes and weights to integers
    (weights summing to 1.77), nats off with no warning."""
    generator = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, generator=generator), torch.randn(3, 3, generator=generator)
    m, weights = torch.tensor([-1.0, 0.5, 2.0]), torch.tensor([0.2, 0.5, 0.3])
    x = 2.0 * torch.randn(8, 3, generator=generator)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(weights))
            z = pyro.sample("z", dist.Normal(m[c], 1.0))
            pyro.sample("x", dist.Normal(z[..., None] * w + b[c], 0.5).to_event(1), obs=x)

    covariance = torch.outer(w, w) + 0.25 * torch.eye(3)
    terms = [
        weights[c].log() + dist.MultivariateNormal(m[c] * w + b[c], covariance).log_prob(x)
        for c in range(3)
    ]
    reference = torch.logsumexp(torch.stack(terms), 0)
    prepared = Quadrature(100).prepare(model, None, (x,), {})
    assert prepared.nodes.is_floating_point()
    torch.testing.assert_close(prepared.log_marginal(), reference, atol=1e-2, rtol=0)


def test_a_masked_discrete_prior_and_values_that_differ_by_row_are_refused_by_name():
    x = torch.randn(4, 3)

    def masked(x):
        with pyro.plate("data", x.shape[0]):
            keep = torch.tensor([True, False, True, True])
            c = pyro.sample("c", dist.Bernoulli(0.3).mask(keep))
            pyro.sample("x", dist.Normal(c[..., None] * torch.ones(3), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match=r"(?s)\['c'\] are masked.*obs_mask"):
        Quadrature().prepare(masked, None, (x,), {})

    def uneven(x):
        with pyro.plate("data", x.shape[0]):
            k = pyro.sample("k", dist.Binomial(torch.tensor([2.0, 3.0, 2.0, 4.0]), 0.5))
            pyro.sample("x", dist.Normal(k[..., None] * torch.ones(3), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match=r"(?s)'k'.*Binomial.*cannot be enumerated"):
        Quadrature().prepare(uneven, None, (x,), {})
