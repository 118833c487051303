"""Self-predictive conditionals by quadrature, from the per-feature log-likelihoods of every
observation at every node: one evaluation of the likelihood serves every mask
(:ref:`theory-quadrature`).

This module is pure tensor code: no Pyro effects.
"""

import torch

from pyro_mpt.ops.floored_exp import (
    exact_where,
    floor_margin,
    floored_exp,
    flushed_exp,
    log_sum_exp,
)

__all__ = ["quadrature_log_conditionals", "quadrature_log_marginal"]


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
    wa = flushed_exp(a - a.amax(-1, keepdim=True))
    ll_max = ll.amax(0)  # batch + (D,)
    # A value impossible at every node keeps its -inf: shift it by a finite number instead.
    el = floored_exp(ll - ll_max.clamp(min=torch.finfo(ll.dtype).min))
    numerator = torch.einsum("p...g,g...d->p...d", wa, el)
    denominator = wa.sum(-1, keepdim=True)
    log_numerator = numerator.log()
    result = log_numerator + ll_max - denominator.log()
    # The floors move a sum by less than floor * (denominator + G): a conditional whose sum
    # is within FLOOR_MARGIN of that is computed again in log space, exactly.
    margin = log_numerator - (floor_margin(ll.dtype, a.shape[-1]) * denominator).log()
    shape = result.shape
    return exact_where(margin, result, lambda index: _log_space(a, ll, index, shape))


def _log_space(log_joint, log_likelihoods, index, shape):
    """``log p(x_j | x_R)`` at the entries ``index`` (index tensors into the conditionals,
    of shape ``shape = (P,) + batch + (D,)``), as ``LSE_g(a_g + l_gj) - LSE_g(a_g)`` from the
    log joint ``a`` ``(P,) + batch + (G,)``: no floor, and no ``(G, P, N, D)`` tensor."""
    rows = log_joint.expand(shape[:-1] + log_joint.shape[-1:])[index[:-1]]  # (E, G)
    ll = log_likelihoods.movedim(0, -1)  # batch + (D, G)
    ll = ll.expand(shape[1:] + ll.shape[-1:])[index[1:]]  # (E, G)
    return log_sum_exp(rows + ll) - log_sum_exp(rows)


def quadrature_log_marginal(log_weights, log_likelihoods):
    """``log p(x) = LSE_g(log w_g + sum_j l_gj)``, shape ``batch``; ``log_weights`` of shape
    ``(G,)`` or ``(G,) + batch``."""
    total = log_likelihoods.sum(-1)  # (G,) + batch
    log_weights = log_weights.reshape(log_weights.shape + (1,) * (total.dim() - log_weights.dim()))
    return torch.logsumexp(log_weights + total, dim=0)
