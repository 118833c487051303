"""The tabulated quadrature path (shared likelihood parameters, few distinct data values)
against the per-observation evaluation it replaces."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt.conditionals import Quadrature
from pyro_mpt.conditionals.quadrature import (
    BernoulliQuadratureSelfPredictive,
    QuadratureSelfPredictive,
    TabulatedQuadratureSelfPredictive,
)
from pyro_mpt.models import LinearVAE
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature_conditionals import (
    quadrature_log_conditionals,
    quadrature_log_marginal,
)
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid
from pyro_mpt.ops.quadrature_tabulated import (
    tabulated_log_conditionals,
    tabulated_log_marginal,
    value_indicators,
)


def _dense(log_table, indicators):
    """``l_gnj = L[g, x_nj, j]`` as the ``(G,) + batch + (D,)`` tensor."""
    return (indicators * log_table.unsqueeze(-2)).sum(1)


@pytest.mark.parametrize("likelihood", ["bernoulli", "poisson"])
@pytest.mark.parametrize("shared_masks", [False, True])
def test_tabulated_equals_per_observation_values_and_gradients(likelihood, shared_masks):
    num_nodes, num_obs, num_features, num_masks = 9, 6, 7, 4
    eta = torch.randn(num_nodes, 1, num_features, requires_grad=True)
    if likelihood == "bernoulli":
        values = torch.tensor([0.0, 1.0])
        fn = dist.Bernoulli(logits=eta)
    else:
        values = torch.arange(4.0)
        fn = dist.Poisson(eta.exp())
    x = values[torch.randint(len(values), (num_obs, num_features))]
    log_table = fn.log_prob(values.reshape(-1, 1))  # (G, V, D)
    indicators = value_indicators(values, x)
    log_weights = torch.log_softmax(torch.randn(num_nodes), 0)
    batch = 1 if shared_masks else num_obs
    context = torch.rand(num_masks, batch, num_features) < 0.5
    table = tabulated_log_conditionals(log_weights, log_table, indicators, context)
    dense = quadrature_log_conditionals(log_weights, _dense(log_table, indicators), context)
    torch.testing.assert_close(table, dense, atol=1e-12, rtol=0)
    upstream = torch.randn(table.shape)
    (grad_table,) = torch.autograd.grad((table * upstream).sum(), eta, retain_graph=True)
    (grad_dense,) = torch.autograd.grad((dense * upstream).sum(), eta, retain_graph=True)
    torch.testing.assert_close(grad_table, grad_dense, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        tabulated_log_marginal(log_weights, log_table, indicators),
        quadrature_log_marginal(log_weights, _dense(log_table, indicators)),
        atol=1e-12,
        rtol=0,
    )


def test_bernoulli_log_table_values_and_gradient():
    # Logits up to +-60: log-likelihoods far apart, where the floors and shifts matter.
    logits = (20 * torch.randn(9, 7)).clamp(-60, 60).requires_grad_()
    table = bernoulli_log_table(logits)
    reference = dist.Bernoulli(logits=logits.unsqueeze(-2)).log_prob(torch.tensor([[0.0], [1.0]]))
    torch.testing.assert_close(table, reference, atol=1e-12, rtol=0)
    upstream = torch.randn(table.shape)
    (grad,) = torch.autograd.grad((table * upstream).sum(), logits)
    (expected,) = torch.autograd.grad((reference * upstream).sum(), logits)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    x = torch.bernoulli(torch.full((4, 6, 7), 0.3))
    indicators = torch.stack([x == 0, x == 1])
    log_weights = torch.log_softmax(torch.randn(9), 0)
    context = torch.rand(3, 4, 6, 7) < 0.5
    ll = dist.Bernoulli(logits=logits.reshape(9, 1, 1, 7)).log_prob(x)
    dense = quadrature_log_conditionals(log_weights, ll, context)
    torch.testing.assert_close(
        tabulated_log_conditionals(log_weights, table, indicators, context),
        dense,
        atol=1e-12,
        rtol=0,
    )
    # The fused function: the same values, and the same gradient as the dense path.
    fused = bernoulli_log_conditionals(log_weights, logits, x, context)
    torch.testing.assert_close(fused, dense, atol=1e-12, rtol=0)
    upstream = torch.randn(fused.shape)
    (grad,) = torch.autograd.grad((fused * upstream).sum(), logits, retain_graph=True)
    (expected,) = torch.autograd.grad((dense * upstream).sum(), logits)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_bernoulli_table_falls_back_to_logsigmoid_for_very_negative_logits():
    logits = torch.tensor([[-800.0, 3.0], [-2.0, 900.0]], requires_grad=True)
    table = bernoulli_log_table(logits)
    assert torch.isfinite(table).all()
    expected = torch.stack(
        [torch.nn.functional.logsigmoid(-logits), torch.nn.functional.logsigmoid(logits)], -2
    )
    torch.testing.assert_close(table, expected, atol=1e-12, rtol=0)


def test_value_indicators_are_one_hot():
    x = torch.tensor([[0.0, 2.0, 1.0], [2.0, 2.0, 0.0]])
    onehot = value_indicators(torch.tensor([0.0, 1.0, 2.0]), x)
    assert onehot.shape == (3, 2, 3)
    assert torch.equal(onehot.sum(0), torch.ones(2, 3))
    assert torch.equal((onehot * torch.arange(3.0).reshape(3, 1, 1)).sum(0), x)


def _offset_model(weight, per_observation_offset):
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            logits = z @ weight.T
            if per_observation_offset:
                logits = logits + 0.1 * torch.arange(x.shape[0]).unsqueeze(-1)
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    return model


def test_strategy_tabulates_counts_and_bernoulli_probs():
    weight = torch.randn(6, 2)

    def model(x, likelihood):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            eta = z @ weight.T
            fn = (
                dist.Poisson(eta.exp())
                if likelihood == "poisson"
                else dist.Bernoulli(probs=torch.sigmoid(eta))
            )
            pyro.sample("x", fn.to_event(1), obs=x)

    nodes, log_weights = gauss_hermite_grid(12, 2)
    eta = (nodes @ weight.T).unsqueeze(1)  # (G, 1, D)
    masks = masks_of_sizes(torch.randint(1, 7, (3, 5)), 6)
    for likelihood in ("poisson", "bernoulli"):
        if likelihood == "poisson":
            x, fn = torch.poisson(torch.full((5, 6), 1.5)), dist.Poisson(eta.exp())
        else:
            x, fn = torch.bernoulli(torch.full((5, 6), 0.4)), dist.Bernoulli(logits=eta)
        prepared = Quadrature(num_points=12).prepare(model, None, (x, likelihood), {})
        assert type(prepared) is TabulatedQuadratureSelfPredictive
        reference = quadrature_log_conditionals(log_weights, fn.log_prob(x), ~masks)
        torch.testing.assert_close(prepared.log_prob(masks), reference, atol=1e-10, rtol=0)


@pytest.mark.parametrize("per_observation_offset", [False, True])
def test_strategy_tabulates_only_when_parameters_are_shared(per_observation_offset):
    weight = torch.randn(6, 2)
    model = _offset_model(weight, per_observation_offset)
    x = torch.bernoulli(torch.full((5, 6), 0.4))
    prepared = Quadrature(num_points=12).prepare(model, None, (x,), {})
    if per_observation_offset:
        assert type(prepared) is QuadratureSelfPredictive
    else:
        assert type(prepared) is BernoulliQuadratureSelfPredictive
    # Against the per-observation log-likelihoods at the same nodes, built by hand.
    nodes, log_weights = gauss_hermite_grid(12, 2)
    logits = (nodes @ weight.T).unsqueeze(1)  # (G, 1, D)
    if per_observation_offset:
        logits = logits + 0.1 * torch.arange(5.0).unsqueeze(-1)
    ll = dist.Bernoulli(logits=logits).log_prob(x)
    masks = masks_of_sizes(torch.randint(1, 7, (3, 5)), 6)
    reference = quadrature_log_conditionals(log_weights, ll, ~masks)
    torch.testing.assert_close(prepared.log_prob(masks), reference, atol=1e-12, rtol=0)


def test_float32_linear_vae_step_matches_float64():
    """784 binary pixels put most node weights far below float32's normal range; the
    flushed weights and floored factors keep the loss and its gradient at float64's."""
    torch.manual_seed(0)
    weight, bias = 0.3 * torch.randn(784, 2), 0.5 * torch.randn(784)
    x = torch.bernoulli(torch.sigmoid(torch.randn(16, 2) @ weight.T + bias))
    masks = masks_of_sizes(torch.randint(1, 785, (4, 16)), 784)
    results = {}
    default = torch.get_default_dtype()
    for dtype in (torch.float64, torch.float32):
        pyro.clear_param_store()
        torch.set_default_dtype(dtype)
        try:
            vae = LinearVAE(784, 2)
            vae.weight = weight.to(dtype)
            vae.bias = bias.to(dtype)
            prepared = Quadrature(num_points=20).prepare(vae.model, None, (x.to(dtype),), {})
            value = torch.where(masks, prepared.log_prob(masks), 0.0).sum()
            (grad,) = torch.autograd.grad(value, vae.weight)
        finally:
            torch.set_default_dtype(default)
        results[dtype] = value.double(), grad.double()
    pyro.clear_param_store()
    (loss64, grad64), (loss32, grad32) = results[torch.float64], results[torch.float32]
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()
    assert abs(loss32 - loss64) / abs(loss64) < 1e-5
    assert (grad32 - grad64).norm() / grad64.norm() < 1e-3
