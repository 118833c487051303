"""Random masks: of given sizes, uniform among the masks of each size, and stratified by
size when several are drawn per observation (:ref:`theory-rates`); masked sums and
selections by arithmetic.

This module is pure tensor code: no Pyro effects.
"""

import math

import numpy as np
import torch
import torch.distributed

from pyro_mpt.errors import check_positive_int

__all__ = [
    "check_num_masks",
    "process_generator",
    "sample_masks",
    "masks_of_sizes",
    "plain_masks_of_sizes",
    "masked_sum",
    "select_masked",
    "sort_rows",
]


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


def masks_of_sizes(sizes, num_features, entries=None, generator=None):
    """Uniformly random masks with the given sizes.

    :param torch.Tensor sizes: integer mask sizes, any shape ``S``.
    :param int num_features: features ``D``.
    :param torch.Tensor entries: optional booleans broadcastable to ``S + (D,)``: masks are
        drawn among the ``True`` entries only (the observed entries of an observation with
        missing ones).
    :param torch.Generator generator: where the random keys come from, on the device of
        ``sizes``; ``None`` for torch's global generator.
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
    # finds each row's M-th smallest key. 16-bit keys are the cheapest to draw, sort and
    # compare; they tie often in long rows, which take float32 keys instead.
    dtype = torch.int16 if num_features <= _MAX_FEATURES_FOR_SHORT_KEYS else torch.float32
    masks, tied = _masks_below_threshold(sizes, num_features, dtype, generator)
    # A tie between the M-th and the next key would mask one feature too many: those rows
    # (about 1 row in 100 of 784 features with 16-bit keys, 1 in 40000 with float32 keys) are
    # drawn again with float64 keys. The test reads a CPU tensor: no device to wait for.
    if bool(tied.any()):
        redrawn = _masks_below_threshold(sizes[tied], num_features, torch.float64, generator)
        masks[tied] = redrawn[0]
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


def _random_keys(shape, dtype, device, generator=None):
    """Independent uniform keys: ``torch.rand`` for floating dtypes; for ``int16``, the four
    16-bit pieces of uniform 64-bit integers, four times fewer draws than ``torch.rand``."""
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype, device=device, generator=generator)
    size = math.prod(shape)
    bits = torch.empty(-(-size // 4), dtype=torch.int64, device=device)
    bits.random_(-(2**63), None, generator=generator)  # every one of the 64 bits uniform
    return bits.view(torch.int16)[:size].reshape(shape)


def _masks_below_threshold(sizes, num_features, dtype, generator=None):
    """Masks of the given sizes from random keys, and which rows' M-th and (M+1)-th keys
    tie."""
    keys = _random_keys(sizes.shape + (num_features,), dtype, sizes.device, generator)
    sorted_keys = sort_rows(keys)
    index = (sizes - 1).clamp(min=0, max=num_features - 1).unsqueeze(-1)
    threshold = sorted_keys.gather(-1, index)
    following = sorted_keys.gather(-1, (index + 1).clamp(max=num_features - 1))
    tied = ((following == threshold) & (index + 1 < num_features)).squeeze(-1)
    masks = (keys <= threshold) & (sizes > 0).unsqueeze(-1)  # rows of size 0 mask nothing
    return masks, tied & (sizes > 0)


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
