"""The observed site of a model run: its observations with the features flattened, which
entries count (masks, ``obs_mask``), its scale, and the checks ``log_prob`` would make
(dtype; NaN and support while Pyro's validation is enabled); and the check that a later run
of a model read before still matches the read around that site (:func:`check_run_matches`)."""

import math
from typing import NamedTuple

import torch
from pyro.distributions import Unit
from pyro.infer.util import is_validation_enabled
from torch.distributions import constraints

from pyro_mpt.errors import StaleStructureError
from pyro_mpt.trace.structure_checks import scale_mismatch
from pyro_mpt.trace.trace_utils import flatten_tail, unwrap_independent

__all__ = [
    "ObservedSite",
    "check_run_matches",
    "read_observed_site",
    "site_scale",
]


class ObservedSite(NamedTuple):
    """The observed site of a model, its features flattened.

    :ivar str name: the site's name.
    :ivar torch.Tensor value: observations ``batch_shape + (D,)``; missing entries are 0.
    :ivar torch.Size batch_shape: the shape of the batch of observations.
    :ivar int num_feature_dims: how many rightmost dims of the site value are features.
    :ivar entries: boolean ``batch_shape + (D,)``, ``True`` at entries that count, or
        ``None`` when every entry does.
    :ivar torch.Size full_shape: the site distribution's batch and event shape.
    :ivar unfilled: the value as the model gave it, in its own dtype and with missing
        entries included (NaN allowed), or ``None`` where that is ``value``: what generation
        returns at the entries it does not draw.
    """

    name: str
    value: torch.Tensor
    batch_shape: torch.Size
    num_feature_dims: int
    entries: torch.Tensor | None = None
    full_shape: torch.Size = torch.Size()
    unfilled: torch.Tensor | None = None

    @property
    def num_features(self):
        """``D``, the number of features of one observation."""
        return self.value.shape[-1]

    def feature_counts(self):
        """How many entries of each observation count, ``batch_shape`` (a float tensor)."""
        if self.entries is None:
            return self.value.new_full(self.batch_shape, float(self.num_features))
        return self.entries.sum(-1).to(self.value.dtype)


def _entry_mask(name, mask, inner, event_shape, full_shape, num_feature_dims):
    """The site's ``mask`` combined with the mask ``inner`` of ``.mask(...)`` wrappers of its
    distribution, as booleans ``batch + (D,)``; ``None`` when every entry counts."""
    if inner is not None and inner.dim() > len(full_shape):
        inner = inner.reshape((-1,) + tuple(full_shape))[0]  # leading dims of points
    if mask is None or mask is True:
        mask = torch.ones((), dtype=torch.bool)
    elif mask is False:
        mask = torch.zeros((), dtype=torch.bool)
    mask = torch.as_tensor(mask, dtype=torch.bool)
    batch_shape = full_shape[: len(full_shape) - len(event_shape)]
    try:
        torch.broadcast_shapes(mask.shape, batch_shape)
    except RuntimeError:
        raise ValueError(
            f"Observed site {name!r} has a mask of shape {tuple(mask.shape)} (poutine.mask or "
            f"pyro.sample(..., mask=...)), which does not broadcast to its batch shape "
            f"{tuple(batch_shape)}: such a mask counts or drops whole events, here of shape "
            f"{tuple(event_shape)}. To mark single entries missing, pass obs_mask=..., or mask "
            f"the distribution before making the features an event: "
            f"dist.Normal(loc, scale).mask(observed).to_event({len(event_shape)})."
        ) from None
    mask = mask.reshape(mask.shape + (1,) * len(event_shape))
    mask = mask.reshape(mask.shape[max(0, mask.dim() - len(full_shape)) :]).expand(full_shape)
    if inner is not None:
        mask = mask & inner
    mask = flatten_tail(mask, num_feature_dims)
    return None if bool(mask.all()) else mask


def read_observed_site(site, full_shape, num_batch, checked=False):
    """The :class:`ObservedSite` of ``site``, whose distribution has the batch and event
    shape ``full_shape`` (after any leading dims of points or samples), of which the first
    ``num_batch`` index observations. With ``checked`` (a later run of a model whose
    structure was read from data of the same shape and dtype), the dtype and shape are
    checked again only while Pyro's validation is enabled. Floating data are computed in
    the dtype of the distribution's parameters in this run: a model whose parameters were
    made float64 since the first read computes in float64."""
    name, fn, raw = site["name"], site["fn"], site["value"]
    validate = is_validation_enabled()
    if not (checked or validate):
        _check_observed(name, raw, fn, full_shape)  # under validation: below, with its data
    batch_shape, num_feature_dims = full_shape[:num_batch], len(full_shape) - num_batch
    # The features flattened into one dim (a new one for a site with none).
    num_features = math.prod(full_shape[num_batch:])
    try:
        value = given = raw.expand(full_shape).reshape(batch_shape + (num_features,))
    except (AttributeError, RuntimeError):
        _check_observed(name, raw, fn, full_shape)  # says what is wrong with it
        raise
    base, inner = unwrap_independent(fn, with_mask=True)  # inner: from .mask(...) on fn
    if value.is_floating_point():
        # Trace_ELBO accepts float64 data in a float32 model by promotion; the conditionals
        # are computed in the model's dtype: that of its first floating parameter.
        for key in base.arg_constraints:
            param = base.__dict__.get(key)
            if torch.is_tensor(param) and param.is_floating_point():
                value = value.to(param.dtype)
                break
    mask = site["mask"]
    entries = None
    if not (mask is None or mask is True) or inner is not None:
        entries = _entry_mask(name, mask, inner, fn.event_shape, full_shape, num_feature_dims)
    # The data checks read the data back (a device synchronisation): like Pyro's own checks
    # of observations, they run while validation is enabled (the default).
    if validate:
        _check_observed(name, raw, fn, full_shape, value, entries)
    if entries is not None:
        value = _fill_missing(value, entries)
    unfilled = None if value is given else given
    return ObservedSite(name, value, batch_shape, num_feature_dims, entries, full_shape, unfilled)


