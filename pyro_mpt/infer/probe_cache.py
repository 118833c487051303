"""One model run per call for strategies that probe the latents at fixed points.

:func:`~pyro_mpt.infer.latent_probe.trace_local_model` runs a model once to read its
structure (observed site, local latents, plates) and
:func:`~pyro_mpt.infer.latent_probe.run_at_latent_points` once more at the probe points.
The structure is the same from one training step to the next, so :class:`ProbeCache`
remembers it after a first call, and later calls with arguments of the same shapes run the
model once: each latent is set to the probe points as it is sampled, from the prior the
model gives it in that very run. A run whose sites or shapes differ from those remembered is
discarded, and the two-run path takes over.
"""

from typing import NamedTuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_mpt.infer.latent_probe import (
    _whitened_prior,
    check_compact_parameters,
    probe_plate,
    probe_value,
)
from pyro_mpt.infer.trace_utils import (
    find_observed_site,
    latent_sites,
    observed_site,
    site_scale,
)

__all__ = ["ProbeCache", "ProbedModel", "call_key", "random_state", "restore_random_state"]


class ProbedModel(NamedTuple):
    """A model run at probe points.

    :ivar ObservedSite observed: the observations.
    :ivar scale: log-probability scale per observation.
    :ivar fn: the observed site's distribution, with a leading probe dim.
    :ivar value: the observed site's value, as the model gave it.
    :ivar tuple latent_names: the latent sites set to the points.
    """

    observed: object
    scale: object
    fn: object
    value: torch.Tensor
    latent_names: tuple


class _Structure(NamedTuple):
    observed_name: str
    latent_names: tuple
    num_batch_dims: tuple
    full_shape: torch.Size  # the observed distribution's batch + event shape
    batch_shape: torch.Size
    max_plate_nesting: int
    dtype: torch.dtype  # of the latent priors
    device: torch.device
    latent_dim: int


def call_key(model, args, kwargs, max_plate_nesting):
    """What must not change between calls for a remembered structure to apply: the model
    (a function, or a method and its object) and the shapes of its tensor arguments. Only
    ``id`` s are kept, not the objects; a stale match is caught by the run's own checks."""

    def describe(value):
        if torch.is_tensor(value):
            return ("tensor", tuple(value.shape), value.dtype, value.device)
        return ("object", id(value))

    return (
        id(getattr(model, "__func__", model)),
        id(getattr(model, "__self__", None)),
        tuple(describe(a) for a in args),
        tuple(sorted((k, describe(v)) for k, v in kwargs.items())),
        max_plate_nesting,
    )


def random_state():
    """The state of torch's random number generators (CPU, and CUDA once initialised)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def restore_random_state(state):
    """Puts back a state from :func:`random_state`."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class _Mismatch(Exception):
    """The run does not follow the remembered structure."""


class _LatentsAtPoints(Messenger):
    """Sets each remembered latent, as it is sampled, to whitened ``points`` ``(Q, K)``
    under the prior the site carries."""

    def __init__(self, structure, points):
        super().__init__()
        self.structure = structure
        self.points = points
        self.sampled = []
        self.offset = 0

    def _pyro_sample(self, msg):
        if msg["is_observed"] or site_is_subsample(msg):
            return
        names = self.structure.latent_names
        position = len(self.sampled)
        if position >= len(names) or msg["name"] != names[position]:
            raise _Mismatch
        num_batch = self.structure.num_batch_dims[position]
        mean, scale_fn = _whitened_prior(msg, msg["name"], num_batch)
        if mean.dtype != self.structure.dtype:
            raise _Mismatch
        size = mean.shape[-1]
        u = self.points[..., self.offset : self.offset + size]
        self.offset += size
        if self.offset > self.points.shape[-1]:
            raise _Mismatch
        # Draw what the model's own sample would, and discard it: a seeded call then uses
        # the same random numbers (masks, subsamples) whether or not the structure was
        # remembered.
        msg["fn"](*msg["args"], **msg["kwargs"])
        msg["value"] = probe_value(
            msg, num_batch, mean, scale_fn, u, self.structure.max_plate_nesting
        )
        msg["done"] = True
        self.sampled.append(msg["name"])


class ProbeCache:
    """Remembers the structure of the model a strategy probes, so that calls after the
    first run the model once.

    :meth:`run` returns ``None`` when nothing applicable is remembered; the caller then
    takes the two-run path and calls :meth:`remember`.
    """

    def __init__(self):
        self._key = None
        self._structure = None

    def remember(self, model, args, kwargs, max_plate_nesting, local, priors):
        """Keeps the structure read by
        :func:`~pyro_mpt.infer.latent_probe.trace_local_model` and
        :func:`~pyro_mpt.infer.latent_probe.whitened_priors`."""
        site = local.trace.nodes[local.observed.name]
        self._key = call_key(model, args, kwargs, max_plate_nesting)
        self._structure = _Structure(
            observed_name=local.observed.name,
            latent_names=tuple(local.latent_names),
            num_batch_dims=tuple(p.num_batch_dims for p in priors),
            full_shape=site["fn"].batch_shape + site["fn"].event_shape,
            batch_shape=local.observed.batch_shape,
            max_plate_nesting=local.max_plate_nesting,
            dtype=priors[0].mean.dtype,
            device=priors[0].mean.device,
            latent_dim=sum(p.mean.shape[-1] for p in priors),
        )

    def forget(self):
        """Drops the remembered structure: the next call takes the two-run path."""
        self._key = self._structure = None

    def latents_for(self, model, args, kwargs, max_plate_nesting):
        """``(K, dtype, device)`` of the remembered latents when they apply to this call,
        else ``None``."""
        if self._key is None or self._key != call_key(model, args, kwargs, max_plate_nesting):
            return None
        structure = self._structure
        return structure.latent_dim, structure.dtype, structure.device

    def run(self, model, args, kwargs, points):
        """Runs ``model`` once with its latents at whitened ``points`` ``(Q, K)``, shared by
        every observation (call :meth:`latents_for` first).

        :returns: a :class:`ProbedModel`, or ``None`` (and the structure is forgotten) when
            the run does not follow the remembered structure.
        """
        structure = self._structure
        latents = _LatentsAtPoints(structure, points)
        state = random_state()
        try:
            # As in the two-run path's probe, distributions at the points go unvalidated (it
            # would cost as much as the run); the first call validated the model.
            plate = probe_plate(points.shape[0], structure.max_plate_nesting)
            with plate, pyro.validation_enabled(False):
                trace = poutine.trace(latents(model)).get_trace(*args, **kwargs)
            name = find_observed_site(trace)
            site = trace.nodes[name]
            fn = site["fn"]
            expected = (points.shape[0],) + (1,) * (
                len(fn.batch_shape) - 1 - len(structure.full_shape) + len(fn.event_shape)
            )
            if (
                name != structure.observed_name
                or tuple(latent_sites(trace)) != structure.latent_names
                or latents.sampled != list(structure.latent_names)
                or latents.offset != points.shape[-1]
                or fn.batch_shape + fn.event_shape != expected + structure.full_shape
            ):
                raise _Mismatch
            observed = observed_site(
                name, site["value"], structure.full_shape, structure.batch_shape, fn
            )
            check_compact_parameters(fn, observed)
        except Exception:
            # Whatever went wrong, the two-run path will meet it again and report it, from
            # the same random state.
            restore_random_state(state)
            self.forget()
            return None
        scale = site_scale(site, structure.batch_shape)
        return ProbedModel(observed, scale, fn, site["value"], structure.latent_names)
