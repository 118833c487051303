"""Small helpers for reading Pyro traces."""

import contextlib

import pyro
import torch
from pyro.poutine.util import site_is_subsample

__all__ = [
    "flatten_tail",
    "latent_sites",
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
    """Strips ``Independent`` wrappers (``.to_event``) from a distribution."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn


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
