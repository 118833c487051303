"""Self-normalised importance conditionals of several masks of one observation from one
shared set of samples (multiple importance sampling, :ref:`theory-importance`).

When the ``P`` masks of an observation pool their draws, every sample's per-feature
log-likelihoods ``l_sj`` are the same for all masks; only the context, and so the weights,
differ. The sums over features and over samples are then matrix products, and no tensor of
shape ``(S, P) + batch + (D,)`` is ever formed: the cost is that of ``S`` rows per
observation instead of ``S * P``.

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

from pyro_mpt.ops.floored_exp import (
    FLOOR_MARGIN,
    exact_where,
    floor_margin,
    floored_exp,
    flushed_exp,
    host_readable,
    log_sum_exp,
)

__all__ = [
    "context_log_likelihoods",
    "every_mask_average",
    "mixture_log_density",
    "plain_every_mask_average",
    "proposal_masks",
    "shared_sample_log_conditionals",
]

#: Stands in for ``-inf`` log-likelihoods in sums over the context: a sample impossible at
#: a context feature gets a log weight of about this, so a weight of 0, and a feature
#: outside the context (multiplied by 0) adds 0 instead of NaN.
_VERY_UNLIKELY = -1e30


def _rows(tensor, lead):
    """``tensor`` with its batch dims (after ``lead`` dims, before the last) flattened."""
    return tensor.reshape(tensor.shape[:lead] + (-1, tensor.shape[-1]))


def context_log_likelihoods(log_likelihoods, context):
    """``sum_{j in R_p} l_sj`` for every sample ``s`` and mask ``p``.

    :param torch.Tensor log_likelihoods: ``l_sj``, shape ``(S,) + batch + (D,)``.
    :param torch.Tensor context: 1/True at the context features of each mask, shape
        ``(P,) + batch + (D,)``.
    :returns: a tensor of shape ``(S, P) + batch``.
    """
    batch = log_likelihoods.shape[1:-1]
    ll = _rows(log_likelihoods.clamp(min=_VERY_UNLIKELY), 1)  # (S, N, D)
    ctx = _rows(context.to(ll.dtype).expand((context.shape[0],) + log_likelihoods.shape[1:]), 1)
    out = torch.einsum("snd,pnd->spn", ll, ctx)
    return out.reshape(out.shape[:2] + batch)


def shared_sample_log_conditionals(log_joint, log_likelihoods):
    """``log p(x_j | x_{R_p})`` for every mask ``p`` and feature ``j`` from shared samples.

    :param torch.Tensor log_joint: ``log p(z_s, x_{R_p}) - log q(z_s)`` (up to a constant
        per mask and observation), shape ``(S, P) + batch``.
    :param torch.Tensor log_likelihoods: ``l_sj = log p(x_j | z_s)``, shape
        ``(S,) + batch + (D,)``.
    :returns: ``log sum_s wbar_sp exp(l_sj)`` with ``wbar`` the weights normalised over
        samples, shape ``(P,) + batch + (D,)``. Equal to
        :func:`~pyro_mpt.ops.self_normalised_importance.plain_importance_log_conditionals`
        given the log-likelihoods repeated for every mask.

    The sums over samples are matrix products of the weights and of the likelihoods shifted
    by their largest over samples. A conditional far below its best sample's likelihood (a
    feature that the samples of large weight explain badly) makes a sum that underflows:
    unchecked it would come out ``-inf``, or a subnormal number with a few bits, in
    float32 as soon as it lies 87 nats below. On the CPU the factors are floored as in
    :mod:`pyro_mpt.ops.floored_exp` (subnormal numbers would slow the products several
    times over); elsewhere they are plain exponentials. Either way the sums that the floors
    or the underflow could move by more than ``1 / FLOOR_MARGIN`` relatively are computed
    again in log space over their own samples
    (:func:`~pyro_mpt.ops.floored_exp.exact_where`), with gradients through them.
    """
    floors = log_likelihoods.device.type == "cpu"
    return _shared_sample_log_conditionals(log_joint, log_likelihoods, floors)


def _reach(dtype, num_samples, floors):
    """How small a sum of ``num_samples`` weighted factors may be, relative to the largest
    factor, before the floors (``floors``) or the underflow of plain exponentials could move
    it by ``1 / FLOOR_MARGIN`` relatively. Without floors each weight, each factor and each
    product is off by at most ``tiny`` (the smallest normal number, below which a device
    may flush to zero): the weights sum to one, so the sum is off by at most
    ``(2 S + 1) tiny``."""
    if floors:
        return floor_margin(dtype, num_samples)
    return FLOOR_MARGIN * torch.finfo(dtype).tiny * 2 * (num_samples + 1)


def _shared_sample_log_conditionals(log_joint, log_likelihoods, floors, read=None):
    """:func:`shared_sample_log_conditionals` with the factors floored or not (``floors``),
    and ``read`` passed to :func:`~pyro_mpt.ops.floored_exp.exact_where` (by the device
    when None)."""
    batch = log_likelihoods.shape[1:-1]
    num_samples, num_masks = log_joint.shape[:2]
    log_joint = log_joint.reshape(num_samples, num_masks, -1)  # (S, P, N)
    ll = _rows(log_likelihoods, 1)  # (S, N, D)
    lowest = torch.finfo(ll.dtype).min
    # Each feature shifted by its largest log-likelihood over samples; a feature impossible
    # under every sample keeps its -inf (its sum is computed again).
    shift = ll.detach().amax(0).clamp(min=lowest)
    if floors:
        top = log_joint.detach().amax(0).clamp(min=lowest)
        weights = flushed_exp(log_joint - top)
        weights = weights / weights.sum(0)
        scaled = floored_exp(ll - shift)
    else:
        weights = torch.softmax(log_joint, 0)
        scaled = torch.exp(ll - shift)
    predictive = torch.einsum("spn,snd->pnd", weights, scaled)
    # The floors keep the sums above 0; without them a sum may underflow to 0, computed
    # again below, and the clamp keeps 0 / 0 out of the gradient of the log.
    kept = predictive if floors else predictive.clamp(min=torch.finfo(ll.dtype).tiny)
    out = kept.log() + shift
    # The weights sum to one and the factors are at most one: a sum above the reach is
    # moved by less than 1 / FLOOR_MARGIN relatively.
    reach = _reach(ll.dtype, num_samples, floors)
    may_read = host_readable(ll) if read is None else read
    # Where it may read, one read of the smallest sum (comparing every entry costs ten
    # times as much on CPUs) skips the search when none is near the reach: the common case.
    if may_read and not float(predictive.detach().amin()) < reach:
        return out.reshape((num_masks,) + batch + out.shape[-1:])

    def exact(index):
        masks, rows, features = index
        joint = log_joint[:, masks, rows]  # (S, E)
        # Log joints are sums over the context, thousands of nats in float32: relative to
        # their largest they lose no precision to the likelihood added.
        joint = joint - joint.detach().amax(0).clamp(min=lowest)
        observed = ll[:, rows, features]  # (S, E)
        return log_sum_exp(joint + observed, 0) - log_sum_exp(joint, 0)

    out = exact_where(predictive.detach() - reach, out, exact, read)
    return out.reshape((num_masks,) + batch + out.shape[-1:])


def every_mask_average(log_ratios, log_likelihoods):
    """The uniform-rate MPT estimate averaged over every mask exactly, for conditionals that
    share one set of samples ``z_s`` across all masks (drawn from one proposal that does
    not depend on the mask).

    With ``g(A) = LSE_s(log r_s + sum_{k in A} l_sk)``, the conditional of feature ``j``
    given the context ``R`` is ``g(R + j) - g(R)``. Averaged over mask sizes ``M ~
    Uniform{1..D}`` and masks of each size, the estimate is the mean over orderings of the
    features of a chain-rule sum, which telescopes to ``g(all) - g(empty)``:

    .. math::

        \\operatorname{LSE}_s(\\log r_s + \\textstyle\\sum_k l_{sk})
            - \\operatorname{LSE}_s(\\log r_s).

    The first term less ``log S`` is the importance estimate of ``log p(x)``; the second
    less ``log S`` is the estimate of ``log p(x_empty) = 0`` (the mean of ``p(z_s) /
    q(z_s)``), so its value is the exact error of that term.

    The backward pass is written by hand (:class:`_EveryMaskAverage`): its weights, the
    softmax over samples of each term, are set to zero below
    :func:`~pyro_mpt.ops.floored_exp.gemm_safe_floor`. A decoder's log-weights often span
    more than the float32 range over a few samples, and subnormal weights would reach the
    decoder's matrix products through the per-feature gradients and slow them several times
    over on CPUs; the dropped weights change the gradient by a relative ``S sqrt(tiny)``
    at most. :func:`plain_every_mask_average` is the same under autograd.

    :param torch.Tensor log_ratios: ``log r_s = log p(z_s) - log q(z_s)``, shape
        ``(S,) + batch``.
    :param torch.Tensor log_likelihoods: ``sum_k l_sk``, the log-likelihood of every
        observed feature at each sample, shape ``(S,) + batch``.
    :returns: a tensor of shape ``batch``.
    """
    return _EveryMaskAverage.apply(log_ratios, log_likelihoods)


def plain_every_mask_average(log_ratios, log_likelihoods):
    """:func:`every_mask_average` by ``logsumexp`` under autograd: the reference its
    hand-written backward pass is tested against."""
    return torch.logsumexp(log_ratios + log_likelihoods, 0) - torch.logsumexp(log_ratios, 0)


class _EveryMaskAverage(torch.autograd.Function):
    """``LSE_s(a_s) - LSE_s(b_s)`` with ``a = log r + L`` and ``b = log r``. With ``wa`` and
    ``wb`` the softmax weights over samples of ``a`` and ``b``, the gradients are ``grad *
    wa`` for ``L`` and ``grad * (wa - wb)`` for ``log r``; both weights are flushed to zero
    below the GEMM-safe floor."""

    @staticmethod
    def forward(ctx, log_ratios, log_likelihoods):
        log_ratios, log_likelihoods = torch.broadcast_tensors(log_ratios, log_likelihoods)
        with_data = log_ratios + log_likelihoods
        top = torch.logsumexp(with_data, 0)
        prior = torch.logsumexp(log_ratios, 0)
        ctx.save_for_backward(flushed_exp(with_data - top), flushed_exp(log_ratios - prior))
        return top - prior

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        with_data_weights, prior_weights = ctx.saved_tensors
        grad_log_likelihoods = grad * with_data_weights
        return grad_log_likelihoods - grad * prior_weights, grad_log_likelihoods


def mixture_log_density(log_densities):
    """``log (1/P) sum_p q_p(z_s)``, the density of the equal mixture of ``P`` proposals
    from which pooled samples were drawn in equal numbers (the balance heuristic).

    :param torch.Tensor log_densities: ``log q_p(z_s)``, shape ``(S, P) + batch``.
    :returns: a tensor of shape ``(S,) + batch``.
    """
    return torch.logsumexp(log_densities, 1) - math.log(log_densities.shape[1])


def proposal_masks(num_masks, num_proposals, device=None):
    """Which of an observation's ``num_masks`` stratified masks draw the pooled samples
    when only ``num_proposals`` of them do: the middle mask of each of ``num_proposals``
    equal runs, so that the proposals spread over the mask sizes (the masks of
    :func:`~pyro_mpt.ops.masks.sample_masks` are ordered by size stratum). All of them
    when ``num_proposals`` is None or at least ``num_masks``.

    :returns: a long tensor of mask indices, or ``slice(None)`` for all.
    """
    if num_proposals is None or num_proposals >= num_masks:
        return slice(None)
    middles = (torch.arange(num_proposals, dtype=torch.float64) + 0.5) * num_masks
    return (middles / num_proposals).floor().long().to(device)
