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
and over nodes become matrix products with a table over the values, and no ``(G, N, D)``
tensor is formed (:mod:`pyro_mpt.ops.tabulated_quadrature`).

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
    # a_g = log w_g + sum_{k in R} l_gk, shape (P,) + batch + (G,).
    context_ll = torch.einsum("g...d,p...d->p...g", ll, context.to(ll.dtype))
    if not bool(torch.isfinite(context_ll).all()):
        # A -inf likelihood at a masked feature must not turn its context sum into NaN.
        picked = torch.where(context.to(torch.bool), ll.unsqueeze(1), 0.0)  # (G, P) + ...
        context_ll = picked.sum(-1).movedim(0, -1)
    a = log_weights.movedim(0, -1) + context_ll
    wa = _flushed_exp(a - a.amax(-1, keepdim=True))
    ll_max = ll.amax(0)  # batch + (D,)
    # A value impossible at every node keeps its -inf: shift it by a finite number instead.
    el = _floored_exp(ll - ll_max.clamp(min=torch.finfo(ll.dtype).min))
    numerator = torch.einsum("p...g,g...d->p...d", wa, el)
    return numerator.log() + ll_max - wa.sum(-1, keepdim=True).log()


def quadrature_log_marginal(log_weights, log_likelihoods):
    """``log p(x) = LSE_g(log w_g + sum_j l_gj)``, shape ``batch``; ``log_weights`` of shape
    ``(G,)`` or ``(G,) + batch``."""
    total = log_likelihoods.sum(-1)  # (G,) + batch
    log_weights = log_weights.reshape(log_weights.shape + (1,) * (total.dim() - log_weights.dim()))
    return torch.logsumexp(log_weights + total, dim=0)


def _gemm_safe_floor(dtype):
    """The square root of the dtype's smallest normal number (``1e-19`` in float32)."""
    return math.sqrt(torch.finfo(dtype).tiny)


def _floored_exp(x):
    """``exp(x)`` for ``x <= 0``, floored at :func:`_gemm_safe_floor`."""
    return x.clamp(min=math.log(_gemm_safe_floor(x.dtype))).exp_()


def _floored_exp_(x):
    """:func:`_floored_exp` in place."""
    return x.clamp_(min=math.log(_gemm_safe_floor(x.dtype))).exp_()


def _flushed_exp(x):
    """``exp(x)`` for ``x <= 0``, set to zero below :func:`_gemm_safe_floor`.

    The argument is clamped before the exponential: ``exp`` of a number far below the
    dtype's range is many times slower than of a normal one on CPUs.
    """
    floor = _gemm_safe_floor(x.dtype)
    # Below the floor, exp(log(floor) - 1) = floor / e is dropped by the threshold.
    return torch.nn.functional.threshold(x.clamp(min=math.log(floor) - 1).exp_(), floor, 0.0)
