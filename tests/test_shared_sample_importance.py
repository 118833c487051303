"""Importance-sampled conditionals whose masks pool their draws
(``ImportanceSampling(share_samples=True)``): the matrix-product conditionals against the
plain per-mask formula, and the pooled estimates and wake gradients against the closed
forms of a 1-D linear-Gaussian model."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.self_normalised_importance import plain_importance_log_conditionals
from pyro_mpt.ops.shared_sample_importance import (
    context_log_likelihoods,
    every_mask_average,
    mixture_log_density,
    plain_every_mask_average,
    proposal_masks,
    shared_sample_log_conditionals,
)

# z ~ N(0, 1), x_j | z ~ N(a_j z + b_j, psi_j).
A = torch.tensor([1.0, -0.5, 0.8, 1.2, 0.3])
B = torch.tensor([0.2, -0.1, 0.0, 0.5, -0.3])
PSI = torch.tensor([0.5, 0.3, 0.8, 0.4, 0.6])


def _model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z.unsqueeze(-1) * A + B, PSI.sqrt()).to_event(1), obs=x)


def _mask_aware_guide(x, hidden=None):
    """q(z | x_R) = N(m + 0.3 h, s^2), ``h`` the number of hidden entries: each mask of an
    observation has a proposal of its own, so the pooled draws come from distinct ones."""
    m = pyro.param("m", torch.tensor(0.2))
    s = pyro.param("s", torch.tensor(1.3))
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(m + 0.3 * _hidden_count(x, hidden), s))


def _hidden_count(x, hidden):
    return x.new_zeros(x.shape[:-1]) if hidden is None else hidden.to(x.dtype).sum(-1)


def _data(num_obs):
    z = torch.randn(num_obs, 1)
    return z * A + B + PSI.sqrt() * torch.randn(num_obs, 5)


def _posterior(x, context):
    c = context.to(x.dtype)
    precision = 1 + (c * A**2 / PSI).sum(-1)
    return (c * A * (x - B) / PSI).sum(-1) / precision, 1 / precision


def _exact_conditionals(x, masks):
    mean, var = _posterior(x, ~masks)
    loc = mean.unsqueeze(-1) * A + B
    return dist.Normal(loc, (var.unsqueeze(-1) * A**2 + PSI).sqrt()).log_prob(x)


def _assert_kl_gradients(grads, x, masks, m, s):
    """``grads`` of ``(m, s)`` against d KL(p(z | x_{R_p}) || q_p) averaged over ``masks``,
    for q_p = N(m + 0.3 h_p, s^2): (loc_p - mu_p) / s^2 for m and
    1/s - (var_p + (mu_p - loc_p)^2) / s^3 for s."""
    mu, var = _posterior(x, ~masks)
    loc = m + 0.3 * masks.to(x.dtype).sum(-1)
    expected_m = ((loc - mu) / s**2).mean(0).sum()
    expected_s = (1 / s - (var + (mu - loc) ** 2) / s**3).mean(0).sum()
    torch.testing.assert_close(grads[0], expected_m, atol=0.05, rtol=0)
    torch.testing.assert_close(grads[1], expected_s, atol=0.08, rtol=0)


def test_shared_sample_conditionals_equal_the_plain_formula_and_its_gradients():
    """Given every mask the same log-likelihoods, the matrix products give the plain
    formula's values and gradients, with -inf likelihoods outside the context ignored."""
    num_samples, num_masks, num_obs, num_features = 7, 3, 4, 6
    log_weights = torch.randn(num_samples, num_obs, requires_grad=True)
    ll = (torch.randn(num_samples, num_obs, num_features) - 1).requires_grad_()
    sizes = torch.tensor([[1, 2, 5, 3], [4, 1, 2, 6], [3, 3, 1, 2]])
    masks = masks_of_sizes(sizes, num_features)
    context = ~masks
    # A sample impossible at one masked feature: no NaN may reach the context sums.
    impossible = torch.zeros(num_samples, num_obs, num_features, dtype=torch.bool)
    impossible[2, 0, masks[0, 0].nonzero()[0]] = True
    ll_inf = torch.where(impossible, -math.inf, ll)

    log_joint = log_weights.unsqueeze(1) + context_log_likelihoods(ll_inf, context)
    shared = shared_sample_log_conditionals(log_joint, ll_inf)
    expanded = ll_inf.unsqueeze(1).expand(num_samples, num_masks, num_obs, num_features)
    plain = plain_importance_log_conditionals(
        log_weights.unsqueeze(1).expand(num_samples, num_masks, num_obs), expanded, context
    )
    finite = torch.isfinite(plain)
    torch.testing.assert_close(shared[finite], plain[finite], atol=1e-12, rtol=0)
    upstream = torch.randn_like(plain).masked_fill(~finite, 0.0)
    grads_shared = torch.autograd.grad(
        (shared.masked_fill(~finite, 0) * upstream).sum(), (log_weights, ll), retain_graph=True
    )
    grads_plain = torch.autograd.grad(
        (plain.masked_fill(~finite, 0) * upstream).sum(), (log_weights, ll)
    )
    for got, expected in zip(grads_shared, grads_plain):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("ratio_shape", [(7, 4), (7, 1)])