#: What to do about each kind of non-finite observed value (see :func:`_check_observed`).
_NON_FINITE_FIXES = {
    "infinite": (
        ": no likelihood gives them a finite density, and the loss and every parameter "
        "would turn NaN. Clip or drop them, or mark them missing (pyro.sample(..., obs=x, "
        "obs_mask=torch.isfinite(x))). To impute them, pass torch.nan_to_num(x, posinf=0, "
        "neginf=0) with missing=~torch.isfinite(x): impute's missing entries are ignored but "
        "must be valid for the likelihood."
    ),
    "NaN": (
        ". Mark missing entries with a mask (pyro.sample(..., obs=x, "
        "obs_mask=~torch.isnan(x)), or poutine.mask(mask=...)): MPTLoss then scores the "
        "observed entries only. To impute NaN entries of a model without such a mask, pass "
        "torch.nan_to_num(x) with missing=torch.isnan(x)."
    ),
}


def _check_observed(name, raw, fn, full_shape, value=None, entries=None):
    """Raises for an observed value ``raw`` that is not a tensor, holds integers under a
    continuous likelihood (or booleans, or integers under a Bernoulli), or does not
    broadcast to the distribution's shape ``full_shape``. Given ``value`` (``raw`` with its
    features flattened) and the ``entries`` that count, also raises ``ValueError`` for an
    infinite or NaN entry, or one outside the support of ``fn`` when that support does not
    depend on the distribution's parameters: a read of the device per check."""
    if not torch.is_tensor(raw):
        kind = type(raw).__module__ + "." + type(raw).__name__
        raise TypeError(
            f"Observed site {name!r} holds a {kind}, not a torch.Tensor. Convert the data "
            f"first, e.g. x = torch.as_tensor(x, dtype=torch.float32)."
        )
    base = unwrap_independent(fn)
    discrete = getattr(base.support, "is_discrete", False)
    family = type(base).__name__
    if raw.dtype == torch.bool or (
        isinstance(base, torch.distributions.Bernoulli) and not raw.is_floating_point()
    ):
        # Bernoulli's log-density (and others' under bool) does float arithmetic on the
        # value: torch fails with a casting error of its own.
        raise TypeError(
            f"Observed site {name!r} holds {raw.dtype} data under a {family} likelihood, "
            f"which scores floats (0. and 1. for a Bernoulli). Convert it, e.g. x = x.float()."
        )
    if not raw.is_floating_point() and not discrete:
        raise TypeError(
            f"Observed site {name!r} holds integer data ({raw.dtype}) under a continuous "
            f"{family} likelihood. Convert it to floats, e.g. "
            f"x = x.float()."
        )
    shape = raw.shape
    broadcasts = len(shape) <= len(full_shape)
    for size, target in zip(reversed(shape), reversed(full_shape)):
        broadcasts = broadcasts and size in (1, target)
    if not broadcasts:
        raise ValueError(
            f"Observed site {name!r} has a value of shape {tuple(shape)} that "
            f"does not broadcast to its distribution's shape {tuple(full_shape)}. In a "
            f"subsampled plate, observe the subsample: obs=pyro.subsample(x, "
            f"event_dim=...) or x[ind] with the plate's indices."
        )
    if value is None:
        return
    if value.is_floating_point():
        finite = torch.isfinite(value)
        if not bool((finite if entries is None else finite | ~entries).all()):
            for kind, stray in (("infinite", torch.isinf(value)), ("NaN", torch.isnan(value))):
                if entries is not None:
                    stray = stray & entries
                if bool(stray.any()):
                    raise ValueError(
                        f"Observed site {name!r} contains {int(stray.sum())} {kind} values "
                        f"out of {value.numel()} among the entries that count"
                        f"{_NON_FINITE_FIXES[kind]}"
                    )
    # A real support holds every finite value: the check above covers it. Whole events'
    # supports are not checked here.
    if base.support is constraints.real or base.event_shape:
        return
    # Boolean tests are slow on CPUs: the common binary support is checked by arithmetic.
    if base.support is constraints.boolean and not bool((value * (1 - value)).any()):
        return
    try:
        inside = base.support.check(value)
    except (NotImplementedError, RuntimeError, TypeError):
        return
    if inside.shape != value.shape:
        return
    if entries is not None:
        inside = inside | ~entries
    if bool(inside.all()):
        return
    outside = value[~inside]
    raise ValueError(
        f"Observed site {name!r} has {outside.numel()} values outside the support "
        f"{base.support} of its {family} likelihood, e.g. {outside[0].item()!r}. "
        f"Bring the data into the support (binary images: binarise them, e.g. "
        f"(x > 0.5).float()), or choose a likelihood that covers it; "
        f"pyro.enable_validation(False) skips this check."
    )


