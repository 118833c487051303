"""What one trace of a Pyro model says about it: the observed site, the local latents and
the plates that index observations.

Every strategy starts here. The rules follow Pyro's semantics: ``pyro.deterministic`` sites
(and the ``Delta`` sites reparameterisers leave) are ignored; ``pyro.factor`` sites are kept
aside (a factor that does not depend on the local latents is added to the loss, as
``Trace_ELBO`` adds it); masks mark entries that do not count
(:mod:`pyro_mpt.trace.observed_site`); latents must count and be scaled wherever their
observation does.
"""

import contextlib
import math
from typing import NamedTuple

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.poutine.util import site_is_subsample

from pyro_mpt.trace.observed_site import (
    ObservedSite,
    read_observed_site,
    site_scale,
)
from pyro_mpt.trace.structure_checks import check_latent_effects, check_plates_cover_batch
from pyro_mpt.trace.trace_utils import plate_frames, unwrap_independent

__all__ = [
    "LatentSite",
    "ModelStructure",
    "PointLayout",
    "enumerable_values",
    "latent_names_in",
    "observed_names_in",
    "points_dtype",
    "read_structure",
    "shared_reads",
]


class LatentSite(NamedTuple):
    """A local latent site.

    :ivar str name: the site's name.
    :ivar int size: how many scalar coordinates it has per observation.
    :ivar int num_batch_dims: how many leading dims of its value index observations.
    :ivar num_values: for a discrete latent whose every coordinate takes one of finitely
        many values (``Categorical``, ``Bernoulli``, ``Binomial``: an enumerable support
        and scalar events), how many; None otherwise. Quadrature sums such a latent out
        exactly, over every value.
    """

    name: str
    size: int
    num_batch_dims: int
    num_values: int | None = None


class ModelStructure(NamedTuple):
    """What one trace says about a model with local latents.

    :ivar trace: the model trace.
    :ivar ObservedSite observed: the observed site.
    :ivar scale: log-probability scale per observation (a float or a ``batch_shape`` tensor).
    :ivar tuple latents: the :class:`LatentSite` s, in execution order.
    :ivar list data_dims: the batch dims of the plates that index observations.
    :ivar int max_plate_nesting: plate nesting of the model.
    :ivar tuple factor_names: the ``pyro.factor`` sites.
    :ivar tuple missing_names: sites that sample the missing part of the observation
        (``obs_mask``); they are not latents.
    :ivar PointLayout point_layout: how runs at points lay out the observations, decided
        on the first such run (:func:`~pyro_mpt.trace.whitened_latents.run_at_points`).
    :ivar tuple latent_names: the names of the :attr:`latents`.
    :ivar int latent_dim: ``K``, the number of scalar latent coordinates per observation.
    """

    trace: object
    observed: ObservedSite
    scale: object
    latents: tuple
    data_dims: list
    max_plate_nesting: int
    factor_names: tuple = ()
    missing_names: tuple = ()
    point_layout: "PointLayout | None" = None
    # Read on every step: worked out once, when the structure is read.
    latent_names: tuple = ()
    latent_dim: int = 0


class PointLayout:
    """Whether a run at points shared by every observation may keep the observations' dims
    of size one (``shared``), so a decoder runs once per point rather than once per point
    and observation. ``None`` until the first run at points decides it. ``site_shapes``
    keeps what runs at points work out per latent site from shapes alone, so later runs
    look it up."""

    def __init__(self):
        self.shared = None
        self.site_shapes = {}


def points_dtype(structure):
    """The dtype and device of points in the latents' whitened space: those of the first
    continuous latent's value; with discrete latents only (integer values), those of the
    data if floating, else torch's default dtype on the data's device."""
    for latent in structure.latents:
        if latent.num_values is None:
            value = structure.trace.nodes[latent.name]["value"]
            if value.is_floating_point():
                return value.dtype, value.device
    value = structure.observed.value
    dtype = value.dtype if value.is_floating_point() else torch.get_default_dtype()
    return dtype, value.device


def enumerable_values(fn):
    """How many values each coordinate of a latent with prior ``fn`` takes, for a discrete
    prior with an enumerable support and scalar events; None for any other prior."""
    base = unwrap_independent(fn)
    if not (base.support.is_discrete and base.has_enumerate_support) or base.event_shape:
        return None
    try:
        return base.enumerate_support(expand=False).numel()
    except NotImplementedError:  # e.g. a Binomial whose total count differs between rows
        return None


def _is_sample(site):
    return site["type"] == "sample" and not site_is_subsample(site)


def _is_deterministic(site):
    return bool(site["infer"].get("_deterministic"))


def _is_factor(site):
    return site["is_observed"] and isinstance(site["fn"], dist.Unit)


def _is_computed(site):
    """An observed ``Delta`` that a reparameteriser (e.g. ``LocScaleReparam``) leaves in
    place of a latent: its value is a function of other sites, and it scores nothing."""
    fn = unwrap_independent(site["fn"])
    if not (site["is_observed"] and isinstance(fn, dist.Delta)):
        return False
    log_density = fn.log_density
    scored = site["mask"] is not False and not (
        isinstance(site["fn"], dist.MaskedDistribution) and site["fn"]._mask is False
    )
    if scored and torch.is_tensor(log_density) and bool((log_density != 0).any()):
        raise ValueError(
            f"Site {site['name']!r} is a Delta with a log-density (a reparameterised latent "
            f"with a Jacobian); MPTLoss cannot integrate such a latent. Sample the latent "
            f"from its distribution instead."
        )
    return True


def _classify(trace):
    """``(observed, latents, factors, missing)`` site names, in execution order."""
    observed, latents, factors = [], [], []
    for name, site in trace.nodes.items():
        if not _is_sample(site) or _is_deterministic(site) or _is_computed(site):
            continue
        if _is_factor(site):
            factors.append(name)
        elif site["is_observed"]:
            observed.append(name)
        else:
            latents.append(name)
    # obs_mask splits a site "x" into "x_observed" and "x_unobserved", the missing part.
    missing = [
        name
        for name in latents
        if name.endswith("_unobserved") and name[: -len("unobserved")] + "observed" in observed
    ]
    latents = [name for name in latents if name not in missing]
    return observed, latents, factors, missing


def latent_names_in(trace):
    """The names of a model trace's latent sites as :func:`read_structure` reads them: no
    observed, deterministic, reparameterised-``Delta``, factor or ``obs_mask`` sites."""
    return _classify(trace)[1]


def observed_names_in(trace):
    """The names of a model trace's observed sites as :func:`read_structure` reads them: no
    deterministic, reparameterised-``Delta`` or factor sites."""
    return _classify(trace)[0]


def _the_observed_site(trace, names, latent_names, what):
    """The name of the model's one observed site, or an error that says what to change when
    it has none or several."""
    if not names:
        raise ValueError(
            f"{what} found no observed sample site in the model. Pass the data to the "
            f"likelihood, e.g. pyro.sample('x', dist.Normal(loc, scale).to_event(1), obs=x)."
        )
    if len(names) > 1:
        raise _several_observed_sites(trace, names, latent_names, what)
    return names[0]


def _several_observed_sites(trace, names, latent_names, what):
    """The error for a model with several observed sites, naming what really stops it: an
    observed site in fewer plates than another is a global with a value (a latent fixed by
    ``poutine.condition``, or data shared by all observations), not an observation."""
    frames = {name: plate_frames(trace.nodes[name]) for name in names}
    globals_ = [n for n in names if any(frames[n] < frames[m] for m in names)]
    local = [n for n in names if n not in globals_]
    if not globals_:
        # obs_mask splits a site observed in part into "<name>_observed" and the latent
        # "<name>_unobserved": beside another observed site, a latent labelled for some rows.
        partial = [
            n[: -len("_observed")]
            for n in names
            if n.endswith("_observed") and n[: -len("_observed")] + "_unobserved" in trace.nodes
        ]
        if partial:
            verb = "is" if len(partial) == 1 else "are"
            return ValueError(
                f"{what} found {len(names)} observed sites {names}: "
                f"{' and '.join(map(repr, partial))} {verb} observed in part (obs_mask), "
                f"beside the data. A latent known for some observations only "
                f"(the class of a semi-supervised model) is not supported: {what} scores the "
                f"features of one observed site. Score the labelled observations apart: pass "
                f"their labels to the model as an argument, used in place of the pyro.sample "
                f"site (with pyro.factor for the labels' prior log-probability), and the "
                f"unlabelled ones with the site left latent; add the two losses."
            )
        return ValueError(
            f"{what} found {len(names)} observed sites {names}; it scores the features of one "
            f"observed site. Concatenate the observations into one site (pyro.deterministic "
            f"and pyro.factor sites are fine: they are not observations). A latent fixed by "
            f"poutine.condition or pyro.condition counts as observed too: pass its value to "
            f"the model as an argument and use it in place of its pyro.sample site."
        )
    data_frames = frozenset.union(*(frames[n] for n in local))
    plates = sorted(name for name, _ in data_frames) or ["<none>"]
    global_latents = [n for n in latent_names if not plate_frames(trace.nodes[n]) >= data_frames]
    message = (
        f"{what} found {len(names)} observed sites {names}, but {globals_} sit outside the "
        f"plates {plates} of {local}: a global site with a value (a latent fixed by "
        f"poutine.condition, or data shared by all observations) is not an observation. "
        f"{what} scores the features of one observed site per observation and integrates "
        f"local latents only. To fix a global at a value, do not condition on it: pass the "
        f"value to the model (an argument, or pyro.param / PyroParam to learn it) and use it "
        f"in place of its pyro.sample site."
    )
    if global_latents:
        message += (
            f" Latent sites {global_latents} are global too (outside the data plate): make "
            f"them parameters (pyro.param / PyroParam) likewise."
        )
    if len(local) > 1:
        message += f" Then concatenate the per-observation sites {local} into one site."
    return ValueError(message)


