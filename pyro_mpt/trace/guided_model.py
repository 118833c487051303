"""Running a guide on filled copies of the data, and the model against its latents.

Strategies that draw the local latents from an amortized guide (importance sampling,
recursive encoding–decoding) feed the guide a copy of the data with the masked features
replaced, inside two extra plates, one over samples and one over masks, and replay the
model against the guide's latents. The densities read off those runs are in
:mod:`pyro_mpt.trace.guide_densities`; the ``Trace_ELBO``-like comparison of the guide's
sites with the model's is in :mod:`pyro_mpt.trace.guide_site_check`.
"""

import difflib
import inspect
import math
import re
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

from pyro_mpt.errors import NotApplicableError, StaleStructureError, joint_likelihood_error
from pyro_mpt.trace.defensive_proposal import defensive_discrete
from pyro_mpt.trace.guide_densities import joint_latent_owner
from pyro_mpt.trace.guide_site_check import check_event_shapes
from pyro_mpt.trace.model_structure import latent_names_in, read_structure
from pyro_mpt.trace.observed_site import check_run_matches, read_observed_site, site_scale
from pyro_mpt.trace.remembered_structure import call_signature
from pyro_mpt.trace.trace_utils import (
    distribution_mask,
    latent_sites,
    plate_frames,
    same_random_state,
    unwrap_independent,
)
from pyro_mpt.trace.vectorized_run_check import (
    CheckedCalls,
    batch_norm_hint,
    check_guided_run,
    no_feature_dim_advice,
)

__all__ = [
    "GuidedModel",
    "RememberedGuided",
    "describe_guide",
    "observed_site_of_run",
    "prepare_guided",
    "run_guided",
]

_SAMPLE_PLATE = "_mpt_samples"
_MASK_PLATE = "_mpt_masks"

_CONVENTION = (
    "the model and the guide must take the data tensor as their first positional argument, "
    "the guide must compute q(z | x) from the tensor it is given, and both must broadcast "
    "over extra leading dims of it (size plates with x.shape[-2], not x.shape[0])"
)


def _invalid_guide_parameters(guided, data, reason):
    """The error for a guide whose distribution got NaN or infinite parameters from a batch of
    filled copies of the data (torch's ``reason`` names the parameter, not its values)."""
    if not bool(torch.isfinite(data).all()):
        copies = "the copies hold NaN or infinite entries"
    else:
        largest = float(data.abs().max()) if data.numel() else 0.0
        copies = f"the copies are finite, the largest entry {largest:.3g} in size"
    return (
        f"The guide {describe_guide(guided.guide)} gave a distribution NaN or infinite "
        f"parameters on a batch of filled copies of the data, of shape {tuple(data.shape)} "
        f"({copies}): {reason.rstrip(':.')}. A guide run on masked inputs must stay finite on "
        f"every filled copy: encode-decode refills hidden entries with the likelihood's means, "
        f"which a fast-growing link (a Poisson's exp) can make huge, and the guide's own "
        f"computation can overflow on them. Bound what the guide computes from its input "
        f"(e.g. a log1p of counts), or clip it."
    )


def _convention(observed):
    """:data:`_CONVENTION`, for data with no feature dim told how to get one: ``x.shape[-2]``
    then names the wrong dim, and only ``(N, 1)`` data observed with ``.to_event(1)`` work."""
    if observed.num_feature_dims:
        return _CONVENTION
    return f"{_CONVENTION}. {no_feature_dim_advice(observed)}"


class GuidedModel(NamedTuple):
    """A model, its guide and their arguments, checked for running the guide on filled data.

    :ivar ModelStructure local: what one model trace says about the model.
    :ivar torch.Size data_shape: the shape of the data argument ``args[0]``.
    :ivar int num_pad: size-1 dims between the extra plates and the data's batch dims.
    :ivar bool takes_hidden: whether the guide declares a ``hidden`` parameter, and so is
        told which entries of the filled data are hidden (see :func:`run_guided`).
    :ivar remembered: the :class:`RememberedGuided` that handed out this call's model from
        an earlier call's read (see :func:`observed_site_of_run`), or None for a fresh read.
    """

    model: object
    guide: object
    args: tuple
    kwargs: dict
    local: object
    data_shape: torch.Size
    num_pad: int
    takes_hidden: bool = False
    remembered: object = None


