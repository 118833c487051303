"""Self-predictive conditionals by self-normalised importance sampling.

With ``S`` latent samples ``z_s`` drawn from a proposal ``q`` (the guide), their log-weights
``log p(z_s) - log q(z_s)`` and the per-feature log-likelihoods ``l_sj = log p(x_j | z_s)``,

.. math::

    \\log p(x_j \\mid x_R) \\approx \\operatorname{LSE}_s\\Big(\\log w_s + l_{sj}\\Big)
        - \\operatorname{LSE}_s\\big(\\log w_s\\big), \\qquad
    \\log w_s = \\log p(z_s) + \\sum_{k \\in R} l_{sk} - \\log q(z_s),

the ratio of two importance estimates of ``p(x_j, x_R)`` and ``p(x_R)``. It is consistent
(exact as ``S`` grows) for any proposal whose support covers the posterior, and biased at
finite ``S`` like every self-normalised estimate.

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

__all__ = [
    "check_fill",
    "fill_masked",
    "importance_log_conditionals",
    "importance_log_marginal",
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
    return torch.where(masks, value, x)


def importance_log_conditionals(log_weights, log_likelihoods, context):
    """``log p(x_j | x_R)`` for every feature, by self-normalised importance sampling.

    :param torch.Tensor log_weights: ``log p(z_s) - log q(z_s)`` of every sample, shape
        ``(S, P) + batch`` (``P`` the masks, as the proposal may depend on the mask).
    :param torch.Tensor log_likelihoods: ``l_sj``, shape ``(S, P) + batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, shape
        ``(P,) + batch + (D,)`` (batch dims may be 1 to share masks).
    :returns: a tensor of shape ``(P,) + batch + (D,)``.
    """
    ll = log_likelihoods
    context = context.to(torch.bool)
    # A -inf likelihood at a masked feature must not turn the context sum into NaN.
    context_ll = torch.where(context, ll, ll.new_zeros(())).sum(-1)
    log_w = log_weights + context_ll  # (S, P) + batch
    numerator = torch.logsumexp(log_w.unsqueeze(-1) + ll, dim=0)
    return numerator - torch.logsumexp(log_w, dim=0).unsqueeze(-1)


def importance_log_marginal(log_weights):
    """``log p(x) ≈ LSE_s(log w_s) - log S``, the log of the importance estimate of
    ``p(x)``, with ``log w_s = log p(x, z_s) - log q(z_s)`` of shape ``(S,) + batch``.

    A lower bound in expectation (Jensen), tight as ``S`` grows (the IWAE bound).
    """
    num_samples = log_weights.shape[0]
    return torch.logsumexp(log_weights, dim=0) - math.log(num_samples)
