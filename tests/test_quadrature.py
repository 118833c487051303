"""Quadrature conditionals against exact Gaussian conditionals and brute-force integrals."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid


def _linear_model(weight, bias, likelihood):
    latent_dim = weight.shape[-1]

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(latent_dim), 1.0).to_event(1))
            eta = z @ weight.T + bias
            if likelihood == "normal":
                fn = dist.Normal(eta, 0.8)
            elif likelihood == "bernoulli":
                fn = dist.Bernoulli(logits=eta)
            elif likelihood == "poisson":
                fn = dist.Poisson(eta.exp())
            else:  # categorical: three classes per feature
                fn = dist.Categorical(logits=torch.stack([eta, -eta, 0.5 * eta], -1))
            pyro.sample("x", fn.to_event(1), obs=x)

    return model


def test_gauss_hermite_grid_integrates_polynomials():
    nodes, log_w = gauss_hermite_grid(8, 2)
    w = log_w.exp()
    assert nodes.shape == (64, 2) and w.sum().item() == pytest.approx(1.0)
    # E[u1^2 u2^4] = 1 * 3 under N(0, I).
    assert (w * nodes[:, 0] ** 2 * nodes[:, 1] ** 4).sum().item() == pytest.approx(3.0)


@pytest.mark.parametrize("latent_dim", [1, 2])
def test_quadrature_matches_exact_conditionals_on_a_gaussian_model(latent_dim):
    weight, bias = 0.6 * torch.randn(5, latent_dim), torch.randn(5)
    model = _linear_model(weight, bias, "normal")
    x = torch.randn(4, 5)
    masks = masks_of_sizes(torch.randint(1, 6, (3, 4)), 5)
    exact = Exact().prepare(model, None, (x,), {})
    quad = Quadrature(num_points=60).prepare(model, None, (x,), {})
    diff = torch.where(masks, exact.log_prob(masks) - quad.log_prob(masks), 0.0)
    assert diff.abs().max() < 1e-6
    torch.testing.assert_close(quad.log_marginal(), exact.log_marginal(), atol=1e-6, rtol=0)


def _brute_force_log_conditionals(model_weight, bias, likelihood, x, mask):
    """``log p(x_j | x_R)`` for one observation by a fine trapezoid rule over a 1-d latent."""
    z = torch.linspace(-9, 9, 20001)
    log_prior = -0.5 * z**2 - 0.5 * math.log(2 * math.pi)
    eta = z[:, None] * model_weight[:, 0] + bias
    if likelihood == "bernoulli":
        ll = dist.Bernoulli(logits=eta).log_prob(x)
    elif likelihood == "poisson":
        ll = dist.Poisson(eta.exp()).log_prob(x)
    else:
        ll = dist.Categorical(logits=torch.stack([eta, -eta, 0.5 * eta], -1)).log_prob(x)
    dz = z[1] - z[0]
    context = (ll * (~mask)).sum(-1) + log_prior
    log_den = torch.logsumexp(context, 0) + dz.log()
    log_num = torch.logsumexp(context[:, None] + ll, 0) + dz.log()
    return log_num - log_den


@pytest.mark.parametrize("likelihood", ["bernoulli", "poisson", "categorical"])
def test_quadrature_matches_brute_force_integrals(likelihood):
    weight, bias = 0.8 * torch.randn(6, 1), 0.3 * torch.randn(6)
    model = _linear_model(weight, bias, likelihood)
    trace = pyro.poutine.trace(model).get_trace(torch.zeros(3, 6))
    x = trace.nodes["x"]["fn"].sample()  # data of the right support
    masks = masks_of_sizes(torch.tensor([[2, 4, 6]]), 6)
    quad = Quadrature(num_points=200).prepare(model, None, (x,), {}).log_prob(masks)
    for n in range(3):
        expected = _brute_force_log_conditionals(weight, bias, likelihood, x[n], masks[0, n])
        got = quad[0, n]
        assert torch.allclose(got[masks[0, n]], expected[masks[0, n]], atol=1e-6)


def test_conditionals_differ_from_the_marginals_when_features_are_dependent():
    """Scoring masked pixels by their marginal, ignoring x_R, is not the MPT conditional."""
    weight, bias = 3.0 * torch.ones(8, 1), torch.zeros(8)
    model = _linear_model(weight, bias, "bernoulli")
    x = torch.ones(2, 8)
    masks = masks_of_sizes(torch.tensor([[1, 1]]), 8)
    prepared = Quadrature(num_points=60).prepare(model, None, (x,), {})
    conditional = prepared.log_prob(masks)[masks]
    marginal = prepared.log_prob(torch.ones_like(masks))[masks]  # empty context
    # Seven ones in the context make another one far more likely than its marginal 1/2.
    assert torch.allclose(marginal, torch.tensor(math.log(0.5)), atol=1e-6)
    assert (conditional > math.log(0.9)).all()


def test_svi_with_quadrature_raises_the_lml_and_reaches_every_parameter():
    true_weight = 1.5 * torch.randn(10, 2)
    truth = _linear_model(true_weight, torch.zeros(10), "bernoulli")
    x = pyro.poutine.trace(truth).get_trace(torch.zeros(200, 10)).nodes["x"]["fn"].sample()

    def model(data):
        weight = pyro.param("weight", 0.1 * torch.randn(10, 2))
        bias = pyro.param("bias", torch.zeros(10))
        _linear_model(weight, bias, "bernoulli")(data)

    quad = Quadrature(num_points=20)
    loss = MPTLoss(conditionals=quad, num_masks=2)
    svi = pyro.infer.SVI(model, lambda data: None, pyro.optim.Adam({"lr": 0.05}), loss)

    def lml():
        with torch.no_grad():
            return quad.prepare(model, None, (x,), {}).log_marginal().mean().item()

    svi.step(x)
    before = lml()
    for _ in range(150):
        svi.step(x)
    assert lml() > before + 0.3
    grads = torch.autograd.grad(
        loss.differentiable_loss(model, None, x), [pyro.param("weight"), pyro.param("bias")]
    )
    assert all(g.abs().sum() > 0 for g in grads)


def test_auto_picks_quadrature_for_small_non_gaussian_models():
    model = _linear_model(torch.randn(4, 2), torch.zeros(4), "bernoulli")
    loss = MPTLoss()
    loss.loss(model, None, torch.ones(3, 4))
    assert isinstance(loss.conditionals.chosen, Quadrature)


def test_latent_too_large_for_quadrature_names_the_limit():
    model = _linear_model(torch.randn(4, 5), torch.zeros(4), "bernoulli")
    with pytest.raises(NotApplicableError, match=r"at most 3 latent dimensions.*K=5.*importance"):
        Quadrature().prepare(model, None, (torch.ones(3, 4),), {})


def test_non_factorising_likelihood_is_rejected():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            cov = torch.eye(3) + 0.5
            pyro.sample(
                "x", dist.MultivariateNormal(z[..., None].expand(z.shape + (3,)) ** 3, cov), obs=x
            )

    with pytest.raises(NotApplicableError, match=r"does not factorise over features"):
        Quadrature().prepare(model, None, (torch.zeros(2, 3),), {})


def test_bad_num_points():
    with pytest.raises(
        ValueError, match=r"num_points must be at least 1, got 0. e.g. num_points=20"
    ):
        Quadrature(num_points=0)
    with pytest.raises(TypeError, match=r"num_points must be a positive integer, got 2.5"):
        Quadrature(num_points=2.5)


def _narrow_posterior_case():
    """A linear-Gaussian model whose posterior is narrow under its prior, its data, its
    exact ``log p(x)``, and the exact posterior's means and marginal scales ``(5, 2)``."""
    weight, bias = 4.0 * torch.randn(12, 2), torch.randn(12)
    model = _linear_model(weight, bias, "normal")
    x = pyro.poutine.trace(model).get_trace(torch.zeros(5, 12)).nodes["x"]["fn"].sample()
    exact = Exact().prepare(model, None, (x,), {}).log_marginal()
    precision = torch.eye(2) + weight.T @ weight / 0.64
    post_cov = torch.linalg.inv(precision)
    post_mean = (x - bias) @ weight / 0.64 @ post_cov
    return model, x, exact, post_mean, post_cov.diagonal().sqrt().expand(5, 2)


