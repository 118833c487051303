"""Self-predictive conditionals by self-normalised importance sampling with the guide as
proposal: consistent as the number of samples grows, biased at a finite number
(:ref:`theory-importance`).

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
from pyro_mpt.ops.importance_weights import ratio_bias
from pyro_mpt.ops.masks import masked_sum, select_masked

__all__ = [
    "check_fill",
    "fill_masked",
    "importance_log_conditionals",
    "importance_log_marginal",
    "per_sample_importance_log_conditionals",
    "plain_importance_log_conditionals",
]

FILLS = ("zeros", "mean")


def check_fill(fill):
    """Returns ``fill`` after checking that it is ``"zeros"`` or ``"mean"``."""
    if fill not in FILLS:
        raise ValueError(f"fill must be 'zeros' or 'mean', got {fill!r}.")
    return fill


def fill_masked(x, masks, fill="zeros"):
    """Replaces the masked features of ``x`` by a fill value.

    :param torch.Tensor x: observations, shape ``batch + (D,)``.
    :param torch.Tensor masks: boolean, ``True`` at masked features, shape
        ``(P,) + batch + (D,)`` (batch dims may be 1 to share masks).
    :param str fill: ``"zeros"``, or ``"mean"``: the mean of each feature over the
        observations of the batch in which that feature is not masked (zero where it is
        masked in every observation). A masked value never enters its own fill.
    :returns: a tensor of shape ``(P,) + batch + (D,)`` and the dtype of ``x``.
    """
    check_fill(fill)
    shape = torch.broadcast_shapes(masks.shape, masks.shape[:1] + x.shape)
    masks = masks.expand(shape)
    if fill == "zeros":
        value = x.new_zeros(())
    else:
        observed = (~masks).to(x.dtype)
        batch_dims = tuple(range(1, x.dim()))  # (P,) + batch + (D,): sum over batch
        total = (observed * x).sum(batch_dims, keepdim=True)
        count = observed.sum(batch_dims, keepdim=True)
        value = total / count.clamp(min=1)
    return select_masked(masks, value, x)


class _ImportanceConditionals(torch.autograd.Function):
    """:func:`importance_log_conditionals` on rows ``r`` (mask and observation flattened),
    one sample at a time.

    With ``w_sr`` the self-normalised weights given the context, ``E_srj = exp(l_srj -
    max_s l_srj)`` and ``pred_rj = sum_s w_sr E_srj``, the output is ``log pred + max_s l``;
    with ``y = grad / pred``, the gradients are

    .. math::

        \\frac{\\partial}{\\partial l_{srj}} = w_{sr} E_{srj} y_{rj} + c_{rj} B_{sr}, \\qquad
        \\frac{\\partial}{\\partial \\log w_{sr}} = B_{sr}
            = w_{sr} \\Big(\\sum_j E_{srj} y_{rj} - \\sum_j \\mathrm{grad}_{rj}\\Big).

    Working on one sample's ``(R, D)`` slice at a time keeps every temporary in cache: the
    ``(S, R, D)`` log-likelihoods are read twice and ``E`` written once forward, and ``E``
    read once and the gradient written once backward.
    """

    @staticmethod
    def forward(ctx, log_weights, log_likelihoods, context):
        # log_weights (S, R); log_likelihoods (S, R, D); context (R, D) bool. The second
        # output, not differentiable, is ratio_bias of the same weights and likelihoods.
        context_ll = torch.empty_like(log_weights)
        ll_max = log_likelihoods[0].clone()
        for s, ll in enumerate(log_likelihoods):
            # A -inf likelihood at a masked feature must not turn its context sum into NaN.
            context_ll[s] = masked_sum(ll, context)
            torch.maximum(ll_max, ll, out=ll_max)
        log_joint = log_weights + context_ll
        weights = flushed_exp(log_joint - log_joint.amax(0))
        weights /= weights.sum(0)
        # A feature impossible under every sample keeps its -inf: shift it by 0 instead.
        shift = ll_max.clamp(min=torch.finfo(ll_max.dtype).min)
        shifted = torch.empty_like(log_likelihoods)
        predictive = torch.zeros_like(ll_max)
        # sum_s (w_s e_s)^2: with predictive = sum_s w_s e_s, 1 / ESS of the numerator.
        squares = torch.zeros_like(ll_max)
        term = torch.empty_like(ll_max)
        for s, ll in enumerate(log_likelihoods):
            floored_exp_(torch.sub(ll, shift, out=shifted[s]))
            torch.mul(shifted[s], weights[s].unsqueeze(-1), out=term)
            predictive.add_(term)
            squares.addcmul_(term, term)
        ctx.save_for_backward(weights, shifted, predictive, context)
        bias = 0.5 * (weights.square().sum(0).unsqueeze(-1) - squares / predictive.square())
        log_predictive = predictive.log()
        ctx.mark_non_differentiable(bias, log_predictive)
        # The third output, log pred, says how near the floors each sum is.
        return log_predictive + ll_max, bias, log_predictive

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_):
        weights, shifted, predictive, context = ctx.saved_tensors
        scaled = grad / predictive
        total = grad.sum(-1)
        context = context.to(grad.dtype)
        grad_weights = torch.empty_like(weights)
        grad_ll = torch.empty_like(shifted)
        for s, shifted_s in enumerate(shifted):
            torch.sub((shifted_s * scaled).sum(-1), total, out=grad_weights[s])
            grad_weights[s] *= weights[s]
            grad_s = torch.mul(context, grad_weights[s].unsqueeze(-1), out=grad_ll[s])
            grad_s.addcmul_(shifted_s, scaled * weights[s].unsqueeze(-1))
        return grad_weights, grad_ll, None


def importance_log_conditionals(log_weights, log_likelihoods, context, with_bias=False):
    """``log p(x_j | x_R)`` for every feature, by self-normalised importance sampling.

    On the CPU by :func:`per_sample_importance_log_conditionals`, whose loop over samples
    keeps every temporary in cache; elsewhere by
    :func:`plain_importance_log_conditionals`, as a GPU runs whole-tensor operations faster
    than a loop of small ones (``benchmarks/bench_fast_paths.py`` measures both on each
    device). Arguments and result as there; with ``with_bias``, also the first-order bias
    of each conditional (:func:`~pyro_mpt.ops.importance_weights.ratio_bias`, detached),
    which the CPU loop accumulates as it goes.
    """
    if log_likelihoods.device.type == "cpu":
        out, bias = _per_sample(log_weights, log_likelihoods, context)
    else:
        out = plain_importance_log_conditionals(log_weights, log_likelihoods, context)
        bias = _plain_bias(log_weights, log_likelihoods, context) if with_bias else None
    return (out, bias) if with_bias else out


def _plain_bias(log_weights, log_likelihoods, context):
    """The first-order bias of each conditional off the CPU: :func:`ratio_bias` of the
    weights toward ``p(z | x_R)`` (the context's likelihood added) and the likelihoods."""
    context_ll = masked_sum(log_likelihoods.detach(), context.to(torch.bool))
    return ratio_bias(log_weights + context_ll, log_likelihoods)


def per_sample_importance_log_conditionals(log_weights, log_likelihoods, context):
    """``log p(x_j | x_R)`` for every feature, by self-normalised importance sampling, one
    sample at a time.

    :param torch.Tensor log_weights: ``log p(z_s) - log q(z_s)`` of every sample, shape
        ``(S, P) + batch`` (``P`` the masks, as the proposal may depend on the mask).
    :param torch.Tensor log_likelihoods: ``l_sj``, shape ``(S, P) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, shape
        ``(P,) + batch + (D,)`` (batch dims may be 1 to share masks).
    :returns: a tensor of shape ``(P,) + batch + (D,)``.

    Sums over samples are those of shifted exponentials, floored as in
    :mod:`pyro_mpt.ops.floored_exp` (a relative error below ``S sqrt(tiny)``), and the few
    that the floors could move are computed again in log space; the forward and backward
    passes are written by hand (:class:`_ImportanceConditionals`).
    """
    return _per_sample(log_weights, log_likelihoods, context)[0]


def _per_sample(log_weights, log_likelihoods, context):
    """:func:`per_sample_importance_log_conditionals` and the first-order bias of each
    conditional that its loop accumulates, both ``(P,) + batch + (D,)``."""
    ll = log_likelihoods
    shape, num_features = ll.shape[1:-1], ll.shape[-1]
    num_samples = ll.shape[0]
    context = context.to(torch.bool).expand(shape + (num_features,)).reshape(-1, num_features)
    log_weights = log_weights.expand(ll.shape[:-1]).reshape(num_samples, -1)
    ll = ll.reshape(num_samples, -1, num_features)
    out, bias, log_predictive = _ImportanceConditionals.apply(log_weights, ll, context)
    # The weights sum to one: the floors move a conditional by less than the margin (see
    # floor_margin) unless it is that close to them, and those are computed exactly.
    margin = log_predictive - math.log(floor_margin(ll.dtype, num_samples))

    def exact(index):
        rows, features = index
        picked = ll[:, rows]  # (S, E, D)
        log_joint = log_weights[:, rows] + torch.where(context[rows], picked, 0.0).sum(-1)
        observed = picked[:, torch.arange(rows.numel()), features]  # (S, E)
        return log_sum_exp(log_joint + observed, 0) - log_sum_exp(log_joint, 0)

    out = exact_where(margin, out, exact)
    return out.reshape(shape + (num_features,)), bias.reshape(shape + (num_features,))


def plain_importance_log_conditionals(log_weights, log_likelihoods, context):
    """:func:`importance_log_conditionals` in plain tensor operations under autograd: the
    reference the hand-written passes of :func:`per_sample_importance_log_conditionals` are
    tested against, and the route off the CPU.

    :param torch.Tensor log_weights: shape ``(S, P) + batch``.
    :param torch.Tensor log_likelihoods: shape ``(S, P) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, ``(P,) + batch + (D,)``.
    :returns: a tensor of shape ``(P,) + batch + (D,)``.
    """
    context = context.to(torch.bool)
    context_ll = torch.where(context, log_likelihoods, 0.0).sum(-1)  # (S, P) + batch
    log_joint = log_weights + context_ll
    log_posterior = log_joint - torch.logsumexp(log_joint, 0)
    return torch.logsumexp(log_posterior.unsqueeze(-1) + log_likelihoods, 0)


def importance_log_marginal(log_weights):
    """``log p(x) ≈ LSE_s(log w_s) - log S``, the log of the importance estimate of
    ``p(x)``, with ``log w_s = log p(x, z_s) - log q(z_s)`` of shape ``(S,) + batch``.

    A lower bound in expectation (Jensen), tight as ``S`` grows (the IWAE bound).
    """
    num_samples = log_weights.shape[0]
    return torch.logsumexp(log_weights, dim=0) - math.log(num_samples)
