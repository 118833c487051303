"""Log-densities read off the traces of a guide run on filled data and of the model
replayed against it, each as ``lead + batch`` per observation: the latents' prior and
proposal densities (a Gaussian ``AutoContinuous`` guide's joint latent by its
per-observation marginals) and the observed site's per-feature terms."""

import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoContinuous, AutoGuideList

from pyro_mpt.trace.trace_utils import flatten_tail, latent_sites, unwrap_independent

__all__ = ["joint_latent_owner", "observed_tensor", "proposal_log_density", "sites_log_density"]


def _per_observation(tensor, lead, tail, site_name):
    """Drops size-1 pad dims after ``lead`` and broadcasts to ``lead + tail``."""
    while tensor.dim() > len(lead) + len(tail) and tensor.shape[len(lead)] == 1:
        tensor = tensor.squeeze(len(lead))
    try:
        return tensor.expand(lead + tail)
    except RuntimeError:
        raise ValueError(
            f"Site {site_name!r} has shape {tuple(tensor.shape)} inside the plates over "
            f"samples and masks, which does not broadcast to {tuple(lead + tail)}; latent "
            f"sites must sit in the data plate of the observed site."
        ) from None


def sites_log_density(trace, names, guided, lead):
    """``sum_i log f_i(z_i)`` over the named sites of a trace, shape ``lead + batch``: each
    ``fn.log_prob(value)``, with the dims of plates inside the data plate summed."""
    local = guided.local
    num_inner = -max(local.data_dims) - 1 if local.data_dims else 0
    total = 0.0
    for name in names:
        site = trace.nodes[name]
        log_prob = site["fn"].log_prob(site["value"])
        if num_inner:
            log_prob = log_prob.sum(tuple(range(-num_inner, 0)))
        total = total + _per_observation(log_prob, lead, local.observed.batch_shape, name)
    return total


def joint_latent_owner(guide, site):
    """The Gaussian ``AutoContinuous`` guide whose joint latent ``site`` is (``guide``
    itself, or a member of an ``AutoGuideList``), whose marginal over each observation's
    coordinates is Gaussian and known; None for any other site."""
    gaussian = (dist.Normal, dist.MultivariateNormal, dist.LowRankMultivariateNormal)
    if not (
        site["infer"].get("is_auxiliary") and isinstance(unwrap_independent(site["fn"]), gaussian)
    ):
        return None
    members = list(guide) if isinstance(guide, AutoGuideList) else [guide]
    for member in members:
        # An AutoContinuous guide samples its joint latent as "_{name}_latent".
        if isinstance(member, AutoContinuous) and site["name"] == f"_{member._pyro_name}_latent":
            return member
    return None


def proposal_log_density(guide_trace, guided, lead):
    """``log q(z_n)`` of each observation's latents under the guide, ``lead + batch``.

    Sites inside the data plate contribute their densities; the joint latent of a Gaussian
    ``AutoContinuous`` guide (all observations' coordinates in one vector) contributes the
    marginal density of each observation's block of coordinates.
    """
    separate, joint = [], []
    for name in latent_sites(guide_trace):
        owner = joint_latent_owner(guided.guide, guide_trace.nodes[name])
        if owner is None:
            separate.append(name)
        else:
            joint.append((name, owner))
    total = sites_log_density(guide_trace, separate, guided, lead)
    for name, owner in joint:
        site = guide_trace.nodes[name]
        total = total + _block_marginal_log_density(site, owner, guided, lead)
    return total


def _observation_coordinates(guide, batch, num_coordinates):
    """Which coordinates of an ``AutoContinuous`` guide's joint latent belong to each
    observation: a long tensor ``batch + (K,)``."""
    positions = torch.arange(num_coordinates, dtype=torch.float64)
    blocks = []
    for _, value in guide._unpack_latent(positions):
        blocks.append(value.reshape(batch + (-1,)))
    return torch.cat(blocks, -1).round().long()


def _block_marginal_log_density(site, owner, guided, lead):
    """The marginal log-density of each observation's block of the joint latent of the
    ``AutoContinuous`` guide ``owner``."""
    fn, value = unwrap_independent(site["fn"]), site["value"]
    num = value.shape[-1]
    batch = guided.local.observed.batch_shape
    index = _observation_coordinates(owner, batch, num).to(value.device)
    picked = value[..., index]  # lead + pad + batch + (K,)
    if isinstance(fn, dist.Normal):
        loc = fn.loc.reshape(-1, num)[0][index]
        scale = fn.scale.reshape(-1, num)[0][index]
        log_prob = dist.Normal(loc, scale).log_prob(picked).sum(-1)
    else:
        loc = fn.loc.reshape(-1, num)[0][index]
        cov = fn.covariance_matrix.reshape(-1, num, num)[0]
        block = cov[index.unsqueeze(-1), index.unsqueeze(-2)]
        log_prob = dist.MultivariateNormal(loc, covariance_matrix=block).log_prob(picked)
    return _per_observation(log_prob, lead, guided.local.observed.batch_shape, site["name"])


def observed_tensor(tensor, guided, lead):
    """A tensor of the observed site's base shape as ``lead + batch + (D,)``."""
    observed = guided.local.observed
    flat = flatten_tail(tensor, observed.num_feature_dims)
    tail = observed.batch_shape + observed.value.shape[-1:]
    return _per_observation(flat, lead, tail, observed.name)
