"""Conditionals from shared samples whose sums over samples lie past the float32 range: the
sample that explains a feature best has a weight below ``tiny`` and the others explain it
badly, so the matrix product of weights and likelihoods underflows. Values and gradients
against plain float64 ``logsumexp`` sums of the same float32 inputs, by each route (floored
on the CPU, plain exponentials elsewhere; the off-CPU search of ``exact_where`` forced
with ``read=False``); without underflow the fast product stands, untouched."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_mpt.conditionals.importance as importance
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.ops import shared_sample_importance
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.shared_sample_importance import (
    _shared_sample_log_conditionals,
    shared_sample_log_conditionals,
)

#: name -> the function under test, by each route.
ROUTES = {
    "cpu": shared_sample_log_conditionals,
    "floored": lambda log_joint, ll: _shared_sample_log_conditionals(log_joint, ll, True),
    "plain": lambda log_joint, ll: _shared_sample_log_conditionals(log_joint, ll, False),
    "floored off the cpu": lambda log_joint, ll: _shared_sample_log_conditionals(
        log_joint, ll, True, read=False
    ),
    "plain off the cpu": lambda log_joint, ll: _shared_sample_log_conditionals(
        log_joint, ll, False, read=False
    ),
}


def _reference(log_joint, log_likelihoods):
    """``LSE_s(log_softmax(log_joint)_sp + l_sj)`` in float64 under autograd."""
    log_posterior = log_joint - torch.logsumexp(log_joint, 0)
    return torch.logsumexp(log_posterior.unsqueeze(-1) + log_likelihoods.unsqueeze(1), 0)


def _against_reference(route, log_joint, log_likelihoods, upstream=None):
    """Values and gradients of ``route`` on the float32 inputs, and of the reference on the
    same inputs in float64, for ``sum(upstream * out)``."""
    results = []
    for function, dtype in ((ROUTES[route], torch.float32), (_reference, torch.float64)):
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in (log_joint, log_likelihoods)]
        out = function(*inputs)
        if upstream is None:
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        weighted = (out * upstream.to(dtype)).masked_fill(upstream == 0, 0.0)
        grads = torch.autograd.grad(weighted.sum(), inputs)
        results.append((out.detach().double(), *(g.double() for g in grads)))
    return results


def _explained_by_one_sample(num_samples):
    """Sample ``S - 1`` explains every feature best (``l = 0``) but lies ``gap`` nats below
    the others in every mask's log joint; the others give the features ``-bad``. The
    conditional is about ``-min(gap, bad)``: past the float32 range of the product where
    both are large. Shapes ``(S, P=2, N=4)`` and ``(S, N=4, D=5)``."""
    gaps = torch.tensor([60.0, 100.0, 110.0, 200.0])
    bads = torch.tensor([10.0, 50.0, 150.0, 200.0, 300.0])
    log_joint = torch.zeros(num_samples, 2, 4)
    log_joint[-1] = -gaps - 3 * torch.arange(2.0).unsqueeze(-1)
    ll = (-bads).expand(num_samples, 4, 5).clone()
    ll[:-1] += torch.linspace(0.0, 1.0, num_samples - 1).view(-1, 1, 1)  # distinct samples
    ll[-1] = 0.0
    return log_joint, ll


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("num_samples", [2, 8, 64])
def test_underflowing_sums_have_the_values_and_gradients_of_float64_sums(route, num_samples):
    """The product of a weight below ``tiny`` and the likelihood factors would be subnormal
    or 0: the conditional would come out ``-inf`` (a NaN gradient for every input), or off
    by tenths of a nat. Every one is within float32 rounding of the float64 sum."""
    log_joint, ll = _explained_by_one_sample(num_samples)
    (out, *grads), (expected, *expected_grads) = _against_reference(route, log_joint, ll)
    assert expected.min() < -190  # the range reached: 87 nats underflow float32
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("num_samples,spread", [(2, 300.0), (8, 100.0), (64, 60.0)])
def test_widely_spread_log_weights_and_likelihoods(route, num_samples, spread):
    """Random log joints and likelihoods spanning hundreds of nats, with two batch dims:
    many conditionals past the float32 range of the product, each as the float64 sum."""
    generator = torch.Generator().manual_seed(num_samples)
    log_joint = spread * torch.randn(num_samples, 3, 2, 5, generator=generator)
    ll = spread * torch.randn(num_samples, 2, 5, 7, generator=generator)
    (out, *grads), (expected, *expected_grads) = _against_reference(route, log_joint, ll)
    assert (expected - ll.double().amax(0)).min() < -120
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_feature_impossible_under_every_sample_stays_minus_infinity(route):
    """A feature with ``l = -inf`` at every sample is ``-inf``, and sends no NaN into the
    gradients of the others, held to the float64 sums (the reference's own gradient there
    is NaN: it is taken with a finite placeholder, which no other conditional reads, and no
    gradient is asked of that feature)."""
    log_joint, ll = _explained_by_one_sample(8)
    upstream = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(2))
    upstream[:, 1, 2] = 0.0
    _, (expected, *expected_grads) = _against_reference(route, log_joint, ll, upstream)
    ll[:, 1, 2] = -math.inf
    (out, *grads), _ = _against_reference(route, log_joint, ll, upstream)
    assert bool((out[:, 1, 2] == -math.inf).all())
    expected[:, 1, 2] = -math.inf
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _fast_product(log_joint, log_likelihoods):
    """The matrix product of softmax weights and shifted likelihoods, unchecked."""
    num_samples, num_masks = log_joint.shape[:2]
    weights = torch.softmax(log_joint.reshape(num_samples, num_masks, -1), 0)
    ll = log_likelihoods.reshape(num_samples, -1, log_likelihoods.shape[-1])
    shift = ll.detach().amax(0)
    predictive = torch.einsum("spn,snd->pnd", weights, torch.exp(ll - shift))
    return (predictive.log() + shift).reshape((num_masks,) + log_likelihoods.shape[1:])


@pytest.mark.parametrize("route", list(ROUTES))
def test_without_underflow_the_fast_product_stands(route, monkeypatch):
    """Log joints and likelihoods a few nats apart: the values and gradients of the plain
    product, and on the CPU no conditional is computed again."""
    recomputed = []
    exact_where = shared_sample_importance.exact_where

    def recording(margin, result, exact, read=None):
        def counted(index):
            recomputed.append(index[0].numel())
            return exact(index)

        return exact_where(margin, result, counted, read)

    monkeypatch.setattr(shared_sample_importance, "exact_where", recording)
    generator = torch.Generator().manual_seed(3)
    log_joint = 3 * torch.randn(8, 4, 6, generator=generator)
    ll = 2 * torch.randn(8, 6, 9, generator=generator) - 1
    upstream = torch.randn(4, 6, 9, generator=generator)
    results = []
    for function in (ROUTES[route], _fast_product):
        inputs = [log_joint.clone().requires_grad_(), ll.clone().requires_grad_()]
        out = function(*inputs)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), inputs)))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    if "off the cpu" not in route:
        assert recomputed == []


W = torch.tensor([1.0, 0.8, 1.2, -0.9, 1.1, 0.7])


def _sharp_model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        pyro.sample("x", dist.Normal(z.unsqueeze(-1) * W, 0.1).to_event(1), obs=x)


def _broad_guide(x, hidden=None):
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(x.new_zeros(()), 2.0))


def test_pooled_importance_conditionals_of_an_outlier_are_the_float64_sums(monkeypatch):
    """``ImportanceSampling(share_samples=True)`` on float32 data of a model with little
    noise and one outlying feature: the draws that explain the outlier are hundreds of nats
    down in the other features' weights, and its conditionals (unchecked, ``-inf`` at
    several) are the float64 sums of the same draws."""
    calls = []

    def recorded(log_joint, log_likelihoods):
        out = shared_sample_log_conditionals(log_joint, log_likelihoods)
        calls.append((log_joint.detach(), log_likelihoods.detach(), out.detach()))
        return out

    monkeypatch.setattr(importance, "shared_sample_log_conditionals", recorded)
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(8, 1, generator=generator)
    x = z * W + 0.1 * torch.randn(8, 6, generator=generator)
    x[:, 3] = 3.0
    masks = masks_of_sizes(torch.tensor([[1] * 8, [2] * 8, [3] * 8]), 6)
    pyro.set_rng_seed(0)
    prepared = ImportanceSampling(16, share_samples=True).prepare(
        _sharp_model, _broad_guide, (x,), {}, 1
    )
    prepared.log_prob(masks)
    ((log_joint, ll, out),) = calls
    expected = _reference(log_joint.double(), ll.double())
    assert (expected - ll.double().amax(0)).min() < -200
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)
