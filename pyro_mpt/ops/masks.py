"""Mask-size schedules (uniform, fixed rate, random ratio) and random masks of given sizes,
stratified when several are drawn per observation (:ref:`theory-rates`).

This module is pure tensor code: no Pyro effects.
"""

import math
import numbers

import numpy as np
import torch

from pyro_mpt.errors import check_positive_int

__all__ = [
    "RateSchedule",
    "UniformRate",
    "FixedRate",
    "RandomRate",
    "as_rate_schedule",
    "check_num_masks",
    "sample_masks",
    "masks_of_sizes",
    "plain_masks_of_sizes",
    "masked_sum",
    "select_masked",
]


class RateSchedule:
    """Base class of mask-size schedules.

    A schedule maps quantiles ``q`` in ``[0, 1)`` to mask sizes in ``{1, ..., D}``; drawing
    ``q ~ U[0, 1)`` draws a mask size.
    """

    #: True when the MPT estimate under this schedule is unbiased for log p(x).
    unbiased = False

    def sizes_from_quantiles(self, quantiles, num_features):
        """Mask sizes for the given quantiles.

        :param torch.Tensor quantiles: values in ``[0, 1)``, any shape.
        :param num_features: the number of features ``D`` of one observation, or a tensor of
            per-observation counts broadcastable to ``quantiles`` (missing entries).
        :returns: a ``torch.long`` tensor of the same shape, with values in ``1 ... D``
            (0 for an observation with no feature).
        """
        raise NotImplementedError

    def sample_sizes(self, num_masks, batch_shape, num_features, device=None):
        """Draws stratified mask sizes, shape ``(num_masks,) + batch_shape``.

        :param int num_masks: masks per observation ``P``; their sizes are stratified.
        :param torch.Size batch_shape: shape of the batch of observations; use ``()`` to
            share each mask size across the batch.
        :param int num_features: features ``D`` per observation.
        """
        shift = torch.rand(batch_shape, dtype=torch.float64, device=device)
        strata = torch.arange(num_masks, dtype=torch.float64, device=device)
        strata = strata.reshape((num_masks,) + (1,) * len(batch_shape))
        quantiles = (strata + shift) / num_masks
        return self.sizes_from_quantiles(quantiles, num_features)

    def mean_size(self, num_features):
        """The expected mask size (used for display and sizing)."""
        grid = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
        return self.sizes_from_quantiles(grid, num_features).double().mean().item()


class RandomRate(RateSchedule):
    """A masking rate drawn uniformly from ``[low, high)`` per mask (random-ratio masking,
    R2MAE); the mask size is ``min(D, floor(r D) + 1)``.

    With ``(low, high) = (0, 1)`` the mask size is uniform on ``{1, ..., D}``.

    :param float low: lower end of the rate range, in ``[0, 1]``.
    :param float high: upper end of the rate range, in ``[low, 1]``.
    """

    def __init__(self, low, high):
        self.low = float(low)
        self.high = float(high)
        self.unbiased = self.low == 0.0 and self.high == 1.0

    def sizes_from_quantiles(self, quantiles, num_features):
        rates = self.low + (self.high - self.low) * quantiles
        # (p + u) * D / P in float64 is exact enough for floor to land on p + 1 when P == D.
        sizes = torch.floor(rates * num_features).long() + 1
        return _clamp_sizes(sizes, num_features)

    def __repr__(self):
        return f"RandomRate(low={self.low}, high={self.high})"


class UniformRate(RandomRate):
    """The mask size is uniform on ``{1, ..., D}``: the MPT estimate is unbiased for log p(x)."""

    def __init__(self):
        super().__init__(0.0, 1.0)

    def __repr__(self):
        return "UniformRate()"


class FixedRate(RateSchedule):
    """A fixed masking rate ``r`` (BERT's 0.15, MAE's 0.75): ``M = max(1, round(r D))``.

    The estimate ``D S(x; M)`` is biased for log p(x); the bias does not depend on how the
    mask is drawn, so the objective still rises with the log-marginal likelihood.

    :param float rate: the masking rate, in ``(0, 1]``.
    """

    def __init__(self, rate):
        self.rate = float(rate)

    def sizes_from_quantiles(self, quantiles, num_features):
        if torch.is_tensor(num_features):
            sizes = torch.floor(self.rate * num_features.double() + 0.5).long()
            return _clamp_sizes(sizes.expand(quantiles.shape), num_features)
        size = max(1, min(num_features, math.floor(self.rate * num_features + 0.5)))
        return torch.full_like(quantiles, size, dtype=torch.long)

    def __repr__(self):
        return f"FixedRate({self.rate})"


def _clamp_sizes(sizes, num_features):
    """Sizes clamped to ``1 ... D``; ``num_features`` may be a tensor of per-observation
    counts, and observations with no feature get size 0."""
    if not torch.is_tensor(num_features):
        return sizes.clamp(1, num_features)
    counts = num_features.to(sizes.device).long()
    return torch.minimum(sizes.clamp(min=1), counts)


