"""Self-predictive conditionals by numerical integration over a low-dimensional latent.

With quadrature nodes ``u_g`` and weights ``w_g`` for a standard normal latent and the
per-feature log-likelihoods ``l_gj = log p(x_j | z(u_g))`` of every node,

.. math::

    \\log p(x_j \\mid x_R) = \\operatorname{LSE}_g\\Big(\\log w_g + \\sum_{k \\in R} l_{gk}
        + l_{gj}\\Big) - \\operatorname{LSE}_g\\Big(\\log w_g + \\sum_{k \\in R} l_{gk}\\Big).

One evaluation of the likelihood at every node serves every mask.

This module is pure tensor code: no Pyro effects.
"""

import math

import numpy as np
import torch

__all__ = [
    "adapted_nodes",
    "gauss_hermite_grid",
    "quadrature_log_conditionals",
    "quadrature_log_marginal",
]


def gauss_hermite_grid(num_points, dim, dtype=None, device=None):
    """Tensor-product Gauss–Hermite rule for ``N(0, I_dim)``.

    :param int num_points: nodes per dimension.
    :param int dim: latent dimension ``K``.
    :returns: ``(nodes, log_weights)`` of shapes ``(num_points**dim, dim)`` and
        ``(num_points**dim,)``; the weights sum to one.
    """
    nodes_1d, weights_1d = np.polynomial.hermite_e.hermegauss(num_points)
    weights_1d = weights_1d / math.sqrt(2 * math.pi)
    dtype = dtype or torch.get_default_dtype()
    nodes_1d = torch.as_tensor(nodes_1d, dtype=dtype, device=device)
    log_w_1d = torch.as_tensor(np.log(weights_1d), dtype=dtype, device=device)
    grids = torch.meshgrid(*[nodes_1d] * dim, indexing="ij")
    log_grids = torch.meshgrid(*[log_w_1d] * dim, indexing="ij")
    nodes = torch.stack([g.reshape(-1) for g in grids], dim=-1)
    log_weights = sum(g.reshape(-1) for g in log_grids)
    return nodes, log_weights


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
    the nodes, so no ``(G, P, N, D)`` tensor is formed; the shift keeps them finite unless a
    single feature's log-likelihood varies by more than ~700 nats across the nodes.
    """
    ll = log_likelihoods
    context = context.to(ll.dtype)
    # a_g = log w_g + sum_{k in R} l_gk, shape (P,) + batch + (G,).
    context_ll = torch.einsum("g...d,p...d->p...g", ll, context)
    a = log_weights.movedim(0, -1) + context_ll
    a_max = a.amax(-1, keepdim=True)
    wa = (a - a_max).exp()
    ll_max = ll.amax(0)  # batch + (D,)
    el = (ll - ll_max).exp()
    numerator = torch.einsum("p...g,g...d->p...d", wa, el)
    return numerator.log() + ll_max - wa.sum(-1, keepdim=True).log()


def quadrature_log_marginal(log_weights, log_likelihoods):
    """``log p(x) = LSE_g(log w_g + sum_j l_gj)``, shape ``batch``; ``log_weights`` of shape
    ``(G,)`` or ``(G,) + batch``."""
    total = log_likelihoods.sum(-1)  # (G,) + batch
    log_weights = log_weights.reshape(log_weights.shape + (1,) * (total.dim() - log_weights.dim()))
    return torch.logsumexp(log_weights + total, dim=0)