def _takes_hidden(guide, args, kwargs):
    """Whether ``guide`` declares a parameter named ``hidden`` that it can be given by
    keyword; ``**kwargs`` does not count. A module's ``forward`` is read, not its
    ``__call__``; bound methods, ``functools.partial`` and wrapped functions are followed.

    :raises ValueError: if the call already gives the guide a ``hidden`` argument.
    """
    target = guide.forward if isinstance(guide, torch.nn.Module) else guide
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    parameter = signature.parameters.get("hidden")
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if parameter is None or parameter.kind not in keyword:
        return False
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return True  # the call does not fit; the guide's own run will say why
    if "hidden" in bound:
        raise ValueError(
            f"The guide {describe_guide(guide)} declares a parameter 'hidden', which is "
            f"reserved for the mask of hidden entries that masked conditionals pass it, but "
            f"the model's arguments already give it one. Rename that argument of the guide "
            f"(and of the model)."
        )
    return True


def describe_guide(guide):
    """A readable name for a guide: a function's qualified name or an object's class."""
    name = getattr(guide, "__qualname__", None)
    return name if isinstance(name, str) else type(guide).__name__


def prepare_guided(model, guide, args, kwargs, max_plate_nesting, what):
    """Checks that ``what`` (a strategy name) applies and returns a :class:`GuidedModel`.

    :raises NotApplicableError: with no guide, no local latents, a likelihood that does
        not factorise over features, a first argument that is not the observed data, or a
        guide that does not sample every local latent or does not broadcast.
    :raises ValueError: for a latent site outside the data plate.
    """
    if guide is None:
        raise NotApplicableError(
            f"{what} draws the local latents from the guide and no guide was given. Pass an "
            f"amortized guide that encodes its data argument (e.g. LinearVAE.guide), or use "
            f"conditionals='exact' or 'quadrature'."
        )
    local = read_structure(model, args, kwargs, max_plate_nesting)
    if not local.latent_names:
        raise NotApplicableError(f"{what} integrates over local latents and the model has none.")
    obs_site = local.trace.nodes[local.observed.name]
    obs_fn = obs_site["fn"]
    base = unwrap_independent(obs_fn)
    if base.event_shape:
        raise joint_likelihood_error(local.observed.name, base, what)
    data = args[0] if args else None
    full_shape = obs_fn.batch_shape + obs_fn.event_shape
    if not torch.is_tensor(data) or data.shape != full_shape:
        got = f"shape {tuple(data.shape)}" if torch.is_tensor(data) else repr(type(data).__name__)
        if torch.is_tensor(data):
            # A tensor of another shape: the model observes a part of it.
            got += "; subsampled data plates are not supported"
        elif not args and kwargs:
            got += f" (the call passes only keywords, {sorted(kwargs)}: pass the data first)"
        raise NotApplicableError(
            f"{what} passes filled copies of the data to the guide, so "
            f"{_convention(local.observed)}. The "
            f"first argument must be the tensor observed at site {local.observed.name!r} "
            f"(shape {tuple(full_shape)}), got {got}."
        )
    num_pad = max(0, local.max_plate_nesting - len(obs_fn.batch_shape))
    guided = GuidedModel(
        model,
        guide,
        tuple(args),
        dict(kwargs),
        local,
        data.shape,
        num_pad,
        takes_hidden=_takes_hidden(guide, args, kwargs),
    )
    if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
        # An autoguide reads the model on its first call: let it do so outside the plates
        # over samples and masks.
        with torch.no_grad(), poutine.block():
            guide(*args, **kwargs)
    if not _PROPOSAL_CHECKED.seen(model, guide, args, kwargs, max_plate_nesting):
        try:
            _check_guide(guided, what)
        except BaseException:
            _PROPOSAL_CHECKED.forget(model, guide, args, kwargs, max_plate_nesting)
            raise
    check_guided_run(guided, what)
    return guided


