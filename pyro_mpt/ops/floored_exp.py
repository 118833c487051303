"""Exponentials floored above the subnormal numbers, which would slow the matrix products
of sums over nodes or samples many times over on CPUs, and the exact recomputation of the
few sums that the floors could move (:ref:`theory-floors`).
"""

import math

import torch

__all__ = [
    "FLOOR_MARGIN",
    "MAX_EXACT_OFF_CPU",
    "exact_where",
    "floor_margin",
    "floored_exp",
    "floored_exp_",
    "flushed_exp",
    "gemm_safe_floor",
    "log_sum_exp",
]

#: A sum over ``G`` terms that is this many times above what the floors can move it by
#: (``floor (G + 1)`` times its largest weight) is kept: the floors change it by less than
#: ``1 / FLOOR_MARGIN`` relatively, 1e-4 nats. Closer sums are computed again, exactly.
FLOOR_MARGIN = 1e4


def gemm_safe_floor(dtype):
    """The square root of the dtype's smallest normal number (``1e-19`` in float32)."""
    return math.sqrt(torch.finfo(dtype).tiny)


def floored_exp(x):
    """``exp(x)`` for ``x <= 0``, floored at :func:`gemm_safe_floor`."""
    return x.clamp(min=math.log(gemm_safe_floor(x.dtype))).exp_()


def floored_exp_(x):
    """:func:`floored_exp` in place."""
    return x.clamp_(min=math.log(gemm_safe_floor(x.dtype))).exp_()


def flushed_exp(x):
    """``exp(x)`` for ``x <= 0``, set to zero below :func:`gemm_safe_floor`.

    The argument is clamped before the exponential: ``exp`` of a number far below the
    dtype's range is many times slower than of a normal one on CPUs.
    """
    floor = gemm_safe_floor(x.dtype)
    # Below the floor, exp(log(floor) - 1) = floor / e is dropped by the threshold.
    return torch.nn.functional.threshold(x.clamp(min=math.log(floor) - 1).exp_(), floor, 0.0)


def log_sum_exp(x, dim=-1):
    """``torch.logsumexp(x, dim)`` with the terms below :func:`gemm_safe_floor` of the
    largest dropped (a relative change below ``n sqrt(tiny)``, and no gradient to them).

    The sums that :func:`exact_where` computes again are those whose terms span hundreds of
    nats, and ``exp`` of arguments far below the dtype's range (the subnormal numbers) is
    many times slower than of normal ones on CPUs: ``torch.logsumexp`` of such rows takes
    about ten times as long as this. A slice impossible at every term stays ``-inf``.
    """
    top = x.amax(dim, keepdim=True).clamp(min=torch.finfo(x.dtype).min)
    return flushed_exp(x - top).sum(dim).log_().add_(top.squeeze(dim))


def floor_margin(dtype, num_terms):
    """How small, relative to the largest of its weights, a sum of ``num_terms`` floored
    products may be before the floors could move it by ``1 / FLOOR_MARGIN`` relatively:
    dropped weights miss at most ``num_terms`` floors, floored factors add at most one per
    unit of weight."""
    return FLOOR_MARGIN * gemm_safe_floor(dtype) * (num_terms + 1)


#: Off the CPU, how many conditionals per call :func:`exact_where` computes again, with no
#: read of the device: those nearest the floors.
MAX_EXACT_OFF_CPU = 1024


def exact_where(margin, result, exact, read=None):
    """``result`` with the entries whose ``margin`` (broadcastable to it) is below 0
    replaced by ``exact(index)``, their values computed another way from the index tensors
    of those entries; gradients flow through ``exact`` there.

    On the CPU one read of ``margin`` finds them. Elsewhere nothing is read back: the
    :data:`MAX_EXACT_OFF_CPU` entries of lowest margin are computed again whatever their
    margins (an exact value replaces an accurate one), so that only a call with more entries
    than that near the floors keeps some floored. ``read`` chooses the way (by the device
    when None).
    """
    margin = margin.expand(result.shape)
    if read if read is not None else result.device.type == "cpu":
        below = margin < 0
        if not bool(below.any()):
            return result
        index = below.nonzero(as_tuple=True)
    else:
        count = min(MAX_EXACT_OFF_CPU, margin.numel())
        flat = margin.reshape(-1).topk(count, largest=False).indices
        index = torch.unravel_index(flat, result.shape)
    return result.index_put(index, exact(index).to(result.dtype))