def _data_dims(trace, obs_name, latent_names):
    """The dims of the plates shared by the observed site and every local latent."""
    obs_frames = plate_frames(trace.nodes[obs_name])
    if not latent_names:
        return sorted(dim for _, dim in obs_frames)
    shared = {name: plate_frames(trace.nodes[name]) & obs_frames for name in latent_names}
    outside = [name for name, frames in shared.items() if not frames]
    plates = sorted(n for n, _ in obs_frames)
    if outside and not plates:
        raise ValueError(
            f"Observed site {obs_name!r} is in no plate: the conditionals integrate out "
            f"local latents, one set per observation, so the observations need a data plate. "
            f"Wrap the latents and the observed site in pyro.plate('data', x.shape[-2]), with "
            f"x of shape (N, D) (a single observation: x[None], of shape (1, D))."
        )
    if outside:
        raise ValueError(
            f"Latent site {outside[0]!r} is outside the data plate {plates} of observed site "
            f"{obs_name!r}: MPTLoss integrates out local latents, one per observation. Make "
            f"{outside[0]!r} a parameter (pyro.param / PyroParam) or move it inside the data "
            f"plate."
        )
    common = frozenset.intersection(*shared.values())
    if not common:
        described = ", ".join(
            f"{name!r} in {sorted(n for n, _ in frames)}" for name, frames in shared.items()
        )
        raise ValueError(
            f"The latent sites share no plate of observed site {obs_name!r} ({described}). "
            f"MPTLoss integrates out local latents, one set per observation, so every latent "
            f"must sit in the plate that indexes observations; a latent shared by all "
            f"observations (e.g. one per feature) is global: make it a parameter "
            f"(pyro.param / PyroParam)."
        )
    return sorted(dim for _, dim in common)


def _check_feature_plates(trace, obs_name, data_dims, latent_names=()):
    """A plate of the observed site that no latent is in holds features: it must sit right
    of the data plates, whose dims and those left of them index observations. One that
    holds some latents but not others makes those others global across it."""
    frames = plate_frames(trace.nodes[obs_name])
    data = sorted(name for name, dim in frames if dim in data_dims)
    for name, dim in sorted(frames, key=lambda frame: frame[1]):
        if data_dims and dim < max(data_dims) and dim not in data_dims:
            inside = [n for n in latent_names if (name, dim) in plate_frames(trace.nodes[n])]
            if inside:
                outside = [n for n in latent_names if n not in inside]
                raise ValueError(
                    f"Latent sites {outside} are outside plate {name!r} (dim {dim}), which "
                    f"holds latent sites {inside} and observed site {obs_name!r}: each of "
                    f"{outside} is shared by every member of {name!r}, a global latent, which "
                    f"MPTLoss cannot integrate out (it integrates local latents, one set per "
                    f"observation). Make {outside} parameters (pyro.param / PyroParam), or "
                    f"move them inside {name!r}."
                )
            raise ValueError(
                f"Plate {name!r} (dim {dim}) of observed site {obs_name!r} holds no latent "
                f"site and sits left of the data plate {data} (dim {max(data_dims)}). MPTLoss "
                f"reads the dims from the data plate leftwards as indexing observations, so a "
                f"plate over features must sit right of it: give the data plate a dim left of "
                f"{name!r}'s (e.g. dim=-2 and dim=-1), or make the features an event with "
                f".to_event(1). If {name!r} is the plate over observations, the latents in "
                f"{data} only are shared by all of them: global latents, which MPTLoss "
                f"cannot integrate out; make them parameters (pyro.param / PyroParam)."
            )


def _check_latent_plates(trace, obs_name, data_dims, latent_names):
    """A plate that a latent sits in beside the data plates holds the latent's components:
    like a plate over features, it must sit right of the data plates, whose dims and those
    left of them index observations."""
    if not data_dims:
        return
    data = sorted(n for n, dim in plate_frames(trace.nodes[obs_name]) if dim in data_dims)
    for latent in latent_names:
        for name, dim in sorted(plate_frames(trace.nodes[latent]), key=lambda frame: frame[1]):
            if dim < max(data_dims) and dim not in data_dims:
                raise ValueError(
                    f"Latent site {latent!r} sits in plate {name!r} (dim {dim}), left of the "
                    f"data plate {data} (dim {max(data_dims)}), and observed site "
                    f"{obs_name!r} does not. MPTLoss reads the dims from the data plate "
                    f"leftwards as indexing observations, so a plate over a latent's "
                    f"components must sit right of it: put the data plate at dim=-2 and "
                    f"{name!r} at dim=-1 (one dim further left each if the observation has a "
                    f"feature plate), or make {latent!r} a vector with .to_event(1)."
                )