class RememberedGuided:
    """The :class:`GuidedModel` of the last call a strategy prepared, so that later calls
    with the same model, guide and argument shapes (new data of the same shape: the next
    mini-batch) neither trace the model again nor check the guide again.

    A later call gets the first call's structure with its own arguments and its own
    observed values, read from the data argument (``args[0]``, the tensor the model
    observes, as :func:`prepare_guided` checked); Pyro's validation, when enabled, checks
    them for NaN and support on every call. That holds when the observed site is the data
    argument itself and has no mask, a constant scale and no ``pyro.factor`` beside it;
    any other model is traced afresh on every call, as the structure may follow the data.
    """

    def __init__(self):
        self._signature = None
        self._guided = None
        self._guide = None

    def get(self, model, guide, args, kwargs, max_plate_nesting, what, signature=None):
        """``(guided, fresh)``: the :class:`GuidedModel` of this call (see
        :func:`prepare_guided`, which raises as it does) and whether it was read afresh,
        so that a strategy runs checks of its own on fresh ones only.

        :param signature: ``call_signature(model, args, kwargs, max_plate_nesting)`` when the
            caller has it already (worked out here otherwise).
        """
        if signature is None:
            signature = call_signature(model, args, kwargs, max_plate_nesting)
        # The guide by id, kept alive with what was read from it (no __eq__ on a step).
        signature = (
            signature,
            id(getattr(guide, "__func__", guide)),
            id(getattr(guide, "__self__", None)),
        )
        if signature == self._signature:
            # The caller's equal signature from now on: compared by identity next time.
            self._signature = signature
            return _with_arguments(self._guided, args, kwargs)._replace(remembered=self), False
        self._signature = self._guided = self._guide = None
        # Read without touching the random state: a seeded call draws the same numbers
        # whether or not it read the model.
        with same_random_state():
            guided = prepare_guided(model, guide, args, kwargs, max_plate_nesting, what)
        if _reusable(guided):
            self._signature, self._guided, self._guide = signature, guided, guide
        return guided, True

    def forget(self):
        """Drops the remembered call (one whose strategy's own check failed)."""
        self._signature = self._guided = self._guide = None


def _reusable(guided):
    """Whether later calls may take ``guided``'s structure with their own data argument:
    the observed site's value is that argument's memory, with no mask, a constant scale,
    no ``pyro.factor`` and a support that does not depend on parameters."""
    local = guided.local
    site = local.trace.nodes[local.observed.name]
    value, data = site["value"], guided.args[0]
    return (
        not local.factor_names
        and not local.missing_names
        and local.observed.entries is None
        and not torch.is_tensor(local.scale)
        and site["mask"] is None
        and not torch.distributions.constraints.is_dependent(unwrap_independent(site["fn"]).support)
        and value.shape == data.shape
        and value.stride() == data.stride()
        and value.data_ptr() == data.data_ptr()
    )


