"""Quadrature conditionals far below their best node are exact: the floors of
:mod:`pyro_mpt.ops.floored_exp` that keep the matrix products fast capped them at 43.7
nats (float32) and 354 nats (float64) below it. References are the same rule's sums in
plain float64 log space."""

import pytest
import torch

from pyro_mpt.ops.floored_exp import MAX_EXACT_OFF_CPU, exact_where
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid
from pyro_mpt.ops.quadrature_tabulated import tabulated_log_conditionals, value_indicators


def _plain(log_weights, log_likelihoods, context):
    """``LSE_g(a_g + l_gj) - LSE_g(a_g)``, ``a_g = log w_g + sum_{k in R} l_gk``, in float64
    with the whole ``(P, G, N, D)`` tensor."""
    ll = log_likelihoods.double()
    a = torch.einsum("gnd,pnd->pgn", ll, context.double())
    a = a + log_weights.double()[:, None]  # (P, G, N)
    joint = a.unsqueeze(-1) + ll  # (P, G, N, D)
    return torch.logsumexp(joint, 1) - torch.logsumexp(a, 1).unsqueeze(-1)


def _outlier_case(dtype, outlier=8.0):
    """A 1-D latent, three features that agree on z = 1 and a fourth ``outlier`` far off:
    the fourth's conditional given the others is tens to hundreds of nats below its best
    node."""
    nodes, log_weights = gauss_hermite_grid(60, 1, dtype=torch.float64)
    weight = torch.tensor([1.0, 0.8, 1.2, -0.9], dtype=torch.float64)
    x = torch.tensor([[1.0, 0.8, 1.2, 0.9 * k] for k in (1.0, 3.0, 5.0, outlier)])
    x = x.double()
    loc = nodes[:, :1, None] * weight  # (G, 1, D)
    log_likelihoods = torch.distributions.Normal(loc, 0.5).log_prob(x)  # (G, N, D)
    context = torch.ones(2, 4, 4, dtype=torch.bool)
    context[0, :, 3] = False  # the outlier hidden
    context[1, :, 0] = False
    return log_weights.to(dtype), log_likelihoods.to(dtype), context


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quadrature_conditionals_far_below_the_best_node_are_exact(dtype):
    outlier = 8.0 if dtype == torch.float32 else 30.0
    log_weights, log_likelihoods, context = _outlier_case(dtype, outlier)
    expected = _plain(log_weights, log_likelihoods, context)
    best = log_likelihoods.double().amax(0)
    floor = 43.7 if dtype == torch.float32 else 354.0
    assert float((best - expected)[0, -1, 3]) > floor + 10  # past where the floor capped it
    out = quadrature_log_conditionals(log_weights, log_likelihoods, context)
    tol = 1e-3 if dtype == torch.float32 else 1e-8
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=1e-6)


def test_the_gradient_of_a_recomputed_conditional_is_that_of_the_plain_sum():
    log_weights, log_likelihoods, context = _outlier_case(torch.float64, outlier=30.0)
    log_likelihoods.requires_grad_()
    weights = torch.randn(context.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(
        (quadrature_log_conditionals(log_weights, log_likelihoods, context) * weights).sum(),
        log_likelihoods,
    )
    (expected,) = torch.autograd.grad(
        (_plain(log_weights, log_likelihoods, context) * weights).sum(), log_likelihoods
    )
    torch.testing.assert_close(grad, expected, atol=1e-9, rtol=1e-7)


def test_tabulated_conditionals_of_an_outlying_count_are_exact():
    # Poisson counts under rates exp(3 z) shared by every observation: one count of 40.
    nodes, log_weights = gauss_hermite_grid(60, 1, dtype=torch.float32)
    rates = torch.exp(3 * nodes[:, :1]).expand(-1, 4)  # (G, D)
    values = torch.tensor([0.0, 1.0, 2.0, 40.0], dtype=torch.float32)
    log_table = torch.distributions.Poisson(rates.unsqueeze(1)).log_prob(values[:, None])
    x = torch.tensor(
        [[0.0, 1.0, 0.0, 40.0], [1.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32
    )
    context = torch.ones(1, 3, 4, dtype=torch.bool)
    context[0, :, 3] = False
    context[0, 1, 0] = False
    log_table = log_table.requires_grad_()
    out = tabulated_log_conditionals(log_weights, log_table, value_indicators(values, x), context)
    indicators = value_indicators(values, x).double()  # (V, N, D)
    ll = torch.einsum("gvd,vnd->gnd", log_table.double(), indicators)  # log p(x_nj | z_g)
    expected = _plain(log_weights, ll, context)
    assert float(ll.amax(0)[0, 3] - expected[0, 0, 3]) > 48.0  # past the float32 floor, 43.7
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=1e-5)
    (grad,) = torch.autograd.grad(out[0, 0, 3], log_table)
    (expected_grad,) = torch.autograd.grad(expected[0, 0, 3], log_table)
    torch.testing.assert_close(grad.double(), expected_grad.double(), atol=1e-4, rtol=1e-3)


def test_bernoulli_conditionals_of_a_value_no_node_in_the_context_predicts_are_exact():
    nodes, log_weights = gauss_hermite_grid(40, 1, dtype=torch.float32)
    # Confident pixels: five that are on for z > 1, one that is on for z > -1.
    shifts = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0], dtype=torch.float32)
    logits = 60 * (nodes[:, :1] - shifts)  # (G, D)
    x = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32
    )
    context = torch.ones(1, 2, 6, dtype=torch.bool)
    context[0, 0, 5] = False  # the pixel that contradicts the others, hidden
    out = bernoulli_log_conditionals(log_weights, logits, x, context)
    log_one = torch.nn.functional.logsigmoid(logits.double())
    log_zero = torch.nn.functional.logsigmoid(-logits.double())
    ll = torch.where(x.bool().unsqueeze(0), log_one.unsqueeze(1), log_zero.unsqueeze(1))
    expected = _plain(log_weights, ll, context)
    assert float(ll.amax(0)[0, 5] - expected[0, 0, 5]) > 53.7
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=1e-5)


