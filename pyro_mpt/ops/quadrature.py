"""Self-predictive conditionals by numerical integration over a low-dimensional latent.

With quadrature nodes ``u_g`` and weights ``w_g`` for a standard normal latent and the
per-feature log-likelihoods ``l_gj = log p(x_j | z(u_g))`` of every node,

.. math::

    \\log p(x_j \\mid x_R) = \\operatorname{LSE}_g\\Big(\\log w_g + \\sum_{k \\in R} l_{gk}
        + l_{gj}\\Big) - \\operatorname{LSE}_g\\Big(\\log w_g + \\sum_{k \\in R} l_{gk}\\Big).

One evaluation of the likelihood at every node serves every mask.

When the nodes and the likelihood's parameters are shared by every observation (nodes under
the prior, a decoder that sees only ``z``) and the data take few distinct values ``v``
(binary pixels, small counts), ``l_gnj = L_{v j g}`` at ``v = x_nj``: the sums over features
and over nodes become matrix products with a ``(V, D, G)`` table, and no ``(G, N, D)``
tensor is formed (:func:`tabulated_log_conditionals`).

Sums over nodes are matrix products of exponentials shifted by their maxima. Products of two
tiny factors would be subnormal numbers, which slow matrix products on CPUs many times over
(3x for a float32 step of the linear VAE), so node weights below ``s = sqrt(tiny)``
(``1e-19`` in float32, ``1e-154`` in float64) of the largest are dropped and likelihood
factors ``p(x_j | z_g) / max_g p(x_j | z_g)`` are floored at ``s``. Every conditional is
then exact to a relative ``G s`` unless it is below ``s`` times the largest
``p(x_j | z_g)``, where it is floored: at ``e^-43.7`` (float32) or ``e^-354`` (float64) of
it, far below anything a trained model predicts for an observed value.

This module is pure tensor code: no Pyro effects.
"""

import functools
import math

import numpy as np
import torch

__all__ = [
    "adapted_nodes",
    "gauss_hermite_grid",
    "quadrature_log_conditionals",
    "quadrature_log_marginal",
    "tabulated_log_conditionals",
    "tabulated_log_marginal",
    "value_indicators",
]


@functools.lru_cache(maxsize=32)
def _hermite_grid(num_points, dim):
    """The tensor-product rule as NumPy arrays ``(nodes, log_weights)``, computed once."""
    nodes_1d, weights_1d = np.polynomial.hermite_e.hermegauss(num_points)
    log_w_1d = np.log(weights_1d / math.sqrt(2 * math.pi))
    nodes = np.stack([g.reshape(-1) for g in np.meshgrid(*[nodes_1d] * dim, indexing="ij")], -1)
    log_weights = sum(g.reshape(-1) for g in np.meshgrid(*[log_w_1d] * dim, indexing="ij"))
    return nodes, log_weights


def gauss_hermite_grid(num_points, dim, dtype=None, device=None):
    """Tensor-product Gauss–Hermite rule for ``N(0, I_dim)``.

    :param int num_points: nodes per dimension.
    :param int dim: latent dimension ``K``.
    :returns: ``(nodes, log_weights)`` of shapes ``(num_points**dim, dim)`` and
        ``(num_points**dim,)``; the weights sum to one.
    """
    nodes, log_weights = _hermite_grid(int(num_points), int(dim))
    dtype = dtype or torch.get_default_dtype()
    return (
        torch.as_tensor(nodes, dtype=dtype, device=device),
        torch.as_tensor(log_weights, dtype=dtype, device=device),
    )


