"""Reads the Gaussian structure of a Pyro model off its traces.

Exact self-predictive conditionals need the model in one of two closed forms:

* **latent linear-Gaussian**: Gaussian latent sites inside the data plate and an observed
  ``Normal`` site whose ``loc`` is affine in them, with a scale that does not depend on them
  (PPCA, factor analysis), or an observed ``LowRankMultivariateNormal``;
* **dense Gaussian**: an observed ``MultivariateNormal`` with no latent sites (a GPyTorch
  ``MultivariateNormal`` included: its covariance is read without being factorised). When
  a plate broadcasts one covariance, the form keeps it as a single matrix with size-one
  batch dims.

The affine map is found by *probing* (:mod:`pyro_mpt.infer.latent_probe`): the model runs
once more inside an extra plate of ``K + 2`` probe points, with the latents set to the prior
mean, the prior mean plus each column of the prior's Cholesky factor, and one check point.
The differences of the likelihood's ``loc`` give the loading matrix in whitened coordinates
(so the latent is standard normal), and the check point verifies that the map is affine.
Gradients flow from the result to every parameter the model uses.
"""

import math
from typing import NamedTuple

import torch

from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.latent_probe import (
    compact_parameter,
    run_at_latent_points,
    trace_local_model,
    whitened_priors,
)
from pyro_mpt.infer.probe_cache import ProbedModel, random_state, restore_random_state
from pyro_mpt.infer.trace_utils import ObservedSite, flatten_tail, unwrap_independent

__all__ = ["GaussianForm", "NotGaussianError", "extract_gaussian_form"]


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
    :ivar torch.Tensor covariance: ``batch + (D, D)`` (broadcastable) or None.
    :ivar tuple latent_names: the latent sites integrated out.
    """

    observed: ObservedSite
    scale: object
    loc: torch.Tensor
    weight: torch.Tensor | None = None
    noise_var: torch.Tensor | None = None
    covariance: torch.Tensor | None = None
    latent_names: tuple = ()


def _probe_points(num_latent, dtype, device):
    """``K + 2`` whitened points: the origin, each unit vector, and an affinity check point."""
    eye = torch.eye(num_latent, dtype=dtype, device=device)
    check = torch.linspace(-1.1, 0.9, num_latent, dtype=dtype, device=device)
    if num_latent == 1:
        check = check.new_tensor([-1.1])
    return torch.cat([eye.new_zeros(1, num_latent), eye, check.unsqueeze(0)])


def _drop_broadcast_dims(matrix):
    """The matrix with every expanded (stride-zero) batch dim narrowed to size one, so a
    covariance shared by a plate stays one matrix and a mask shared by the plate is
    factorised once.

    When ``matrix`` is exactly an expanded view of its base tensor, the base is returned
    (reshaped): gradients then reach it without passing through the expansion, whose
    backward would allocate a full-size gradient of every broadcast copy.
    """
    batch_dims = range(matrix.dim() - 2)
    compact_shape = tuple(
        1 if matrix.stride(d) == 0 else matrix.shape[d] for d in batch_dims
    ) + tuple(matrix.shape[-2:])
    if compact_shape == tuple(matrix.shape):
        return matrix
    base = matrix._base
    if (
        base is not None
        and base.numel() == math.prod(compact_shape)
        and base.data_ptr() == matrix.data_ptr()
        and base.reshape(compact_shape).expand(matrix.shape).stride() == matrix.stride()
    ):
        return base.reshape(compact_shape)
    for dim in batch_dims:
        if matrix.stride(dim) == 0:
            matrix = matrix.narrow(dim, 0, 1)
    return matrix


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
        # ``covariance_matrix`` reads the matrix without factorising it (a lazy GPyTorch
        # MultivariateNormal never does), and broadcast dims stay views of one matrix.
        cov = _drop_broadcast_dims(fn.covariance_matrix.expand(shape + shape[-1:]))
        return GaussianForm(observed, scale, fn.loc.expand(shape), covariance=cov)
    if isinstance(fn, torch.distributions.Normal):
        # Independent features: the conditionals are the marginals (a zero loading matrix).
        full = site["fn"].batch_shape + site["fn"].event_shape
        loc = flatten_tail(fn.loc.expand(full), observed.num_feature_dims)
        var = flatten_tail(fn.scale.expand(full), observed.num_feature_dims) ** 2
        return GaussianForm(observed, scale, loc, torch.zeros_like(loc).unsqueeze(-1), var)
    raise NotGaussianError(
        f"Observed site {name!r} has a {type(fn).__name__} likelihood and the model has no "
        f"latent sites; exact conditionals need a Normal, MultivariateNormal or "
        f"LowRankMultivariateNormal observation."
    )


def extract_gaussian_form(model, args, kwargs, max_plate_nesting=math.inf, probes=None):
    """Traces ``model`` and returns its :class:`GaussianForm`.

    :param ProbeCache probes: remembers the model's structure between calls, so that calls
        after the first run it once (:mod:`pyro_mpt.infer.probe_cache`).
    :raises NotGaussianError: if the model is not linear-Gaussian.
    :raises ValueError: for invalid models (no observed site, NaN observations, a latent
        site outside the data plate).
    """
    if probes is not None:
        remembered = probes.latents_for(model, args, kwargs, max_plate_nesting)
        if remembered is not None:
            points = _probe_points(*remembered)
            state = random_state()
            probed = probes.run(model, args, kwargs, points)
            if probed is not None:
                try:
                    return _form_at_points(probed, points)
                except Exception:
                    # The two-run path below meets it again and says why.
                    restore_random_state(state)
                    probes.forget()
    local = trace_local_model(model, args, kwargs, max_plate_nesting)
    observed, obs_name, latents = local.observed, local.observed.name, local.latent_names
    obs_site = local.trace.nodes[obs_name]
    if not latents:
        return _no_latent_form(obs_site, observed, local.scale)
    _check_normal(obs_site["fn"], obs_name)  # before the probe run, which would be wasted
    priors = whitened_priors(local)
    x = observed.value
    points = _probe_points(sum(p.mean.shape[-1] for p in priors), x.dtype, x.device)
    fn = run_at_latent_points(model, args, kwargs, local, priors, points)
    probed = ProbedModel(observed, local.scale, fn, obs_site["value"], tuple(latents))
    form = _form_at_points(probed, points)
    if probes is not None and priors[0].mean.dtype == x.dtype:
        probes.remember(model, args, kwargs, max_plate_nesting, local, priors)
    return form


def _check_normal(fn, name):
    """The base distribution of the observed site ``fn``, which must be ``Normal``."""
    base = unwrap_independent(fn)
    if not isinstance(base, torch.distributions.Normal):
        raise NotGaussianError(
            f"Observed site {name!r} has a {type(base).__name__} likelihood; exact "
            f"conditionals need a Normal likelihood whose loc is affine in the latents."
        )
    return base


def _form_at_points(probed, points):
    """The latent linear-Gaussian form from the likelihood at the probe points."""
    observed, fn, latents = probed.observed, probed.fn, probed.latent_names
    x, obs_name = observed.value, observed.name
    base = _check_normal(fn, obs_name)
    locs = compact_parameter(base.loc, fn, observed)
    scales = compact_parameter(base.scale, fn, observed)
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
            f"{list(latents)}; exact conditionals need a linear-Gaussian model."
        )
    if not constant_scale:
        raise NotGaussianError(
            f"The scale of observed site {obs_name!r} depends on the latent sites "
            f"{list(latents)}; exact conditionals need a noise scale that does not."
        )
    return GaussianForm(observed, probed.scale, bias, weight, scales[0] ** 2, None, tuple(latents))
