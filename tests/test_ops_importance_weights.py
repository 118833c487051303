"""Importance-weight diagnostics against independent references: ``arviz.psislw`` for the
Pareto shape k-hat, a plain Python sum for the effective sample size, and the known shape
of generalized Pareto weights."""

import math

import arviz
import numpy as np
import pytest
import torch

from pyro_mpt.ops.importance_weights import effective_sample_size, pareto_shape, ratio_bias

NUM_ROWS = 12


def _log_weights(kind, num_samples, num_rows=NUM_ROWS):
    """``(num_rows, num_samples)`` log-weights with light, heavy, tied or very wide tails."""
    shape = (num_rows, num_samples)
    if kind == "normal":  # log-normal weights: light tail
        return 1.5 * torch.randn(shape)
    if kind == "pareto":  # Pareto weights with alpha = 1.25: k = 0.8
        return torch.distributions.Exponential(1.25).sample(shape)
    if kind == "student_t":  # |t_2| weights: k = 0.5
        return torch.distributions.StudentT(2.0).sample(shape).abs().log()
    if kind == "tied":  # integer log-weights: ties at the threshold shorten the tail
        return (2.0 * torch.randn(shape)).round()
    if kind == "wide":  # spans beyond e^-708: the threshold is raised to log(tiny)
        return 300.0 * torch.randn(shape)
    if kind == "zeros":  # a third of the weights exactly zero
        log_w = 2.0 * torch.randn(shape)
        return log_w.masked_fill(torch.rand(shape) < 1 / 3, -math.inf)
    raise ValueError(kind)


def _arviz_khat(log_weights):
    """k-hat of each row (samples last) from arviz, with its ``inf`` for short tails
    mapped to the NaN that :func:`pareto_shape` returns."""
    _, khat = arviz.psislw(log_weights.cpu().numpy().copy())
    khat = np.where(np.isinf(khat), np.nan, khat)
    return torch.as_tensor(khat, dtype=log_weights.dtype, device=log_weights.device)


@pytest.mark.parametrize("num_samples", [20, 21, 50, 64, 100, 1000])  # M = 4, 5, 10, ...
@pytest.mark.parametrize("kind", ["normal", "pareto", "student_t", "tied", "wide", "zeros"])
def test_pareto_shape_matches_arviz(kind, num_samples):
    log_w = _log_weights(kind, num_samples)
    expected = _arviz_khat(log_w)
    if num_samples > 20:
        assert expected.isfinite().any()
    # Samples along the last dim, and along the first dim with the rows batched after.
    torch.testing.assert_close(
        pareto_shape(log_w, dim=-1), expected, atol=1e-10, rtol=0, equal_nan=True
    )
    torch.testing.assert_close(
        pareto_shape(log_w.T, dim=0), expected, atol=1e-10, rtol=0, equal_nan=True
    )


