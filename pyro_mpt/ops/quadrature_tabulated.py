"""Quadrature conditionals from a likelihood table over the distinct observed values, for
nodes and likelihood parameters shared by every observation (binary pixels, small counts):
every sum is a matrix product with the table, and no ``(G, N, D)`` tensor is formed. The
passes are written by hand so the only large temporaries are the table and its exponential
(:ref:`theory-quadrature`).

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

from pyro_mpt.ops.floored_exp import (
    exact_where,
    floor_margin,
    floored_exp_,
    flushed_exp,
    log_sum_exp,
)

__all__ = [
    "tabulated_log_conditionals",
    "tabulated_log_marginal",
    "value_indicators",
]


def value_indicators(values, data):
    """One-hot indicators of which of ``values`` each entry of ``data`` equals.

    :param torch.Tensor values: the ``V`` distinct values, shape ``(V,)``.
    :param torch.Tensor data: any shape ``S``; every entry must be one of ``values``.
    :returns: a tensor of shape ``(V,) + S`` in the dtype of ``data`` (floating) or the
        default dtype.
    """
    dtype = data.dtype if data.is_floating_point() else torch.get_default_dtype()
    shape = values.shape + (1,) * data.dim()
    return (data.unsqueeze(0) == values.reshape(shape)).to(dtype)


def floored_node_posterior(log_joint):
    """``softmax`` over the last dim (the nodes), with weights below the floor set to zero."""
    posterior = flushed_exp(log_joint - log_joint.amax(-1, keepdim=True))
    return posterior.div_(posterior.sum(-1, keepdim=True))


def _context_posterior(log_weights, table, onehot, context):
    """``(W, pi)``: the context-weighted indicators ``W = c [x = v]``, ``(R, V * D)``, and
    the node posterior ``pi = softmax(a)`` of every row, ``(R, G)``, floored, from the log
    joint ``a = log w + W L^T``.

    :param table: ``L``, shape ``(G, V * D)``.
    :param onehot: ``[x_rj = v]``, shape ``(R, V, D)``.
    :param context: ``c_rj``, shape ``(R, D)``.
    """
    weighted = _weighted(context, onehot)
    return weighted, floored_node_posterior(torch.addmm(log_weights, weighted, table.T))


def _weighted(context, onehot):
    """``W = c [x = v]``, ``(R, V * D)``, from ``context`` ``(R, D)`` and ``onehot``
    ``(R, V, D)``."""
    return (context.unsqueeze(-2) * onehot).flatten(-2)


def table_conditionals_forward(posterior, table, onehot, overwrite=False):
    """``log p(x_rj | x_R)``, ``(R, D)``, from the node posterior ``(R, G)`` of
    :func:`_context_posterior`, and the tensors :func:`table_conditionals_backward` needs besides
    ``W`` and ``pi``; ``table`` is overwritten by ``E`` if ``overwrite``."""
    table_max = table.amax(0)  # (V * D,)
    shifted = table.sub_(table_max) if overwrite else table - table_max
    shifted = floored_exp_(shifted)  # E = exp(L - max_g L), floored
    sums = (posterior @ shifted).unflatten(-1, onehot.shape[-2:])
    numerator = (sums * onehot).sum(-2)  # (R, D)
    shift = (table_max.unflatten(-1, onehot.shape[-2:]) * onehot).sum(-2)
    return numerator.log().add_(shift), (shifted, numerator, onehot)


def table_conditionals_backward(grad, weighted, posterior, shifted, numerator, onehot):
    """The gradient ``(pi^T M) * E + B^T W`` with respect to the table ``(G, V * D)``, where
    ``M_r = [x = v] grad_rj / num_rj`` and ``B_rg = pi_rg ((M E^T)_rg - sum_j grad_rj)``."""
    scaled = (onehot * (grad / numerator).unsqueeze(-2)).flatten(-2)  # M, (R, V * D)
    node_grad = scaled @ shifted.T  # (R, G)
    node_grad.sub_(grad.sum(-1, keepdim=True)).mul_(posterior)
    grad_table = (posterior.T @ scaled).mul_(shifted)  # (G, V * D)
    return grad_table.addmm_(node_grad.T, weighted)


class _TabulatedConditionals(torch.autograd.Function):
    """:func:`tabulated_log_conditionals` on rows, with a hand-written backward: three
    matrix products, and no ``(R, G, D)`` tensor."""

    @staticmethod
    def forward(ctx, log_weights, log_table, onehot, context):
        weighted, posterior = _context_posterior(log_weights, log_table, onehot, context)
        out, saved = table_conditionals_forward(posterior, log_table, onehot)
        ctx.save_for_backward(weighted, posterior, *saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return None, table_conditionals_backward(grad, *ctx.saved_tensors), None, None


def tabulated_log_conditionals(log_weights, log_table, indicators, context):
    """``log p(x_j | x_R)`` by quadrature, for data with few distinct values under
    likelihood parameters shared by every observation; equal to
    :func:`~pyro_mpt.ops.quadrature_conditionals.quadrature_log_conditionals` on the full
    ``(G,) + batch + (D,)`` tensor of log-likelihoods.

    :param torch.Tensor log_weights: ``log w_g``, shape ``(G,)``; no gradient flows to it.
    :param torch.Tensor log_table: ``L_{gvj} = log p(x_j = v | z_g)``, shape ``(G, V, D)``;
        finite.
    :param torch.Tensor indicators: ``[x_nj = v]`` from :func:`value_indicators`, shape
        ``(V,) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, ``(P,) + batch + (D,)`` (batch
        dims may be 1 to share masks).
    :returns: ``log p(x_j | x_R)``, shape ``(P,) + batch + (D,)``.

    Two matrix products of sizes ``(P N, V D) x (V D, G)`` and ``(P N, G) x (G, V D)`` make
    the forward pass and three the backward pass, in memory ``O(P N (V D + G) + V D G)``.
    """
    table = log_table.flatten(-2)  # (G, V * D)
    return _tabulated(_TabulatedConditionals, log_weights, table, indicators, context)


def _tabulated(function, log_weights, table, indicators, context):
    """Flattens masks and observations to rows, applies ``function`` and restores them."""
    dtype, (num_values, num_features) = table.dtype, indicators.shape[:1] + context.shape[-1:]
    onehot = indicators.to(dtype).movedim(0, -2)  # batch + (V, D)
    shape = torch.broadcast_shapes(context.shape[:-1], (1,) + onehot.shape[:-2])
    context = context.to(dtype).expand(shape + (num_features,)).reshape(-1, num_features)
    onehot = onehot.expand(shape + onehot.shape[-2:]).reshape(-1, num_values, num_features)
    log_weights = log_weights.detach()
    out = function.apply(log_weights, table, onehot, context)
    # The posterior sums to one: the floors move a conditional by less than the margin
    # (see floor_margin) unless it is that close to them, and those are computed exactly.
    shift = (table.amax(0).unflatten(-1, onehot.shape[-2:]) * onehot).sum(-2)  # (R, D)
    margin = out - shift - math.log(floor_margin(dtype, table.shape[0]))

    def exact(index):
        rows, features = index
        log_joint = torch.addmm(log_weights, _weighted(context[rows], onehot[rows]), table.T)
        values = onehot[rows, :, features].argmax(-1)
        observed = table[:, values * num_features + features].T  # (E, G)
        return log_sum_exp(log_joint + observed) - log_sum_exp(log_joint)

    out = exact_where(margin, out, exact)
    return out.reshape(shape + (num_features,))


def tabulated_log_marginal(log_weights, log_table, indicators):
    """``log p(x) = LSE_g(log w_g + sum_j L_{g x_j j})`` from a value table ``(G, V, D)``
    (see :func:`tabulated_log_conditionals`), shape ``batch``."""
    onehot = indicators.to(log_table.dtype).movedim(0, -2).flatten(-2)  # batch + (V * D,)
    total = onehot @ log_table.flatten(1).T  # batch + (G,)
    return torch.logsumexp(log_weights + total, dim=-1)
