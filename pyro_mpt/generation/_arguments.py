"""Argument checks shared by :func:`~pyro_mpt.impute` and :func:`~pyro_mpt.gibbs`."""

import numbers

import torch

from pyro_mpt.trace.trace_utils import flatten_tail

__all__ = ["check_count", "check_missing", "flat_missing"]


def check_count(name, value, low, high=None, hint=""):
    """``value`` as an ``int`` after checking that it is an integer in ``[low, high]``.

    :raises TypeError: if it is not an integer (``True`` and ``False`` are not counts).
    :raises ValueError: naming ``name``, the value, the range and ``hint``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}."
            + (f" {hint}" if hint else "")
        )
    if value < low or (high is not None and value > high):
        allowed = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {allowed}, got {value}." + (f" {hint}" if hint else ""))
    return int(value)


def check_missing(missing):
    """Checks that ``missing`` is a boolean tensor (its shape and its ``True`` entries are
    checked against the observed site by :func:`flat_missing`)."""
    if not torch.is_tensor(missing) or missing.dtype != torch.bool:
        got = (
            f"a {missing.dtype} tensor"
            if torch.is_tensor(missing)
            else f"{type(missing).__name__} {missing!r}"
        )
        raise TypeError(
            f"missing must be a boolean tensor, True at the entries to impute, got {got}. "
            f"Pass e.g. torch.isnan(x) or x_mask == 0."
        )


def flat_missing(missing, observed):
    """``missing``, broadcast to the observed site's shape, as ``batch + (D,)`` booleans.

    :raises ValueError: if it does not broadcast to the observed site's shape, or, after
        that, has no ``True`` entry.
    """
    full_shape = tuple(observed.full_shape)
    try:
        ok = torch.broadcast_shapes(missing.shape, full_shape) == torch.Size(full_shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"missing has shape {tuple(missing.shape)}, which does not broadcast to the shape "
            f"{full_shape} of the observed site {observed.name!r}. Pass a boolean tensor of "
            f"the data's shape (or one that broadcasts to it, e.g. one row of features)."
        )
    if not bool(missing.any()):
        raise ValueError(
            f"missing has no True entry (shape {tuple(missing.shape)}): nothing to impute. "
            f"Set missing[i, j] = True at each entry of the data to draw."
        )
    return flatten_tail(missing.expand(full_shape), observed.num_feature_dims)