def _normal_guide(loc, scale):
    """An amortized Normal guide with these means and scales."""

    def guide(data):
        with pyro.plate("data", data.shape[0]):
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return guide


def test_guide_centred_nodes_agree_with_exact_using_few_nodes():
    """Nodes placed at q(z | x) integrate a narrow posterior that prior nodes miss."""
    model, x, exact, post_mean, post_scale = _narrow_posterior_case()
    # The exact posterior of u given x, as an amortized Normal guide (its diagonal).
    guide = _normal_guide(post_mean, post_scale)
    guided = Quadrature(num_points=12, center="guide").prepare(model, guide, (x,), {})
    prior = Quadrature(num_points=12).prepare(model, guide, (x,), {})
    guided_error = (guided.log_marginal() - exact).abs().max()
    assert guided_error < 1e-3
    assert (prior.log_marginal() - exact).abs().max() > 100 * guided_error


def test_guide_centred_nodes_refuse_masked_inputs_and_average_every_mask_exactly():
    # The nodes sit at the guide's q(z | x) of the whole data: log p(x) is right, the
    # conditionals of masked inputs were nats off with no warning in mpt_curve, MPTLoss
    # with drawn masks and the coherence diagnostic. The average over every mask
    # telescopes to the rule's log p(x), which matches the closed form.
    from pyro_mpt import mpt_curve, ordering_log_likelihoods

    model, x, exact, post_mean, post_scale = _narrow_posterior_case()
    guide = _normal_guide(post_mean, post_scale)
    rule = Quadrature(num_points=12, center="guide")
    match = r"scores masked inputs, but Quadrature\(center='guide'\)"
    with pytest.raises(ValueError, match="mpt_curve " + match):
        mpt_curve(model, x, guide=guide, conditionals=rule)
    with pytest.raises(ValueError, match="ordering_log_likelihoods " + match):
        ordering_log_likelihoods(model, x, guide=guide, conditionals=rule)
    with pytest.raises(ValueError, match="MPTLoss with drawn masks " + match):
        MPTLoss(conditionals=rule).loss(model, guide, x)
    every = MPTLoss(num_masks="all", conditionals=rule).estimate(model, guide, x)
    torch.testing.assert_close(every.detach(), exact, atol=1e-3, rtol=0)