def observed_site_of_run(guided, model_trace):
    """The observed site of a run of ``guided``'s model and its scale per observation now,
    which may differ from the first call's (annealing with ``poutine.scale``).

    A model reused from an earlier call's read (``guided.remembered``) was reused because its
    observed site had no mask and it had no ``pyro.factor`` then; a run with either means the
    model changed under the same argument shapes: the read is forgotten and
    :class:`~pyro_mpt.errors.StaleStructureError` raised, so that the caller reads the
    model afresh. So does a run whose latent sites are not those of the read (a latent that
    came or went would be left out of the weights, or missed). Its latents must still be
    scaled like the observation (a tempered likelihood is refused, as on the first read).
    Callers read the site before the latents' densities.
    """
    local = guided.local
    site = model_trace.nodes[local.observed.name]
    scale = site_scale(site, local.observed.batch_shape, local.observed.num_feature_dims)
    if guided.remembered is None:
        return site, scale
    try:
        if site["mask"] is not None or distribution_mask(site["fn"]) is not None:
            raise StaleStructureError(
                f"Observed site {site['name']!r} has a mask on this call that it had not on "
                f"the first call with these argument shapes: the model is read again."
            )
        latents = latent_names_in(model_trace)
        if latents != list(local.latent_names):
            raise StaleStructureError(
                f"The model's latent sites are {latents} on this call and were "
                f"{list(local.latent_names)} on the first call with these argument shapes: "
                f"the model is read again."
            )
        check_run_matches(local, model_trace, scale)
    except StaleStructureError:
        guided.remembered.forget()
        raise
    return site, scale


def _with_arguments(guided, args, kwargs):
    """``guided`` for a call with new arguments of the same shapes: the observed site is
    read from the new data argument."""
    local = guided.local
    site = local.trace.nodes[local.observed.name]
    first = local.observed
    observed = read_observed_site(
        dict(site, value=args[0]), first.full_shape, len(first.batch_shape), checked=True
    )
    return guided._replace(
        args=tuple(args), kwargs=dict(kwargs), local=local._replace(observed=observed)
    )


#: The (model, guide, argument shapes) whose guide has passed :func:`_check_guide`: the
#: check runs the guide, so it runs once per such call, not every step.
_PROPOSAL_CHECKED = CheckedCalls()


def _check_guide(guided, what):
    """The guide runs on filled copies of the data and proposes every local latent from a
    density of its own."""
    local, guide = guided.local, guided.guide
    with torch.no_grad():
        value = local.observed.value
        guide_trace, _ = run_guided(guided, value.expand((2,) + value.shape), 1, False)
    check_event_shapes(guide_trace, local.trace)
    _check_proposal(guide_trace, local, guide, what)
    sampled = set(latent_sites(guide_trace))
    missing = [name for name in local.latent_names if name not in sampled]
    if missing:
        raise NotApplicableError(
            f"{what} draws every local latent from the guide, but guide "
            f"{describe_guide(guide)!r} samples no site {missing}. "
            f"{_misnamed_sites(local, guide_trace, sampled, missing)}"
        )
    _check_proposal_sites(guide_trace, local, guide, what)


