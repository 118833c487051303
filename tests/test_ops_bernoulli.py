"""The Bernoulli log-likelihood helpers of :mod:`pyro_mpt.ops.bernoulli` against
``torch.nn.functional.logsigmoid`` and ``torch.distributions.Bernoulli``."""

import math

import pytest
import torch
import torch.distributions as tdist
import torch.nn.functional as F

from pyro_mpt.ops.bernoulli import log_prob, log_sigmoid, observed_log_prob


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_sigmoid_is_logsigmoid_on_both_sides_of_the_cpu_threshold(dtype):
    threshold = math.log(torch.finfo(dtype).tiny) + 8
    moderate = torch.linspace(threshold + 1, 40, 500, dtype=dtype)  # the log(sigmoid) path
    extreme = torch.cat([moderate, torch.tensor([threshold - 1, -1e4], dtype=dtype)])
    eps = torch.finfo(dtype).eps
    for x in (moderate, extreme):
        values, probs = log_sigmoid(x)
        # Within the dtype's rounding of the plain, stable logsigmoid, in absolute terms.
        torch.testing.assert_close(values, F.logsigmoid(x), atol=4 * eps, rtol=4 * eps)
        assert torch.equal(probs, torch.sigmoid(x))
        assert torch.isfinite(values).all()
    # Below the threshold the log of an underflowing sigmoid would be -inf or lose digits.
    assert log_sigmoid(extreme)[0][-1] == -1e4
    empty = log_sigmoid(torch.empty(0, dtype=dtype))
    assert empty[0].shape == empty[1].shape == (0,)


def test_observed_log_prob_is_the_distributions_log_prob():
    logits = torch.randn(5, 3) * 4
    value = torch.bernoulli(torch.full((5, 3), 0.4))
    torch.testing.assert_close(
        observed_log_prob(tdist.Bernoulli(logits=logits), value),
        tdist.Bernoulli(logits=logits).log_prob(value),
        atol=1e-12,
        rtol=0,
    )
    normal = tdist.Normal(logits, 2.0)
    assert torch.equal(observed_log_prob(normal, value), normal.log_prob(value))


def test_log_prob_is_a_deprecated_alias():
    fn, value = tdist.Bernoulli(logits=torch.tensor([0.3, -2.0])), torch.tensor([1.0, 0.0])
    with pytest.warns(DeprecationWarning, match="observed_log_prob"):
        result = log_prob(fn, value)
    torch.testing.assert_close(result, fn.log_prob(value), atol=1e-12, rtol=0)
