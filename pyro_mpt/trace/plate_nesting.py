"""The plate nesting of a model and guide, guessed from their traces as ``Trace_ELBO``
guesses it, with as few runs of the model as the guide allows."""

import math

import pyro.poutine as poutine
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import check_site_shape

from pyro_mpt.trace.guide_site_check import check_event_shapes

__all__ = ["copied_trace", "guessed_plate_nesting", "guide_and_model_traces"]


def guide_and_model_traces(model, guide, args, kwargs, structure):
    """The guide's trace and the model's against its samples, blocked, as ``Trace_ELBO``
    runs them to guess the plate nesting. A guide that draws nothing (nor a subsample)
    leaves the model's run as it is: the trace of ``structure``
    (:class:`~pyro_mpt.trace.model_structure.ModelStructure`) serves, one model run fewer.
    """
    with poutine.block():
        try:
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        except TypeError as error:
            if "'hidden'" not in str(error):
                raise
            # Pyro calls the guide with the model's arguments only: SVI, Predictive and
            # MPTLoss's own checks; the masked conditionals pass 'hidden' by keyword.
            raise TypeError(
                f"The guide requires an argument 'hidden' ({error}), but it is called with "
                f"the model's arguments only, as Pyro calls guides (SVI, Predictive): give it "
                f"a default, guide(x, hidden=None), read as nothing hidden."
            ) from error
        if not any(_draws(site) for site in guide_trace.nodes.values()):
            return guide_trace, copied_trace(structure.trace)
        check_event_shapes(guide_trace, structure.trace)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
    return guide_trace, model_trace


def _draws(site):
    """Whether a site of a guide's trace draws something that replaying it would give the
    model: a sample, or the subsample of a plate that subsamples."""
    if site["type"] != "sample":
        return False
    if not site_is_subsample(site):
        return True
    return site["fn"].subsample_size not in (None, site["fn"].size)


def guessed_plate_nesting(guide_trace, model_trace):
    """The plate nesting of the guide and the model, as ``Trace_ELBO`` guesses it from the
    same two traces: the deepest vectorized plate of their sample sites, their shapes
    checked first while validation is enabled."""
    sites = [
        site
        for trace in (prune_subsample_sites(model_trace), prune_subsample_sites(guide_trace))
        for site in trace.nodes.values()
        if site["type"] == "sample"
    ]
    if is_validation_enabled():
        for trace in (guide_trace, model_trace):
            prune_subsample_sites(trace).compute_log_prob()
        for site in sites:
            check_site_shape(site, max_plate_nesting=math.inf)
    dims = [frame.dim for site in sites for frame in site["cond_indep_stack"] if frame.vectorized]
    return -min(dims) if dims else 0


def copied_trace(trace):
    """A copy of ``trace`` whose site dicts are copies too, so that computing log-probs on it
    leaves the original's sites as they were."""
    copy = trace.copy()
    for name, site in trace.nodes.items():
        copy.nodes[name] = dict(site)
    return copy
