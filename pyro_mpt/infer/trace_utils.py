"""Small helpers for reading Pyro traces."""

import contextlib

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.util import site_is_subsample

__all__ = [
    "distribution_mask",
    "flatten_tail",
    "latent_sites",
    "narrow_broadcast_dims",
    "param_store_rollback",
    "plate_frames",
    "unwrap_independent",
]


def plate_frames(site):
    """The vectorized plates a site sits in, as a frozenset of ``(name, dim)`` pairs."""
    return frozenset((f.name, f.dim) for f in site["cond_indep_stack"] if f.vectorized)


def _is_sample(site):
    return site["type"] == "sample" and not site_is_subsample(site)


def latent_sites(trace):
    """Names of the unobserved sample sites of a trace, in execution order."""
    return [
        name for name, site in trace.nodes.items() if _is_sample(site) and not site["is_observed"]
    ]


def unwrap_independent(fn):
    """Strips ``Independent`` (``.to_event``) and ``MaskedDistribution`` (``.mask``) wrappers
    from a distribution."""
    while isinstance(fn, (torch.distributions.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def distribution_mask(fn):
    """The mask of ``.mask(...)`` wrappers of ``fn`` as booleans of its batch and event
    shape, or ``None`` when it has none."""
    full_shape = fn.batch_shape + fn.event_shape
    mask = None
    while isinstance(fn, (torch.distributions.Independent, dist.MaskedDistribution)):
        if isinstance(fn, dist.MaskedDistribution) and fn._mask is not None:
            level = torch.as_tensor(fn._mask, dtype=torch.bool).expand(fn.batch_shape)
            level = level.reshape(level.shape + (1,) * len(fn.event_shape)).expand(full_shape)
            mask = level if mask is None else mask & level
        fn = fn.base_dist
    return mask


@contextlib.contextmanager
def param_store_rollback():
    """Removes parameters that a failing call added to Pyro's param store.

    A call that raises leaves the store as it found it: no half-initialised parameters.
    """
    store = pyro.get_param_store()
    before = set(store.keys())
    try:
        yield
    except BaseException:
        for name in set(store.keys()) - before:
            del store[name]
        raise


def flatten_tail(tensor, num_dims):
    """Merges the rightmost ``num_dims`` dims into one (a new one if ``num_dims == 0``)."""
    if num_dims == 0:
        return tensor.unsqueeze(-1)
    return tensor.reshape(tensor.shape[: tensor.dim() - num_dims] + (-1,))


def narrow_broadcast_dims(tensor, num_dims):
    """``tensor`` with each broadcast (stride-0) dim among its first ``num_dims`` narrowed
    to size one."""
    for dim in range(num_dims):
        if tensor.stride(dim) == 0 and tensor.shape[dim] > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor
