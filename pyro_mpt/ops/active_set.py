"""Gaussian conditionals through an active set: only the context block is ever factorised,
and masks of different sizes share one padded batch (:ref:`theory-active-set`). The helpers
are split so that callers with a lazily evaluated covariance (a kernel matrix) can gather
the blocks themselves and share :func:`active_set_predictive`.

This module is pure tensor code: no Pyro effects.
"""

from typing import NamedTuple

import torch

__all__ = [
    "ActiveSet",
    "split_masks",
    "gather_blocks",
    "active_set_predictive",
    "active_set_conditionals",
]


class ActiveSet(NamedTuple):
    """Context and target indices of a batch of masks, padded to common lengths.

    :ivar torch.Tensor context_index: ``batch + (R_max,)`` long indices of context tokens.
    :ivar torch.Tensor context_valid: ``batch + (R_max,)`` bool, False at padding.
    :ivar torch.Tensor target_index: ``batch + (T_max,)`` long indices of masked tokens; the
        indices of one row are distinct.
    :ivar torch.Tensor target_valid: ``batch + (T_max,)`` bool, False at padding.
    """

    context_index: torch.Tensor
    context_valid: torch.Tensor
    target_index: torch.Tensor
    target_valid: torch.Tensor


def split_masks(masks):
    """Splits boolean masks into padded context and target index sets.

    :param torch.Tensor masks: boolean, ``True`` at masked tokens, shape ``batch + (N,)``.
    :returns: an :class:`ActiveSet`.

    Example::

        >>> active = split_masks(torch.tensor([[True, False, False, True]]))
        >>> active.context_index.tolist(), active.target_index.tolist()
        ([[1, 2]], [[0, 3]])
    """
    num_tokens = masks.shape[-1]
    # A stable sort puts each row's context first and its targets last, both in index order.
    order = torch.argsort(masks.to(torch.uint8), dim=-1, stable=True)
    num_masked = masks.sum(-1, keepdim=True)
    num_context = num_tokens - num_masked
    max_context = int(num_context.max()) if masks.numel() else 0
    max_masked = int(num_masked.max()) if masks.numel() else 0
    positions = torch.arange(num_tokens, device=masks.device)
    context_valid = positions[:max_context] < num_context
    target_valid = positions[num_tokens - max_masked :] >= num_context
    return ActiveSet(
        order[..., :max_context],
        context_valid,
        order[..., num_tokens - max_masked :],
        target_valid,
    )


def _batch_indices(batch_shape, full_shape, device):
    """One broadcastable index tensor per batch dim of a tensor of shape ``batch_shape``."""
    num_dims = len(full_shape)
    offset = num_dims - len(batch_shape)
    indices = []
    for dim, size in enumerate(batch_shape):
        view = [1] * (num_dims + 2)
        view[offset + dim] = size
        indices.append(torch.arange(size, device=device).reshape(view))
    return indices


def gather_blocks(covariance, rows, cols):
    """The blocks ``covariance[..., rows[..., :, None], cols[..., None, :]]`` with the batch
    dims of ``covariance`` and of the indices broadcast, without copying ``covariance``.

    :param torch.Tensor covariance: ``batch + (N, N)``, any broadcastable batch shape.
    :param torch.Tensor rows: ``batch + (r,)`` long.
    :param torch.Tensor cols: ``batch + (c,)`` long.
    :returns: a tensor of shape ``broadcast(batch) + (r, c)``.
    """
    batch = torch.broadcast_shapes(covariance.shape[:-2], rows.shape[:-1], cols.shape[:-1])
    # Size-one batch dims of the covariance are indexed at 0 and broadcast by the indices.
    index = _batch_indices(covariance.shape[:-2], batch, covariance.device)
    return covariance[(*index, rows.unsqueeze(-1), cols.unsqueeze(-2))]


