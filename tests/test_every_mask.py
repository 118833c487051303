"""``MPTLoss(num_masks="all")`` and ``SelfPredictive.mask_average``: the uniform-rate MPT
estimate averaged over every mask exactly, checked against the brute-force average over
all ``2^D - 1`` masks of the same conditionals, and against closed forms."""

import itertools
import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import EncodeDecode, ImportanceSampling, Quadrature
from pyro_mpt.errors import ImportanceAccuracyWarning

D, K, N = 4, 2, 3
W = torch.tensor([[1.2, -0.7, 0.4, 2.0], [-0.3, 1.5, -1.1, 0.6]])


def bernoulli_model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=2 * torch.tanh(z @ W)).to_event(1), obs=x)


def guide(x):
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(0.3 * x[..., :K], 0.8).to_event(1))


def masked_model(x, observed):
    """The Bernoulli model with some entries missing (``poutine.mask``)."""
    with pyro.plate("data", x.shape[-2], dim=-2):
        z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
        logits = 2 * torch.tanh(z @ W).squeeze(-2)
        with pyro.plate("features", D, dim=-1), poutine.mask(mask=observed):
            pyro.sample("x", dist.Bernoulli(logits=logits), obs=x)


def masked_guide(x, observed):
    with pyro.plate("data", x.shape[-2], dim=-2):
        loc = 0.3 * x[..., :K].unsqueeze(-2)
        pyro.sample("z", dist.Normal(loc, 0.8).to_event(1))


def shared_draws(num_samples=16):
    return ImportanceSampling(
        num_samples, share_samples=True, num_proposals=0, unmasked_proposal=True
    )


def every_mask_by_brute_force(prepared, observed_entries=None):
    """The uniform-rate estimate averaged over all masks of each observation's observed
    entries, from one call of ``log_prob`` (one set of draws) on every mask at once."""
    masks = torch.tensor(list(itertools.product([0, 1], repeat=D)), dtype=torch.bool)[1:]
    log_cond = prepared.log_prob(masks.unsqueeze(1).expand(-1, N, -1))  # (P, N, D)
    entries = torch.ones(N, D, dtype=torch.bool) if observed_entries is None else observed_entries
    totals = []
    for n in range(N):
        count = int(entries[n].sum())
        total = 0.0
        for p, mask in enumerate(masks):
            if (mask & ~entries[n]).any():
                continue  # masks only among the observed entries
            size = int(mask.sum())
            score = float((log_cond[p, n] * mask).sum()) / size
            total += score / math.comb(count, size)  # mean over masks of size M, summed over M
        totals.append(total)
    return torch.tensor(totals)


def test_shared_importance_draws_average_over_every_mask_in_closed_form():
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    prepared = shared_draws().prepare(bernoulli_model, guide, (x,), {}, 1)
    torch.manual_seed(3)
    brute = every_mask_by_brute_force(prepared)
    torch.manual_seed(3)  # the same draws
    closed = prepared.mask_average()
    assert torch.allclose(closed, brute, atol=1e-10, rtol=0)
    # The empty context's term is the log of the mean prior-to-guide ratio: an estimate of 0.
    assert prepared.diagnostics.empty_context.shape == (N,)


def test_every_mask_average_counts_observed_entries_only():
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    observed = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    prepared = shared_draws().prepare(masked_model, masked_guide, (x, observed), {}, 2)
    torch.manual_seed(5)
    brute = every_mask_by_brute_force(prepared, observed)
    torch.manual_seed(5)
    closed = prepared.mask_average()
    assert torch.allclose(closed, brute, atol=1e-10, rtol=0)


@pytest.mark.parametrize("center", ["prior", "guide"])
def test_a_quadrature_rule_averages_to_its_log_marginal_over_every_mask(center):
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    prepared = Quadrature(10, center=center).prepare(bernoulli_model, guide, (x,), {}, 1)
    brute = every_mask_by_brute_force(prepared)
    # The tabulated conditionals flush node weights too small to matter (ops/floored_exp).
    assert torch.allclose(prepared.mask_average(), brute, atol=1e-5, rtol=0)


def test_mpt_loss_over_every_mask_of_a_linear_gaussian_model_is_minus_log_p_x():
    weight = torch.tensor([[1.0, 0.5, -0.3], [0.2, -1.0, 0.8]])
    bias = torch.tensor([0.1, -0.2, 0.3])

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight + bias, 0.4).to_event(1), obs=x)

    x = torch.randn(7, 3)
    covariance = weight.T @ weight + 0.16 * torch.eye(3)
    exact = dist.MultivariateNormal(bias, covariance).log_prob(x).sum()
    loss = MPTLoss(num_masks="all", conditionals="exact").loss(model, lambda x: None, x)
    assert loss == pytest.approx(-float(exact), abs=1e-9)