def adapted_nodes(nodes, log_weights, center, scale):
    """Moves a rule for ``N(0, I)`` to ``N(center, diag(scale^2))`` while still integrating
    against ``N(0, I)``: the weights absorb the density ratio.

    .. math::

        u_g = c + s \\odot v_g, \\qquad
        \\log w'_g = \\log w_g - \\tfrac12 \\lVert u_g \\rVert^2
            + \\tfrac12 \\lVert v_g \\rVert^2 + \\sum_k \\log s_k.

    :param torch.Tensor nodes: ``v_g``, shape ``(G, K)``.
    :param torch.Tensor log_weights: shape ``(G,)``.
    :param torch.Tensor center: ``c``, shape ``batch + (K,)``.
    :param torch.Tensor scale: ``s > 0``, shape ``batch + (K,)``.
    :returns: nodes of shape ``(G,) + batch + (K,)`` and log weights ``(G,) + batch``.
    """
    shape = (nodes.shape[0],) + (1,) * (center.dim() - 1) + nodes.shape[-1:]
    v = nodes.reshape(shape)
    u = center + scale * v
    log_w = log_weights.reshape(shape[:-1]) - 0.5 * u.pow(2).sum(-1) + 0.5 * v.pow(2).sum(-1)
    return u, log_w + scale.log().sum(-1)


def quadrature_log_conditionals(log_weights, log_likelihoods, context):
    """``log p(x_j | x_R)`` for every feature, by quadrature.

    :param torch.Tensor log_weights: ``log w_g``, shape ``(G,)``, or ``(G,) + batch`` for
        nodes placed per observation.
    :param torch.Tensor log_likelihoods: ``l_gj``, shape ``(G,) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, shape
        ``(P,) + batch + (D,)`` (batch dims may be 1 to share masks).
    :returns: a tensor of shape ``(P,) + batch + (D,)``.

    The sums over nodes are matrix products of exponentials shifted by their maxima over
    the nodes (see the module notes on the floor), so no ``(G, P, N, D)`` tensor is formed.
    """
    ll = log_likelihoods
    context = context.to(ll.dtype)
    # a_g = log w_g + sum_{k in R} l_gk, shape (P,) + batch + (G,).
    context_ll = torch.einsum("g...d,p...d->p...g", ll, context)
    a = log_weights.movedim(0, -1) + context_ll
    wa = _flushed_exp(a - a.amax(-1, keepdim=True))
    ll_max = ll.amax(0)  # batch + (D,)
    el = _floored_exp(ll - ll_max)
    numerator = torch.einsum("p...g,g...d->p...d", wa, el)
    return numerator.log() + ll_max - wa.sum(-1, keepdim=True).log()


def quadrature_log_marginal(log_weights, log_likelihoods):
    """``log p(x) = LSE_g(log w_g + sum_j l_gj)``, shape ``batch``; ``log_weights`` of shape
    ``(G,)`` or ``(G,) + batch``."""
    total = log_likelihoods.sum(-1)  # (G,) + batch
    log_weights = log_weights.reshape(log_weights.shape + (1,) * (total.dim() - log_weights.dim()))
    return torch.logsumexp(log_weights + total, dim=0)


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


def _gemm_safe_floor(dtype):
    """The square root of the dtype's smallest normal number (``1e-19`` in float32)."""
    return math.sqrt(torch.finfo(dtype).tiny)


def _floored_exp(x):
    """``exp(x)`` for ``x <= 0``, floored at :func:`_gemm_safe_floor`."""
    return x.clamp(min=math.log(_gemm_safe_floor(x.dtype))).exp_()


def _flushed_exp(x):
    """``exp(x)`` for ``x <= 0``, set to zero below :func:`_gemm_safe_floor`."""
    out = x.exp()
    return out.masked_fill(out < _gemm_safe_floor(x.dtype), 0.0)


