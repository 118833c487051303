"""Self-predictive conditionals by numerical integration over a low-dimensional latent."""

import math

import pyro.poutine as poutine
import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.errors import NotApplicableError, check_positive_int
from pyro_mpt.infer.latent_probe import (
    compact_parameter,
    run_at_latent_points,
    trace_local_model,
    whitened_priors,
)
from pyro_mpt.infer.probe_cache import ProbeCache, ProbedModel
from pyro_mpt.infer.trace_utils import flatten_tail, unwrap_independent
from pyro_mpt.ops.bernoulli_quadrature import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature import (
    adapted_nodes,
    gauss_hermite_grid,
    quadrature_log_conditionals,
    quadrature_log_marginal,
)
from pyro_mpt.ops.tabulated_quadrature import (
    tabulated_log_conditionals,
    tabulated_log_marginal,
    value_indicators,
)

__all__ = [
    "BernoulliQuadratureSelfPredictive",
    "Quadrature",
    "QuadratureSelfPredictive",
    "TabulatedQuadratureSelfPredictive",
]


#: Distributions over one feature whose log-likelihoods can be tabulated over the distinct
#: observed values, with the constructor argument that carries their parameter.
_TABULATED_PARAMETERS = {
    torch.distributions.Bernoulli: ("logits", "probs"),
    torch.distributions.Geometric: ("logits", "probs"),
    torch.distributions.Poisson: ("rate",),
}
#: The most distinct observed values for which a table beats per-observation likelihoods.
_MAX_TABULATED_VALUES = 16


class QuadratureSelfPredictive(SelfPredictive):
    """Conditionals from the per-feature log-likelihoods at every quadrature node."""

    def __init__(self, observed, scale, log_weights, log_likelihoods):
        super().__init__(observed, scale)
        self.log_weights = log_weights
        self.log_likelihoods = log_likelihoods

    def log_prob(self, masks):
        return quadrature_log_conditionals(self.log_weights, self.log_likelihoods, ~masks)

    def log_marginal(self):
        """``log p(x)`` of each observation by the same quadrature rule."""
        return quadrature_log_marginal(self.log_weights, self.log_likelihoods)


class TabulatedQuadratureSelfPredictive(SelfPredictive):
    """Quadrature conditionals from a table ``log p(x_j = v | z_g)``, ``(V, D, G)``, over the
    distinct observed values ``v``, for nodes and likelihood parameters shared by every
    observation."""

    def __init__(self, observed, scale, log_weights, log_table, indicators):
        super().__init__(observed, scale)
        self.log_weights = log_weights
        self.log_table = log_table
        self.indicators = indicators

    def log_prob(self, masks):
        return tabulated_log_conditionals(self.log_weights, self.log_table, self.indicators, ~masks)

    def log_marginal(self):
        """``log p(x)`` of each observation by the same quadrature rule."""
        return tabulated_log_marginal(self.log_weights, self.log_table, self.indicators)


class BernoulliQuadratureSelfPredictive(SelfPredictive):
    """Quadrature conditionals of binary data under ``Bernoulli(logits)`` with logits
    ``(G, D)`` shared by every observation, by
    :func:`~pyro_mpt.ops.bernoulli_quadrature.bernoulli_log_conditionals`."""

    def __init__(self, observed, scale, log_weights, logits):
        super().__init__(observed, scale)
        self.log_weights = log_weights
        self.logits = logits

    def log_prob(self, masks):
        return bernoulli_log_conditionals(
            self.log_weights, self.logits, self.observed.value, ~masks
        )

    def log_marginal(self):
        """``log p(x)`` of each observation by the same quadrature rule."""
        log_table = bernoulli_log_table(self.logits)
        indicators = _binary_indicators(self.observed.value.to(log_table.dtype))
        return tabulated_log_marginal(self.log_weights, log_table, indicators)