def test_mpt_loss_over_every_mask_matches_a_fine_rule_at_many_draws():
    """Independent of the closed form's code: the whole loss at S=20000 shared draws from a
    guide that covers the posterior, against a 60-node-per-dimension quadrature rule."""
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])

    def wide_guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(torch.zeros(K), 1.3).to_event(1))

    reference = Quadrature(60).prepare(bernoulli_model, wide_guide, (x,), {}, 1).log_marginal()
    loss = MPTLoss(num_masks="all", conditionals=shared_draws(20000), guide_loss=None)
    estimates = torch.stack([loss.estimate(bernoulli_model, wide_guide, x) for _ in range(8)])
    mean, standard_error = estimates.mean(0), estimates.std(0) / math.sqrt(8)
    # The finite-S bias of the ratio is of order 1/S, far below the tolerance here.
    assert ((mean - reference).abs() <= 5 * standard_error + 2e-3).all()


def test_a_guide_that_misses_the_prior_is_flagged_with_the_empty_contexts_figure():
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])

    def narrow_guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(torch.full((K,), 1.5), 0.05).to_event(1))

    loss = MPTLoss(num_masks="all", conditionals=shared_draws(64), guide_loss=None)
    with pytest.warns(ImportanceAccuracyWarning, match="empty context") as caught:
        loss.estimate(bernoulli_model, narrow_guide, x)
    figures = loss.diagnostics.summary()
    assert figures["empty_context"] < -0.5  # the mean of p(z)/q(z) far below its value 1
    # Already over every mask, with the guide on the unmasked input: the fix advises neither
    # the average over every mask nor a guide told which entries are hidden.
    (message,) = [str(w.message) for w in caught if w.category is ImportanceAccuracyWarning]
    assert "num_masks='all'" not in message and "'hidden'" not in message
    assert "wake_contexts" in message

    # Over drawn masks, the same guide's warning points to the average over every mask.
    drawn = MPTLoss(num_masks=4, conditionals=ImportanceSampling(64), guide_loss=None)
    with pytest.warns(ImportanceAccuracyWarning, match=r"MPTLoss\(num_masks='all'\)"):
        drawn.estimate(bernoulli_model, narrow_guide, x)


def test_the_gradient_over_every_mask_is_that_of_the_brute_force_average():
    """The model's gradient of the closed form equals that of the average over all masks
    of the same draws."""
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])

    def model(x):
        shift = pyro.param("shift", torch.tensor([0.3, -0.2, 0.1, 0.5]))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            logits = 2 * torch.tanh(z @ W) + shift
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    prepared = shared_draws().prepare(model, guide, (x,), {}, 1)
    shift = pyro.param("shift")
    torch.manual_seed(7)
    (brute,) = torch.autograd.grad(every_mask_by_brute_force_differentiable(prepared), shift)
    torch.manual_seed(7)
    (closed,) = torch.autograd.grad(prepared.mask_average().sum(), shift)
    assert torch.allclose(closed, brute, atol=1e-10, rtol=0)


def every_mask_by_brute_force_differentiable(prepared):
    """The sum over observations of :func:`every_mask_by_brute_force`, as a tensor."""
    masks = torch.tensor(list(itertools.product([0, 1], repeat=D)), dtype=torch.bool)[1:]
    log_cond = prepared.log_prob(masks.unsqueeze(1).expand(-1, N, -1))
    sizes = masks.sum(-1)
    weights = 1.0 / (sizes * torch.tensor([math.comb(D, int(m)) for m in sizes]))
    return ((log_cond * masks.unsqueeze(1)).sum(-1) * weights.unsqueeze(-1)).sum()