def test_off_the_cpu_the_entries_nearest_the_floors_are_recomputed_without_a_read():
    margin = torch.tensor([[3.0, -1.0, 0.5], [-2.0, 4.0, 1.0]])
    result = torch.zeros(2, 3)

    def exact(index):
        return 10.0 * index[0] + index[1] + 1.0

    read = exact_where(margin, result, exact, read=True)
    assert read.tolist() == [[0.0, 2.0, 0.0], [11.0, 0.0, 0.0]]
    # Without the read, every entry (6 <= MAX_EXACT_OFF_CPU) is computed again.
    assert MAX_EXACT_OFF_CPU >= 6
    unread = exact_where(margin, result, exact, read=False)
    assert unread.tolist() == [[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]


def test_importance_conditionals_far_below_the_best_sample_are_exact():
    # Two samples: the context's posterior rests on the first, under which the hidden
    # feature's value is 100 nats less likely than under the second, which the context
    # makes 200 nats less likely. The plain sums (the route off the CPU) are the reference.
    from pyro_mpt.ops.self_normalised_importance import (
        per_sample_importance_log_conditionals,
        plain_importance_log_conditionals,
    )

    log_weights = torch.zeros(2, 1, 3, dtype=torch.float32)
    log_likelihoods = torch.zeros(2, 1, 3, 4, dtype=torch.float32)
    log_likelihoods[0, ..., 3] = -100.0
    log_likelihoods[1, ..., :3] = -200.0 / 3
    context = torch.ones(1, 3, 4, dtype=torch.bool)
    context[..., 3] = False
    log_likelihoods.requires_grad_()
    out = per_sample_importance_log_conditionals(log_weights, log_likelihoods, context)
    expected = plain_importance_log_conditionals(
        log_weights.double(), log_likelihoods.double(), context
    )
    assert float(expected[0, 0, 3]) < -99  # past the float32 floor, 43.7 below the best
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-5)
    (grad,) = torch.autograd.grad(out[..., 3].sum(), log_likelihoods)
    (expected_grad,) = torch.autograd.grad(expected[..., 3].sum(), log_likelihoods)
    torch.testing.assert_close(grad.double(), expected_grad.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_log_sums_of_recomputed_conditionals_are_those_of_logsumexp(dtype):
    # Rows spanning hundreds of nats, as those exact_where recomputes do, and one row
    # impossible at every term.
    from pyro_mpt.ops.floored_exp import log_sum_exp

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 60, generator=generator, dtype=torch.float64) * 300 - 200
    x[-1] = -float("inf")
    x = x.to(dtype).requires_grad_()
    out = log_sum_exp(x)
    expected = torch.logsumexp(x.double(), -1)  # float64 logsumexp, no floor
    assert out.dtype == dtype and out[-1] == -float("inf")
    torch.testing.assert_close(out[:-1].double(), expected[:-1], atol=0.0, rtol=1e-6)
    # No NaN reaches the gradient from the impossible row (torch.logsumexp sends NaN).
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert bool((grad[-1] == 0).all())
    (expected_grad,) = torch.autograd.grad(expected[:-1].sum(), x)
    torch.testing.assert_close(
        grad[:-1].double(), expected_grad[:-1].double(), atol=1e-6, rtol=1e-5
    )


def test_a_hidden_value_impossible_at_every_node_sends_no_nan_to_the_gradient():
    # Its conditional is -inf and is recomputed in log space; the finite conditionals'
    # gradient must stay finite (torch.logsumexp of an all -inf row sends NaN back).
    generator = torch.Generator().manual_seed(0)
    log_likelihoods = torch.randn(20, 3, 4, generator=generator) - 1
    log_likelihoods[:, 1, 2] = -float("inf")
    log_likelihoods.requires_grad_()
    context = torch.ones(1, 3, 4, dtype=torch.bool)
    context[0, :, 2] = False
    out = quadrature_log_conditionals(torch.full((20,), -3.0), log_likelihoods, context)
    assert out[0, 1, 2] == -float("inf")
    finite = torch.isfinite(out)
    (grad,) = torch.autograd.grad(out[finite].sum(), log_likelihoods)
    assert bool(torch.isfinite(grad).all())