def _check_proposal_sites(guide_trace, local, guide, what):
    """Every site the guide samples enters the proposal's density ``q``; the weights are
    right only where each has its match in ``p``. Refused: a point mass among the model's
    latents (an ``AutoDelta`` member of an ``AutoGuideList``: the same value on two
    independent draws), a site of the model that is not one of its local latents (the
    missing part ``x_unobserved`` of an ``obs_mask``), and a site the model lacks unless it
    is the auxiliary that a guide's point masses transform (``AutoNormal``'s
    ``z_unconstrained`` behind its ``Delta`` at ``z``, with the Jacobian as the Delta's
    log-density), or the joint latent of an ``AutoContinuous`` guide. A mixing variable
    (``k ~ Categorical``, then ``z ~ q(z | k)``) would shift every weight by its ``log q``."""
    names, latents = latent_sites(guide_trace), set(local.latent_names)
    transformed = []
    for name in names:
        site = guide_trace.nodes[name]
        if name not in latents or not isinstance(unwrap_independent(site["fn"]), dist.Delta):
            continue
        value = site["value"]
        # Two copies of the data, one draw each: lead dims (1, 2).
        if value.dim() >= 2 and value.shape[1] == 2 and torch.equal(value[:, 0], value[:, 1]):
            raise NotApplicableError(
                f"{what} needs a guide with spread, but guide {describe_guide(guide)} gives "
                f"latent {name!r} the same value on independent draws: a point mass (Delta, "
                f"e.g. an AutoDelta member of an AutoGuideList), which is no proposal "
                f"density. Give it an AutoNormal (or another guide with spread), or use "
                f"conditionals='exact' or 'quadrature'."
            )
        transformed.append(name)
    model_sites = set(latent_sites(local.trace))
    extra = [
        name
        for name in names
        if name not in latents and joint_latent_owner(guide, guide_trace.nodes[name]) is None
    ]
    of_model = [name for name in extra if name in model_sites]
    if of_model:
        raise NotApplicableError(
            f"{what} weights the guide's draws by p(x, z) / q(z) over the model's local "
            f"latents {sorted(latents)}, but guide {describe_guide(guide)} also samples the "
            f"model's sites {of_model} (the missing entries of an obs_mask, which the "
            f"conditionals integrate out themselves): their log q would enter the weights "
            f"with nothing in p to match. Build the guide on the model with them hidden, "
            f"e.g. AutoNormal(poutine.block(model, hide={of_model!r}))."
        )
    auxiliary = all(guide_trace.nodes[n]["infer"].get("is_auxiliary") for n in extra)
    if extra and not (transformed and auxiliary):
        raise NotApplicableError(
            f"{what} weights the guide's draws by p(x, z) / q(z), but guide "
            f"{describe_guide(guide)} also samples {extra}, which the model's local latents "
            f"{sorted(latents)} do not include and which no point mass of the guide "
            f"transforms into them (as AutoNormal's auxiliaries are): their log-density "
            f"would enter q with nothing in p to match it (a mixing variable of the guide "
            f"shifts every weight by its log q). Sample the latents from q(z) directly, or "
            f"remove those sites from the guide."
        )


def _misnamed_sites(local, guide_trace, guide_names, missing):
    """What to do about model latents ``missing`` from the guide, naming the guide's sites
    and the model latent closest to each guide site that the model lacks (an autoguide's
    auxiliaries, such as AutoNormal's ``z_unconstrained``, are not such sites)."""
    latent_names = local.latent_names
    extra = [
        name
        for name in guide_names
        if name not in latent_names and not guide_trace.nodes[name]["infer"].get("is_auxiliary")
    ]
    discrete = [
        latent.name for latent in local.latents if latent.num_values and latent.name in missing
    ]
    enumerated = ""
    if discrete:
        enumerated = (
            f" Discrete latents {discrete} that TraceEnum_ELBO sums out of the model "
            f"(config_enumerate) must be sampled by the guide here, as importance sampling "
            f"draws every latent (e.g. a Categorical site in the guide with learned "
            f"probabilities); 'quadrature' sums them over their values instead, where the "
            f"continuous latents have at most 3 dimensions."
        )
    if not extra:
        return (
            f"Sample them in the guide (an amortized q(z | x)), or use conditionals='exact' "
            f"or 'quadrature'.{enumerated}"
        )
    pairs = []
    for name in extra:
        close = difflib.get_close_matches(name, missing, n=1, cutoff=0.0)
        if close:
            pairs.append(f"the guide samples {name!r}; the model's latent is {close[0]!r}")
    renames = "; ".join(pairs)
    return (
        f"The guide's sites are {sorted(guide_names)} and the model's latents "
        f"{list(latent_names)}: {renames}; rename the guide site to the model's name (a guide "
        f"site of another name is never used as the model's latent).{enumerated}"
    )