def test_every_mask_average_has_the_gradients_of_its_autograd_version(ratio_shape):
    """The hand-written backward pass against ``logsumexp`` under autograd, with an
    impossible sample and log-ratios broadcast over the batch."""
    torch.manual_seed(0)
    log_ratios = (3 * torch.randn(ratio_shape, dtype=torch.float64)).requires_grad_()
    ll = (5 * torch.randn(7, 4, dtype=torch.float64)).requires_grad_()
    impossible = torch.arange(7).unsqueeze(-1) == 2
    upstream = torch.randn(4, dtype=torch.float64)
    results = []
    for average in (every_mask_average, plain_every_mask_average):
        value = average(log_ratios, torch.where(impossible, -math.inf, ll))
        results.append((value, *torch.autograd.grad((value * upstream).sum(), (log_ratios, ll))))
    for got, expected in zip(*results):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_every_mask_average_flushes_subnormal_weights_from_its_gradients():
    """Log-weights 100 nats apart give float32 softmax weights below the normal range;
    the gradients drop them (no subnormal number reaches a decoder's matrix products), and
    differ from the autograd version's by no more than those weights."""
    torch.manual_seed(0)
    log_ratios = torch.tensor([0.0, -30.0, -50.0, -95.0, -100.0], dtype=torch.float32)
    log_ratios = log_ratios.unsqueeze(-1).repeat(1, 6).requires_grad_()
    ll = torch.randn(5, 6, dtype=torch.float32).requires_grad_()
    tiny = torch.finfo(torch.float32).tiny
    results = []
    for average in (every_mask_average, plain_every_mask_average):
        value = average(log_ratios, ll)
        results.append((value, *torch.autograd.grad(value.sum(), (log_ratios, ll))))
    (value, *grads), (plain_value, *plain_grads) = results
    torch.testing.assert_close(value, plain_value, atol=0, rtol=0)

    def subnormals(t):
        return int(((t != 0) & (t.abs() < tiny)).sum())

    assert subnormals(plain_grads[1]) > 0  # the inputs do reach the subnormal range
    for got, expected in zip(grads, plain_grads):
        assert subnormals(got) == 0
        torch.testing.assert_close(got, expected, atol=2e-19, rtol=1e-6)


def test_mixture_log_density_is_the_log_of_the_mean_density():
    log_q = torch.randn(5, 3, 4) * 3
    expected = log_q.exp().mean(1).log()
    torch.testing.assert_close(mixture_log_density(log_q), expected, atol=1e-12, rtol=0)