def _fill_missing(value, entries):
    """Missing entries are never scored, but every likelihood is evaluated on them: each
    gets an observed value of the same feature (any observed value if the feature has none),
    which lies in the likelihood's support, so no log-probability or gradient is NaN."""
    flat_value, flat_entries = (
        value.reshape(-1, value.shape[-1]),
        entries.reshape(-1, value.shape[-1]),
    )
    if not bool(flat_entries.any()):
        return torch.zeros_like(value)
    first = flat_entries.to(torch.uint8).argmax(0)  # first observed row of each feature
    filler = flat_value.gather(0, first.unsqueeze(0)).squeeze(0)
    anywhere = flat_value[flat_entries][0]
    filler = torch.where(flat_entries.any(0), filler, anywhere)
    return torch.where(entries, value, filler)


def site_scale(site, batch_shape, num_feature_dims=0):
    """The site's scale per observation; it may not vary across features. A scale laid out
    over the ``num_feature_dims`` feature dims too (``poutine.scale`` with a scale of shape
    ``(N, 1)`` around a feature plate) counts when it is constant along them: of size one
    there, or broadcast."""
    scale = site["scale"]
    if not torch.is_tensor(scale):
        return float(scale)
    if num_feature_dims and scale.dim() > len(batch_shape):
        padded = scale.reshape((1,) * max(0, num_feature_dims - scale.dim()) + scale.shape)
        for dim in range(padded.dim() - num_feature_dims, padded.dim()):
            if padded.stride(dim) == 0:  # broadcast along a feature dim: one value
                padded = padded.narrow(dim, 0, 1)
        if all(size == 1 for size in padded.shape[padded.dim() - num_feature_dims :]):
            scale = padded.reshape(padded.shape[: padded.dim() - num_feature_dims])
    try:
        return torch.broadcast_to(scale, batch_shape)
    except RuntimeError:
        raise ValueError(
            f"Site {site['name']!r} has a scale of shape {tuple(scale.shape)} that varies "
            f"across the features of an observation; MPTLoss supports one scale per "
            f"observation (shape broadcastable to {tuple(batch_shape)})."
        ) from None


def check_run_matches(structure, trace, scale):
    """Checks a later run of a model whose structure was read before (the next call with the
    same argument shapes), around its observed site of scale ``scale`` in this run:

    * the ``pyro.factor`` sites are those of the read; one that came or went means the model
      changed under the same shapes (:class:`~pyro_mpt.errors.StaleStructureError`: the
      caller reads it afresh);
    * every latent is scaled like the observation (annealing may change both, not one
      alone): ``ValueError`` as on the first read. Tensor scales are compared by value, a
      read of the device, while Pyro's validation is enabled; with it off, a scale that
      became a tensor or a number since the read (``poutine.scale`` added or removed around
      one site) is a :class:`~pyro_mpt.errors.StaleStructureError`, so the read afresh
      compares the scales by value.
    """
    factors = []
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and site["is_observed"] and isinstance(site["fn"], Unit):
            factors.append(name)
    if factors != list(structure.factor_names):
        raise StaleStructureError(
            f"The model's pyro.factor sites are {factors} on this run and were "
            f"{list(structure.factor_names)} when it was read: the model is read again."
        )
    validate = is_validation_enabled()
    read = structure.trace.nodes
    for name in structure.latent_names:
        latent_scale = trace.nodes[name]["scale"]
        if not torch.is_tensor(latent_scale) and not torch.is_tensor(scale):
            same = float(latent_scale) == scale
        elif validate:
            latent_scale, scale_now = torch.as_tensor(latent_scale), torch.as_tensor(scale)
            if latent_scale.dim() and scale_now.dim() and latent_scale.shape != scale_now.shape:
                continue  # laid out differently: the first read compared them per observation
            same = bool((latent_scale == scale_now).all())
        elif torch.is_tensor(latent_scale) != torch.is_tensor(read[name]["scale"]) or (
            torch.is_tensor(scale) != torch.is_tensor(structure.scale)
        ):
            raise StaleStructureError(
                f"The scales of sites {name!r} and {structure.observed.name!r} changed kind "
                f"(a number or a tensor) since the model was read: the model is read again."
            )
        else:
            continue
        if not same:
            raise scale_mismatch(name, structure.observed.name)