def _check_proposal(guide_trace, local, guide, what):
    """The guide must propose each observation's latents from a density of its own: no point
    masses, and no site that draws the latents of all observations jointly."""
    data_frames = {
        frame
        for frame in plate_frames(local.trace.nodes[local.observed.name])
        if frame[1] in local.data_dims
    }
    names = latent_sites(guide_trace)
    if names and all(
        isinstance(unwrap_independent(guide_trace.nodes[n]["fn"]), dist.Delta) for n in names
    ):
        raise NotApplicableError(
            f"{what} needs a guide with spread, but guide {describe_guide(guide)} samples "
            f"site {names[0]!r} from a point mass (Delta, e.g. AutoDelta): it is not a "
            f"proposal density. Use AutoNormal or an amortized encoder, or "
            f"conditionals='exact' or 'quadrature'."
        )
    for name in names:
        site = guide_trace.nodes[name]
        if not data_frames <= plate_frames(site) and joint_latent_owner(guide, site) is None:
            raise NotApplicableError(
                f"{what} weighs each observation's latents by their proposal density, but "
                f"guide {describe_guide(guide)} samples site {name!r} outside the data plate, "
                f"jointly for all observations. Use a guide with one distribution per "
                f"observation (AutoNormal, an amortized encoder) or a Gaussian AutoContinuous "
                f"guide (AutoDiagonalNormal, AutoLowRankMultivariateNormal, "
                f"AutoMultivariateNormal), alone or in an AutoGuideList, whose per-observation "
                f"marginals are used."
            )