def test_mpt_loss_over_every_mask_has_the_gradient_of_log_p_x():
    def model(x):
        weight = pyro.param("weight", torch.tensor([[1.0, 0.5, -0.3], [0.2, -1.0, 0.8]]))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight, 0.4).to_event(1), obs=x)

    x = torch.randn(7, 3)
    loss = MPTLoss(num_masks="all").differentiable_loss(model, lambda x: None, x)
    weight = pyro.param("weight")
    (got,) = torch.autograd.grad(loss, weight)
    covariance = weight.T @ weight + 0.16 * torch.eye(3)
    exact = -dist.MultivariateNormal(torch.zeros(3), covariance).log_prob(x).sum()
    (expected,) = torch.autograd.grad(exact, weight)
    assert torch.allclose(got, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rate=0.15), "rate=0.15"),
        (dict(share_masks=True), "share_masks"),
    ],
)
def test_every_mask_refuses_settings_without_that_average(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPTLoss(num_masks="all", **kwargs)


@pytest.mark.parametrize(
    "num_masks, error, match",
    [
        ("ALL", ValueError, "positive integer or 'all'.*'ALL'"),
        (0, ValueError, "at least 1, got 0.*or 'all'"),
        (2.5, TypeError, "positive integer"),
    ],
)
def test_num_masks_is_a_positive_integer_or_all(num_masks, error, match):
    with pytest.raises(error, match=match):
        MPTLoss(num_masks=num_masks)


@pytest.mark.parametrize(
    "conditionals, match",
    [
        (ImportanceSampling(8), "unmasked_proposal=True"),
        (EncodeDecode(), "no closed form"),
    ],
)
def test_every_mask_refuses_conditionals_that_draw_per_mask(conditionals, match):
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    loss = MPTLoss(num_masks="all", conditionals=conditionals)
    with pytest.raises(ValueError, match=match):
        loss.loss(bernoulli_model, guide, x)
    assert not list(pyro.get_param_store().keys())


def test_the_wake_loss_toward_the_full_context_is_that_of_the_unmasked_proposal():
    """wake_contexts=0: the same targets and draws as the masks' path with the unmasked
    proposal only (its weights toward p(z | x)), computed there from log_prob's draws."""
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    strategy = ImportanceSampling(
        16, share_samples=True, num_proposals=0, unmasked_proposal=True, wake_contexts=0
    )
    prepared = strategy.prepare(bernoulli_model, guide, (x,), {}, 1)
    torch.manual_seed(11)
    prepared.mask_average()
    every_mask = prepared.proposal_loss()
    masks = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 1]], dtype=torch.bool).unsqueeze(1)
    torch.manual_seed(11)
    prepared.log_prob(masks.expand(-1, N, -1))
    assert torch.allclose(every_mask, prepared.proposal_loss(), atol=1e-12, rtol=0)


def test_wake_contexts_average_the_targets():
    """Under a likelihood that ignores the latent every context's posterior is the prior, so
    any number of drawn contexts gives the full context's loss (a sum instead of a mean
    would not); under one that depends on it, drawn contexts change the loss."""
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])

    def flat_model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            logits = torch.zeros(x.shape[-1]) + 0 * z.sum(-1, keepdim=True)
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    def wake_loss(model, contexts):
        strategy = ImportanceSampling(
            16, share_samples=True, num_proposals=0, unmasked_proposal=True,
            wake_contexts=contexts,
        )  # fmt: skip
        prepared = strategy.prepare(model, guide, (x,), {}, 1)
        torch.manual_seed(13)
        prepared.mask_average()
        return prepared.proposal_loss()

    assert torch.allclose(wake_loss(flat_model, 3), wake_loss(flat_model, 0), atol=1e-12)
    assert not torch.allclose(wake_loss(bernoulli_model, 3), wake_loss(bernoulli_model, 0))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(wake_contexts=-1), ValueError, "non-negative"),
        (dict(wake_contexts=1.5), TypeError, "non-negative integer, got 1.5 of type float"),
        (dict(wake_contexts=True), TypeError, "non-negative integer, got True of type bool"),
        (dict(share_samples=True, wake_contexts=2), ValueError, "unmasked_proposal=True"),
    ],
)
def test_wake_contexts_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        ImportanceSampling(8, **kwargs)


def deep_model(x):
    """A 4-dimensional latent: beyond quadrature, so ``auto`` takes importance sampling."""
    weight = torch.linspace(-1.0, 1.0, 4 * D).reshape(4, D)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=torch.tanh(z @ weight)).to_event(1), obs=x)


def deep_guide(x):
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(torch.zeros(4), 1.0).to_event(1))


@pytest.mark.parametrize("name", ["auto", "importance"])
def test_importance_by_name_over_every_mask_draws_from_the_unmasked_guide(name):
    x = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    loss = MPTLoss(num_masks="all", conditionals=name)
    value = loss.loss(deep_model, deep_guide, x)
    used = loss.conditionals.in_use
    assert isinstance(used, ImportanceSampling) and math.isfinite(value)
    assert used.share_samples and used.num_proposals == 0 and used.unmasked_proposal
    # The prior as guide: the estimate is a plain Monte Carlo average over the prior's draws
    # for the full context, and the empty context's term is 0 exactly.
    assert torch.allclose(loss.diagnostics.empty_context, torch.zeros(N), atol=1e-12)
