"""Gauss–Hermite rules for a standard normal latent, under the prior or moved to a
per-observation centre and scale."""

import functools
import math

import numpy as np
import torch

__all__ = ["adapted_nodes", "enumerated_nodes", "gauss_hermite_grid"]


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
    dtype = dtype or torch.get_default_dtype()
    if dim == 0:  # one node, of weight one, in a space of no coordinates
        return torch.zeros(1, 0, dtype=dtype, device=device), torch.zeros(
            1, dtype=dtype, device=device
        )
    nodes, log_weights = _hermite_grid(int(num_points), int(dim))
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


def enumerated_nodes(nodes, log_weights, columns, num_values):
    """A rule over continuous coordinates extended by discrete ones: each node is repeated
    for every combination of the discrete coordinates' values, which its ``columns`` hold as
    indices ``0 .. num_values[i] - 1``; the other columns hold the node's own coordinates,
    in order. The log-weights are repeated: the probabilities of the values, which depend on
    the model, are the caller's to add.

    :param torch.Tensor nodes: ``(G, K_c)``.
    :param torch.Tensor log_weights: ``(G,)``.
    :param list columns: the positions of the discrete coordinates among all ``K_c +
        len(columns)``, increasing.
    :param list num_values: how many values each discrete coordinate takes.
    :returns: nodes ``(G V, K)`` and log-weights ``(G V,)``, ``V = prod(num_values)``; the
        nodes of one continuous node are consecutive.
    """
    if not columns:
        return nodes, log_weights
    ranges = [torch.arange(v, device=nodes.device) for v in num_values]
    grids = torch.meshgrid(*ranges, indexing="ij")
    indices = torch.stack([g.reshape(-1) for g in grids], -1).to(nodes.dtype)  # (V, len)
    num_nodes, num_combinations = nodes.shape[0], indices.shape[0]
    dim = nodes.shape[-1] + len(columns)
    continuous = [k for k in range(dim) if k not in set(columns)]
    out = nodes.new_empty(num_nodes, num_combinations, dim)
    out[..., continuous] = nodes.unsqueeze(1).expand(-1, num_combinations, -1)
    out[..., list(columns)] = indices.expand(num_nodes, -1, -1)
    return out.reshape(-1, dim), log_weights.repeat_interleave(num_combinations)