def test_pareto_shape_batched_over_several_dims():
    log_w = torch.distributions.Exponential(2.0).sample((3, 100, 4))  # samples in dim 1
    expected = _arviz_khat(log_w.movedim(1, -1))
    assert expected.shape == (3, 4)
    torch.testing.assert_close(pareto_shape(log_w, dim=1), expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(pareto_shape(log_w, dim=-2), expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [0.3, 0.9])
def test_pareto_shape_recovers_generalized_pareto_shape(shape):
    # Weights exactly GPD(shape, scale 1): w = expm1(shape * E) / shape, E ~ Exponential(1).
    # Exceedances of a GPD over a threshold are GPD with the same shape, so each row's tail
    # of M = 300 points is an exact GPD sample; the estimator's asymptotic sd is
    # (1 + k) / sqrt(M), and the prior moves its mean to (M k + 5) / (M + 10).
    num_rows, num_samples, tail = 64, 10000, 300
    exponential = torch.distributions.Exponential(1.0).sample((num_rows, num_samples))
    log_w = torch.log(torch.expm1(shape * exponential)) - math.log(shape)
    khat = pareto_shape(log_w, dim=-1)
    sd = (1 + shape) / math.sqrt(tail)
    assert (khat - shape).abs().max() < 4 * sd
    expected_mean = (tail * shape + 5) / (tail + 10)
    assert abs(khat.mean() - expected_mean) < 4 * sd / math.sqrt(num_rows)


@pytest.mark.parametrize("constant", [1000.0, -1000.0])
def test_invariant_to_a_constant(constant):
    log_w = _log_weights("pareto", 100)
    # e^1000 overflows even float64: only a shift by the maximum survives this.
    torch.testing.assert_close(
        pareto_shape(log_w + constant, dim=-1), pareto_shape(log_w, dim=-1), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(
        effective_sample_size(log_w + constant, dim=-1),
        effective_sample_size(log_w, dim=-1),
        atol=0,
        rtol=1e-12,
    )


@pytest.mark.parametrize("kind", ["normal", "pareto", "student_t", "tied"])
@pytest.mark.parametrize("num_samples", [64, 1000])
def test_float32_agrees_with_float64(kind, num_samples):
    log_w = _log_weights(kind, num_samples, 200).float()  # both see the same inputs
    k32 = pareto_shape(log_w, dim=-1)
    assert k32.dtype == torch.float32
    k64 = pareto_shape(log_w.double(), dim=-1)
    # k-hat moves by ~1e-5 when float64 log-weights move by float32 rounding (measured),
    # so float32 precision for k-hat is a few hundred float32 eps.
    tol = 400 * torch.finfo(torch.float32).eps * (1 + k64.abs())
    assert torch.equal(k32.isnan(), k64.isnan())  # ties can leave a tail of under 5
    finite = k64.isfinite()
    assert finite.sum() > 150
    assert ((k32.double() - k64).abs() <= tol)[finite].all()
    ess32 = effective_sample_size(log_w, dim=-1)
    assert ess32.dtype == torch.float32
    torch.testing.assert_close(
        ess32.double(), effective_sample_size(log_w.double(), dim=-1), atol=0, rtol=1e-5
    )


def test_float32_matches_arviz():
    log_w = _log_weights("student_t", 1000).float()
    expected = _arviz_khat(log_w.double())
    assert (pareto_shape(log_w, dim=-1).double() - expected).abs().max() < 1e-4


@pytest.mark.parametrize("num_samples", [0, 1, 2, 5, 19, 20])
def test_short_tails_give_nan(num_samples):
    # M = ceil(min(S / 5, 3 sqrt(S))) < 5 for S <= 20: no fit.
    khat = pareto_shape(torch.randn(num_samples, 3), dim=0)
    assert khat.shape == (3,)
    assert khat.isnan().all()


def test_nan_rows():
    log_w = torch.randn(6, 100)
    log_w[0, :] = 2.0  # constant weights: empty tail (arviz: inf)
    log_w[1, :96] = -math.inf  # four nonzero weights: a tail of 4 at most
    log_w[2, 7] = math.nan
    log_w[3, 7] = math.inf
    log_w[4, :] = -math.inf
    khat = pareto_shape(log_w, dim=-1)
    assert khat[:5].isnan().all()
    assert khat[5].isfinite()
    assert torch.isinf(torch.as_tensor(arviz.psislw(log_w[:2].numpy().copy())[1])).all()

    ess = effective_sample_size(log_w, dim=-1)
    assert ess[0] == 100
    assert ess[1].isfinite()
    assert ess[2:4].isnan().all()
    assert ess[4] == 0
    assert ess[5].isfinite()


def _brute_force_ess(row):
    weights = [math.exp(value) for value in row]
    return sum(weights) ** 2 / sum(w * w for w in weights)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_effective_sample_size_matches_brute_force(dim):
    log_w = 3.0 * torch.randn(5, 40, 7)
    log_w[0, 0, 0] = -math.inf  # a zero weight
    ess = effective_sample_size(log_w, dim=dim)
    moved = log_w.movedim(dim, -1)
    expected = torch.tensor(
        [_brute_force_ess(row) for row in moved.reshape(-1, moved.shape[-1]).tolist()]
    ).reshape(moved.shape[:-1])
    torch.testing.assert_close(ess, expected, atol=0, rtol=1e-12)
    assert ((ess >= 1) & (ess <= log_w.shape[dim])).all()


def test_effective_sample_size_of_known_weights():
    # S - 1 weights of 1 and one of 0: ESS = S - 1; one weight dominating: ESS -> 1.
    log_w = torch.zeros(2, 10)
    log_w[0, 0] = -math.inf
    log_w[1, 0] = 800.0
    torch.testing.assert_close(
        effective_sample_size(log_w, dim=-1), torch.tensor([9.0, 1.0]), atol=0, rtol=1e-12
    )


def test_effective_sample_size_gradient():
    # d ESS / d l_s = 2 ESS (w_s / sum w - w_s^2 / sum w^2), against autograd.
    log_w = torch.randn(30, requires_grad=True)
    ess = effective_sample_size(log_w)
    (grad,) = torch.autograd.grad(ess, log_w)
    w = log_w.detach().exp()
    expected = 2 * ess.detach() * (w / w.sum() - w.square() / w.square().sum())
    torch.testing.assert_close(grad, expected)
    # All weights zero: ESS 0 with a zero, not NaN, gradient.
    zero = torch.full((5,), -math.inf, requires_grad=True)
    (grad,) = torch.autograd.grad(effective_sample_size(zero), zero)
    assert (grad == 0).all()


def test_shapes_follow_the_input_without_data():
    # Meta tensors hold no data: any .item(), host sync or data-dependent shape would fail,
    # so this checks the functions can run inside a GPU step without synchronising.
    log_w = torch.empty(64, 8192, device="meta")
    assert pareto_shape(log_w).shape == (8192,)
    assert effective_sample_size(log_w, dim=-1).shape == (64,)


def test_rejects_integer_log_weights():
    message = "pareto_shape: log_weights must be a floating-point tensor, got a tensor of dtype"
    with pytest.raises(TypeError, match=message + " torch.int64; convert it"):
        pareto_shape(torch.zeros(100, dtype=torch.long))
    with pytest.raises(TypeError, match="effective_sample_size: .* got list"):
        effective_sample_size([0.0, 1.0])


@pytest.mark.parametrize("proposal_scale", [1.0, 1.6], ids=["exact_proposal", "wider_proposal"])
def test_ratio_bias_matches_the_bias_of_the_log_ratio_over_many_replicates(proposal_scale):
    """z ~ N(0, 1) given the context (the target of the weights), x_j | z ~ N(z, 0.4^2): the
    log of the self-normalised estimate of p(x_j | x_R) is low on average by its bias,
    measured over 20000 replicates of S = 100 draws against the closed form
    N(x_j; 0, 1 + 0.4^2); the first-order figure, averaged over the same replicates, agrees
    within 15% (the second-order terms, at ESS of the numerator near 12), and its sign and
    factor 1/2 are those of the measurement."""
    generator = torch.Generator().manual_seed(0)
    num_reps, num_samples, noise = 20_000, 100, 0.4
    x_j = torch.tensor([0.3, 1.5], dtype=torch.float64)
    shape = (num_samples, num_reps, 1)
    z = proposal_scale * torch.randn(shape, generator=generator, dtype=torch.float64)
    normal = torch.distributions.Normal
    log_weights = normal(0.0, 1.0).log_prob(z[..., 0]) - normal(0.0, proposal_scale).log_prob(
        z[..., 0]
    )
    log_likelihoods = normal(z, noise).log_prob(x_j)  # (S, reps, 2)
    log_numerator = torch.logsumexp(log_weights.unsqueeze(-1) + log_likelihoods, 0)
    log_estimate = log_numerator - torch.logsumexp(log_weights, 0).unsqueeze(-1)
    exact = normal(0.0, math.sqrt(1 + noise**2)).log_prob(x_j)
    measured = (log_estimate - exact).mean(0)
    standard_error = (log_estimate - exact).std(0) / math.sqrt(num_reps)
    predicted = ratio_bias(log_weights, log_likelihoods).mean(0)
    assert (measured < -4 * standard_error).all()  # a real bias, well resolved
    torch.testing.assert_close(predicted, measured, rtol=0.15, atol=4 * float(standard_error.max()))


def test_ratio_bias_of_a_likelihood_flat_in_z_is_zero():
    # The numerator's weights are the denominator's: the ratio is exact, whatever the weights.
    log_weights = torch.randn(50, 3, dtype=torch.float64)
    flat = torch.full((50, 3, 4), -1.7, dtype=torch.float64)
    zeros = torch.zeros(3, 4, dtype=torch.float64)
    torch.testing.assert_close(ratio_bias(log_weights, flat), zeros)


@pytest.mark.parametrize("route", ["cpu_loop", "plain"])
def test_the_conditionals_bias_is_ratio_bias_of_the_weights_toward_the_context(route):
    """The CPU loop accumulates the bias as it goes; off the CPU it is computed apart. Both
    are :func:`ratio_bias` of the weights toward p(z | x_R) (the context's likelihood
    added to the log weights, written out here) and the likelihoods."""
    from pyro_mpt.ops import self_normalised_importance as sni

    generator = torch.Generator().manual_seed(1)
    log_w = torch.randn(32, 3, 4, generator=generator, dtype=torch.float64)
    ll = torch.randn(32, 3, 4, 5, generator=generator, dtype=torch.float64) * 2
    context = torch.rand(3, 4, 5, generator=generator) < 0.5
    expected = ratio_bias(log_w + (ll * context).sum(-1), ll)
    if route == "cpu_loop":
        out, bias = sni.importance_log_conditionals(log_w, ll, context, with_bias=True)
        torch.testing.assert_close(out, sni.plain_importance_log_conditionals(log_w, ll, context))
    else:  # the route a GPU takes, called on the CPU
        bias = sni._plain_bias(log_w, ll, context)
    torch.testing.assert_close(bias, expected)
