"""Random masks and the masked pre-training estimate over them.

* **Mask sizes**: schedules that map quantiles to sizes (uniform, unbiased with exact
  conditionals; a fixed rate, BERT's 15%, MAE's 75%; a random ratio, R2MAE), so that several
  masks per observation are stratified (:ref:`theory-rates`). "Unbiased" is over the draw
  of the masks, given the conditionals: for ``log p(x)`` when they are exact (and
  quadrature up to its rule's error); with importance-sampled conditionals the uniform
  schedule gives a consistent but biased estimate, with encode-decode a biased one.
* **Masks**: uniform among the masks of each size, drawn per observation (or per process
  under :mod:`torch.distributed`); masked sums and selections by arithmetic.
* **The estimate**: ``(D / M) sum_{j in mask} log p(x_j | x_R)`` from per-feature
  conditionals, averaged over masks (:ref:`theory-estimator`).

This module is pure tensor code: no Pyro effects.
"""

import math
import numbers

import numpy as np
import torch
import torch.distributed

from pyro_mpt.errors import check_positive_int

__all__ = [
    "FixedRate",
    "RandomRate",
    "RateSchedule",
    "UniformRate",
    "as_rate_schedule",
    "check_num_masks",
    "mask_scores",
    "masked_sum",
    "masks_of_sizes",
    "mpt_estimate",
    "plain_masks_of_sizes",
    "process_generator",
    "sample_masks",
    "select_masked",
    "sort_rows",
]


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
        if not torch.is_tensor(num_features):
            return sizes.clamp(1, num_features)
        return _clamp_to_counts(sizes, num_features)

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


#: ``1/2`` and a little more, so that a product ``r D`` whose decimal value ends in ``.5``
#: rounds up even where binary rounding leaves it just below (``0.35 * 90`` is
#: ``31.499999999999996``).
_HALF_UP = 0.5 + 1e-9


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
            sizes = torch.floor(self.rate * num_features.double() + _HALF_UP).long()
            return _clamp_to_counts(sizes.expand(quantiles.shape), num_features)
        size = max(1, min(num_features, math.floor(self.rate * num_features + _HALF_UP)))
        return torch.full_like(quantiles, size, dtype=torch.long)

    def __repr__(self):
        return f"FixedRate({self.rate})"


def _clamp_to_counts(sizes, counts):
    """Sizes clamped to ``1 ... count`` for per-observation ``counts`` of features (a
    tensor); observations with no feature get size 0."""
    return torch.minimum(sizes.clamp(min=1), counts.to(sizes.device).long())


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


def sort_rows(keys, use_numpy=None):
    """Sorts the last dim. On CPU NumPy's vectorised sort is many times faster than
    ``torch.sort`` for short rows; both give identical results. A tensor off the CPU is
    always sorted by ``torch.sort``: it never makes the round trip through NumPy."""
    if use_numpy is None or keys.device.type != "cpu":
        use_numpy = keys.device.type == "cpu"
    if use_numpy:
        return torch.from_numpy(np.sort(keys.numpy(), axis=-1))
    return keys.sort(dim=-1).values


