"""Exponentials floored above the subnormal numbers, which would slow the matrix products
of sums over nodes or samples many times over on CPUs; the floors keep every sum exact to a
relative ``G sqrt(tiny)`` (:ref:`theory-floors`).
"""

import math

import torch

__all__ = ["floored_exp", "floored_exp_", "flushed_exp", "gemm_safe_floor"]


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
