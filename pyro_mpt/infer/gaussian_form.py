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


def _compact(tensor, num_dims):
    """Narrows each broadcast (stride-0) dim among the leading ``num_dims`` to size 1.

    Parameters that are the same for every observation then stay one copy, and every
    later product is ``N`` times cheaper.
    """
    index = tuple(
        slice(0, 1) if stride == 0 and size > 1 else slice(None)
        for size, stride in zip(tensor.shape[:num_dims], tensor.stride()[:num_dims])
    )
    return tensor[index]


def _unexpanded(tensor, num_dims):
    """The tensor that ``tensor`` was broadcast from, when it is a plain ``expand`` view
    (as plates and ``broadcast_all`` make), left-padded to ``num_dims`` dims.

    Slicing a broadcast view down would make autograd allocate the full broadcast shape in
    the backward pass; taking the view's base keeps the graph small.
    """
    base = tensor._base
    if base is not None and base.dim() <= tensor.dim():
        padded = base.reshape((1,) * (tensor.dim() - base.dim()) + base.shape)
        try:
            same = padded.expand(tensor.shape)
        except RuntimeError:
            same = None
        if (
            same is not None
            and same.stride() == tensor.stride()
            and same.data_ptr() == tensor.data_ptr()
        ):
            tensor = padded
    return tensor.reshape((1,) * (num_dims - tensor.dim()) + tensor.shape)


def _whitened_prior(site, name, num_batch_dims):
    """``(mean, scale_fn)`` with ``z = mean + scale_fn(u)`` for ``u ~ N(0, I)``; the mean has
    shape ``batch + (K,)`` with batch dims of size 1 where the prior is shared."""
    fn = unwrap_independent(site["fn"])
    full = site["fn"].batch_shape + site["fn"].event_shape
    if isinstance(fn, torch.distributions.Normal):
        loc = _compact(fn.loc.expand(full), num_batch_dims)
        scale = _compact(fn.scale.expand(full), num_batch_dims)
        loc, scale = torch.broadcast_tensors(loc, scale)
        flat = loc.shape[:num_batch_dims] + (-1,)
        scale = scale.reshape(flat)
        return loc.reshape(flat), lambda u: scale * u
    if isinstance(fn, torch.distributions.MultivariateNormal) and len(full) == num_batch_dims + 1:
        loc = _compact(fn.loc.expand(full), num_batch_dims)
        tril = _compact(fn.scale_tril.expand(full + full[-1:]), num_batch_dims)
        loc = loc.expand(torch.broadcast_shapes(loc.shape, tril.shape[:-1]))
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
        priors.append((name, site, num_batch, loc, scale_fn))
    x = observed.value
    points = _probe_points(sum(p[3].shape[-1] for p in priors), x.dtype, x.device)  # (Q, K)
    nesting = _max_plate_nesting(trace) if max_plate_nesting == math.inf else max_plate_nesting
    try:
        # Latents with a prior shared by every observation are probed once, not N times.
        locs, scales = _probe(
            model, args, kwargs, trace, obs_name, observed, priors, points, nesting, compact=True
        )
    except Exception:
        # A model that indexes its latents per observation needs full-size probe values.
        locs, scales = _probe(
            model, args, kwargs, trace, obs_name, observed, priors, points, nesting, compact=False
        )
    # locs[q] = bias + weight @ points[q]: bias from the origin, weight from unit vectors.
    bias = locs[0]
    num_latent = points.shape[-1]
    differences = torch.cat([-torch.ones(1, num_latent), torch.eye(num_latent)]).to(x)
    weight = torch.einsum("q...d,qk->...dk", locs[:-1], differences)
    tol = 10 * math.sqrt(torch.finfo(x.dtype).eps)
    with torch.no_grad():
        predicted = bias + weight @ points[-1]
        magnitude = locs.abs().amax() + 1
        affine = torch.allclose(predicted, locs[-1], rtol=tol, atol=tol * magnitude)
        constant_scale = torch.allclose(scales, scales[:1].expand_as(scales), rtol=tol)
    if not affine:
        raise NotGaussianError(
            f"The loc of observed site {obs_name!r} is not affine in the latent sites "
            f"{latents}; exact conditionals need a linear-Gaussian model."
        )
    if not constant_scale:
        raise NotGaussianError(
            f"The scale of observed site {obs_name!r} depends on the latent sites {latents}; "
            f"exact conditionals need a noise scale that does not."
        )
    return GaussianForm(observed, scale, bias, weight, scales[0] ** 2, None, tuple(latents))


def _probe(model, args, kwargs, trace, obs_name, observed, priors, points, nesting, compact):
    """Runs the model with its latents at the probe points, inside a plate over the points.

    :returns: the likelihood's ``(loc, scale)`` at each point, shape
        ``(Q,) + batch + (D,)``, with batch dims of size 1 where they do not vary.
    """
    num_probes, offset = points.shape[0], 0
    probe_trace = trace.copy()
    for name, site, num_batch, loc, scale_fn in priors:
        size = loc.shape[-1]
        u = points[:, offset : offset + size]
        offset += size
        u = u.reshape((num_probes,) + (1,) * (loc.dim() - 1) + (size,))
        z = loc + scale_fn(u)  # (Q,) + batch + (K_i,)
        full = site["fn"].batch_shape + site["fn"].event_shape
        batch = z.shape[1 : 1 + num_batch] if compact else full[:num_batch]
        z = z.expand((num_probes,) + full[:num_batch] + (size,)) if not compact else z
        pad = (1,) * (nesting - len(site["fn"].batch_shape))
        z = z.reshape((num_probes,) + pad + batch + full[num_batch:])
        probe_trace.nodes[name] = dict(site, value=z)
    with pyro.plate(_PROBE_PLATE, num_probes, dim=-(nesting + 1)):
        probed = poutine.trace(poutine.replay(model, trace=probe_trace)).get_trace(*args, **kwargs)
    fn = probed.nodes[obs_name]["fn"]
    base = unwrap_independent(fn)
    full = fn.batch_shape + fn.event_shape
    num_lead = len(full) - observed.num_feature_dims
    target = (num_probes,) + observed.batch_shape + observed.value.shape[-1:]
    out = []
    for param in (base.loc, base.scale):
        param = _unexpanded(param, len(full))
        param = _compact(param.expand(param.shape[:num_lead] + full[num_lead:]), num_lead)
        param = _flatten_tail(param, observed.num_feature_dims)
        param = param.reshape(param.shape[:1] + param.shape[-1 - len(observed.batch_shape) :])
        torch.broadcast_shapes(param.shape, target)  # raises if the model broke the shapes
        out.append(param)
    return out