def test_adapted_nodes_integrate_against_the_standard_normal():
    from pyro_mpt.ops.quadrature_nodes import adapted_nodes

    nodes, log_w = gauss_hermite_grid(30, 2)
    u, log_w2 = adapted_nodes(nodes, log_w, torch.tensor([[0.5, -1.0]]), torch.tensor([[0.7, 1.3]]))
    # E[u1^2 + u2] = 1 under N(0, I), computed with the moved rule.
    estimate = (log_w2.exp() * (u[..., 0] ** 2 + u[..., 1])).sum(0)
    assert estimate.item() == pytest.approx(1.0, abs=1e-8)


def test_guide_centred_nodes_need_normal_guides():
    model = _linear_model(torch.randn(4, 1), torch.zeros(4), "bernoulli")

    def guide(data):
        with pyro.plate("data", data.shape[0]):
            pyro.sample("z", dist.Laplace(torch.zeros(1), 1.0).to_event(1))

    with pytest.raises(NotApplicableError, match=r"Normal guide distribution for latent site 'z'"):
        Quadrature(center="guide").prepare(model, guide, (torch.ones(3, 4),), {})
    with pytest.raises(ValueError, match=r"center must be 'prior' or 'guide', got 'mode'"):
        Quadrature(center="mode")


def test_per_observation_path_with_impossible_masked_values():
    """A value impossible at some or every node, at a masked feature, gives the log-sum-exp
    of the definition (``-inf`` when impossible everywhere), not NaN."""
    from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals

    ll = torch.randn(5, 2, 3)  # (G, N, D)
    ll[:2, 0, 1] = -math.inf  # impossible at two nodes
    ll[:, 1, 2] = -math.inf  # impossible at every node
    log_w = torch.log_softmax(torch.randn(5), 0)
    context = torch.tensor([[[True, False, True], [True, True, False]]])
    got = quadrature_log_conditionals(log_w, ll, context)
    a = log_w.reshape(5, 1) + torch.where(context[0], ll, 0.0).sum(-1)  # (G, N)
    expected = torch.logsumexp(a.unsqueeze(-1) + ll, 0) - torch.logsumexp(a, 0).unsqueeze(-1)
    torch.testing.assert_close(got[0, 0, 1], expected[0, 1], atol=1e-12, rtol=0)
    assert got[0, 1, 2] == -math.inf
    assert not torch.isnan(got).any()


def test_guide_centred_nodes_read_autonormal():
    """AutoNormal samples each latent as a Delta at its auxiliary Normal: the nodes sit at
    that Normal, as for a hand-written guide with the same means and scales."""
    from pyro.infer.autoguide import AutoNormal

    model, x, exact, post_mean, post_scale = _narrow_posterior_case()
    auto = AutoNormal(model)
    auto(x)  # creates its parameters: set them to the posterior's marginals
    auto.locs.z = post_mean
    auto.scales.z = post_scale.clone()
    guide = _normal_guide(post_mean, post_scale)
    rule = Quadrature(num_points=12, center="guide")
    by_auto = rule.prepare(model, auto, (x,), {}).log_marginal()
    by_hand = Quadrature(num_points=12, center="guide").prepare(model, guide, (x,), {})
    torch.testing.assert_close(by_auto, by_hand.log_marginal(), atol=1e-10, rtol=0)
    assert (by_auto - exact).abs().max() < 1e-3
