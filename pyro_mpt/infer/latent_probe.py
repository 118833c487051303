"""Runs a Pyro model with its local latents set to chosen points.

Strategies that integrate the local latents out (exact Gaussian conditioning, quadrature)
need the likelihood of every observation at a set of latent values. :func:`trace_local_model`
reads the model's structure off one trace (the observed site, the local latents in the data
plate, their Gaussian priors in whitened form), and :func:`run_at_latent_points` runs the
model once more inside an extra plate over ``Q`` points ``u`` of the whitened latent space
(``z = mean + L u`` for a prior ``N(mean, L L^T)``), returning the observed site's
distribution with a leading dim of size ``Q``. Gradients flow from it to every parameter the
model uses.

Latents whose prior is the same for every observation are probed once rather than ``N``
times (batch dims of size 1); a model that indexes its latents per observation falls back to
full-size probe values.
"""

import math
from typing import NamedTuple

import pyro
import pyro.poutine as poutine
import torch

from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.trace_utils import (
    ObservedSite,
    find_observed_site,
    flatten_tail,
    latent_sites,
    observation_shape,
    observed_site,
    plate_frames,
    site_scale,
    unwrap_independent,
)

__all__ = [
    "LatentPrior",
    "LocalModel",
    "check_compact_parameters",
    "compact_parameter",
    "probe_plate",
    "probe_value",
    "run_at_latent_points",
    "trace_local_model",
    "whitened_priors",
]

_PROBE_PLATE = "_mpt_probe"


class LatentPrior(NamedTuple):
    """A local latent site's Gaussian prior in whitened form, ``z = mean + scale_fn(u)``.

    :ivar str name: the site name.
    :ivar dict site: the trace site.
    :ivar int num_batch_dims: how many leading dims of the site index observations.
    :ivar torch.Tensor mean: ``batch + (K_i,)``, batch dims of size 1 where shared.
    :ivar callable scale_fn: maps whitened ``u`` of shape ``(..., K_i)`` to ``z - mean``.
    """

    name: str
    site: dict
    num_batch_dims: int
    mean: torch.Tensor
    scale_fn: object


class LocalModel(NamedTuple):
    """What one trace says about a model with local latents.

    :ivar trace: the model trace.
    :ivar ObservedSite observed: the observed site, features flattened.
    :ivar scale: log-probability scale per observation.
    :ivar list latent_names: the local latent sites, in execution order.
    :ivar list data_dims: the batch dims of the plates that index observations.
    :ivar int max_plate_nesting: plate nesting of the model.
    """

    trace: object
    observed: ObservedSite
    scale: object
    latent_names: list
    data_dims: list
    max_plate_nesting: int


def _max_plate_nesting(trace):
    dims = [
        -frame.dim
        for site in trace.nodes.values()
        for frame in site.get("cond_indep_stack", ())
        if frame.vectorized and frame.dim is not None
    ]
    return max(dims, default=0)


def _observed(trace, name, data_dims):
    site = trace.nodes[name]
    fn = site["fn"]
    batch_shape, _ = observation_shape(site, data_dims)
    return observed_site(name, site["value"], fn.batch_shape + fn.event_shape, batch_shape, fn)


def _data_dims(trace, obs_name, latent_names):
    """Dims of the plates shared by the observed site and every latent site."""
    obs_frames = plate_frames(trace.nodes[obs_name])
    shared = None
    for name in latent_names:
        common = plate_frames(trace.nodes[name]) & obs_frames
        if not common:
            plates = sorted(n for n, _ in obs_frames) or ["<none>"]
            raise ValueError(
                f"Latent site {name!r} is outside the data plate {plates}: MPTLoss integrates "
                f"out local latents, one per observation. Make {name!r} a parameter "
                f"(pyro.param / PyroParam) or move it inside the data plate."
            )
        if shared is not None and common != shared:
            raise NotApplicableError(
                f"Latent sites {latent_names} sit in different plates; exact conditionals "
                f"need every latent in the same data plate."
            )
        shared = common
    return [dim for _, dim in shared] if shared else [dim for _, dim in obs_frames]


