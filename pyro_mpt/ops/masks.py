"""Random masks: of given sizes, uniform among the masks of each size, and stratified by
size when several are drawn per observation (:ref:`theory-rates`); masked sums and
selections by arithmetic.

This module is pure tensor code: no Pyro effects.
"""

import math

import numpy as np
import torch

from pyro_mpt.errors import check_positive_int

__all__ = [
    "check_num_masks",
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
    sorted_keys = sort_rows(keys)
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