def _observation_dims(site, data_dims):
    """How many leading dims of the site's batch and event shape index observations."""
    fn = site["fn"]
    if not data_dims:
        return 0
    return len(fn.batch_shape) + max(data_dims) + 1


def _max_plate_nesting(trace):
    dims = [
        -frame.dim
        for site in trace.nodes.values()
        for frame in site.get("cond_indep_stack", ())
        if frame.vectorized and frame.dim is not None
    ]
    return max(dims, default=0)


#: While :func:`shared_reads` is active: the structures read in it, by call signature.
_SHARED = None


@contextlib.contextmanager
def shared_reads():
    """Within the block, :func:`read_structure` traces a model once per call signature
    (the model, and its arguments' shapes, or identities for other objects) and every later
    read of it takes that structure: the first call of a loss reads the model in several
    places (its own checks, each strategy it tries) on the same data. Reads made with
    gradients disabled are not shared with reads that need them (a ``pyro.factor``'s
    gradient comes from the trace). Blocks nest; the outermost one holds the record."""
    global _SHARED
    outermost = _SHARED is None
    if outermost:
        _SHARED = {}
    try:
        yield
    finally:
        if outermost:
            _SHARED = None


def read_structure(model, args, kwargs, max_plate_nesting=math.inf, what="pyro_mpt"):
    """Traces ``model`` once and reads off its :class:`ModelStructure` (inside
    :func:`shared_reads`, once per call signature).

    :raises ValueError: for a model with no (or several) observed sites, NaN observations
        outside a mask, a latent site outside the data plate, a batch dim in no plate, or
        inconsistent masks and scales.
    :raises TypeError: for observations that are not a floating tensor where the
        likelihood needs one.
    """
    if _SHARED is None:
        structure = _read_structure(model, args, kwargs, what)
    else:
        from pyro_mpt.trace.remembered_structure import call_signature  # it imports this

        key = call_signature(model, args, kwargs, None)
        grad = torch.is_grad_enabled()
        shared = _SHARED.get(key)
        if shared is None or (grad and not shared[0]):
            shared = _SHARED[key] = (grad, _read_structure(model, args, kwargs, what))
        # Each reader gets a layout of its own, decided on its own first run at points.
        structure = shared[1]._replace(point_layout=PointLayout())
    nesting = structure.max_plate_nesting
    if max_plate_nesting != math.inf:
        if nesting > max_plate_nesting:
            raise ValueError(
                f"The model nests {nesting} plates but max_plate_nesting={max_plate_nesting}; "
                f"raise max_plate_nesting to at least {nesting}, or leave it unset."
            )
        structure = structure._replace(max_plate_nesting=int(max_plate_nesting))
    return structure


def _read_structure(model, args, kwargs, what):
    """:func:`read_structure` with the trace's own plate nesting."""
    trace = poutine.trace(model).get_trace(*args, **kwargs)
    observed_names, latent_names, factors, missing = _classify(trace)
    obs_name = _the_observed_site(trace, observed_names, latent_names, what)
    obs_site = trace.nodes[obs_name]
    for name in [obs_name, *latent_names]:
        check_plates_cover_batch(trace.nodes[name])
    data_dims = _data_dims(trace, obs_name, latent_names)
    _check_feature_plates(trace, obs_name, data_dims, latent_names)
    _check_latent_plates(trace, obs_name, data_dims, latent_names)
    fn = obs_site["fn"]
    num_batch = _observation_dims(obs_site, data_dims) if data_dims else len(fn.batch_shape)
    observed = read_observed_site(obs_site, fn.batch_shape + fn.event_shape, num_batch)
    scale = site_scale(obs_site, observed.batch_shape, observed.num_feature_dims)
    latents = []
    for name in latent_names:
        site = trace.nodes[name]
        full = site["fn"].batch_shape + site["fn"].event_shape
        num_batch = _observation_dims(site, data_dims)
        size = math.prod(full[num_batch:])
        latents.append(LatentSite(name, size, num_batch, enumerable_values(site["fn"])))
    check_latent_effects(trace, latents, observed, scale)
    nesting = _max_plate_nesting(trace)
    return ModelStructure(
        trace,
        observed,
        scale,
        tuple(latents),
        data_dims,
        nesting,
        tuple(factors),
        tuple(missing),
        PointLayout(),
        tuple(latent.name for latent in latents),
        sum(latent.size for latent in latents),
    )
