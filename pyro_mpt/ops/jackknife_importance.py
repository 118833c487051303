"""Jackknife bias correction of self-normalised importance estimates: the ratio
``log p(x_j | x_R)`` and the log-marginal ``log p(x)``, each with a bias of order ``1/S``
that the jackknife cuts to order ``1/S^2`` (Nowozin, 2018).

With ``f`` an estimate from all ``S`` samples and ``f_{-i}`` the same estimate without
sample ``i``,

.. math::

    \\hat f_J = S f - \\frac{S - 1}{S} \\sum_{i=1}^S f_{-i}.

Only the mean of the ``f_{-i}`` is needed, and it costs a few passes over the samples,
``O(S)`` per row: each sum without a sample that is not the largest keeps the largest term,
so it is formed relative to the largest; the sum without the largest is formed relative to
the second largest. No sum is a difference of two nearly equal numbers, however much one
weight dominates.

The correction assumes ``S`` large enough for the ``1/S`` expansion of the bias to hold. With
few samples for a poor proposal it overshoots, and can leave a larger error of the opposite
sign than the plain estimate; ``benchmarks/bench_importance_bias.py`` measures both.

Reference: S. Nowozin, "Debiasing evidence approximations: on importance-weighted
autoencoders and jackknife variational inference", ICLR 2018.

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

__all__ = [
    "jackknife_importance_log_conditionals",
    "jackknife_importance_log_marginal",
]


def _check_num_samples(log_weights):
    num_samples = log_weights.shape[0] if log_weights.dim() else 0
    if num_samples < 2:
        raise ValueError(
            f"log_weights must hold at least 2 samples along dim 0 for the jackknife, got shape "
            f"{tuple(log_weights.shape)}; draw S >= 2 samples, or use the plain estimate."
        )
    return num_samples


def _log_sum_and_mean_leave_one_out(x):
    """``log sum_s exp(x_s)`` along dim 0, the mean over ``i`` of the same sum without
    ``x_i``, and where every such sum has a finite term.

    :param torch.Tensor x: shape ``(S,) + batch``, ``S >= 2``; entries may be ``-inf``.
    :returns: ``(total, mean_leave_one_out, defined)``, each of shape ``batch``: the first
        ``-inf`` where ``x`` has no finite entry, the second meaningful only where
        ``defined`` (at least two finite entries), and their gradients never NaN.

    Relative to the largest entry ``m_1`` (at ``s = k``) and the second largest ``m_2``,
    with ``T = sum_{s != k} exp(x_s - m_2)`` and ``U_i = e^{x_k - m_1} + e^{m_2 - m_1}
    (T - e^{x_i - m_2} [i != k])``, ``LSE_s x_s = m_1 + log U_k`` and

    .. math::

        \\mathrm{LSE}_{s \\ne k}\\, x_s = m_2 + \\log T, \\qquad
        \\mathrm{LSE}_{s \\ne i}\\, x_s = m_1 + \\log U_i \\quad (i \\ne k).

    The term ``e^{x_k - m_1} = 1`` bounds every ``U_i`` below, so the rounding of the
    subtraction costs an absolute ``O(S eps)``, never a relative one, however much one entry
    dominates; the sum without the largest entry is formed without it.
    """
    num_samples = x.shape[0]
    first, largest = x.detach().max(0, keepdim=True)
    sample = torch.arange(num_samples, device=x.device)
    is_largest = sample.reshape((num_samples,) + (1,) * (x.dim() - 1)) == largest
    others = x.masked_fill(is_largest, -math.inf)
    first, second = first[0], others.detach().amax(0)
    # Shifts are constants (the sums do not depend on them), finite even in rows of -inf.
    has_one, defined = first > -math.inf, second > -math.inf
    shift1 = torch.where(has_one, first, 0.0)
    shift2 = torch.where(defined, second, 0.0)
    ratio = (second - shift1).exp()  # e^{m2 - m1} <= 1, 0 when m2 = -inf
    head = (x.gather(0, largest)[0] - shift1).exp()  # e^{x_k - m1} = 1, or 0 in a row of -inf
    head = torch.where(has_one, head, 1.0)  # keeps every log finite; those rows are dropped
    rest = (others - shift2).exp()  # e^{x_s - m2} <= 1, 0 at k
    rest_total = rest.sum(0)  # T
    scaled_total = head + ratio * rest_total  # U_k
    total = torch.where(has_one, shift1 + scaled_total.log(), -math.inf)
    # sum_i log U_i counts U_k once: swap it for the sum without the largest entry.
    log_u = torch.addcmul(scaled_total, rest, ratio, value=-1.0).log().sum(0)
    without_largest = shift2 + torch.where(defined, rest_total, 1.0).log()
    mean_leave_one_out = (
        (num_samples - 1) * shift1 + log_u - scaled_total.log() + without_largest
    ) / num_samples
    return total, mean_leave_one_out, defined


def _jackknife(full, mean_leave_one_out, defined, num_samples):
    """``S f - (S - 1) mean_i f_{-i}`` where ``defined``, else ``f`` (the correction is
    undefined where some ``f_{-i}`` is not finite, e.g. where only one sample gives a feature
    a finite likelihood)."""
    corrected = num_samples * full - (num_samples - 1) * mean_leave_one_out
    return torch.where(defined, corrected, full)


def jackknife_importance_log_conditionals(log_weights, log_likelihoods, context):
    """``log p(x_j | x_R)`` for every feature by self-normalised importance sampling, with
    the jackknife correction of its ``O(1/S)`` bias.

    The estimate from all samples is that of
    :func:`~pyro_mpt.ops.self_normalised_importance.plain_importance_log_conditionals`,

    .. math::

        f_j = \\mathrm{LSE}_s(a_s + l_{sj}) - \\mathrm{LSE}_s(a_s), \\qquad
        a_s = \\log w_s + \\sum_{k \\in R} l_{sk},

    and ``f_{-i, j}`` leaves sample ``i`` out of both sums; the result is
    ``S f_j - (S - 1) mean_i f_{-i, j}``. Each sample's ``1/S`` weight cancels in the ratio.

    :param torch.Tensor log_weights: ``log p(z_s) - log q(z_s)`` of every sample, shape
        ``(S, P) + batch`` with ``S >= 2`` (``P`` the masks).
    :param torch.Tensor log_likelihoods: ``l_sj``, shape ``(S, P) + batch + (D,)``;
        ``-inf`` is allowed (outside the context it never enters ``a_s``).
    :param torch.Tensor context: 1/True at observed features, shape
        ``(P,) + batch + (D,)`` (batch dims may be 1 to share masks).
    :returns: a tensor of shape ``(P,) + batch + (D,)``. Where a leave-one-out estimate is
        not finite (a feature with a finite likelihood under one sample only), the plain
        estimate is returned instead.
    :raises ValueError: if there are fewer than 2 samples.

    Example::

        >>> log_w = torch.zeros(16, 1, 3)  # S=16 draws from the prior, P=1 mask, N=3
        >>> ll = torch.randn(16, 1, 3, 5)
        >>> ctx = torch.tensor([True, True, False, False, False]).expand(1, 3, 5)
        >>> jackknife_importance_log_conditionals(log_w, ll, ctx).shape
        torch.Size([1, 3, 5])
    """
    num_samples = _check_num_samples(log_weights)
    context = context.to(torch.bool)
    # A -inf likelihood outside the context must not make its context sum NaN.
    context_ll = torch.where(context, log_likelihoods, 0.0).sum(-1)  # (S, P) + batch
    log_joint = log_weights + context_ll
    norm, norm_loo, norm_defined = _log_sum_and_mean_leave_one_out(log_joint)
    pred, pred_loo, pred_defined = _log_sum_and_mean_leave_one_out(
        log_joint.unsqueeze(-1) + log_likelihoods
    )
    # Every f_{-i} is finite where both sums keep a finite term without any one sample.
    defined = norm_defined.unsqueeze(-1) & pred_defined
    full = pred - norm.unsqueeze(-1)
    mean_leave_one_out = pred_loo - norm_loo.unsqueeze(-1)
    return _jackknife(full, mean_leave_one_out, defined, num_samples)


def jackknife_importance_log_marginal(log_weights):
    """``log p(x) ≈ LSE_s(log w_s) - log S`` with the jackknife correction of its
    ``O(1/S)`` downward bias, with ``log w_s = log p(x, z_s) - log q(z_s)``.

    :param torch.Tensor log_weights: shape ``(S,) + batch`` with ``S >= 2``.
    :returns: a tensor of shape ``batch``: ``S f - (S - 1) mean_i f_{-i}`` with
        ``f = LSE_s(log w_s) - log S`` and ``f_{-i} = LSE_{s != i}(log w_s) - log(S - 1)``;
        the plain ``f`` where a leave-one-out value is not finite.
    :raises ValueError: if there are fewer than 2 samples.

    Unlike the plain estimate, the corrected one is not a lower bound in expectation.
    """
    num_samples = _check_num_samples(log_weights)
    total, mean_leave_one_out, defined = _log_sum_and_mean_leave_one_out(log_weights)
    full = total - math.log(num_samples)
    mean_leave_one_out = mean_leave_one_out - math.log(num_samples - 1)
    return _jackknife(full, mean_leave_one_out, defined, num_samples)
