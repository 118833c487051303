"""Exact self-predictive conditionals of linear-Gaussian models: the strategy
(:class:`Exact`), its conditionals (:class:`GaussianSelfPredictive`) and how it reads a
model's Gaussian form off its runs (:func:`extract_gaussian_form`).

Exact self-predictive conditionals need the model in one of two closed forms:

* **latent linear-Gaussian**: Gaussian latent sites inside the data plate and an observed
  ``Normal`` site whose ``loc`` is affine in them, with a scale that does not depend on them
  (PPCA, factor analysis), or an observed ``LowRankMultivariateNormal``;
* **dense Gaussian**: an observed ``MultivariateNormal`` with no latent sites (a GPyTorch
  ``MultivariateNormal`` included: its covariance is read without being factorised). When
  a plate broadcasts one covariance, the form keeps it as a single matrix with size-one
  batch dims.

The affine map is found by *probing*: the model runs once more with its local latents at
``K + 1`` whitened points (:mod:`pyro_mpt.trace.whitened_latents`), the origin and each unit
vector, whose likelihood ``loc`` s give the loading matrix in whitened coordinates. The map
is then verified at further points, random and far (30 standard deviations out), where the
``loc`` must be affine and the ``scale`` constant, compared in float64 to within the
rounding of the model's own dtype: a mean that is affine only near the origin, or a noise
scale that depends on the latents, is refused.
"""

import contextlib
import contextvars
import math
import weakref
from typing import NamedTuple

import torch
from pyro.infer.util import is_validation_enabled
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.ops.autograd_graph import gradients, leaf_tensors
from pyro_mpt.ops.conditional_sampling import (
    dense_gaussian_block_sample,
    dense_gaussian_marginal_sample,
    latent_gaussian_block_sample,
    latent_gaussian_marginal_sample,
)
from pyro_mpt.ops.gaussian import (
    dense_gaussian_conditionals,
    latent_gaussian_conditionals,
    latent_gaussian_log_marginal,
    normal_log_prob,
)
from pyro_mpt.trace.factors import factor_log_prob
from pyro_mpt.trace.model_structure import read_structure
from pyro_mpt.trace.observed_site import ObservedSite
from pyro_mpt.trace.remembered_structure import RememberedStructure
from pyro_mpt.trace.trace_utils import check_points, flatten_tail, unwrap_independent
from pyro_mpt.trace.whitened_latents import point_parameter, run_at_points