class Quadrature(Conditionals):
    """Conditionals by Gauss–Hermite quadrature over the local latents.

    The model runs once with its latents at every node of a tensor-product Gauss–Hermite
    rule for their Gaussian prior (``num_points ** K`` nodes in whitened coordinates), and
    the per-feature log-likelihoods at the nodes serve every mask:

    .. math::

        p(x_j \\mid x_R) = \\frac{\\sum_g w_g\\, p(x_j \\mid z_g)
            \\prod_{k \\in R} p(x_k \\mid z_g)}{\\sum_g w_g \\prod_{k \\in R} p(x_k \\mid z_g)}.

    Any likelihood that factorises over features works (Bernoulli, Normal, Poisson,
    Categorical, ...): the observed site must be a distribution over single features, made
    an event with ``.to_event`` or placed in a feature plate.

    With nodes under the prior, a ``Bernoulli``, ``Geometric`` or ``Poisson`` likelihood
    whose parameters depend on the observation only through ``z`` (a decoder), and data
    with at most 16 distinct values (binary pixels, small counts), the log-likelihoods are
    tabulated over those values, ``(V, D, G)``, and every sum becomes a matrix product: no
    ``(G, N, D)`` tensor, in time or memory. Other cases evaluate the likelihood of every
    observation at every node.

    The first call runs the model twice, once to read its structure and once at the nodes;
    with nodes under the prior, later calls with data of the same shape run it once, at the
    nodes (:mod:`pyro_mpt.infer.probe_cache`).

    :param int num_points: nodes per latent dimension.
    :param int max_latent_dim: the largest total latent dimension ``K`` accepted
        (``num_points ** K`` nodes; the default 3).
    :param str center: where the nodes go. ``"prior"`` places them under the latent prior.
        ``"guide"`` centres and scales them per observation at the guide's ``q(z | x)``
        (the weights absorb the density ratio, so the rule still integrates against the
        prior): far more accurate when the posterior is much narrower than the prior, as
        for images with hundreds of pixels. Needs ``Normal`` priors and a guide with
        ``Normal`` latents; no gradient flows into the guide.

    .. note:: Latents must have ``Normal`` or ``MultivariateNormal`` priors and sit inside
        the data plate. For larger latents use ``conditionals="importance"``.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Quadrature
        >>> loss = MPTLoss(rate="uniform", conditionals=Quadrature(num_points=20))
    """

    name = "quadrature"

    def __init__(self, num_points=20, max_latent_dim=3, center="prior"):
        num_points = check_positive_int("num_points", num_points, "e.g. num_points=20.")
        if center not in ("prior", "guide"):
            raise ValueError(f"center must be 'prior' or 'guide', got {center!r}.")
        self.num_points = int(num_points)
        self.max_latent_dim = int(max_latent_dim)
        self.center = center
        self._probes = ProbeCache()

    def __repr__(self):
        return f"Quadrature(num_points={self.num_points}, center={self.center!r})"

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        if self.center == "prior":
            remembered = self._probes.latents_for(model, args, kwargs, max_plate_nesting)
            if remembered is not None:
                nodes, log_weights = gauss_hermite_grid(self.num_points, *remembered)
                probed = self._probes.run(model, args, kwargs, nodes)
                if probed is not None:
                    return _self_predictive(probed, log_weights)
        local = trace_local_model(model, args, kwargs, max_plate_nesting)
        if not local.latent_names:
            raise NotApplicableError(
                "quadrature integrates over local latents and the model has none."
            )
        obs_site = local.trace.nodes[local.observed.name]
        base = unwrap_independent(obs_site["fn"])
        if base.event_shape:
            raise NotApplicableError(
                f"Observed site {local.observed.name!r} has a {type(base).__name__} likelihood "
                f"that does not factorise over features; quadrature needs one distribution per "
                f"feature (e.g. Bernoulli(...).to_event(1))."
            )
        priors = whitened_priors(local)
        latent_dim = sum(p.mean.shape[-1] for p in priors)
        if latent_dim > self.max_latent_dim:
            raise NotApplicableError(
                f"quadrature integrates over at most {self.max_latent_dim} latent dimensions "
                f"({self.num_points}**K nodes) and the latent sites {local.latent_names} have "
                f"K={latent_dim}. Use conditionals='importance' for larger latents."
            )
        # Nodes follow the latents' dtype: observations may be integers (counts, classes).
        mean = priors[0].mean
        nodes, log_weights = gauss_hermite_grid(
            self.num_points, latent_dim, mean.dtype, mean.device
        )
        if self.center == "guide":
            center, scale = _guide_in_whitened_coordinates(guide, args, kwargs, local, priors)
            nodes, log_weights = adapted_nodes(nodes, log_weights, center, scale)
        fn = run_at_latent_points(model, args, kwargs, local, priors, nodes)
        if self.center == "prior":
            self._probes.remember(model, args, kwargs, max_plate_nesting, local, priors)
        latents = tuple(local.latent_names)
        probed = ProbedModel(local.observed, local.scale, fn, obs_site["value"], latents)
        return _self_predictive(probed, log_weights)