def _check_unit_interval(value, name, allow_zero):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}."
        )
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1) or math.isnan(value):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(
            f"{name} must lie in {bound}, got {value!r}. A masking rate is the fraction of "
            f"features hidden per observation, e.g. 0.15 as in BERT."
        )


def as_rate_schedule(rate):
    """Normalises every accepted form of the ``rate`` argument into a :class:`RateSchedule`.

    :param rate: ``"uniform"``; a float in ``(0, 1]`` (fixed rate); a pair ``(lo, hi)`` with
        ``0 <= lo <= hi <= 1`` (random ratio); or a :class:`RateSchedule`.
    :raises TypeError: for a value of another type.
    :raises ValueError: for a value out of range.

    Example::

        >>> as_rate_schedule("uniform")
        UniformRate()
        >>> as_rate_schedule(0.15)
        FixedRate(0.15)
        >>> as_rate_schedule((0.1, 0.8))
        RandomRate(low=0.1, high=0.8)
    """
    if isinstance(rate, RateSchedule):
        return rate
    if isinstance(rate, str):
        if rate == "uniform":
            return UniformRate()
        raise ValueError(
            f"rate={rate!r} is not a known schedule. Use 'uniform' (unbiased), a float in "
            f"(0, 1] such as 0.15 (fixed rate), or a pair (lo, hi) (random ratio)."
        )
    if isinstance(rate, (tuple, list)):
        if len(rate) != 2:
            raise ValueError(
                f"rate={rate!r} must be a pair (lo, hi) of rates in [0, 1], got {len(rate)} values."
            )
        low, high = rate
        _check_unit_interval(low, "rate[0] (lo)", allow_zero=True)
        _check_unit_interval(high, "rate[1] (hi)", allow_zero=True)
        if low > high:
            raise ValueError(
                f"rate=({low!r}, {high!r}) has lo > hi. Give the range in increasing order, "
                f"e.g. ({high!r}, {low!r})."
            )
        if high == 0:
            raise ValueError(
                f"rate=({low!r}, {high!r}) masks nothing. Use hi > 0, e.g. (0, 1) for the "
                f"uniform schedule."
            )
        return UniformRate() if (low, high) == (0, 1) else RandomRate(low, high)
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(
            f"rate must be 'uniform', a float in (0, 1] or a pair (lo, hi); got {rate!r} of "
            f"type {type(rate).__name__}."
        )
    _check_unit_interval(rate, "rate", allow_zero=False)
    return FixedRate(rate)


def check_num_masks(num_masks):
    """``num_masks`` as an ``int`` after checking it is a positive integer (see
    :func:`~pyro_mpt.errors.check_positive_int`)."""
    return check_positive_int(
        "num_masks",
        num_masks,
        "It is the number of random masks drawn per observation and step, e.g. num_masks=1.",
    )


def _sort_rows(keys, use_numpy=None):
    """Sorts the last dim. On CPU NumPy's vectorised sort is many times faster than
    ``torch.sort`` for short rows; both give identical results."""
    if use_numpy is None:
        use_numpy = keys.device.type == "cpu"
    if use_numpy:
        return torch.from_numpy(np.sort(keys.numpy(), axis=-1))
    return keys.sort(dim=-1).values


def masks_of_sizes(sizes, num_features, entries=None):
    """Uniformly random masks with the given sizes.

    :param torch.Tensor sizes: integer mask sizes, any shape ``S``.
    :param int num_features: features ``D``.
    :param torch.Tensor entries: optional booleans broadcastable to ``S + (D,)``: masks are
        drawn among the ``True`` entries only (the observed entries of an observation with
        missing ones).
    :returns: a boolean tensor of shape ``S + (D,)``, ``True`` at masked features; each row
        is uniform among the masks of its size.
    """
    if entries is not None:
        # float64 keys, and +inf at entries that cannot be masked.
        keys = torch.rand(sizes.shape + (num_features,), dtype=torch.float64, device=sizes.device)
        keys = keys.masked_fill(~entries.expand(keys.shape), math.inf)
        threshold = keys.sort(-1).values.gather(-1, (sizes - 1).clamp(min=0).unsqueeze(-1))
        return (keys <= threshold) & (sizes > 0).unsqueeze(-1) & entries
    # A feature is masked when its random key is among the M smallest of its row: one sort
    # finds each row's M-th smallest key. 16-bit keys are the cheapest to draw, sort and
    # compare; they tie often in long rows, which take float32 keys instead.
    dtype = torch.int16 if num_features <= _MAX_FEATURES_FOR_SHORT_KEYS else torch.float32
    masks, tied = _masks_below_threshold(sizes, num_features, dtype)
    # A tie between the M-th and the next key would mask one feature too many: those rows
    # (about 1 row in 100 of 784 features with 16-bit keys, 1 in 40000 with float32 keys) are
    # drawn again with float64 keys.
    if bool(tied.any()):
        masks[tied] = _masks_below_threshold(sizes[tied], num_features, torch.float64)[0]
    return masks