__all__ = [
    "Exact",
    "GaussianForm",
    "GaussianSelfPredictive",
    "NotGaussianError",
    "extract_gaussian_form",
    "no_latent_form",
    "verify_every_call",
]


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
    :ivar pending_check: with Pyro's validation off, a boolean scalar tensor, ``True`` when
        the model failed this call's check of the form (:func:`extract_gaussian_form`), left
        on the device to spare a synchronisation; ``None`` when the check was read (or made no
        sense: no latents).
    """

    observed: ObservedSite
    scale: object
    loc: torch.Tensor
    weight: torch.Tensor | None = None
    noise_var: torch.Tensor | None = None
    covariance: torch.Tensor | None = None
    latent_names: tuple = ()
    pending_check: torch.Tensor | None = None


#: Check points beyond the fitting points: three draws of the prior, new on every call,
#: and two far points.
_NUM_RANDOM_CHECKS, _FAR_RADIUS = 3, 30.0
#: Where the prior draws among the check points come from: a generator of their own, so
#: the caller's random stream is untouched, advanced by every check, so that a loc that
#: departs from an affine map only between some points (a bump, a kink) meets a draw
#: inside that region sooner or later, where fixed points would miss it on every call.
_CHECK_DRAWS = torch.Generator(device="cpu").manual_seed(0)


def _probe_points(num_latent, dtype, device):
    """The origin, each unit vector, then the two far check points: ``(K + 3, K)``, the
    same on every call (the prior draws are added per call, by
    :func:`extract_gaussian_form`)."""
    direction = check_points(1, num_latent)[0]
    far = _FAR_RADIUS * direction / direction.norm()
    eye = torch.eye(num_latent, device="cpu")
    points = torch.cat([eye.new_zeros(1, num_latent), eye, far[None], -far.flip(0)[None]])
    return points.to(dtype=dtype, device=device)


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


def extract_gaussian_form(model, args, kwargs, structure):
    """The :class:`GaussianForm` of ``model`` and its ``pyro.factor`` terms, from one run of
    the model at the whitened points of :func:`_probe_points`; ``structure`` was read from
    an earlier trace (:func:`~pyro_mpt.trace.model_structure.read_structure`). The form is
    verified at the check points, where the loc must be affine and the scale constant, on
    every call while Pyro's validation is enabled, else on the first with the structure
    (later calls leave the outcome on the device, :attr:`GaussianForm.pending_check`).

    :raises NotGaussianError: if the model is not linear-Gaussian.
    """
    observed = structure.observed
    obs_site = structure.trace.nodes[observed.name]
    if not structure.latents:
        raise ValueError("extract_gaussian_form needs a model with local latents.")
    layout = structure.point_layout
    points = _PROBES.get(layout) if layout is not None else None
    if points is None:  # once per structure: the check and the points depend on nothing else
        discrete = [latent.name for latent in structure.latents if latent.num_values]
        if discrete:
            raise NotGaussianError(
                f"Latent sites {discrete} are discrete; exact conditionals need Gaussian "
                f"latents. Use conditionals='auto' or Quadrature(), which sum discrete latents "
                f"over every value, exactly."
            )
        base = unwrap_independent(obs_site["fn"])
        if not isinstance(base, torch.distributions.Normal):  # before the run at the points
            raise _not_normal(base, observed.name)
        first = structure.trace.nodes[structure.latents[0].name]["value"]
        points = _probe_points(structure.latent_dim, first.dtype, first.device)
        if layout is not None:
            _PROBES[layout] = points
    # Followed by _NUM_RANDOM_CHECKS fresh draws of the whitened prior from _CHECK_DRAWS.
    shape = (_NUM_RANDOM_CHECKS, points.shape[-1])
    draws = torch.randn(shape, generator=_CHECK_DRAWS, dtype=torch.float64)
    points = torch.cat([points, draws.to(dtype=points.dtype, device=points.device)])
    run = run_at_points(model, args, kwargs, structure, points)
    observed, fn = run.observed, run.fn
    base = unwrap_independent(fn)
    if not isinstance(base, torch.distributions.Normal):
        raise _not_normal(base, observed.name)
    num_latent = points.shape[-1]
    locs = point_parameter(base.loc, fn, observed).expand(
        points.shape[:1] + (-1,) * observed.value.dim()
    )
    scales = point_parameter(base.scale, fn, observed)
    # locs[q] = bias + weight @ points[q]: bias from the origin, weight from unit vectors.
    bias = locs[0]
    weight = (locs[1 : num_latent + 1] - bias).movedim(0, -1)  # batch + (D, K)
    # A noise scale per observation (heteroscedastic noise, known measurement errors) can
    # have more rows than a loc shared by every observation: the broadcast shape of both.
    noise_var = scales[0].expand(torch.broadcast_shapes(bias.shape, scales.shape[1:])) ** 2
    latents = tuple(structure.latent_names)
    form = GaussianForm(observed, run.scale, bias, weight, noise_var, None, latents)
    # The check: the locs at the check points (past the origin and the unit vectors) must be
    # those the affine form predicts, and the scales the same at every point. It runs in
    # float64, so only the model's own rounding (in its dtype) is allowed.
    checks = points[num_latent + 1 :]
    tol = 10 * math.sqrt(torch.finfo(locs.dtype).eps)
    with torch.no_grad():
        bias64, weight64, checks64 = bias.double(), weight.double(), checks.double()
        predicted = bias64 + torch.einsum("...dk,ck->c...d", weight64, checks64)
        size = bias64.abs() + torch.einsum("...dk,ck->c...d", weight64.abs(), checks64.abs())
        # Written as "not within", so that NaN fails.
        not_affine = ~((predicted - locs[num_latent + 1 :].double()).abs() <= tol * (size + 1))
        scales64 = scales.double()
        scale_varies = ~((scales64 - scales64[:1]).abs() <= tol * scales64[:1].abs())
        failed = not_affine.any() | scale_varies.any()
    # Verified on every call while Pyro's validation is enabled, else read once per
    # structure (the check reads the device); on later calls its outcome stays on the
    # device, for MPTLoss to read with the loss (GaussianSelfPredictive.pending_check).
    once = not is_validation_enabled() and not _EVERY_CALL.get()
    first = layout is None or layout not in _VERIFIED
    if once and not first:
        return form._replace(pending_check=failed), run.extra_log_prob
    if bool(failed):
        # Parameters that are NaN or infinite (after a step on unchecked data) fail the check
        # too: said as such, not as a model that is not affine.
        params = [p for t in (locs, scales) if t.grad_fn is not None for p in leaf_tensors(t)]
        finite = all(bool(torch.isfinite(p).all()) for p in params)
        raise _not_affine(form, affine=not bool(not_affine.any()), finite=finite)
    if first or _EVERY_CALL.get():
        _verify_derivatives(form, locs, scales, checks)
    if layout is not None:
        _VERIFIED.add(layout)
    return form, run.extra_log_prob


def no_latent_form(structure):
    """The :class:`GaussianForm` of a model without local latents, from its trace."""
    observed = structure.observed
    return _no_latent_form(structure.trace.nodes[observed.name], observed, structure.scale)


def _not_normal(base, name):
    """The error for an observed site ``name`` whose base distribution ``base`` is not
    ``Normal``."""
    dense = ""
    if isinstance(base, (MultivariateNormal, LowRankMultivariateNormal)):
        dense = (
            f" A {type(base).__name__} observation is exact only in a model with no local "
            f"latents; with latents, write the noise as Normal(loc, scale).to_event(1) and "
            f"its correlations as latents."
        )
    return NotGaussianError(
        f"Observed site {name!r} has a {type(base).__name__} likelihood; exact "
        f"conditionals need a Normal likelihood whose loc is affine in the latents.{dense} "
        f"Use conditionals='auto', or 'quadrature' or 'importance'."
    )


#: The structures (by their :class:`~pyro_mpt.trace.model_structure.PointLayout`) whose
#: linear-Gaussian form has been verified once.
_VERIFIED = weakref.WeakSet()
#: The probe points of :func:`_probe_points` of each structure (by its layout).
_PROBES = weakref.WeakKeyDictionary()

#: Whether the form is verified on every call even with Pyro's validation off (see
#: :func:`verify_every_call`).
_EVERY_CALL = contextvars.ContextVar("verify_every_call", default=False)


@contextlib.contextmanager
def verify_every_call():
    """Inside the block, the linear-Gaussian form is verified on every call, as while Pyro's
    validation is enabled: for calls that may come long after the structure was read, with
    other parameters (a model linear at one value of a parameter is not at another)."""
    token = _EVERY_CALL.set(True)
    try:
        yield
    finally:
        _EVERY_CALL.reset(token)


def _not_affine(form, affine, finite=True):
    """The error for a model whose likelihood's loc is not affine in its latents (``affine``
    False) or whose scale depends on them, or whose parameters are not ``finite`` (a
    ``ValueError``: no strategy applies then)."""
    observed, latents = form.observed, list(form.latent_names)
    if not finite:
        return ValueError(
            f"The loc or scale of observed site {observed.name!r} depends on parameters that "
            f"are NaN or infinite, as after a step on data with NaN or infinite values while "
            f"Pyro's validation was off (the data are checked only while it is on). Check the "
            f"data (torch.isfinite(x).all()), mark missing entries with obs_mask, and restore "
            f"the parameters (Pyro's param store) from before the first NaN loss."
        )
    if not affine:
        return NotGaussianError(
            f"The loc of observed site {observed.name!r} is not affine in the latent sites "
            f"{latents} (checked at random points and at {_FAR_RADIUS:g} prior standard "
            f"deviations); exact conditionals need a linear-Gaussian model. Use "
            f"conditionals='quadrature' or 'importance'."
        )
    return NotGaussianError(
        f"The scale of observed site {observed.name!r} depends on the latent sites "
        f"{latents}; exact conditionals need a noise scale that does not. Use "
        f"conditionals='quadrature' or 'importance'."
    )


def _verify_derivatives(form, locs, scales, checks):
    """Raises :class:`NotGaussianError` when the form holds at the parameters' values but
    not near them, so that its gradient would be wrong: a loc with a nonlinear term whose
    coefficient is 0 for now (``W z + c z**2`` at ``c = 0``, an output layer initialised at
    zero) is affine in value, but its derivative in ``c`` is not. The departure of the locs
    at the check points from the affine form's prediction, and of the scales from the
    first, must have no derivative in any parameter: one backward pass over a random
    combination of them, compared in size with that of the locs and scales themselves (a
    form that holds everywhere departs by rounding only). Nothing to check where no
    gradient is taken."""
    if not (torch.is_grad_enabled() and (locs.requires_grad or scales.requires_grad)):
        return
    num_fitted = locs.shape[0] - checks.shape[0]
    predicted = form.loc + torch.einsum("...dk,ck->c...d", form.weight, checks.to(locs.dtype))
    departures = [locs[num_fitted:] - predicted, scales - scales[:1]]
    values = [locs[num_fitted:], scales]
    weights = [torch.randn(t.shape, generator=_CHECK_DRAWS).to(t) for t in values]
    departure = sum((w * t).sum() for w, t in zip(weights, departures))
    reference = sum((w * t).sum() for w, t in zip(weights, values))
    params = [p for p in leaf_tensors(reference) if p.requires_grad]
    if not params:
        return
    moved = gradients(departure, params, retain_graph=True)
    scale = gradients(reference, params, retain_graph=True)

    def size(grads):
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))

    tol = 10 * math.sqrt(torch.finfo(locs.dtype).eps)
    if size(moved) > tol * (size(scale) + 1):
        observed, latents = form.observed, list(form.latent_names)
        raise NotGaussianError(
            f"The loc or scale of observed site {observed.name!r} is affine (constant) in the "
            f"latent sites {latents} at the parameters' present values but not near them (a "
            f"nonlinear term whose coefficient is 0 for now, e.g. a layer initialised at "
            f"zero): exact conditionals would give the right value with a wrong gradient. "
            f"Use conditionals='auto', 'quadrature' or 'importance'."
        )


class GaussianSelfPredictive(SelfPredictive):
    """Closed-form conditionals of a :class:`GaussianForm`."""

    def __init__(self, form, extra_log_prob=0.0):
        super().__init__(form.observed, form.scale, extra_log_prob)
        self.form = form
        self.pending_check = form.pending_check

    def log_prob(self, masks):
        form = self.form
        x, entries = self.observed.value, self.observed.entries
        context = ~masks if entries is None else ~masks & entries  # as self.context(masks)
        if form.covariance is None:
            mean, var = latent_gaussian_conditionals(
                x, form.weight, form.loc, form.noise_var, context
            )
        else:
            mean, var = dense_gaussian_conditionals(x, form.loc, form.covariance, context)
        return normal_log_prob(x, mean, var)

    @property
    def log_prob_width(self):
        """``K`` through a ``K``-dimensional latent, ``D`` for a dense covariance."""
        form = self.form
        if form.weight is not None:
            return form.weight.shape[-1]
        return form.covariance.shape[-1]

    def sample(self, hidden, num_samples, joint=True):
        """Exact draws: through the latent posterior, ``z ~ p(z | x_R)`` then
        ``x_S ~ p(x_S | z)``, ``O(D K^2 + K^3)`` per observation; or from the dense Gaussian
        block conditional of a ``MultivariateNormal`` observation. See
        :meth:`SelfPredictive.sample`."""
        form, x = self.form, self.observed.value
        context = self.context(hidden)
        if form.covariance is not None:
            draw = dense_gaussian_block_sample if joint else dense_gaussian_marginal_sample
            draws = draw(x, form.loc, form.covariance, context, num_samples)
        else:
            draw = latent_gaussian_block_sample if joint else latent_gaussian_marginal_sample
            draws = draw(x, form.weight, form.loc, form.noise_var, context, num_samples)
        return self.keep_given(hidden, draws)

    def mask_average(self):
        """The exact ``log p(x)``: exact conditionals average to it over every mask."""
        return self.log_marginal()

    def log_marginal(self):
        """The exact ``log p(x)`` of each observation, shape ``batch_shape``."""
        form = self.form
        x = self.observed.value
        entries = self.observed.entries
        if form.covariance is None:
            return latent_gaussian_log_marginal(x, form.weight, form.loc, form.noise_var, entries)
        if entries is not None:
            raise NotImplementedError(
                "log_marginal of a dense multivariate normal observation with missing entries"
            )
        return torch.distributions.MultivariateNormal(
            form.loc, covariance_matrix=form.covariance
        ).log_prob(x)


class Exact(Conditionals):
    """Closed-form conditionals of linear-Gaussian models.

    Applies to models whose local latents are Gaussian (``Normal`` or
    ``MultivariateNormal``), sit inside the data plate, and enter the ``loc`` of an observed
    ``Normal`` site affinely (PPCA, factor analysis), and to models whose observed site is a
    ``MultivariateNormal`` or ``LowRankMultivariateNormal``. Conditioning goes through the
    ``K``-dimensional latent posterior (Woodbury): ``O(D K^2 + K^3)`` per mask, never a
    ``D x D`` inverse. A dense ``MultivariateNormal`` observation (a GP decoder's, whose
    features are data points) is conditioned through each mask's active set: one
    ``|R| x |R|`` Cholesky of the context block and the predictive variances of the masked
    features only.

    The guide is not used: the latents are integrated out exactly. Each call runs the model
    once at ``K + 6`` points of the latents' whitened space, which give the affine map and
    verify it far from the origin; the first call with a model (and argument shapes) also
    traces it once to read its structure.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Exact
        >>> loss = MPTLoss(rate="uniform", conditionals=Exact())
    """

    name = "exact"

    def __init__(self):
        self._structure = RememberedStructure()

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """See :meth:`Conditionals.prepare`.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        call = (model, guide, args, kwargs, max_plate_nesting, signature)
        return self._structure.prepared(self, *call)

    def structure_for(self, signature):
        """The structure :meth:`prepare` read for calls of ``signature`` (the very object it
        was passed), or None: a caller that holds it calls :meth:`prepare_with`."""
        return self._structure.held(signature)

    def prepare_with(self, structure, model, guide, args, kwargs):
        """:meth:`prepare` for a call like the one ``structure`` was read from (the same
        model and argument shapes): the model runs once, at the probe points."""
        if not structure.latents:
            # The model's one run is the structure trace itself.
            structure = read_structure(model, args, kwargs, structure.max_plate_nesting)
            return GaussianSelfPredictive(no_latent_form(structure), factor_log_prob(structure))
        form, extra_log_prob = extract_gaussian_form(model, args, kwargs, structure)
        return GaussianSelfPredictive(form, extra_log_prob)
