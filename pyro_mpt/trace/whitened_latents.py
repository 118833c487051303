"""Runs a model with its local latents at points of their whitened (standard-normal) space.

Every local latent is drawn through its own prior *as the model samples it*: a point ``u``
of standard normal noise is mapped through the site's distribution with the parameters it
has at that call (``z = loc + scale * u`` for a ``Normal``, ``loc + L u`` for a multivariate
normal with Cholesky factor ``L``, then any transforms of a transformed normal such as
``LogNormal``). A latent whose prior depends on another latent, on a parameter or on
covariates is then mapped at its parents' values at the same point, so the points are draws
of the joint prior exactly when ``u ~ N(0, I)``: quadrature nodes and exact probes live in
that space, and hierarchies are right by construction.

The model runs once inside an extra plate over the ``Q`` points, left of all its plates.
Points shared by every observation keep the batch dims of size one where the priors are the
same for every observation, so a decoder runs ``Q`` times rather than ``Q N`` times. A prior
is the same for every observation when its parameters are broadcast along the data plate
(``Normal(torch.zeros(K), 1)`` inside it) and also when they are materialised per
observation with equal rows (``Normal(x.new_zeros(N, K), x.new_ones(N, K))``, as Pyro's VAE
tutorial writes it): the rows are compared on every run, since the same call signature may
bring different values, and parameters that need a gradient keep their rows (each row's
gradient is its own observation's).
"""

import math
from typing import NamedTuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.util import is_validation_enabled
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_mpt.errors import NotApplicableError, unsupported_prior_error, without_trace_shapes
from pyro_mpt.trace.factors import check_factors, factor_log_prob
from pyro_mpt.trace.observed_site import check_run_matches, read_observed_site, site_scale
from pyro_mpt.trace.points_check import check_model_at_points
from pyro_mpt.trace.trace_utils import narrow_broadcast_dims, unwrap_independent

__all__ = [
    "PointsRun",
    "enumerated_log_prob",
    "point_parameter",
    "run_at_points",
    "whiten",
]

_POINTS_PLATE = "_mpt_points"


class PointsRun(NamedTuple):
    """The model run at ``Q`` whitened points.

    :ivar fn: the observed site's distribution, with a leading dim of size ``Q`` (or 1
        where it does not depend on the latents).
    :ivar trace: the run's trace.
    :ivar observed: the run's :class:`~pyro_mpt.trace.model_structure.ObservedSite`.
    :ivar scale: its log-probability scale per observation.
    :ivar extra_log_prob: the model's ``pyro.factor`` terms (see :func:`factor_log_prob`).
    :ivar rows_differ: whether some prior's parameters differ between observations (read
        only by a run asked to ``watch`` them; False otherwise).
    """

    fn: object
    trace: object
    observed: object
    scale: object
    extra_log_prob: object
    rows_differ: bool = False


def _narrow_broadcast_dims(tensor):
    """The tensor with every broadcast (stride-0) dim narrowed to size one: a prior shared by
    every observation stays one copy."""
    return narrow_broadcast_dims(tensor, tensor.dim())


def _narrow_equal_rows(tensor, dims, first=False):
    """``tensor`` narrowed to its first row along each of ``dims`` (positions from the left)
    where all its rows are equal, or along all of them with ``first=True``. A tensor that
    needs a gradient keeps its rows: narrowed, every row's gradient would go to the first."""
    if not first and tensor.requires_grad and torch.is_grad_enabled():
        return tensor
    for dim in dims:
        if dim >= tensor.dim() or tensor.shape[dim] == 1:
            continue
        row = tensor.narrow(dim, 0, 1)
        if first or bool((tensor == row).all()):
            tensor = row
    return tensor