def plain_masks_of_sizes(sizes, num_features):
    """:func:`masks_of_sizes` the plain way, float64 keys sorted by ``torch.sort``: the
    reference the fast version is tested against.

    :returns: a boolean tensor of shape ``sizes.shape + (D,)``.
    """
    keys = torch.rand(sizes.shape + (num_features,), dtype=torch.float64, device=sizes.device)
    threshold = keys.sort(-1).values.gather(-1, (sizes - 1).clamp(min=0).unsqueeze(-1))
    return (keys <= threshold) & (sizes > 0).unsqueeze(-1)


#: The most features per row for which masks use 16-bit keys.
_MAX_FEATURES_FOR_SHORT_KEYS = 4096


def _random_keys(shape, dtype, device):
    """Independent uniform keys: ``torch.rand`` for floating dtypes; for ``int16``, the four
    16-bit pieces of uniform 64-bit integers, four times fewer draws than ``torch.rand``."""
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype, device=device)
    size = math.prod(shape)
    bits = torch.empty(-(-size // 4), dtype=torch.int64, device=device)
    bits.random_(-(2**63), None)  # every one of the 64 bits uniform
    return bits.view(torch.int16)[:size].reshape(shape)


def _masks_below_threshold(sizes, num_features, dtype):
    """Masks of the given sizes from random keys, and which rows' M-th and (M+1)-th keys
    tie."""
    keys = _random_keys(sizes.shape + (num_features,), dtype, sizes.device)
    sorted_keys = _sort_rows(keys)
    index = (sizes - 1).clamp(min=0, max=num_features - 1).unsqueeze(-1)
    threshold = sorted_keys.gather(-1, index)
    following = sorted_keys.gather(-1, (index + 1).clamp(max=num_features - 1))
    tied = ((following == threshold) & (index + 1 < num_features)).squeeze(-1)
    masks = keys <= threshold
    empty = sizes < 1
    if bool(empty.any()):  # rows of size 0 mask nothing
        masks &= ~empty.unsqueeze(-1)
    return masks, tied & ~empty


def sample_masks(schedule, num_masks, batch_shape, num_features, device=None, entries=None):
    """Draws ``num_masks`` stratified masks per observation.

    :param RateSchedule schedule: the mask-size schedule.
    :param int num_masks: masks per observation.
    :param torch.Size batch_shape: observation batch shape (``()`` to share masks across
        the batch, as in the paper's own experiments).
    :param int num_features: features per observation.
    :param torch.Tensor entries: optional booleans ``batch_shape + (D,)``, ``True`` at the
        observed entries of observations with missing ones: each observation's mask size is
        drawn for its own count of observed entries, and its mask among them.
    :returns: ``(masks, sizes)``: a boolean tensor of shape
        ``(num_masks,) + batch_shape + (D,)`` and the long tensor of mask sizes.
    """
    batch_shape = torch.Size(batch_shape)
    if entries is None:
        sizes = schedule.sample_sizes(num_masks, batch_shape, num_features, device)
        return masks_of_sizes(sizes, num_features), sizes
    counts = entries.sum(-1)
    shift = torch.rand(batch_shape, dtype=torch.float64, device=device)
    strata = torch.arange(num_masks, dtype=torch.float64, device=device)
    quantiles = (strata.reshape((num_masks,) + (1,) * len(batch_shape)) + shift) / num_masks
    sizes = schedule.sizes_from_quantiles(quantiles, counts)
    return masks_of_sizes(sizes, num_features, entries), sizes


def select_masked(masks, masked, unmasked):
    """``torch.where(masks, masked, unmasked)`` for finite values, by arithmetic.

    Each product is by exactly 0 or 1, so the values are those of ``where``, and on CPUs it is
    many times faster than ``where`` with a boolean condition. A non-finite value would meet
    a 0 and give NaN: use ``torch.where`` when there may be one.

    :param torch.Tensor masks: boolean, broadcastable to the other two.
    :param masked: the value where ``masks`` is ``True`` (a tensor or a number).
    :param unmasked: the value elsewhere (a tensor or a number).
    """
    weights = masks.to(torch.result_type(masked, unmasked))
    return masked * weights + unmasked * (1 - weights)


def masked_sum(values, masks):
    """The sum over the last dim of ``values`` where ``masks`` is ``True``; values elsewhere,
    ``inf`` and NaN included, are ignored.

    A product with the mask, many times faster than ``where`` on CPUs, unless a sum comes out
    non-finite: then ``where`` decides.

    :param torch.Tensor values: shape ``S + (D,)``.
    :param torch.Tensor masks: boolean, broadcastable to ``values``.
    :returns: a tensor of the broadcast shape without its last dim.
    """
    total = (values * masks.to(values.dtype)).sum(-1)
    if not bool(torch.isfinite(total).all()):
        total = torch.where(masks, values, 0.0).sum(-1)
    return total
