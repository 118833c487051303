"""The comparison of a guide's sites with the model's latents that ``Trace_ELBO`` makes
under validation, for ``MPTLoss``: conditionals that integrate the latents out never run
the guide, so a misspelled guide site would otherwise go unnoticed."""

import difflib
import warnings

import pyro.poutine as poutine
import torch
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import site_is_subsample

from pyro_mpt.trace.model_structure import latent_names_in
from pyro_mpt.trace.trace_utils import latent_sites, same_random_state
from pyro_mpt.trace.vectorized_run_check import CheckedCalls

__all__ = ["check_event_shapes", "check_guide_sites"]

#: The (model, guide, argument shapes) whose sites :func:`check_guide_sites` compared.
_SITES_CHECKED = CheckedCalls()


def check_guide_sites(model, guide, args, kwargs, max_plate_nesting, traces=None):
    """Warns, as ``Trace_ELBO`` does under validation (``pyro.util.check_model_guide_match``),
    when the guide samples a site the model lacks or lacks a latent of the model: a
    misspelled guide site is otherwise never noticed by conditionals that do not run the
    guide. Once per model, guide and argument shapes; nothing without a guide or with
    validation off.

    The guide runs once and the model against its samples, as ``Trace_ELBO`` runs them,
    blocked, without gradients, from a forked random state (a seeded step draws the same
    masks either way); if either raises, nothing is reported here. Guide sites marked
    ``infer={'is_auxiliary': True}`` are not compared; the model's latents are those MPTLoss
    integrates (no ``obs_mask`` or deterministic sites). A guide that samples no site at all
    (a no-op, which exact and quadrature conditionals accept) is not reported.

    :param callable model: the model.
    :param callable guide: the guide, or None.
    :param tuple args: their positional arguments.
    :param dict kwargs: their keyword arguments.
    :param max_plate_nesting: as the loss holds it (part of the call's record).
    :param tuple traces: ``(guide_trace, model_trace)`` of such runs made already (for the
        guess of the plate nesting), so that the model need not run again; None: run them.
    """
    if guide is None or not is_validation_enabled():
        return
    if _SITES_CHECKED.seen(model, guide, args, kwargs, max_plate_nesting):
        return
    if traces is not None:
        guide_trace, model_trace = traces
    else:
        guide_trace, model_trace = _traces_for_sites(model, guide, args, kwargs)
        if guide_trace is None:
            return
    _check_sites_of(guide_trace, model_trace)


def _traces_for_sites(model, guide, args, kwargs):
    """The guide's trace and the model's against it, blocked, without gradients and from a
    forked random state; ``(None, None)`` if either raises."""
    try:
        with torch.no_grad(), same_random_state(), poutine.block():
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
                *args, **kwargs
            )
    except Exception:  # noqa: BLE001
        # Advisory only: a guide that fails here is reported, in MPTLoss's words, by the
        # conditionals that run it, and conditionals that do not run it never needed it.
        return None, None
    return guide_trace, model_trace


def _check_sites_of(guide_trace, model_trace):
    """:func:`check_guide_sites` on the traces of a guide and of the model against it."""
    guide_names = [
        name
        for name in latent_sites(guide_trace)
        if not guide_trace.nodes[name]["infer"].get("is_auxiliary")
    ]
    model_names = latent_names_in(model_trace)
    # A guide may sample the missing part of an observation (obs_mask), which is no latent.
    extra = [name for name in guide_names if name not in latent_sites(model_trace)]
    missing = [name for name in model_names if name not in guide_names]
    both = f"the model's latent sites are {model_names}, the guide's {guide_names}"
    if extra:
        close = [difflib.get_close_matches(n, missing or model_names, 1, 0.0) for n in extra]
        renames = "; ".join(
            f"rename {name!r} to {match[0]!r}" for name, match in zip(extra, close) if match
        )
        warnings.warn(
            f"Found non-auxiliary vars in guide but not model, consider marking these "
            f"infer={{'is_auxiliary': True}}:\n{set(extra)}\n(MPTLoss: {both}"
            + (f"; {renames} if it is a misspelling" if renames else "")
            + ".)",
            stacklevel=7,
        )
    if missing and guide_names:  # a guide that samples nothing is a no-op, not a typo
        warnings.warn(
            f"Found vars in model but not guide: {set(missing)}\n(MPTLoss: {both}; "
            f"conditionals that draw the latents from the guide cannot be used, and a "
            f"guide site that is not named after a model latent is never used.)",
            stacklevel=7,
        )


def check_event_shapes(guide_trace, model_trace):
    """Refuses a guide site whose event shape is not the model's for the same latent: the
    model, replayed at its value, would fail inside its own code (a matrix product of the
    wrong size) with nothing to say which site is at fault."""
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
            continue
        model_site = model_trace.nodes.get(name)
        if model_site is None or model_site["type"] != "sample" or model_site["is_observed"]:
            continue
        guide_event, model_event = site["fn"].event_shape, model_site["fn"].event_shape
        if guide_event != model_event:
            raise ValueError(
                f"The guide samples site {name!r} with event shape {tuple(guide_event)}, "
                f"but the model's {name!r} has event shape {tuple(model_event)}: the model "
                f"would run at values of the wrong shape. Give the guide's distribution the "
                f"model's shape (e.g. .to_event({len(model_event)}) over "
                f"{tuple(model_event)})."
            )