def masks_of_sizes(sizes, num_features, entries=None, generator=None, key_dtype=None):
    """Uniformly random masks with the given sizes.

    :param torch.Tensor sizes: integer mask sizes, any shape ``S``.
    :param int num_features: features ``D``.
    :param torch.Tensor entries: optional booleans broadcastable to ``S + (D,)``: masks are
        drawn among the ``True`` entries only (the observed entries of an observation with
        missing ones).
    :param torch.Generator generator: where the random keys come from, on the device of
        ``sizes``; ``None`` for torch's global generator.
    :param torch.dtype key_dtype: on the CPU, the dtype of the random keys, ``torch.int16``,
        ``float32`` or ``float64``: by default 16-bit integers for rows of up to 4096
        features, the cheapest to draw, sort and compare, and float32 for longer rows, whose
        16-bit keys would tie often. Rows whose ``M``-th key ties with the next are drawn
        again with float64 keys.
    :returns: a boolean tensor of shape ``S + (D,)``, ``True`` at masked features; each row
        is uniform among the masks of its size.
    """
    if entries is not None:
        # float64 keys, and +inf at entries that cannot be masked.
        shape = sizes.shape + (num_features,)
        keys = torch.rand(shape, dtype=torch.float64, device=sizes.device, generator=generator)
        keys = keys.masked_fill(~entries.expand(keys.shape), math.inf)
        threshold = keys.sort(-1).values.gather(-1, (sizes - 1).clamp(min=0).unsqueeze(-1))
        return (keys <= threshold) & (sizes > 0).unsqueeze(-1) & entries
    if sizes.device.type != "cpu":
        return _unique_key_masks(sizes, num_features, generator)
    # A feature is masked when its random key is among the M smallest of its row: one sort
    # (NumPy's, see sort_rows) finds each row's M-th smallest key.
    if key_dtype is None:
        key_dtype = torch.int16 if num_features <= _MAX_FEATURES_FOR_SHORT_KEYS else torch.float32
    elif key_dtype not in (torch.int16, torch.float32, torch.float64):
        raise ValueError(
            f"key_dtype must be torch.int16, torch.float32 or torch.float64, got {key_dtype!r}; "
            f"leave it unset to have it chosen by the number of features."
        )
    shape = sizes.shape + (num_features,)
    if key_dtype.is_floating_point:
        keys = torch.rand(shape, dtype=key_dtype, device="cpu", generator=generator)
    else:  # the four 16-bit pieces of uniform 64-bit integers: four times fewer draws
        size = math.prod(shape)
        bits = torch.empty(-(-size // 4), dtype=torch.int64, device="cpu")
        bits.random_(-(2**63), None, generator=generator)  # every one of the 64 bits uniform
        keys = bits.view(torch.int16)[:size].reshape(shape)
    sorted_keys = torch.from_numpy(np.sort(keys.numpy(), axis=-1))
    index = (sizes - 1).clamp(min=0, max=num_features - 1).unsqueeze(-1)
    threshold = sorted_keys.gather(-1, index)
    masks = (keys <= threshold) & (sizes > 0).unsqueeze(-1)  # rows of size 0 mask nothing
    if key_dtype == torch.float64:
        return masks
    # A tie between the M-th and the next key would mask one feature too many: those rows
    # (about 1 row in 100 of 784 features with 16-bit keys, 1 in 40000 with float32 keys) are
    # drawn again with float64 keys. The test reads a CPU tensor: no device to wait for.
    following = sorted_keys.gather(-1, (index + 1).clamp(max=num_features - 1))
    tied = ((following == threshold) & (index + 1 < num_features)).squeeze(-1) & (sizes > 0)
    if bool(tied.any()):
        masks[tied] = masks_of_sizes(sizes[tied], num_features, None, generator, torch.float64)
    return masks


def _unique_key_masks(sizes, num_features, generator=None):
    """:func:`masks_of_sizes` off the CPU, with no host round trip: each key is a random
    integer of ``63 - b`` bits with the feature's index in its low ``b`` bits, so the keys of
    a row are distinct and the ``M`` smallest are exactly ``M``, with no tie to redraw. Two
    random parts tie with probability below ``D * 2**(b - 63)`` per row (about ``1e-13`` for
    ``D = 784``), and only then does the index decide."""
    num_bits = max(1, (num_features - 1).bit_length())
    shape = sizes.shape + (num_features,)
    keys = torch.empty(shape, dtype=torch.int64, device=sizes.device)
    keys.random_(0, 2 ** (63 - num_bits), generator=generator)
    keys = (keys << num_bits) | torch.arange(num_features, device=sizes.device)
    index = (sizes - 1).clamp(min=0, max=num_features - 1).unsqueeze(-1)
    threshold = keys.sort(dim=-1).values.gather(-1, index)
    return (keys <= threshold) & (sizes > 0).unsqueeze(-1)


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


def sample_masks(
    schedule, num_masks, batch_shape, num_features, device=None, entries=None, generator=None
):
    """Draws ``num_masks`` stratified masks per observation.

    :param RateSchedule schedule: the mask-size schedule; sizes come from its
        ``sizes_from_quantiles``.
    :param int num_masks: masks per observation.
    :param torch.Size batch_shape: observation batch shape (``()`` to share masks across
        the batch, as in the paper's own experiments).
    :param int num_features: features per observation.
    :param torch.Tensor entries: optional booleans ``batch_shape + (D,)``, ``True`` at the
        observed entries of observations with missing ones: each observation's mask size is
        drawn for its own count of observed entries, and its mask among them.
    :param torch.Generator generator: where the masks come from, on ``device``; ``None`` for
        torch's global generator (see :func:`process_generator`).
    :returns: ``(masks, sizes)``: a boolean tensor of shape
        ``(num_masks,) + batch_shape + (D,)`` and the long tensor of mask sizes.
    """
    batch_shape = torch.Size(batch_shape)
    # One uniform shift per observation, spread over num_masks strata of [0, 1).
    shift = torch.rand(batch_shape, dtype=torch.float64, device=device, generator=generator)
    strata = torch.arange(num_masks, dtype=torch.float64, device=device)
    quantiles = (strata.reshape((num_masks,) + (1,) * len(batch_shape)) + shift) / num_masks
    counts = num_features if entries is None else entries.sum(-1)
    sizes = schedule.sizes_from_quantiles(quantiles, counts)
    return masks_of_sizes(sizes, num_features, entries, generator), sizes


def process_generator(device=None):
    """The generator that this process's masks should come from: ``None`` (torch's global
    generator) in a single process, and under :mod:`torch.distributed` with several
    processes a fresh one per call, seeded with a draw from torch's global CPU generator
    plus the process's rank.

    Data-parallel processes are usually seeded alike (Pyro's and Lightning's recipes), so
    masks drawn from the global generator would be the same on every process, and the
    processes' estimates correlated. Seeded this way, each process draws masks of its own,
    independent of the others', and one seed still reproduces every process's masks, as
    reseeding the global generator does, at the cost of one draw from the CPU generator
    (no device synchronisation).

    :param device: the device of the masks, and of the generator (the CPU when ``None``).
    :returns: a :class:`torch.Generator` or ``None``.
    """
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return None
    if distributed.get_world_size() < 2:
        return None
    # A 62-bit base, the same on processes whose global generators are in the same state.
    # (A CPU generator keeps the low 32 bits of a seed: processes still differ at every step,
    # and two steps' seeds coincide about once in 4e9 pairs of steps.)
    base = int(torch.randint(2**62, (), dtype=torch.int64, device="cpu"))
    generator = torch.Generator(device=device if device is not None else "cpu")
    return generator.manual_seed(base + distributed.get_rank())


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

    On the CPU, a product with the mask, many times faster there than ``where``
    (``benchmarks/bench_fast_paths.py``), unless a sum comes out non-finite: then ``where``
    decides (a read of a CPU tensor, with no device to wait for). On other devices
    ``where`` always, with no host round trip.

    :param torch.Tensor values: shape ``S + (D,)``.
    :param torch.Tensor masks: boolean, broadcastable to ``values``.
    :returns: a tensor of the broadcast shape without its last dim.
    """
    if values.device.type != "cpu":
        return torch.where(masks, values, 0.0).sum(-1)
    total = (values * masks.to(values.dtype)).sum(-1)
    if not bool(torch.isfinite(total).all()):
        total = torch.where(masks, values, 0.0).sum(-1)
    return total


def mask_scores(log_conditionals, masks, sizes=None):
    """The per-mask score ``(1/M) sum_{j in mask} log p(x_j | x_R)`` (0 for an empty mask).

    :param torch.Tensor log_conditionals: ``log p(x_j | x_R)`` for every feature, shape
        ``S + (D,)``; entries outside the mask are ignored.
    :param torch.Tensor masks: boolean masks, shape ``S + (D,)`` (broadcastable).
    :param torch.Tensor sizes: the masks' sizes ``M`` (broadcastable to ``S``), where the
        caller has them (:func:`sample_masks` returns them): counted from ``masks``
        otherwise, a pass over every mask entry.
    :returns: a tensor of shape ``S``.
    """
    if sizes is None:
        sizes = masks.expand(log_conditionals.shape).sum(-1)
    return masked_sum(log_conditionals, masks) / sizes.to(log_conditionals.dtype).clamp(min=1)


def mpt_estimate(log_conditionals, masks, num_features=None, sizes=None):
    """The MPT estimate ``D / M sum_{j in mask} log p(x_j | x_R)`` averaged over masks.

    :param torch.Tensor log_conditionals: shape ``(P,) + batch + (D,)``, one row per mask.
    :param torch.Tensor masks: boolean, shape ``(P,) + batch + (D,)`` (broadcastable).
    :param num_features: ``D``, or a ``batch`` tensor of per-observation counts of observed
        entries (missing data); by default the size of the last dim.
    :param torch.Tensor sizes: the masks' sizes, as for :func:`mask_scores`.
    :returns: a tensor of shape ``batch``: for each observation, the mean over its ``P``
        masks of ``D`` times the mask score.
    """
    if num_features is None:
        num_features = log_conditionals.shape[-1]
    if sizes is None:
        sizes = masks.expand(log_conditionals.shape).sum(-1)
    # Each mask's score, as mask_scores gives it.
    scores = masked_sum(log_conditionals, masks) / sizes.to(log_conditionals.dtype).clamp(min=1)
    return num_features * scores.mean(0)