def _self_predictive(probed, log_weights):
    """The :class:`SelfPredictive` of a model probed at the nodes."""
    observed, fn = probed.observed, probed.fn
    if log_weights.dim() == 1:
        tabulated = _tabulated_self_predictive(fn, observed, probed.scale, log_weights)
        if tabulated is not None:
            return tabulated
    ll = unwrap_independent(fn).log_prob(probed.value)
    ll = flatten_tail(ll, observed.num_feature_dims)
    ll = ll.expand(ll.shape[:1] + (-1,) * (ll.dim() - 1))
    ll = ll.reshape((log_weights.shape[0],) + observed.batch_shape + (-1,))
    return QuadratureSelfPredictive(observed, probed.scale, log_weights, ll)


def _guide_in_whitened_coordinates(guide, args, kwargs, local, priors):
    """The guide's mean and scale of every latent in the prior's whitened coordinates
    ``u = (z - prior_mean) / prior_scale``, concatenated: ``batch + (K,)`` each, detached."""
    if guide is None:
        raise NotApplicableError("quadrature with center='guide' needs a guide.")
    with torch.no_grad():
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        centers, scales = [], []
        for prior in priors:
            prior_fn = unwrap_independent(prior.site["fn"])
            site = guide_trace.nodes.get(prior.name)
            q = unwrap_independent(site["fn"]) if site is not None else None
            if not isinstance(prior_fn, torch.distributions.Normal) or not isinstance(
                q, torch.distributions.Normal
            ):
                raise NotApplicableError(
                    f"quadrature with center='guide' needs a Normal prior and a Normal guide "
                    f"distribution for latent site {prior.name!r}; use center='prior'."
                )
            shape = prior.mean.shape[:-1] + (-1,)
            full = site["fn"].batch_shape + site["fn"].event_shape
            q_loc = q.loc.expand(full).reshape(local.observed.batch_shape + (-1,))
            q_scale = q.scale.expand(full).reshape(local.observed.batch_shape + (-1,))
            prior_scale = prior.scale_fn(torch.ones_like(prior.mean)).reshape(shape)
            centers.append((q_loc - prior.mean) / prior_scale)
            scales.append(q_scale / prior_scale)
    return torch.cat(centers, -1), torch.cat(scales, -1)


def _binary_indicators(ones):
    """``[x = 0]`` and ``[x = 1]``, ``(2,) + batch + (D,)``, stacked on dim -2 and viewed
    as such: the layout the tables use."""
    return torch.stack([1 - ones, ones], -2).movedim(-2, 0)


def _tabulated_self_predictive(fn, observed, scale, log_weights):
    """A :class:`BernoulliQuadratureSelfPredictive` for ``Bernoulli(logits)`` over binary
    data, or a :class:`TabulatedQuadratureSelfPredictive` with tables ``(G, V, D)`` and
    ``(V,) + batch + (D,)``, when the probed likelihood is one of ``_TABULATED_PARAMETERS``
    with parameters shared by every observation and the data take at most
    ``_MAX_TABULATED_VALUES`` distinct values; ``None`` otherwise."""
    base = unwrap_independent(fn)
    names = next((n for t, n in _TABULATED_PARAMETERS.items() if isinstance(base, t)), None)
    if names is None:
        return None
    # The parameter the distribution was built from: the other is computed lazily, and
    # Bernoulli keeps the constructor's tensor as ``_param``.
    params = vars(base)
    name = next(
        (n for n in names if n in params and params.get("_param", params[n]) is params[n]), None
    )
    if name is None:
        return None
    try:
        param = compact_parameter(params[name], fn, observed)
    except RuntimeError:
        return None
    if any(size != 1 for size in param.shape[1:-1]):
        return None  # parameters vary across observations
    param = param.reshape(param.shape[:1] + param.shape[-1:])  # (G, D)
    value = observed.value
    ones = value.to(param.dtype)
    if not bool((ones * (1 - ones)).any()):  # binary data (NaN was ruled out by the trace)
        if name == "logits" and isinstance(base, torch.distributions.Bernoulli):
            return BernoulliQuadratureSelfPredictive(observed, scale, log_weights, param)
        values = value.new_tensor([0, 1])
        indicators = _binary_indicators(ones)
    else:
        values = torch.unique(value)
        if values.numel() > _MAX_TABULATED_VALUES:
            return None
        indicators = value_indicators(values, value).to(param.dtype)
    table_fn = type(base)(**{name: param.unsqueeze(-2)}, validate_args=False)
    log_table = table_fn.log_prob(values.to(param.dtype).reshape(-1, 1))  # (G, V, D)
    if not bool(torch.isfinite(log_table).all()):
        return None  # a value impossible at some node (e.g. probs of exactly 0 or 1)
    return TabulatedQuadratureSelfPredictive(observed, scale, log_weights, log_table, indicators)
