"""Mask-size schedules: uniform (unbiased with exact conditionals), a fixed rate (BERT's 15%,
MAE's 75%) and a random ratio (R2MAE), each drawing sizes from quantiles so that several
masks per observation are stratified (:ref:`theory-rates`).

"Unbiased" is over the draw of the masks, given the conditionals: for ``log p(x)`` when they
are exact (and quadrature up to its rule's error); with importance-sampled conditionals the
uniform schedule gives a consistent but biased estimate, with encode-decode a biased one.

This module is pure tensor code: no Pyro effects.
"""

import math
import numbers

import torch

__all__ = ["FixedRate", "RandomRate", "RateSchedule", "UniformRate", "as_rate_schedule"]


class RateSchedule:
    """Base class of mask-size schedules.

    A schedule maps quantiles ``q`` in ``[0, 1)`` to mask sizes in ``{1, ..., D}``; drawing
    ``q ~ U[0, 1)`` draws a mask size.
    """

    #: True when the MPT estimate under this schedule is unbiased for log p(x) with exact
    #: conditionals.
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
    """The mask size is uniform on ``{1, ..., D}``: the MPT estimate is unbiased for log p(x)
    with exact conditionals (quadrature: up to its rule's error), consistent but biased with
    importance-sampled ones."""

    def __init__(self):
        super().__init__(0.0, 1.0)

    def __repr__(self):
        return "UniformRate()"


class FixedRate(RateSchedule):
    """A fixed masking rate ``r`` (BERT's 0.15, MAE's 0.75): ``M = max(1, floor(r D + 1/2))``.

    Halves round up, unlike Python's ``round``, which rounds them to even: ``D = 30`` at
    ``0.15`` (``r D = 4.5``) masks 5 features, not 4.

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