def run_guided(
    guided, filled, num_samples, replay_model=True, hidden=None, guide_trace=None, defensive=True
):
    """Runs the guide on filled data and replays the model against its latents.

    **Guides for masked inputs.** Filled data do not say which entries were filled: where 0
    is a legal value, a zero-filled entry looks observed. So a guide that declares a
    parameter named ``hidden`` (``def guide(x, hidden=None)``; ``guided.takes_hidden``) is
    also given ``hidden=``, booleans of the shape of the data argument it gets, ``True`` at
    the entries it must not read (masked, or missing in the model), and can compute
    ``q(z | x_R)`` for any mask (partial-VAE style: the mask beside the filled input). It
    gets all ``False`` when ``hidden`` is None here; ``hidden=None``, as in ordinary
    ``Trace_ELBO`` training, means nothing is hidden. Only an explicitly named parameter
    counts: a guide taking ``**kwargs`` (an autoguide) gets the filled data only.

    :param GuidedModel guided: the checked model and guide.
    :param torch.Tensor filled: data with features flattened, ``lead + batch + (D,)``, with
        ``lead = (P,)`` or ``(S, P)``.
    :param int num_samples: ``S``, the size of the plate over samples.
    :param bool replay_model: whether to run the model against the guide's latents.
    :param torch.Tensor hidden: booleans that broadcast to ``filled``, ``True`` at masked or
        missing entries; ``None`` when nothing is hidden.
    :param guide_trace: a trace of the guide's latents, of these batch dims, to replay the
        model against instead of running the guide (which then is not run at all).
    :param bool defensive: whether the guide's discrete choices are mixed with uniform ones
        (:func:`~pyro_mpt.trace.defensive_proposal.defensive_discrete`), as importance
        weights correct for; ``False`` for callers that use the draws as ``q``'s own.
    :returns: ``(guide_trace, model_trace)``; every site has the batch dims
        ``(S, P) + batch``; ``model_trace`` is None unless ``replay_model``.
    """
    local = guided.local
    num_lead = filled.dim() - len(local.observed.batch_shape) - 1
    lead = filled.shape[:num_lead]
    data_shape = lead + (1,) * guided.num_pad + guided.data_shape
    data = filled.reshape(data_shape)
    guide_kwargs = guided.kwargs
    if guided.takes_hidden:
        hidden = _hidden_like(hidden, filled)
        guide_kwargs = {**guided.kwargs, "hidden": hidden.reshape(data_shape)}
    nesting = local.max_plate_nesting
    with (
        pyro.plate(_SAMPLE_PLATE, num_samples, dim=-(nesting + 2)),
        pyro.plate(_MASK_PLATE, lead[-1], dim=-(nesting + 1)),
    ):
        try:
            if guide_trace is None:
                guide = defensive_discrete(guided.guide) if defensive else guided.guide
                guide_trace = poutine.trace(guide).get_trace(data, *guided.args[1:], **guide_kwargs)
        except (ValueError, RuntimeError, IndexError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if "invalid values" in reason:  # torch's check of a distribution's parameters
                raise NotApplicableError(_invalid_guide_parameters(guided, data, reason)) from error
            raise NotApplicableError(
                f"The guide {describe_guide(guided.guide)} failed on a batch of filled copies "
                f"of the data, of shape {tuple(data.shape)}: {reason}. To run the guide on "
                f"masked inputs, {_convention(local.observed)}."
                f"{_flattening_hint(guided.guide, reason, data.shape, local.observed)}"
                f"{_guide_batch_norm_hint(guided)}"
            ) from error
        model_trace = None
        if replay_model:
            replayed = poutine.trace(poutine.replay(guided.model, trace=guide_trace))
            try:
                model_trace = replayed.get_trace(*guided.args, **guided.kwargs)
            except (ValueError, RuntimeError, IndexError) as error:
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
                hint = batch_norm_hint(guided.model, guided.args, guided.kwargs)
                if isinstance(error, ValueError) and not hint:
                    raise  # in Pyro's or the model's own words (a BatchNorm's is a ValueError)
                raise ValueError(
                    f"The model failed when run at the guide's samples ({reason}). "
                    + (
                        hint
                        or "Importance sampling runs the model with extra batch dims left of its "
                        "plates (samples and masks), as Pyro's vectorized particles do, so the "
                        "model must broadcast over leading dims: expand covariates to the "
                        "latent's batch shape before concatenating "
                        "(torch.cat([z, c.expand(z.shape[:-1] + c.shape[-1:])], -1)), and "
                        "reshape with z.shape[:-1] rather than the data size."
                    )
                ) from error
    return guide_trace, model_trace


#: A reshape or view to a fixed leading size, which merges every leading dim into one.
_FLATTENING = re.compile(r"\.(?:reshape|view)\(\s*-1\s*,")
_PLATE_MISMATCH = re.compile(r"Shape mismatch inside plate\('[^']*'\) at site .* (\d+) vs (\d+)")


def _flattening_hint(guide, reason, data_shape, observed):
    """A sentence on a guide that flattens its input to a fixed number of dims (e.g.
    ``x.reshape(-1, D)``): seen in its source, or in a plate mismatch whose size is the plate's
    times the extra leading dims'. Empty when neither shows."""
    target = guide.forward if isinstance(guide, torch.nn.Module) else guide
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = ""
    found = _FLATTENING.search(source)
    mismatch = _PLATE_MISMATCH.search(reason)
    num_lead = len(data_shape) - len(observed.full_shape)
    merged = False
    if mismatch:
        expected, got = int(mismatch.group(1)), int(mismatch.group(2))
        merged = got == expected * math.prod(data_shape[:num_lead])
    if not (found or merged):
        return ""
    call = source[found.start() :].split(")")[0] + ")" if found else "a reshape"
    num_feature = max(1, observed.num_feature_dims)
    return (
        f" The guide flattens its input with {call.lstrip('.')}, which merges the extra "
        f"leading dims of the filled copies into the batch of observations. Flatten the "
        f"feature dims only and keep the leading batch dims: "
        f"x.reshape(x.shape[:-{num_feature}] + (-1,)) in place of x.reshape(-1, D)."
    )


def _guide_batch_norm_hint(guided):
    """:func:`batch_norm_hint` for the guide on the data it is given, with a leading space."""
    hint = batch_norm_hint(guided.guide, guided.args, guided.kwargs, who="guide")
    return f" {hint}" if hint else ""


def _hidden_like(hidden, filled):
    """``hidden`` as booleans of the shape of ``filled``: all ``False`` for ``None``."""
    if hidden is None:
        return torch.zeros(filled.shape, dtype=torch.bool, device=filled.device)
    try:
        return hidden.to(torch.bool).expand(filled.shape)
    except RuntimeError:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)}, which does not broadcast to the filled "
            f"data's shape {tuple(filled.shape)}; pass one flag per entry of the data."
        ) from None