def whiten(fn, u, name="latent", narrow=_narrow_broadcast_dims, check_shape=None):
    """The value of a latent with distribution ``fn`` at standard normal noise ``u``.

    :param fn: the site's distribution (``Normal``, ``MultivariateNormal``,
        ``LowRankMultivariateNormal``, a transformed one of these such as ``LogNormal``, any
        of them made an event with ``.to_event``).
    :param torch.Tensor u: noise broadcastable to the site's value shape. The value is in
        the prior's dtype, as a draw from it would be, whatever the dtype of ``u``: points
        made for a model whose parameters have since changed dtype still fit it.
    :param narrow: applied to each parameter tensor of the prior before it maps ``u``; the
        default narrows broadcast dims, so a prior shared by every observation stays one
        copy.
    :param check_shape: if given, called with the value's shape and dtype before the value
        is formed (a memory check may raise there).
    :raises NotApplicableError: for another distribution.

    A discrete prior with an enumerable support and scalar events (``Categorical``,
    ``Bernoulli``) has no whitened space: each coordinate of ``u`` holds the index of one of
    its values, rounded and clipped into range (so any point gives a value the prior can
    take), and the value is that element of its support. A rule over such coordinates
    enumerates the indices and weighs each by the prior's probability of its value
    (:func:`enumerated_log_prob`).
    """
    base = unwrap_independent(fn)
    if base.support.is_discrete and base.has_enumerate_support and not base.event_shape:
        try:
            support = base.enumerate_support(expand=False).reshape(-1)
        except NotImplementedError as error:
            raise NotApplicableError(
                f"Latent site {name!r} has a {type(base).__name__} prior whose values cannot be "
                f"enumerated here ({error}): summing a discrete latent over its values needs "
                f"the same values for every observation. Use conditionals='importance' with a "
                f"guide that samples {name!r}."
            ) from None
        index = u.round().clamp(0, support.numel() - 1).long()
        return support[index]
    if isinstance(base, torch.distributions.Normal):
        loc, scale = narrow(base.loc), narrow(base.scale)
        if check_shape is not None:
            check_shape(torch.broadcast_shapes(loc.shape, scale.shape, u.shape), loc.dtype)
        return loc + scale * u.to(loc.dtype)
    if isinstance(
        base,
        (torch.distributions.MultivariateNormal, torch.distributions.LowRankMultivariateNormal),
    ):
        loc, tril = narrow(base.loc), narrow(base.scale_tril)
        if check_shape is not None:
            shape = torch.broadcast_shapes(loc.shape, tril.shape[:-1], u.shape)
            check_shape(shape, loc.dtype)
        return loc + (tril @ u.to(loc.dtype).unsqueeze(-1)).squeeze(-1)
    if isinstance(base, torch.distributions.TransformedDistribution):
        inner = base.base_dist
        if inner.batch_shape + inner.event_shape != base.batch_shape + base.event_shape:
            transforms = ", ".join(type(t).__name__ for t in base.transforms)
            raise NotApplicableError(
                f"Latent site {name!r} has a {type(base).__name__} prior whose transforms "
                f"({transforms}) change the latent's shape; integrating the latents needs "
                f"transforms that keep it. Sample the normal latent with pyro.sample and apply "
                f"the transform in the model, or use conditionals='importance' with a guide."
            )
        try:
            z = whiten(inner, u, name, narrow, check_shape)
        except NotApplicableError:
            raise unsupported_prior_error(name, base) from None
        for transform in base.transforms:
            z = transform(z)
        return z
    raise unsupported_prior_error(name, base)


