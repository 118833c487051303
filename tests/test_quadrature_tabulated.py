"""The tabulated quadrature path (shared likelihood parameters, few distinct data values)
against the per-observation evaluation it replaces."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt.conditionals import Quadrature
from pyro_mpt.conditionals.quadrature import (
    QuadratureSelfPredictive,
    TabulatedQuadratureSelfPredictive,
)
from pyro_mpt.models import LinearVAE
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.ops.quadrature import (
    gauss_hermite_grid,
    quadrature_log_conditionals,
    quadrature_log_marginal,
    tabulated_log_conditionals,
    tabulated_log_marginal,
    value_indicators,
)


def _dense(log_table, indicators):
    """``l_gnj = L[x_nj, j, g]`` as the ``(G,) + batch + (D,)`` tensor."""
    picked = (indicators.unsqueeze(-1) * log_table.unsqueeze(1)).sum(0)  # batch + (D, G)
    return picked.movedim(-1, 0)


@pytest.mark.parametrize("likelihood", ["bernoulli", "poisson"])
@pytest.mark.parametrize("shared_masks", [False, True])
def test_tabulated_equals_per_observation_values_and_gradients(likelihood, shared_masks):
    num_nodes, num_obs, num_features, num_masks = 9, 6, 7, 4
    eta = torch.randn(num_features, num_nodes, requires_grad=True)
    if likelihood == "bernoulli":
        values = torch.tensor([0.0, 1.0])
        fn = dist.Bernoulli(logits=eta)
    else:
        values = torch.arange(4.0)
        fn = dist.Poisson(eta.exp())
    x = values[torch.randint(len(values), (num_obs, num_features))]
    log_table = fn.log_prob(values.reshape(-1, 1, 1))
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


@pytest.mark.parametrize("per_observation_offset", [False, True])
def test_strategy_tabulates_only_when_parameters_are_shared(per_observation_offset):
    weight = torch.randn(6, 2)
    model = _offset_model(weight, per_observation_offset)
    x = torch.bernoulli(torch.full((5, 6), 0.4))
    prepared = Quadrature(num_points=12).prepare(model, None, (x,), {})
    if per_observation_offset:
        assert type(prepared) is QuadratureSelfPredictive
    else:
        assert type(prepared) is TabulatedQuadratureSelfPredictive
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