def test_pooled_conditionals_approach_the_exact_ones():
    """With 3 masks of 2000 draws each pooled, every conditional is within a few standard
    errors of the closed form; weighting the pooled draws by each mask's own proposal
    instead of the mixture would be off by tenths of a nat."""
    x = _data(4)
    masks = masks_of_sizes(torch.tensor([[1, 4, 2, 3], [3, 1, 4, 2], [5, 2, 1, 4]]), 5)
    exact = _exact_conditionals(x, masks)
    prepared = ImportanceSampling(2000, share_samples=True).prepare(
        _model, _mask_aware_guide, (x,), {}, 1
    )
    repeats = torch.stack([prepared.log_prob(masks).detach() for _ in range(8)])
    assert prepared.diagnostics.num_samples == 6000
    error = (repeats.mean(0) - exact)[masks]
    standard_error = repeats.std(0)[masks] / math.sqrt(repeats.shape[0])
    # The ratio estimate's bias is of order 1/S: a few thousandths of a nat here.
    assert bool((error.abs() <= 4 * standard_error + 0.005).all()), error


def test_pooled_wake_gradient_is_the_gradient_of_kl_per_mask():
    """The wake loss with pooled draws: E[-sum_s wbar_sp d log q_p(z_s)] is
    d KL(p(z | x_{R_p}) || q_p) for each mask's own proposal q_p = N(m + 0.3 h_p, s^2):
    (loc_p - mu_p) / s^2 for m and 1/s - (var_p + (mu_p - loc_p)^2) / s^3 for s."""
    x = _data(6)
    masks = masks_of_sizes(torch.tensor([[1, 3, 4, 2, 5, 1], [2, 2, 1, 4, 3, 5]]), 5)
    prepared = ImportanceSampling(num_samples=20000, share_samples=True).prepare(
        _model, _mask_aware_guide, (x,), {}, 1
    )
    prepared.log_prob(masks)
    m, s = pyro.param("m"), pyro.param("s")
    grads = torch.autograd.grad(prepared.proposal_loss(), (m, s))
    _assert_kl_gradients(grads, x, masks, m, s)


def test_share_samples_in_mpt_loss_matches_the_exact_loss_gradient_direction():
    """Through MPTLoss with several masks, a model parameter's gradient from pooled draws
    agrees with the exact conditionals' gradient for the same masks."""
    x = _data(5)

    def model(x):
        shift = pyro.param("shift", torch.tensor(0.4))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.unsqueeze(-1) * A + B + shift
            pyro.sample("x", dist.Normal(loc, PSI.sqrt()).to_event(1), obs=x)

    grads = {}
    for name, conditionals in (
        ("pooled", ImportanceSampling(num_samples=3000, share_samples=True)),
        ("exact", "exact"),
    ):
        loss = MPTLoss(num_masks=4, conditionals=conditionals, guide_loss=None)
        loss.loss(model, _mask_aware_guide, x)  # the first call's checks draw random numbers
        pyro.set_rng_seed(5)
        value = loss.differentiable_loss(model, _mask_aware_guide, x)
        grads[name] = torch.autograd.grad(value, [pyro.param("shift")])[0]
    # The same masks (same seed, drawn first in a later call); the pooled gradient is a
    # ratio estimate from 12000 draws per mask.
    tolerance = 0.05 * float(grads["exact"].abs())
    torch.testing.assert_close(grads["pooled"], grads["exact"], atol=tolerance, rtol=0)


def test_share_samples_is_checked():
    with pytest.raises(ValueError, match=r"share_samples must be True or False, got 'yes'"):
        ImportanceSampling(share_samples="yes")
    with pytest.raises(ValueError, match=r"debias='jackknife' and share_samples=True"):
        ImportanceSampling(num_samples=4, debias="jackknife", share_samples=True)
    assert "share_samples=True" in repr(ImportanceSampling(4, share_samples=True))