def _compact(tensor, num_dims):
    """Narrows each broadcast (stride-0) dim among the leading ``num_dims`` to size 1.

    Parameters that are the same for every observation then stay one copy, and every
    later product is ``N`` times cheaper.
    """
    index = tuple(
        slice(0, 1) if stride == 0 and size > 1 else slice(None)
        for size, stride in zip(tensor.shape[:num_dims], tensor.stride()[:num_dims])
    )
    return tensor[index]


def _unexpanded(tensor, num_dims):
    """The tensor that ``tensor`` was broadcast from, when it is a plain ``expand`` view
    (as plates and ``broadcast_all`` make), left-padded to ``num_dims`` dims.

    Slicing a broadcast view down would make autograd allocate the full broadcast shape in
    the backward pass; taking the view's base keeps the graph small.
    """
    base = tensor._base
    if base is not None and base.dim() <= tensor.dim():
        padded = base.reshape((1,) * (tensor.dim() - base.dim()) + base.shape)
        try:
            same = padded.expand(tensor.shape)
        except RuntimeError:
            same = None
        if (
            same is not None
            and same.stride() == tensor.stride()
            and same.data_ptr() == tensor.data_ptr()
        ):
            tensor = padded
    return tensor.reshape((1,) * (num_dims - tensor.dim()) + tensor.shape)


def _whitened_prior(site, name, num_batch_dims):
    """``(mean, scale_fn)`` with ``z = mean + scale_fn(u)`` for ``u ~ N(0, I)``; the mean has
    shape ``batch + (K,)`` with batch dims of size 1 where the prior is shared."""
    fn = unwrap_independent(site["fn"])
    full = site["fn"].batch_shape + site["fn"].event_shape
    if isinstance(fn, torch.distributions.Normal):
        loc = _compact(fn.loc.expand(full), num_batch_dims)
        scale = _compact(fn.scale.expand(full), num_batch_dims)
        loc, scale = torch.broadcast_tensors(loc, scale)
        flat = loc.shape[:num_batch_dims] + (-1,)
        scale = scale.reshape(flat)
        return loc.reshape(flat), lambda u: scale * u
    if isinstance(fn, torch.distributions.MultivariateNormal) and len(full) == num_batch_dims + 1:
        loc = _compact(fn.loc.expand(full), num_batch_dims)
        tril = _compact(fn.scale_tril.expand(full + full[-1:]), num_batch_dims)
        loc = loc.expand(torch.broadcast_shapes(loc.shape, tril.shape[:-1]))
        return loc, lambda u: (tril @ u.unsqueeze(-1)).squeeze(-1)
    raise NotApplicableError(
        f"Latent site {name!r} has a {type(fn).__name__} prior; exact conditionals need Normal "
        f"or MultivariateNormal latents."
    )


def trace_local_model(model, args, kwargs, max_plate_nesting=math.inf):
    """Traces ``model`` and reads off its observed site and local latents.

    :raises ValueError: for a model with no (or several) observed sites, NaN observations,
        or a latent site outside the data plate.
    """
    trace = poutine.trace(model).get_trace(*args, **kwargs)
    obs_name = find_observed_site(trace)
    latents = latent_sites(trace)
    data_dims = _data_dims(trace, obs_name, latents)
    observed = _observed(trace, obs_name, data_dims)
    scale = site_scale(trace.nodes[obs_name], observed.batch_shape)
    nesting = _max_plate_nesting(trace) if max_plate_nesting == math.inf else max_plate_nesting
    return LocalModel(trace, observed, scale, latents, data_dims, nesting)


def whitened_priors(local):
    """The :class:`LatentPrior` of every local latent.

    :raises NotApplicableError: for a latent whose prior is not Normal or
        MultivariateNormal.
    """
    priors = []
    for name in local.latent_names:
        site = local.trace.nodes[name]
        num_batch = len(observation_shape(site, local.data_dims)[0])
        mean, scale_fn = _whitened_prior(site, name, num_batch)
        priors.append(LatentPrior(name, site, num_batch, mean, scale_fn))
    return priors


def run_at_latent_points(model, args, kwargs, local, priors, points):
    """Runs ``model`` with its latents at whitened ``points`` of shape ``(Q, K)`` (shared by
    every observation) or ``(Q,) + batch + (K,)`` (points per observation).

    :returns: the observed site's distribution, with a leading batch dim of size ``Q``.
    """
    try:
        return _probe(model, args, kwargs, local, priors, points, compact=True)
    except Exception:
        # A model that indexes its latents per observation needs full-size probe values.
        return _probe(model, args, kwargs, local, priors, points, compact=False)