class _LatentsAtPoints(Messenger):
    """Sets each local latent, as it is sampled, to its prior's map of whitened points.

    With ``compact`` points (shared by every observation, their dims of size one), a prior
    whose parameters are equal along the observations' dims keeps one row, so the value
    does too; ``first_rows=True`` takes every observation's prior from the first one, as the
    check of the compact layout does. ``memory_check``, if given, is called as
    ``memory_check(num_points, dtype)`` before a value that differs per observation is
    formed: the run is then per observation, ``Q N`` evaluations of the model. With
    ``watch_rows``, :attr:`rows_differ` records whether some prior's parameters differ
    between observations (a read of the device per prior).
    """

    def __init__(
        self, structure, points, compact, first_rows=False, memory_check=None, watch_rows=False
    ):
        super().__init__()
        self.structure = structure
        self.points = points
        self.compact = compact
        self.first_rows = first_rows
        self.memory_check = memory_check
        self.watch_rows = watch_rows
        self.rows_differ = False
        layout = structure.point_layout
        self.site_shapes = {} if layout is None else layout.site_shapes
        self.position = 0
        self.offset = 0

    def _pyro_sample(self, msg):
        if msg["is_observed"] or site_is_subsample(msg):
            return
        structure = self.structure
        if msg["name"] in structure.missing_names:
            # The missing part of an observation (obs_mask) is not scored: any value does.
            msg["value"] = torch.zeros((), dtype=self.points.dtype).expand(msg["fn"].shape())
            msg["done"] = True
            return
        latents = structure.latents
        if self.position >= len(latents) or msg["name"] != latents[self.position].name:
            expected = [latent.name for latent in latents]
            raise ValueError(
                f"The model sampled latent site {msg['name']!r} where its first run sampled "
                f"{expected[self.position : self.position + 1] or 'nothing more'} (latents "
                f"{expected}). MPTLoss needs the same latent sites on every run of the model: "
                f"stochastic control flow over latent sites is not supported."
            )
        latent = latents[self.position]
        u = self.points[..., self.offset : self.offset + latent.size]
        fn = msg["fn"]
        # Worked out from shapes alone: once per structure and layout.
        key = (self.position, self.compact, u.shape, fn.batch_shape, fn.event_shape)
        shapes = self.site_shapes.get(key)
        if shapes is None:
            shapes = (self._observation_dims(fn), self._noise_shape(fn, u))
            self.site_shapes[key] = shapes
        obs_dims, noise_shape = shapes
        first_rows = self.first_rows

        def narrow(tensor):
            tensor = narrow_broadcast_dims(tensor, tensor.dim())
            if self.watch_rows and not self.rows_differ:
                first = _narrow_equal_rows(tensor, obs_dims, first=True)
                self.rows_differ = not bool((tensor == first).all())
            many_rows = math.prod(tensor.shape[obs_dims.start : obs_dims.stop]) > 1
            if (self.compact or first_rows) and many_rows:
                tensor = _narrow_equal_rows(tensor, obs_dims, first_rows)
            return tensor

        check_shape = None
        if self.memory_check is not None:
            num_dims = len(fn.batch_shape + fn.event_shape)

            def check_shape(shape, dtype):
                lead = len(shape) - num_dims  # obs_dims count from the left of fn's dims
                if math.prod(shape[lead + obs_dims.start : lead + obs_dims.stop]) > 1:
                    self.memory_check(self.points.shape[0], dtype)

        msg["value"] = whiten(fn, u.reshape(noise_shape), latent.name, narrow, check_shape)
        msg["done"] = True
        self.position += 1
        self.offset += latent.size

    def _plate_batch(self, fn):
        """``fn``'s batch shape within the model's plates, and how many of its leading dims
        index observations."""
        nesting = self.structure.max_plate_nesting
        batch = fn.batch_shape[max(0, len(fn.batch_shape) - nesting) :]
        data_dims = self.structure.data_dims
        return batch, len(batch) + max(data_dims) + 1 if data_dims else 0

    def _observation_dims(self, fn):
        """The positions, from the left of ``fn``'s batch and event shape, of the dims that
        index observations (right of the plate over points)."""
        batch, num_obs = self._plate_batch(fn)
        offset = len(fn.batch_shape) - len(batch)
        return range(offset, offset + num_obs)

    def _noise_shape(self, fn, u):
        """The shape of ``u`` reshaped to the site's value shape inside the plate over
        points."""
        nesting = self.structure.max_plate_nesting
        batch, num_obs = self._plate_batch(fn)
        full = batch + fn.event_shape
        lead = full[:num_obs]
        if u.dim() == 2 and self.compact:
            lead = (1,) * len(lead)
        pad = (1,) * (nesting - len(batch))
        return u.shape[:1] + pad + tuple(lead) + full[num_obs:]


def run_at_points(
    model,
    args,
    kwargs,
    structure,
    points,
    memory_check=None,
    *,
    compact=None,
    first_rows=False,
    check=None,
    watch=False,
):
    """Runs ``model`` with its local latents at whitened ``points``: ``(Q, K)`` shared by
    every observation, or ``(Q,) + batch + (K,)``. The first run of a structure checks the
    model first (:func:`~pyro_mpt.trace.points_check.check_model_at_points`), which decides
    whether shared points keep the observations' dims of size one.

    :param memory_check: if given, called as ``memory_check(num_points, dtype)`` before the
        run forms latent values that differ per observation (it may raise to refuse a run
        too large for memory).
    :param compact: whether shared points keep the observations' dims of size one; None
        (the default): as the structure's check decided. The check itself passes it, and
        ``first_rows`` (every prior taken from its first observation, see
        :class:`_LatentsAtPoints`) and ``watch`` (whether some prior's parameters differ
        between observations, :attr:`PointsRun.rows_differ`).
    :param check: whether the run's ``pyro.factor`` terms are checked not to depend on the
        latents (a read of the device); None (the default): while Pyro's validation is
        enabled, the structure's first run having checked them, or always when ``compact``
        is given.
    :returns: a :class:`PointsRun`.
    """
    if compact is None:
        layout = structure.point_layout
        if layout.shared is None:
            layout.shared = check_model_at_points(model, args, kwargs, structure, run_at_points)
        compact = points.dim() == 2 and layout.shared
        if check is None:
            check = is_validation_enabled()
    elif check is None:
        check = True
    if points.dim() == 2 and not compact:  # the same points for every observation
        batch = structure.observed.batch_shape
        points = points.reshape(points.shape[:1] + (1,) * len(batch) + points.shape[1:])
        points = points.expand(points.shape[:1] + batch + points.shape[-1:])
    latents = _LatentsAtPoints(structure, points, compact, first_rows, memory_check, watch)
    # The first trace validated the model on the data; validating every distribution again
    # at every point would double the cost of this run.
    # The plate over points sits left of every plate of the model.
    plate = pyro.plate(_POINTS_PLATE, points.shape[0], dim=-(structure.max_plate_nesting + 1))
    with plate, pyro.validation_enabled(False):
        try:
            trace = poutine.trace(latents(model)).get_trace(*args, **kwargs)
        except NotApplicableError as error:  # raised by _LatentsAtPoints, in words
            raise type(error)(without_trace_shapes(str(error))) from None
    if latents.position != len(structure.latents):
        missing = [latent.name for latent in structure.latents[latents.position :]]
        raise ValueError(
            f"The model did not sample latent sites {missing} on its second run. MPTLoss "
            f"needs the same latent sites on every run of the model."
        )
    # The observed site, read and checked as the structure's own.
    first = structure.observed
    site = trace.nodes.get(first.name)
    if site is None:
        raise ValueError(
            f"The model did not sample observed site {first.name!r} on this run; MPTLoss "
            f"needs the same sites on every run of the model."
        )
    observed = read_observed_site(site, first.full_shape, len(first.batch_shape), checked=True)
    # A number is the scale of every observation; a tensor is read per observation.
    scale = site["scale"]
    if torch.is_tensor(scale):
        scale = site_scale(site, observed.batch_shape, observed.num_feature_dims)
    else:
        scale = float(scale)
    check_run_matches(structure, trace, scale)
    fn = site["fn"]
    rows_differ = latents.rows_differ
    if not structure.factor_names:
        return PointsRun(fn, trace, observed, scale, 0.0, rows_differ)
    if check:
        check_factors(structure, trace, "integrating the latents out")
    extra_log_prob = factor_log_prob(structure, trace)
    return PointsRun(fn, trace, observed, scale, extra_log_prob, rows_differ)