@pytest.mark.parametrize(
    "options",
    [{}, {"num_proposals": 0, "unmasked_proposal": True}],
    ids=["every mask draws", "only the unmasked input draws"],
)
def test_pooled_draws_of_a_guide_with_two_dependent_sites(options):
    """A guide whose second site depends on its first draw (q(z2 | z1)): the pooled draws
    are scored by replaying the guide under every proposal. The conditionals of the 2-latent
    linear-Gaussian model approach the closed form (Schur complement of W W^T + Psi)."""
    weights = torch.tensor([[1.0, 0.3], [-0.5, 0.8], [0.8, -0.6], [1.2, 0.2], [0.3, 1.1]])
    x = torch.randn(3, 2) @ weights.T + B + PSI.sqrt() * torch.randn(3, 5)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
            z2 = pyro.sample("z2", dist.Normal(0.0, 1.0))
            loc = z1.unsqueeze(-1) * weights[:, 0] + z2.unsqueeze(-1) * weights[:, 1] + B
            pyro.sample("x", dist.Normal(loc, PSI.sqrt()).to_event(1), obs=x)

    def guide(x, hidden=None):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.1 * _hidden_count(x, hidden), 1.2))
            pyro.sample("z2", dist.Normal(0.2 * z1, 1.2))

    masks = masks_of_sizes(torch.tensor([[1, 3, 2], [4, 1, 3], [2, 2, 5]]), 5)
    covariance = weights @ weights.T + torch.diag(PSI)
    mean = B
    exact = torch.zeros(masks.shape)
    for p in range(masks.shape[0]):
        for n in range(masks.shape[1]):
            context = ~masks[p, n]
            c = context.nonzero().squeeze(-1)
            for j in masks[p, n].nonzero().squeeze(-1).tolist():
                gain = torch.linalg.solve(covariance[c][:, c], covariance[c, j])
                loc = mean[j] + gain @ (x[n, c] - mean[c])
                var = covariance[j, j] - covariance[c, j] @ gain
                exact[p, n, j] = dist.Normal(loc, var.sqrt()).log_prob(x[n, j])
    strategy = ImportanceSampling(3000, share_samples=True, **options)
    prepared = strategy.prepare(model, guide, (x,), {}, 1)
    repeats = torch.stack([prepared.log_prob(masks).detach() for _ in range(8)])
    error = (repeats.mean(0) - exact)[masks]
    standard_error = repeats.std(0)[masks] / math.sqrt(repeats.shape[0])
    assert bool((error.abs() <= 4 * standard_error + 0.005).all()), error


def test_proposal_masks_are_the_middles_of_equal_runs():
    assert proposal_masks(16, 4).tolist() == [2, 6, 10, 14]
    assert proposal_masks(5, 2).tolist() == [1, 3]
    assert proposal_masks(3, 1).tolist() == [1]
    assert proposal_masks(4, 4) == slice(None)
    assert proposal_masks(4, None) == slice(None)


def test_masks_that_draw_nothing_approach_the_exact_conditionals():
    """Six masks, two of which draw 3000 samples each: all six masks' conditionals, those of
    the four that only reweight the pooled draws included, are within a few standard errors
    of the closed form (weights against the mixture of the two drawing masks' proposals)."""
    x = _data(3)
    sizes = torch.tensor([[1, 2, 1], [1, 3, 2], [2, 1, 3], [3, 4, 2], [4, 3, 5], [5, 4, 4]])
    masks = masks_of_sizes(sizes, 5)
    exact = _exact_conditionals(x, masks)
    prepared = ImportanceSampling(3000, share_samples=True, num_proposals=2).prepare(
        _model, _mask_aware_guide, (x,), {}, 1
    )
    repeats = torch.stack([prepared.log_prob(masks).detach() for _ in range(8)])
    assert prepared.diagnostics.num_samples == 6000
    assert prepared.diagnostics.pareto_k.shape == (6, 3)  # every mask's weights are checked
    error = (repeats.mean(0) - exact)[masks]
    standard_error = repeats.std(0)[masks] / math.sqrt(repeats.shape[0])
    assert bool((error.abs() <= 4 * standard_error + 0.005).all()), error


