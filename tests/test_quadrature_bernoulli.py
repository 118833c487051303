"""The Bernoulli quadrature path, in each of its branches, against the dense quadrature of
every observation at every node."""

import pyro.distributions as dist
import pytest
import torch

from pyro_mpt.ops import quadrature_bernoulli
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid


@pytest.fixture
def branches(monkeypatch):
    """Records, per call, how many entries the one-product path computed exactly, or
    ``None`` where the two-value table took over."""
    calls = []
    oriented_forward = quadrature_bernoulli._oriented_forward

    def spy(*args):
        result = oriented_forward(*args)
        calls.append(None if result is None else result[1].index.numel())
        return result

    monkeypatch.setattr(quadrature_bernoulli, "_oriented_forward", spy)
    return calls


def _decoder_case(logit_scale, from_model=True, num_obs=40, num_features=30, seed=0):
    """Nodes under a 2-d prior, a linear decoder, data drawn from the model (or at random)
    and masks of every rate: ``(log_weights, logits, x, context)``, in float64."""
    dtype = torch.float64
    generator = torch.Generator().manual_seed(seed)
    nodes, log_weights = gauss_hermite_grid(6, 2, dtype)
    weight = logit_scale * torch.randn(2, num_features, generator=generator, dtype=dtype)
    bias = torch.randn(num_features, generator=generator, dtype=dtype) - 1
    logits = nodes @ weight + bias
    z = torch.randn(num_obs, 2, generator=generator, dtype=dtype)
    probs = torch.sigmoid(z @ weight + bias) if from_model else torch.full_like(z[:, :1], 0.3)
    x = torch.bernoulli(probs.expand(num_obs, num_features), generator=generator)
    rates = torch.rand(3, num_obs, 1, generator=generator, dtype=dtype)
    context = torch.rand(3, num_obs, num_features, generator=generator, dtype=dtype) > rates
    return log_weights, logits, x, context


def _compare(log_weights, logits, x, context, atol):
    """Values and logits gradients of the fused function against the dense reference."""
    logits = logits.detach().requires_grad_()
    fused = bernoulli_log_conditionals(log_weights, logits, x, context)
    ll = dist.Bernoulli(logits=logits.unsqueeze(1)).log_prob(x)
    dense = quadrature_log_conditionals(log_weights, ll, context)
    torch.testing.assert_close(fused, dense, atol=atol, rtol=0)
    upstream = torch.randn(fused.shape, dtype=fused.dtype)
    (grad,) = torch.autograd.grad((fused * upstream).sum(), logits)
    (expected,) = torch.autograd.grad((dense * upstream).sum(), logits)
    torch.testing.assert_close(grad, expected, atol=atol * expected.abs().max(), rtol=0)


def test_one_product_path_matches_dense_quadrature(branches):
    _compare(*_decoder_case(logit_scale=1.0), atol=1e-12)
    assert branches == [0]


def test_confident_mispredictions_are_computed_exactly(branches, monkeypatch):
    # Large logits and data not from the model: many observed values the model gives less
    # than 1/64, all computed exactly when the limit on their number is lifted.
    monkeypatch.setattr(quadrature_bernoulli, "_MAX_EXACT_FRACTION", 1.0)
    _compare(*_decoder_case(logit_scale=6.0, from_model=False), atol=1e-12)
    assert branches[0] > 100


def test_too_many_exact_entries_fall_back_to_the_two_value_table(branches):
    _compare(*_decoder_case(logit_scale=6.0, from_model=False), atol=1e-12)
    assert branches == [None]


def test_conditionals_near_the_floors_fall_back_to_the_two_value_table(branches):
    log_weights, logits, x, context = _decoder_case(logit_scale=1.0)
    # Feature 0 is one in most rows and its logit -400 at every node: p(x_0 = 1 | x_R)
    # is about e^-400, below the fourth root of the smallest float64 (e^-177).
    x[:, 0] = 1.0
    logits[:, 0] = -400.0
    _compare(log_weights, logits, x, context, atol=1e-12)
    assert branches == [None]


def test_float32_matches_the_float64_reference(branches):
    log_weights, logits, x, context = _decoder_case(logit_scale=2.0, num_obs=128, seed=3)
    fused = bernoulli_log_conditionals(log_weights.float(), logits.float(), x, context)
    ll = dist.Bernoulli(logits=logits.unsqueeze(1)).log_prob(x)
    dense = quadrature_log_conditionals(log_weights, ll, context)
    assert branches[0] is not None
    # Relative error of each conditional: 64 (G + 1) rounding errors at worst.
    bound = 64 * (log_weights.numel() + 1) * torch.finfo(torch.float32).eps
    assert (fused.double() - dense).abs().max() < bound


def test_likelihoods_below_the_floor_leave_the_one_product_path_exact(branches):
    log_weights, logits, x, context = _decoder_case(logit_scale=1.0)
    # Feature 0: one in every row, a logit of -720 (sigmoid ~1e-313, subnormal) at every
    # other node and +3 elsewhere: floored likelihoods, conditionals far above the floors.
    x[:, 0] = 1.0
    logits[::2, 0] = -720.0
    logits[1::2, 0] = 3.0
    _compare(log_weights, logits, x, context, atol=1e-12)
    assert branches == [0]


@pytest.mark.parametrize("scale, path", [(1.0, "one product"), (6.0, "table")])
def test_features_every_row_agrees_at_skip_the_disagreement_product(branches, scale, path):
    # Blank borders, as in images: features where every row takes the same value drop out
    # of the product over the features some row disagrees at; each path must still match.
    log_weights, logits, x, context = _decoder_case(logit_scale=scale, from_model=path == "table")
    x[:, :10] = 0.0
    x[:, 10:14] = 1.0
    _compare(log_weights, logits, x, context, atol=1e-12)
    assert (branches == [None]) == (path == "table")


def test_identical_rows_leave_no_disagreement_product(branches):
    log_weights, logits, x, context = _decoder_case(logit_scale=1.0)
    x[:] = x[0]
    _compare(log_weights, logits, x, context, atol=1e-12)
    assert branches == [0]


@pytest.mark.parametrize(
    "case",
    ["one product", "mispredictions", "near the floors", "below the floor", "blank borders"],
)
def test_the_path_that_reads_nothing_back_matches_dense_quadrature(branches, monkeypatch, case):
    # Off the CPU no path is chosen by the data: the disagreement product runs over every
    # feature and the two-value table always serves, with the dense reference's results.
    monkeypatch.setattr(quadrature_bernoulli, "_may_read", lambda tensor: False)
    scale, from_model = {"mispredictions": (6.0, False)}.get(case, (1.0, True))
    log_weights, logits, x, context = _decoder_case(logit_scale=scale, from_model=from_model)
    if case == "near the floors":
        x[:, 0], logits[:, 0] = 1.0, -400.0
    if case == "below the floor":
        x[:, 0], logits[::2, 0], logits[1::2, 0] = 1.0, -720.0, 3.0
    if case == "blank borders":
        x[:, :10], x[:, 10:14] = 0.0, 1.0
    _compare(log_weights, logits, x, context, atol=1e-12)
    assert branches == []


def test_off_the_cpu_nothing_is_read_back():
    # Any read of a meta tensor raises.
    log_weights, logits, x, context = (
        t.to("meta") for t in _decoder_case(logit_scale=1.0, num_obs=4, num_features=5)
    )
    logits.requires_grad_()
    out = bernoulli_log_conditionals(log_weights, logits, x, context)
    assert out.shape == (3, 4, 5) and out.device.type == "meta"
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert grad.shape == logits.shape