def enumerated_log_prob(structure, trace):
    """The log-probability under their priors of the values that a run at points (``trace``)
    gave the discrete latents (see :func:`whiten`), summed over those latents and over each
    observation's coordinates: ``(Q,) + batch``, with dims of size one where it is the same
    for every observation. A rule that enumerates their values adds it to its log-weights:
    the probability of each value under its prior at its parents' values at that point.
    Rows are compared as :func:`_narrow_equal_rows` compares them (a read of the device)."""
    batch = structure.observed.batch_shape
    total = None
    for latent in structure.latents:
        if latent.num_values is None:
            continue
        site = trace.nodes[latent.name]
        log_prob = site["fn"].log_prob(site["value"])
        # Dims of the prior's batch right of those that index observations are coordinates
        # of one observation (a feature plate): their probabilities multiply.
        plain = structure.trace.nodes[latent.name]["fn"].batch_shape
        within = len(plain) - latent.num_batch_dims
        if within > 0:
            log_prob = log_prob.sum(tuple(range(-within, 0)))
        num_obs = latent.num_batch_dims
        kept = log_prob.shape[log_prob.dim() - num_obs :] if num_obs else ()
        kept = (1,) * (len(batch) - len(kept)) + tuple(kept)
        log_prob = log_prob.reshape(log_prob.shape[:1] + kept)
        total = log_prob if total is None else total + log_prob
    # Equal for every observation (a prior broadcast along the data plate): one row, so
    # that the rule's weights are shared and the likelihood can be tabulated.
    return _narrow_equal_rows(total, range(1, total.dim()))


def point_parameter(param, fn, observed):
    """A parameter of the observed distribution ``fn`` of a :func:`run_at_points` run as
    ``(Q,) + batch + (D,)``, with dims of size 1 where it is the same for every point or
    every observation: a decoder's output at the nodes stays one copy for every
    observation.

    :raises RuntimeError: if its shape does not broadcast to the observations.
    """
    full = fn.batch_shape + fn.event_shape
    num_lead = len(full) - observed.num_feature_dims
    # A plain ``expand`` view (as plates make) is replaced by the tensor it was broadcast
    # from: narrowing the view would make autograd allocate the full broadcast shape in the
    # backward pass, while the base keeps the graph small.
    base = param._base
    if base is not None and base.dim() <= param.dim():
        padded = base.reshape((1,) * (param.dim() - base.dim()) + base.shape)
        try:
            same = padded.expand(param.shape)
        except RuntimeError:
            same = None
        if (
            same is not None
            and same.stride() == param.stride()
            and same.data_ptr() == param.data_ptr()
        ):
            param = padded
    param = param.reshape((1,) * (len(full) - param.dim()) + param.shape)
    param = param.expand(param.shape[:num_lead] + full[num_lead:])
    param = narrow_broadcast_dims(param, num_lead)
    # (Q,), then the dims that index observations (those between are plates' of size one),
    # then the features flattened into one dim.
    lead = param.shape[:num_lead]
    num_features = math.prod(param.shape[num_lead:])
    param = param.reshape(lead[:1] + lead[num_lead - len(observed.batch_shape) :] + (num_features,))
    target = (param.shape[0],) + observed.batch_shape + observed.value.shape[-1:]
    torch.broadcast_shapes(param.shape, target)
    return param