def test_wake_gradient_trains_the_drawing_masks_proposals():
    """With num_proposals, the wake loss is that of the masks that drew samples: its
    gradient is d KL(p(z | x_{R_p}) || q_p) averaged over those masks only."""
    x = _data(6)
    sizes = torch.tensor([[1, 3, 4, 2, 5, 1], [2, 2, 1, 4, 3, 5], [4, 1, 2, 5, 1, 3]])
    sizes = torch.cat([sizes, sizes.flip(0)])
    masks = masks_of_sizes(sizes, 5)
    prepared = ImportanceSampling(num_samples=20000, share_samples=True, num_proposals=2).prepare(
        _model, _mask_aware_guide, (x,), {}, 1
    )
    prepared.log_prob(masks)
    m, s = pyro.param("m"), pyro.param("s")
    grads = torch.autograd.grad(prepared.proposal_loss(), (m, s))
    _assert_kl_gradients(grads, x, masks[proposal_masks(6, 2)], m, s)


@pytest.mark.parametrize(
    "num_proposals, pooled", [(2, 9000), (0, 3000)], ids=["two masks draw", "no mask draws"]
)
def test_an_unmasked_proposal_keeps_every_mask_right(num_proposals, pooled):
    """Two drawing masks and the unmasked input, or the unmasked input alone
    (``num_proposals=0``), propose 3000 samples each: every mask's conditionals stay within
    a few standard errors of the closed form (weights against the mixture of the
    proposals)."""
    x = _data(3)
    sizes = torch.tensor([[1, 2, 1], [1, 3, 2], [2, 1, 3], [3, 4, 2], [4, 3, 5], [5, 4, 4]])
    masks = masks_of_sizes(sizes, 5)
    exact = _exact_conditionals(x, masks)
    strategy = ImportanceSampling(
        3000, share_samples=True, num_proposals=num_proposals, unmasked_proposal=True
    )
    prepared = strategy.prepare(_model, _mask_aware_guide, (x,), {}, 1)
    repeats = torch.stack([prepared.log_prob(masks).detach() for _ in range(8)])
    assert prepared.diagnostics.num_samples == pooled  # the proposals' draws, pooled
    error = (repeats.mean(0) - exact)[masks]
    standard_error = repeats.std(0)[masks] / math.sqrt(repeats.shape[0])
    assert bool((error.abs() <= 4 * standard_error + 0.005).all()), error


@pytest.mark.parametrize("num_proposals", [2, 0], ids=["two masks draw", "no mask draws"])
def test_wake_gradient_trains_the_unmasked_proposal_too(num_proposals):
    """With unmasked_proposal, the wake loss averages d KL(p(z | x_R) || q) over the drawing
    masks (none with ``num_proposals=0``) and the unmasked input, whose posterior is
    p(z | x) and whose q hides nothing."""
    x = _data(6)
    sizes = torch.tensor([[1, 3, 4, 2, 5, 1], [2, 2, 1, 4, 3, 5], [4, 1, 2, 5, 1, 3]])
    sizes = torch.cat([sizes, sizes.flip(0)])
    masks = masks_of_sizes(sizes, 5)
    strategy = ImportanceSampling(
        num_samples=20000, share_samples=True, num_proposals=num_proposals, unmasked_proposal=True
    )
    prepared = strategy.prepare(_model, _mask_aware_guide, (x,), {}, 1)
    prepared.log_prob(masks)
    m, s = pyro.param("m"), pyro.param("s")
    grads = torch.autograd.grad(prepared.proposal_loss(), (m, s))
    drawing = masks[proposal_masks(6, num_proposals)]
    proposing = torch.cat([drawing, torch.zeros_like(masks[:1])])
    assert proposing.shape[0] == num_proposals + 1
    _assert_kl_gradients(grads, x, proposing, m, s)


def test_unmasked_proposal_is_checked():
    with pytest.raises(ValueError, match=r"unmasked_proposal=True needs share_samples=True"):
        ImportanceSampling(num_samples=4, unmasked_proposal=True)
    with pytest.raises(ValueError, match=r"unmasked_proposal must be True or False"):
        ImportanceSampling(num_samples=4, share_samples=True, unmasked_proposal="yes")
    strategy = ImportanceSampling(4, share_samples=True, unmasked_proposal=True)
    assert "unmasked_proposal=True" in repr(strategy)


