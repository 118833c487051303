"""Reads the Gaussian structure of a Pyro model off its traces.

Exact self-predictive conditionals need the model in one of two closed forms:

* **latent linear-Gaussian**: Gaussian latent sites inside the data plate and an observed
  ``Normal`` site whose ``loc`` is affine in them, with a scale that does not depend on them
  (PPCA, factor analysis), or an observed ``LowRankMultivariateNormal``;
* **dense Gaussian**: an observed ``MultivariateNormal`` with no latent sites.

The affine map is found by *probing*: the model runs once more inside an extra plate of
``K + 2`` probe points, with the latents set to the prior mean, the prior mean plus each
column of the prior's Cholesky factor, and one check point. The differences of the
likelihood's ``loc`` give the loading matrix in whitened coordinates (so the latent is
standard normal), and the check point verifies that the map is affine. Gradients flow from
the result to every parameter the model uses.
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
    latent_sites,
    observation_shape,
    plate_frames,
    site_scale,
    unwrap_independent,
)

__all__ = ["GaussianForm", "NotGaussianError", "extract_gaussian_form"]

_PROBE_PLATE = "_mpt_probe"


class NotGaussianError(NotApplicableError):
    """The model is valid but has no closed-form Gaussian conditionals."""


class GaussianForm(NamedTuple):
    """A model's observations in closed Gaussian form.

    Either ``weight`` and ``noise_var`` are set (latent linear-Gaussian form,
    ``x = weight @ u + loc + eps`` with ``u ~ N(0, I)``) or ``covariance`` is (dense form).

    :ivar ObservedSite observed: the observed site, features flattened.
    :ivar scale: log-probability scale per observation (float or tensor of batch shape).
    :ivar torch.Tensor loc: ``batch + (D,)``.
    :ivar torch.Tensor weight: ``batch + (D, K)`` or None.
    :ivar torch.Tensor noise_var: ``batch + (D,)`` or None.
    :ivar torch.Tensor covariance: ``batch + (D, D)`` or None.
    :ivar tuple latent_names: the latent sites integrated out.
    """

    observed: ObservedSite
    scale: object
    loc: torch.Tensor
    weight: torch.Tensor | None = None
    noise_var: torch.Tensor | None = None
    covariance: torch.Tensor | None = None
    latent_names: tuple = ()


def _flatten_tail(tensor, num_dims):
    """Merges the rightmost ``num_dims`` dims into one (a new one if ``num_dims == 0``)."""
    if num_dims == 0:
        return tensor.unsqueeze(-1)
    return tensor.reshape(tensor.shape[: tensor.dim() - num_dims] + (-1,))


def _shared_across_batch(tensor, num_batch_dims):
    """Keeps one copy of a parameter that is the same for every observation.

    Probing yields a loading matrix per observation; in most models (PPCA, factor analysis)
    all copies are equal, and one shared copy makes every later product ``N`` times
    cheaper.
    """
    first = tensor[(slice(0, 1),) * num_batch_dims]
    if torch.equal(tensor.detach(), first.detach().expand_as(tensor)):
        return first
    return tensor


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
    value = site["value"].expand(fn.batch_shape + fn.event_shape)
    # One isnan pass is cheap next to the model run, so it is always made.
    num_nan = int(torch.isnan(value).sum())
    if num_nan:
        raise ValueError(
            f"Observed site {name!r} contains {num_nan} NaN values out of "
            f"{value.numel()}. MPTLoss scores every observed feature; drop the "
            f"observations with missing features or impute them before training."
        )
    batch_shape, num_feature_dims = observation_shape(site, data_dims)
    return ObservedSite(name, _flatten_tail(value, num_feature_dims), batch_shape, num_feature_dims)


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
            raise NotGaussianError(
                f"Latent sites {latent_names} sit in different plates; exact conditionals "
                f"need every latent in the same data plate."
            )
        shared = common
    return [dim for _, dim in shared] if shared else [dim for _, dim in obs_frames]


def _whitened_prior(site, name, num_batch_dims):
    """``(mean, scale_fn)`` with ``z = mean + scale_fn(u)`` for ``u ~ N(0, I)``, flattened."""
    fn = unwrap_independent(site["fn"])
    full = site["fn"].batch_shape + site["fn"].event_shape
    if isinstance(fn, torch.distributions.Normal):
        loc = fn.loc.expand(full).reshape(full[:num_batch_dims] + (-1,))
        scale = fn.scale.expand(full).reshape(full[:num_batch_dims] + (-1,))
        return loc, lambda u: scale * u
    if isinstance(fn, torch.distributions.MultivariateNormal) and len(full) == num_batch_dims + 1:
        loc = fn.loc.expand(full)
        tril = fn.scale_tril.expand(full + full[-1:])
        return loc, lambda u: (tril @ u.unsqueeze(-1)).squeeze(-1)
    raise NotGaussianError(
        f"Latent site {name!r} has a {type(fn).__name__} prior; exact conditionals need Normal "
        f"or MultivariateNormal latents."
    )


def _probe_points(num_latent, dtype, device):
    """``K + 2`` whitened points: the origin, each unit vector, and an affinity check point."""
    eye = torch.eye(num_latent, dtype=dtype, device=device)
    check = torch.linspace(-1.1, 0.9, num_latent, dtype=dtype, device=device)
    if num_latent == 1:
        check = check.new_tensor([-1.1])
    return torch.cat([eye.new_zeros(1, num_latent), eye, check.unsqueeze(0)])


def _no_latent_form(site, observed, scale):
    fn = unwrap_independent(site["fn"])
    name = observed.name
    shape = observed.value.shape
    if isinstance(fn, torch.distributions.LowRankMultivariateNormal):
        factor = fn.cov_factor.expand(shape + fn.cov_factor.shape[-1:])
        return GaussianForm(
            observed, scale, fn.loc.expand(shape), factor, fn.cov_diag.expand(shape)
        )
    if isinstance(fn, torch.distributions.MultivariateNormal):
        cov = fn.covariance_matrix.expand(shape + shape[-1:])
        return GaussianForm(observed, scale, fn.loc.expand(shape), covariance=cov)
    if isinstance(fn, torch.distributions.Normal):
        # Independent features: the conditionals are the marginals (a zero loading matrix).
        full = site["fn"].batch_shape + site["fn"].event_shape
        loc = _flatten_tail(fn.loc.expand(full), observed.num_feature_dims)
        var = _flatten_tail(fn.scale.expand(full), observed.num_feature_dims) ** 2
        return GaussianForm(observed, scale, loc, torch.zeros_like(loc).unsqueeze(-1), var)
    raise NotGaussianError(
        f"Observed site {name!r} has a {type(fn).__name__} likelihood and the model has no "
        f"latent sites; exact conditionals need a Normal, MultivariateNormal or "
        f"LowRankMultivariateNormal observation."
    )


def extract_gaussian_form(model, args, kwargs, max_plate_nesting=math.inf):
    """Traces ``model`` and returns its :class:`GaussianForm`.

    :raises NotGaussianError: if the model is not linear-Gaussian.
    :raises ValueError: for invalid models (no observed site, NaN observations, a latent
        site outside the data plate).
    """
    trace = poutine.trace(model).get_trace(*args, **kwargs)
    obs_name = find_observed_site(trace)
    latents = latent_sites(trace)
    data_dims = _data_dims(trace, obs_name, latents)
    observed = _observed(trace, obs_name, data_dims)
    scale = site_scale(trace.nodes[obs_name], observed.batch_shape)
    if not latents:
        return _no_latent_form(trace.nodes[obs_name], observed, scale)

    obs_fn = unwrap_independent(trace.nodes[obs_name]["fn"])
    if not isinstance(obs_fn, torch.distributions.Normal):
        raise NotGaussianError(
            f"Observed site {obs_name!r} has a {type(obs_fn).__name__} likelihood; exact "
            f"conditionals need a Normal likelihood whose loc is affine in the latents."
        )

    # Whitened priors of every latent, flattened to batch + (K_i,).
    priors = []
    for name in latents:
        site = trace.nodes[name]
        num_batch = len(observation_shape(site, data_dims)[0])
        loc, scale_fn = _whitened_prior(site, name, num_batch)
        priors.append((name, site, loc, scale_fn))
    sizes = [loc.shape[-1] for _, _, loc, _ in priors]
    num_latent = sum(sizes)
    x = observed.value
    points = _probe_points(num_latent, x.dtype, x.device)  # (Q, K)
    num_probes = points.shape[0]

    # Set every latent to its probe values, inside an extra plate over probe points.
    nesting = _max_plate_nesting(trace) if max_plate_nesting == math.inf else max_plate_nesting
    probe_trace = trace.copy()
    offset = 0
    for (name, site, loc, scale_fn), size in zip(priors, sizes):
        u = points[:, offset : offset + size]
        offset += size
        u = u.reshape((num_probes,) + (1,) * (loc.dim() - 1) + (size,))
        z = (loc + scale_fn(u)).reshape((num_probes,) + site["value"].shape)
        fn_dims = len(site["fn"].batch_shape)
        pad = (1,) * (nesting - fn_dims)
        z = z.reshape((num_probes,) + pad + site["fn"].batch_shape + site["fn"].event_shape)
        probe_trace.nodes[name] = dict(site, value=z)
    probe_dim = -(nesting + 1)
    with pyro.plate(_PROBE_PLATE, num_probes, dim=probe_dim):
        probed = poutine.trace(poutine.replay(model, trace=probe_trace)).get_trace(*args, **kwargs)

    fn = probed.nodes[obs_name]["fn"]
    base = unwrap_independent(fn)
    full = fn.batch_shape + fn.event_shape
    n = observed.num_feature_dims
    locs = _flatten_tail(base.loc.expand(full), n).reshape((num_probes,) + x.shape)
    scales = _flatten_tail(base.scale.expand(full), n).reshape((num_probes,) + x.shape)
    bias = locs[0]
    weight = (locs[1:-1] - bias).movedim(0, -1)  # batch + (D, K)
    predicted = bias + weight @ points[-1]
    tol = 10 * math.sqrt(torch.finfo(x.dtype).eps)
    magnitude = locs.detach().abs().amax() + 1
    if not torch.allclose(predicted.detach(), locs[-1].detach(), rtol=tol, atol=tol * magnitude):
        raise NotGaussianError(
            f"The loc of observed site {obs_name!r} is not affine in the latent sites "
            f"{latents}; exact conditionals need a linear-Gaussian model."
        )
    if not torch.allclose(scales.detach(), scales[:1].detach().expand_as(scales), rtol=tol):
        raise NotGaussianError(
            f"The scale of observed site {obs_name!r} depends on the latent sites {latents}; "
            f"exact conditionals need a noise scale that does not."
        )
    num_batch = len(observed.batch_shape)
    weight = _shared_across_batch(weight, num_batch)
    noise_var = _shared_across_batch(scales[0], num_batch) ** 2
    bias = _shared_across_batch(bias, num_batch)
    return GaussianForm(observed, scale, bias, weight, noise_var, None, tuple(latents))