class _TabulatedConditionals(torch.autograd.Function):
    """Forward and a hand-written backward of :func:`tabulated_log_conditionals` on rows
    ``r`` (mask and observation flattened).

    With ``pi_rg`` the node posterior given the context, ``M_r = [x = v] * grad_rj /
    num_rj`` and ``W_r = c_r * [x = v]``, the gradient with respect to the table is
    ``(M^T pi) * E + W^T B`` with ``B_rg = pi_rg ((M E)_rg - sum_j grad_rj)``: three matrix
    products, no ``(R, G, D)`` tensor and no transposed copy of the table.
    """

    @staticmethod
    def forward(ctx, log_weights, log_table, onehot, context):
        # log_table (V, D, G); onehot (R, V, D); context (R, D), all one dtype.
        num_values, num_features, num_nodes = log_table.shape
        table = log_table.reshape(num_values * num_features, num_nodes)
        weighted = (context.unsqueeze(-2) * onehot).flatten(-2)  # (R, V * D)
        a = torch.addmm(log_weights, weighted, table)  # (R, G)
        posterior = _flushed_exp(a - a.amax(-1, keepdim=True))
        posterior /= posterior.sum(-1, keepdim=True)
        table_max = table.amax(-1, keepdim=True)  # (V * D, 1)
        shifted = _floored_exp(table - table_max)  # exp(L - max_g L), (V * D, G)
        sums = (posterior @ shifted.T).unflatten(-1, (num_values, num_features))
        numerator = (sums * onehot).sum(-2)  # (R, D)
        ctx.save_for_backward(weighted, posterior, shifted, numerator, onehot)
        shift = (table_max.reshape(num_values, num_features) * onehot).sum(-2)
        return numerator.log() + shift

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        weighted, posterior, shifted, numerator, onehot = ctx.saved_tensors
        scaled = (onehot * (grad / numerator).unsqueeze(-2)).flatten(-2)  # (R, V * D)
        node_grad = posterior * (scaled @ shifted - grad.sum(-1, keepdim=True))  # (R, G)
        grad_table = (scaled.T @ posterior).mul_(shifted)  # (V * D, G)
        grad_table.addmm_(weighted.T, node_grad)
        return None, grad_table.reshape(onehot.shape[-2:] + posterior.shape[-1:]), None, None


def tabulated_log_conditionals(log_weights, log_table, indicators, context):
    """:func:`quadrature_log_conditionals` for data with few distinct values under
    likelihood parameters shared by every observation.

    .. math::

        l_{gnj} = L_{x_{nj}, j, g}, \\qquad
        \\sum_{k \\in R} l_{gnk} = \\sum_{v, k} c_{nk} [x_{nk} = v] L_{vkg}, \\qquad
        \\sum_g a_{ng} e^{l_{gnj}} = \\sum_v [x_{nj} = v] \\sum_g a_{ng} e^{L_{vjg}}.

    :param torch.Tensor log_weights: ``log w_g``, shape ``(G,)``; no gradient flows to it.
    :param torch.Tensor log_table: ``L_{vjg} = log p(x_j = v | z_g)``, shape ``(V, D, G)``;
        finite.
    :param torch.Tensor indicators: ``[x_nj = v]`` from :func:`value_indicators`, shape
        ``(V,) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, ``(P,) + batch + (D,)`` (batch
        dims may be 1 to share masks).
    :returns: ``log p(x_j | x_R)``, shape ``(P,) + batch + (D,)``; equal to
        :func:`quadrature_log_conditionals` on the full ``(G,) + batch + (D,)`` tensor.

    Two matrix products of sizes ``(P N, V D) x (V D, G)`` and ``(P N, G) x (G, V D)`` make
    the forward pass and three the backward pass, in memory ``O(P N (V D + G) + V D G)``.
    """
    dtype = log_table.dtype
    num_values, num_features, _ = log_table.shape
    onehot = indicators.to(dtype).movedim(0, -2)  # batch + (V, D)
    shape = torch.broadcast_shapes(context.shape[:-1], (1,) + onehot.shape[:-2])
    context = context.to(dtype).expand(shape + (num_features,)).reshape(-1, num_features)
    onehot = onehot.expand(shape + onehot.shape[-2:]).reshape(-1, num_values, num_features)
    out = _TabulatedConditionals.apply(log_weights.detach(), log_table, onehot, context)
    return out.reshape(shape + (num_features,))


def tabulated_log_marginal(log_weights, log_table, indicators):
    """:func:`quadrature_log_marginal` from a value table (see
    :func:`tabulated_log_conditionals`), shape ``batch``."""
    onehot = indicators.to(log_table.dtype).movedim(0, -2).flatten(-2)  # batch + (V * D,)
    total = onehot @ log_table.flatten(0, 1)  # batch + (G,)
    return torch.logsumexp(log_weights + total, dim=-1)
