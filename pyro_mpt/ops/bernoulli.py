"""Bernoulli log-likelihoods with logits, faster than ``torch.distributions.Bernoulli``.

Image models score every pixel of every sample, so ``log p(x | eta)`` runs over tensors of
``S x P x N x D`` entries. ``Bernoulli.log_prob`` takes ``binary_cross_entropy_with_logits``
through ``log1p``, which is not vectorised on CPUs; here

.. math::

    \\log p(x \\mid \\eta) = \\log \\sigma\\big((2x - 1)\\, \\eta\\big),

with ``log sigmoid`` as ``log(sigmoid(.))`` wherever ``sigmoid`` is a normal number (exact
to the dtype's rounding, in absolute terms) and ``logsigmoid`` elsewhere, and the gradient
``(2x - 1)(1 - sigmoid)`` written by hand.

This module is pure tensor code: no Pyro effects.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["bernoulli_log_prob", "log_prob", "log_sigmoid"]


def log_sigmoid(x):
    """``(log sigmoid(x), sigmoid(x))``, without autograd.

    ``log(sigmoid(x))`` is twice as fast as ``logsigmoid`` on CPUs; below ``log(tiny) + 8``
    (``-79`` in float32), where ``sigmoid`` would leave the normal numbers, ``logsigmoid`` is
    used instead.
    """
    probs = torch.sigmoid(x)
    if x.numel() and not bool(x.min() > math.log(torch.finfo(x.dtype).tiny) + 8):
        return F.logsigmoid(x), probs
    return probs.log(), probs


class _BernoulliLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, signs):
        signed = logits * signs
        out, probs = log_sigmoid(signed)
        ctx.save_for_backward(signs, probs)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        signs, probs = ctx.saved_tensors
        # d/d eta log sigmoid(s eta) = s (1 - sigmoid(s eta)).
        return torch.sub(1, probs, out=probs).mul_(signs).mul_(grad), None


def bernoulli_log_prob(logits, value):
    """``Bernoulli(logits=logits).log_prob(value)`` for ``value`` in ``{0, 1}``, broadcast;
    differentiable in ``logits``."""
    shape = torch.broadcast_shapes(logits.shape, value.shape)
    signs = (2 * value - 1).to(logits.dtype)
    return _BernoulliLogProb.apply(logits.expand(shape), signs.expand(shape))


def log_prob(fn, value):
    """``fn.log_prob(value)``, by :func:`bernoulli_log_prob` for a ``Bernoulli`` built from
    logits (as decoders build it)."""
    params = vars(fn)
    if isinstance(fn, torch.distributions.Bernoulli) and params.get("_param") is params.get(
        "logits", False
    ):
        return bernoulli_log_prob(fn.logits, value)
    return fn.log_prob(value)