def test_num_proposals_is_checked():
    with pytest.raises(ValueError, match=r"num_proposals=2 needs share_samples=True"):
        ImportanceSampling(num_samples=4, num_proposals=2)
    with pytest.raises(ValueError, match=r"num_proposals=0 is accepted only with unmasked_pr"):
        ImportanceSampling(num_samples=4, share_samples=True, num_proposals=0)
    with pytest.raises(ValueError, match=r"num_proposals"):
        ImportanceSampling(num_samples=4, share_samples=True, num_proposals=-1)
    with pytest.raises(TypeError, match=r"num_proposals"):
        ImportanceSampling(4, share_samples=True, num_proposals=0.5, unmasked_proposal=True)
    assert "num_proposals=2" in repr(ImportanceSampling(4, share_samples=True, num_proposals=2))


def test_masks_that_share_draws_telescope_to_the_self_normalised_estimate():
    # Given one set of draws, the conditionals of every ordering's chain sum to
    # log sum_s w_s p(x | z_s) - log sum_s w_s, and so does the uniform-rate MPT estimate
    # averaged over every mask (sizes 1..D equally likely, then every mask of a size):
    # with draws shared by the masks, the mask noise is the only noise MPT adds.
    import itertools

    from pyro_mpt.ops.estimators import mpt_estimate

    generator = torch.Generator().manual_seed(0)
    num_samples, num_features = 6, 4
    log_w = torch.randn(num_samples, 1, dtype=torch.float64, generator=generator)
    ll = -torch.rand(num_samples, 1, num_features, dtype=torch.float64, generator=generator) * 3

    def conditionals(context):
        context = context.reshape(-1, 1, num_features)
        log_joint = log_w.unsqueeze(1) + context_log_likelihoods(ll, context)
        return shared_sample_log_conditionals(log_joint, ll)  # (P, 1, D)

    expected = torch.logsumexp(log_w[:, 0] + ll[:, 0].sum(-1), 0) - torch.logsumexp(log_w[:, 0], 0)
    for order in itertools.permutations(range(num_features)):
        contexts = torch.zeros(num_features, num_features, dtype=torch.bool)
        for step in range(1, num_features):
            contexts[step, list(order[:step])] = True
        terms = conditionals(contexts)[torch.arange(num_features), 0, list(order)]
        assert torch.allclose(terms.sum(), expected, atol=1e-10)

    by_size = []
    for size in range(1, num_features + 1):
        masks = torch.tensor(
            [
                [j in chosen for j in range(num_features)]
                for chosen in itertools.combinations(range(num_features), size)
            ]
        ).unsqueeze(1)  # (masks of this size, 1, D)
        by_size.append(mpt_estimate(conditionals(~masks), masks).squeeze())
    assert torch.allclose(torch.stack(by_size).mean(), expected, atol=1e-10)
    # One mask size alone is not the expectation: sizes, like masks, add noise of their own.
    assert (torch.stack(by_size) - expected).abs().max() > 1e-3


def test_pooled_draws_run_the_guide_once():
    """With one latent site, one guide run draws every pooled sample and scores it under
    every proposal; the model is replayed against those draws without a second guide run."""
    calls = []

    def guide(x, hidden=None):
        calls.append(x.shape)
        _mask_aware_guide(x, hidden)

    x = _data(4)
    masks = masks_of_sizes(torch.tensor([[1, 2, 3, 4], [5, 4, 3, 2], [2, 2, 2, 2]]), 5)
    for options in ({}, {"num_proposals": 0, "unmasked_proposal": True}):
        strategy = ImportanceSampling(16, share_samples=True, **options)
        prepared = strategy.prepare(_model, guide, (x,), {}, 1)
        calls.clear()
        prepared.log_prob(masks)
        assert len(calls) == 1, (options, calls)
