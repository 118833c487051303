"""The guide's means and scales of the local latents in the whitened coordinates of their
priors: where guide-centred quadrature places its nodes."""

import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions import Delta
from pyro.poutine.messenger import Messenger

from pyro_mpt.errors import NotApplicableError
from pyro_mpt.trace.trace_utils import unwrap_independent

__all__ = ["whitened_guide"]


class _LatentsAtGuideMeans(Messenger):
    """Sets each local latent to the guide's mean and records the guide's mean and scale in
    the whitened coordinates of the prior the site has at that point."""

    def __init__(self, structure, guide_trace):
        super().__init__()
        self.structure = structure
        self.guide_trace = guide_trace
        self.centers, self.scales = [], []

    def _pyro_sample(self, msg):
        structure, name = self.structure, msg["name"]
        if name not in structure.latent_names:
            return
        prior = unwrap_independent(msg["fn"])
        q = _guide_normal(self.guide_trace, name)
        if not isinstance(prior, torch.distributions.Normal) or q is None:
            raise NotApplicableError(
                f"quadrature with center='guide' needs a Normal prior and a Normal guide "
                f"distribution for latent site {name!r} (a guide that samples it from a "
                f"Normal, or AutoNormal); use center='prior', or such a guide (AutoDelta, "
                f"AutoDiagonalNormal, AutoMultivariateNormal and AutoLaplaceApproximation "
                f"do not give one site's Normal)."
            )
        full = msg["fn"].batch_shape + msg["fn"].event_shape
        loc = q.loc.expand(full)
        batch = structure.observed.batch_shape
        self.centers.append(((loc - prior.loc) / prior.scale).reshape(batch + (-1,)))
        self.scales.append((q.scale / prior.scale).expand(full).reshape(batch + (-1,)))
        msg["value"] = loc
        msg["done"] = True


def _guide_normal(guide_trace, name):
    """The guide's ``Normal`` of latent site ``name``: the site's own distribution, or, for a
    site that ``AutoNormal`` samples as a ``Delta`` at the value of its auxiliary
    ``<name>_unconstrained`` Normal, that Normal (the value is the auxiliary's itself when
    the prior's support is the real line, as a Normal prior's is). None for anything
    else."""
    site = guide_trace.nodes.get(name)
    if site is None:
        return None
    q = unwrap_independent(site["fn"])
    if isinstance(q, torch.distributions.Normal):
        return q
    auxiliary = guide_trace.nodes.get(name + "_unconstrained")
    if not isinstance(q, Delta) or auxiliary is None:
        return None
    if not auxiliary["infer"].get("is_auxiliary"):
        return None
    q = unwrap_independent(auxiliary["fn"])
    return q if isinstance(q, torch.distributions.Normal) else None


def whitened_guide(model, guide, args, kwargs, structure):
    """The guide's mean and scale of every local latent in the whitened coordinates of its
    prior, ``batch + (K,)`` each, detached: the prior of each latent is read at the guide's
    means of its parents."""
    with torch.no_grad(), pyro.validation_enabled(False), poutine.block():
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        at_means = _LatentsAtGuideMeans(structure, guide_trace)
        at_means(model)(*args, **kwargs)
    if len(at_means.centers) != len(structure.latents):
        raise NotApplicableError("quadrature with center='guide' found no guide latents.")
    return torch.cat(at_means.centers, -1), torch.cat(at_means.scales, -1)