def active_set_predictive(
    context_cov, cross_cov, target_var, context_residual, context_valid, cholesky=None
):
    """Predictive means (as offsets) and variances of the targets given an active set.

    .. math::

        m_T = \\Sigma_{TR}\\Sigma_{RR}^{-1} r_R, \\qquad
        v_T = \\mathrm{diag}\\big(\\Sigma_{TT}
            - \\Sigma_{TR}\\Sigma_{RR}^{-1}\\Sigma_{RT}\\big).

    :param torch.Tensor context_cov: ``Sigma_RR``, shape ``batch + (R, R)``.
    :param torch.Tensor cross_cov: ``Sigma_TR``, shape ``batch + (T, R)``.
    :param torch.Tensor target_var: ``diag(Sigma_TT)``, shape ``batch + (T,)``.
    :param torch.Tensor context_residual: ``x_R - mu_R``, shape ``batch + (R,)``.
    :param torch.Tensor context_valid: bool ``batch + (R,)``; padded slots are replaced by an
        identity block and a zero residual.
    :param callable cholesky: factorises ``Sigma_RR`` into its lower Cholesky factor;
        ``torch.linalg.cholesky`` unless given, e.g. a factorisation that adds jitter where
        rounding makes the block indefinite.
    :returns: ``(mean_offset, var)``, each ``batch + (T,)``; add ``mu_T`` to the mean.
    """
    valid = context_valid.to(context_cov.dtype)
    pair = valid.unsqueeze(-1) * valid.unsqueeze(-2)
    padding = torch.diag_embed(1 - valid)
    context_cov = context_cov * pair + padding
    cross_cov = cross_cov * valid.unsqueeze(-2)
    context_residual = context_residual * valid
    chol = (torch.linalg.cholesky if cholesky is None else cholesky)(context_cov)
    # whitened[..., :, t] = L^{-1} Sigma_{R t}; the variance reduction is its squared norm.
    whitened = torch.linalg.solve_triangular(chol, cross_cov.transpose(-1, -2), upper=False)
    # Sigma_RR^{-1} Sigma_RT depends on the covariance only, so residuals with more batch
    # dims (observations sharing a mask) are contracted against it in one einsum instead of
    # broadcasting the factor over them.
    weights = torch.linalg.solve_triangular(chol.transpose(-1, -2), whitened, upper=True)
    mean_offset = torch.einsum("...rt,...r->...t", weights, context_residual)
    var = target_var - whitened.pow(2).sum(-2)
    return mean_offset, var


def active_set_conditionals(x, loc, covariance, masks):
    """Conditionals ``p(x_j | x_R)`` of the masked tokens of ``N(loc, covariance)``.

    :param torch.Tensor x: values, shape ``batch + (N,)``.
    :param torch.Tensor loc: mean, shape ``batch + (N,)`` (broadcastable).
    :param torch.Tensor covariance: ``batch + (N, N)`` (broadcastable; never copied whole).
    :param torch.Tensor masks: boolean, ``True`` at masked tokens, ``batch + (N,)``.
    :returns: ``(active, mean, var)``: the :class:`ActiveSet` and the predictive means and
        variances of its targets, ``batch + (T_max,)`` (padding slots are finite); ``var``
        does not depend on ``x`` and has the batch shape of ``masks`` and ``covariance``.
    """
    active = split_masks(masks)
    # The blocks depend on the masks and the covariance only: observations that share both
    # (a mask shared by a batch) share one factorisation.
    context_cov = gather_blocks(covariance, active.context_index, active.context_index)
    cross_cov = gather_blocks(covariance, active.target_index, active.context_index)
    cov_batch = cross_cov.shape[:-2]
    diagonal = covariance.diagonal(dim1=-2, dim2=-1)
    target_var = diagonal.expand(cov_batch + diagonal.shape[-1:]).gather(
        -1, active.target_index.expand(cov_batch + active.target_index.shape[-1:])
    )
    residual = x - loc
    batch = torch.broadcast_shapes(residual.shape[:-1], cov_batch)
    context_index = active.context_index.expand(batch + active.context_index.shape[-1:])
    target_index = active.target_index.expand(batch + active.target_index.shape[-1:])
    mean_offset, var = active_set_predictive(
        context_cov,
        cross_cov,
        target_var,
        residual.expand(batch + residual.shape[-1:]).gather(-1, context_index),
        active.context_valid,
    )
    target_loc = loc.expand(batch + loc.shape[-1:]).gather(-1, target_index)
    return active, target_loc + mean_offset, var
