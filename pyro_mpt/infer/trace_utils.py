"""Small helpers for reading Pyro traces and the observations in them."""

import contextlib
from typing import NamedTuple

import pyro
import torch
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import site_is_subsample
from torch.distributions import constraints

__all__ = [
    "ObservedSite",
    "find_observed_site",
    "flatten_tail",
    "latent_sites",
    "observation_shape",
    "observed_site",
    "param_store_rollback",
    "plate_frames",
    "site_scale",
    "unwrap_independent",
]


class ObservedSite(NamedTuple):
    """The observed site of a model trace, with its features flattened.

    :ivar str name: the site's name.
    :ivar torch.Tensor value: observations of shape ``batch_shape + (D,)``.
    :ivar torch.Size batch_shape: the shape of the batch of observations.
    :ivar int num_feature_dims: how many rightmost dims of the site value are features.
    """

    name: str
    value: torch.Tensor
    batch_shape: torch.Size
    num_feature_dims: int


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


def find_observed_site(trace, what="MPTLoss"):
    """The single observed sample site of a model trace.

    :raises ValueError: if the model has no observed site, or more than one.
    """
    observed = [
        name for name, site in trace.nodes.items() if _is_sample(site) and site["is_observed"]
    ]
    if not observed:
        raise ValueError(
            f"{what} found no observed sample site in the model. Pass the data to the "
            f"likelihood, e.g. pyro.sample('x', dist.Normal(loc, scale).to_event(1), obs=x)."
        )
    if len(observed) > 1:
        raise ValueError(
            f"{what} found {len(observed)} observed sites {observed}; it scores the features "
            f"of one observed site. Concatenate the observations into one site."
        )
    return observed[0]


def observation_shape(site, data_dims):
    """Splits a site's full shape into ``(batch_shape, num_feature_dims)``.

    :param dict site: a trace site.
    :param data_dims: the (negative) batch dims of the plates that index observations.
    :returns: the batch shape (every dim up to the rightmost data plate) and the number of
        feature dims to its right (inner plates and event dims).
    """
    fn = site["fn"]
    full_shape = fn.batch_shape + fn.event_shape
    if not data_dims:
        return fn.batch_shape, len(fn.event_shape)
    rightmost = max(data_dims)
    num_batch = len(fn.batch_shape) + rightmost + 1
    return full_shape[:num_batch], len(full_shape) - num_batch


def site_scale(site, batch_shape):
    """The site's log-probability scale (plate subsampling, ``poutine.scale``) per observation.

    :raises ValueError: if the scale varies across the features of an observation.
    """
    scale = site["scale"]
    if not torch.is_tensor(scale):
        return float(scale)
    try:
        return torch.broadcast_to(scale, batch_shape)
    except RuntimeError:
        raise ValueError(
            f"Site {site['name']!r} has a scale of shape {tuple(scale.shape)} that varies "
            f"across the features of an observation; MPTLoss supports one scale per "
            f"observation (shape broadcastable to {tuple(batch_shape)})."
        ) from None


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


def observed_site(name, value, full_shape, batch_shape, fn=None):
    """The :class:`ObservedSite` of observations ``value`` (broadcast to ``full_shape``, the
    distribution's batch and event shape) whose first dims ``batch_shape`` index
    observations.

    :param fn: the site's distribution; with Pyro's validation on, every observation must
        lie in its support, as ``log_prob`` would demand.
    :raises ValueError: for NaN observations, or observations outside the support.
    """
    value = value.expand(full_shape)
    # One isnan pass is cheap next to the model run, so it is always made.
    num_nan = int(torch.isnan(value).sum())
    if num_nan:
        raise ValueError(
            f"Observed site {name!r} contains {num_nan} NaN values out of "
            f"{value.numel()}. MPTLoss scores every observed feature; drop the "
            f"observations with missing features or impute them before training."
        )
    if fn is not None and is_validation_enabled():
        _check_support(name, unwrap_independent(fn), value)
    num_feature_dims = len(full_shape) - len(batch_shape)
    return ObservedSite(name, flatten_tail(value, num_feature_dims), batch_shape, num_feature_dims)


def _check_support(name, fn, value):
    """Raises ``ValueError`` for observations outside the support of ``fn``, when the support
    does not depend on the distribution's parameters."""
    # Boolean tests are slow on CPUs: the two common supports are checked by arithmetic
    # first (NaN was ruled out), the exact test runs only if that fails.
    if fn.support is constraints.real and bool(torch.isfinite(value.sum())):
        return
    if fn.support is constraints.boolean and not bool((value * (1 - value)).any()):
        return
    try:
        inside = fn.support.check(value)
    except (NotImplementedError, RuntimeError):
        return
    if inside.shape != value.shape or bool(inside.all()):
        return
    outside = value[~inside]
    raise ValueError(
        f"Observed site {name!r} has {outside.numel()} values outside the support "
        f"{fn.support} of its {type(fn).__name__} likelihood, e.g. {outside[0].item()!r}. "
        f"Bring the data into the support (binary images: binarise them, e.g. "
        f"(x > 0.5).float()), or choose a likelihood that covers it; "
        f"pyro.enable_validation(False) skips this check."
    )