def compact_parameter(param, fn, observed):
    """A likelihood parameter of a probed distribution as ``(Q,) + batch + (D,)``, with
    batch dims of size 1 where it is shared by every observation.

    :raises RuntimeError: if the shape does not broadcast to the observations.
    """
    full = fn.batch_shape + fn.event_shape
    num_lead = len(full) - observed.num_feature_dims
    param = _unexpanded(param, len(full))
    param = _compact(param.expand(param.shape[:num_lead] + full[num_lead:]), num_lead)
    param = flatten_tail(param, observed.num_feature_dims)
    param = param.reshape(param.shape[:1] + param.shape[-1 - len(observed.batch_shape) :])
    target = (param.shape[0],) + observed.batch_shape + observed.value.shape[-1:]
    torch.broadcast_shapes(param.shape, target)
    return param


def probe_value(site, num_batch_dims, mean, scale_fn, u, max_plate_nesting, compact=True):
    """The value of a latent site at whitened points ``u`` inside the probe plate.

    :param dict site: the latent's site (its ``fn`` without the probe dim).
    :param int num_batch_dims: how many leading dims of the site index observations.
    :param mean: the whitened prior's mean (see :class:`LatentPrior`).
    :param scale_fn: the whitened prior's scale map.
    :param u: points ``(Q, K_i)`` shared by every observation, or ``(Q,) + batch + (K_i,)``.
    :param int max_plate_nesting: the model's plate nesting.
    :param bool compact: keep batch dims of size 1 where the points and prior are shared.
    :returns: ``z`` of shape ``(Q,) + pad + batch + event``, ``pad`` up to the plate nesting.
    """
    num_probes, size = u.shape[0], mean.shape[-1]
    if u.dim() == 2:  # the same points for every observation
        u = u.reshape((num_probes,) + (1,) * (mean.dim() - 1) + (size,))
    z = mean + scale_fn(u)  # (Q,) + batch + (K_i,)
    full = site["fn"].batch_shape + site["fn"].event_shape
    batch = z.shape[1 : 1 + num_batch_dims] if compact else full[:num_batch_dims]
    if not compact:
        z = z.expand((num_probes,) + full[:num_batch_dims] + (size,))
    pad = (1,) * (max_plate_nesting - len(site["fn"].batch_shape))
    return z.reshape((num_probes,) + pad + batch + full[num_batch_dims:])


def probe_plate(num_probes, max_plate_nesting):
    """The plate over probe points, left of every plate of the model."""
    return pyro.plate(_PROBE_PLATE, num_probes, dim=-(max_plate_nesting + 1))


def check_compact_parameters(fn, observed):
    """Raises ``RuntimeError`` unless every parameter of the probed ``fn`` broadcasts to the
    observations with batch dims of size 1 kept (see :func:`compact_parameter`)."""
    for param in _distribution_parameters(fn):
        compact_parameter(param, fn, observed)


def _probe(model, args, kwargs, local, priors, points, compact):
    probe_trace, offset = local.trace.copy(), 0
    for prior in priors:
        size = prior.mean.shape[-1]
        u = points[..., offset : offset + size]
        offset += size
        z = probe_value(
            prior.site,
            prior.num_batch_dims,
            prior.mean,
            prior.scale_fn,
            u,
            local.max_plate_nesting,
            compact,
        )
        probe_trace.nodes[prior.name] = dict(prior.site, value=z)
    # The first trace validated the model on the data; checking every distribution again at
    # every point would double the cost of this run.
    with probe_plate(points.shape[0], local.max_plate_nesting), pyro.validation_enabled(False):
        probed = poutine.trace(poutine.replay(model, trace=probe_trace)).get_trace(*args, **kwargs)
    fn = probed.nodes[local.observed.name]["fn"]
    if compact:
        # Check the shapes here so that a model that broke them falls back to full size.
        check_compact_parameters(fn, local.observed)
    return fn


def _distribution_parameters(fn):
    base = unwrap_independent(fn)
    return [
        getattr(base, name)
        for name in ("loc", "scale", "logits", "rate")
        if name in type(base).arg_constraints and torch.is_tensor(getattr(base, name, None))
    ]
