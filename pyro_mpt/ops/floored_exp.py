"""Exponentials floored above the subnormal numbers, which would slow the matrix products
of sums over nodes or samples many times over on CPUs, and the exact recomputation of the
few sums that the floors could move (:ref:`theory-floors`), and the ledger that counts on
the device those that stay floored off the CPU.
"""

import contextlib
import contextvars
import math

import torch

__all__ = [
    "FLOOR_MARGIN",
    "MAX_EXACT_OFF_CPU",
    "FlooredLedger",
    "exact_where",
    "floor_margin",
    "floored_ledger",
    "host_readable",
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
#: read of the device: those nearest the floors. The ones it leaves floored beyond these are
#: counted in the open :class:`FlooredLedger`.
MAX_EXACT_OFF_CPU = 1024


class FlooredLedger:
    """A count, kept on the device, of the entries below margin that :func:`exact_where`
    left floored off the CPU (those beyond the :data:`MAX_EXACT_OFF_CPU` it computes
    again). Adding reads nothing back: whoever opened the ledger reads its total once, e.g.
    ``MPTLoss`` with the loss, in the synchronisation it makes anyway."""

    def __init__(self):
        self._total = None

    def add(self, count):
        """Adds ``count``, a 0-dim integer tensor on the device."""
        self._total = count if self._total is None else self._total + count

    def total(self):
        """The entries left floored so far, a 0-dim device tensor, or None when no call
        could leave any (none on the CPU, nor off it with at most
        :data:`MAX_EXACT_OFF_CPU` entries in a call): then there is nothing to read."""
        return self._total


#: The ledger :func:`exact_where` adds to, where one is open (:func:`floored_ledger`).
_OPEN_LEDGER = contextvars.ContextVar("floored_ledger", default=None)


@contextlib.contextmanager
def floored_ledger():
    """Opens a :class:`FlooredLedger` for the block and yields it: the calls of
    :func:`exact_where` in the block (in this thread or task) add what they leave floored
    to it. A ledger opened inside another counts its own block only, so the caller that
    opened it reads and reports those alone. With none open nothing is counted."""
    ledger = FlooredLedger()
    token = _OPEN_LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _OPEN_LEDGER.reset(token)


def host_readable(tensor):
    """Whether :func:`exact_where` may read ``tensor``'s values to find the entries below
    margin: on the CPU only, where the read waits for no device (and so nothing is left
    floored to count in a :class:`FlooredLedger`)."""
    return tensor.device.type == "cpu"


def exact_where(margin, result, exact, read=None):
    """``result`` with the entries whose ``margin`` (broadcastable to it) is below 0
    replaced by ``exact(index)``, their values computed another way from the index tensors
    of those entries; gradients flow through ``exact`` there.

    On the CPU one read of ``margin`` finds them. Elsewhere nothing is read back: the
    :data:`MAX_EXACT_OFF_CPU` entries of lowest margin are computed again whatever their
    margins (an exact value replaces an accurate one), so that only a call with more entries
    than that near the floors keeps some floored; how many it keeps is counted on the
    device into the open :class:`FlooredLedger`, if any (:func:`floored_ledger`). ``read``
    chooses the way (by the device when None).
    """
    margin = margin.expand(result.shape)
    if read if read is not None else host_readable(result):
        below = margin < 0
        if not bool(below.any()):
            return result
        index = below.nonzero(as_tuple=True)
    else:
        count = min(MAX_EXACT_OFF_CPU, margin.numel())
        flat = margin.reshape(-1).topk(count, largest=False).indices
        index = torch.unravel_index(flat, result.shape)
        ledger = _OPEN_LEDGER.get()
        if ledger is not None and count < margin.numel():
            # The entries below margin beyond the `count` of lowest margin computed again.
            ledger.add(((margin < 0).sum() - count).clamp_(min=0))
    return result.index_put(index, exact(index).to(result.dtype))
