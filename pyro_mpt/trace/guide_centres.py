"""The guide's means and scales of the local latents in the whitened coordinates of their
priors: where guide-centred quadrature places its nodes."""

import pyro
import pyro.poutine as poutine
import torch
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
        site = self.guide_trace.nodes.get(name)
        q = unwrap_independent(site["fn"]) if site is not None else None
        if not isinstance(prior, torch.distributions.Normal) or not isinstance(
            q, torch.distributions.Normal
        ):
            raise NotApplicableError(
                f"quadrature with center='guide' needs a Normal prior and a Normal guide "
                f"distribution for latent site {name!r}; use center='prior'."
            )
        full = msg["fn"].batch_shape + msg["fn"].event_shape
        loc = q.loc.expand(full)
        batch = structure.observed.batch_shape
        self.centers.append(((loc - prior.loc) / prior.scale).reshape(batch + (-1,)))
        self.scales.append((q.scale / prior.scale).expand(full).reshape(batch + (-1,)))
        msg["value"] = loc
        msg["done"] = True


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
