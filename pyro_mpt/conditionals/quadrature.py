"""Self-predictive conditionals by numerical integration over a low-dimensional latent."""

import copy
import math

import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.errors import NotApplicableError, check_positive_int
from pyro_mpt.infer.remembered_structure import RememberedStructure
from pyro_mpt.infer.trace_utils import flatten_tail, unwrap_independent
from pyro_mpt.infer.whitened_latents import (
    point_parameter,
    run_at_points,
    whitened_guide,
)
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_nodes import adapted_nodes, gauss_hermite_grid
from pyro_mpt.ops.quadrature_tabulated import (
    tabulated_log_conditionals,
    value_indicators,
)

__all__ = [
    "BernoulliQuadratureSelfPredictive",
    "Quadrature",
    "QuadratureRuleSelfPredictive",
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
#: The most nodes per dimension: Gauss-Hermite weights underflow beyond a few hundred.
MAX_POINTS = 200
#: The most distinct observed values for which a table beats per-observation likelihoods.
_MAX_TABULATED_VALUES = 16


class QuadratureRuleSelfPredictive(SelfPredictive):
    """What every quadrature rule's conditionals offer besides ``log_prob``: the
    log-marginal likelihood and the posterior over the nodes, by the same rule."""

    def node_log_joint(self):
        """``log w_g + log p(x | z_g)`` over the observed entries, ``(G,) + batch``."""
        raise NotImplementedError

    def log_marginal(self):
        """``log p(x)`` of each observation (of its observed entries) by the same rule."""
        return torch.logsumexp(self.node_log_joint(), dim=0)

    def _entry_weights(self, dtype):
        entries = self.observed.entries
        return None if entries is None else entries.to(dtype)

    def node_log_posterior(self, context):
        """``log pi_g(x_R)``, the posterior probability of each node given the context
        features of each observation, ``(G,) + batch``: ``pi_g`` is proportional to
        ``w_g prod_{k in R} p(x_k | z_g)``.

        :param torch.Tensor context: booleans ``batch + (D,)``, ``True`` at the features of
            ``R`` (observed entries only: see :meth:`SelfPredictive.context`).
        """
        restricted = copy.copy(self)
        restricted.observed = self.observed._replace(entries=context.to(torch.bool))
        log_joint = restricted.node_log_joint()
        return log_joint - torch.logsumexp(log_joint, 0)


class QuadratureSelfPredictive(QuadratureRuleSelfPredictive):
    """Conditionals from the per-feature log-likelihoods at every quadrature node."""

    def __init__(self, observed, scale, log_weights, log_likelihoods, extra_log_prob=0.0):
        super().__init__(observed, scale, extra_log_prob)
        self.log_weights = log_weights
        self.log_likelihoods = log_likelihoods

    def log_prob(self, masks):
        return quadrature_log_conditionals(
            self.log_weights, self.log_likelihoods, self.context(masks)
        )

    def node_log_joint(self):
        ll = self.log_likelihoods
        weights = self._entry_weights(ll.dtype)
        total = ll.sum(-1) if weights is None else (ll * weights).sum(-1)
        log_weights = self.log_weights
        return (
            log_weights.reshape(log_weights.shape + (1,) * (total.dim() - log_weights.dim()))
            + total
        )


class TabulatedQuadratureSelfPredictive(QuadratureRuleSelfPredictive):
    """Quadrature conditionals from a table ``log p(x_j = v | z_g)``, ``(V, D, G)``, over the
    distinct observed values ``v``, for nodes and likelihood parameters shared by every
    observation."""

    def __init__(self, observed, scale, log_weights, log_table, indicators, extra_log_prob=0.0):
        super().__init__(observed, scale, extra_log_prob)
        self.log_weights = log_weights
        self.log_table = log_table
        self.indicators = indicators

    def log_prob(self, masks):
        return tabulated_log_conditionals(
            self.log_weights, self.log_table, self.indicators, self.context(masks)
        )

    def node_log_joint(self):
        indicators = self.indicators.to(self.log_table.dtype)
        weights = self._entry_weights(indicators.dtype)
        if weights is not None:
            indicators = indicators * weights
        onehot = indicators.movedim(0, -2).flatten(-2)  # batch + (V * D,)
        total = onehot @ self.log_table.flatten(1).T  # batch + (G,)
        return (self.log_weights + total).movedim(-1, 0)


class BernoulliQuadratureSelfPredictive(TabulatedQuadratureSelfPredictive):
    """Quadrature conditionals of binary data under ``Bernoulli(logits)`` with logits
    ``(G, D)`` shared by every observation, by
    :func:`~pyro_mpt.ops.quadrature_bernoulli.bernoulli_log_conditionals`."""

    def __init__(self, observed, scale, log_weights, logits, extra_log_prob=0.0):
        # The table and indicators serve log_marginal only: built when it is called.
        super().__init__(observed, scale, log_weights, None, None, extra_log_prob)
        self.logits = logits

    def log_prob(self, masks):
        return bernoulli_log_conditionals(
            self.log_weights, self.logits, self.observed.value, self.context(masks)
        )

    def node_log_joint(self):
        self.log_table = bernoulli_log_table(self.logits)
        self.indicators = _binary_indicators(self.observed.value.to(self.logits.dtype))
        return super().node_log_joint()


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

    Each call runs the model once at the nodes, with every latent drawn through its own
    prior at the nodes of the whitened space (:mod:`pyro_mpt.infer.whitened_latents`), so
    hierarchical latents are integrated right; the first call with a model (and argument
    shapes) also traces it once to read its structure.

    :param int num_points: nodes per latent dimension.
    :param int max_latent_dim: the largest total latent dimension ``K`` accepted
        (``num_points ** K`` nodes; the default 3).
    :param str center: where the nodes go. ``"prior"`` places them under the latent prior.
        ``"guide"`` centres and scales them per observation at the guide's ``q(z | x)``
        (the weights absorb the density ratio, so the rule still integrates against the
        prior): far more accurate when the posterior is much narrower than the prior, as
        for images with hundreds of pixels. Needs ``Normal`` priors and a guide with
        ``Normal`` latents; no gradient flows into the guide.

    .. note:: Latents must have ``Normal``, ``MultivariateNormal`` or transformed-normal
        (e.g. ``LogNormal``) priors, possibly depending on other latents, and sit inside
        the data plate. For larger latents use ``conditionals="importance"``.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Quadrature
        >>> loss = MPTLoss(rate="uniform", conditionals=Quadrature(num_points=20))
    """

    name = "quadrature"

    def __init__(self, num_points=20, max_latent_dim=3, center="prior"):
        self._structure = RememberedStructure()
        num_points = check_positive_int("num_points", num_points, "e.g. num_points=20.")
        if num_points > MAX_POINTS:
            raise ValueError(
                f"num_points={num_points} is more than {MAX_POINTS}, past which Gauss-Hermite "
                f"weights underflow; use at most {MAX_POINTS}, or importance sampling."
            )
        if center not in ("prior", "guide"):
            raise ValueError(
                f"center must be 'prior' or 'guide', got {center!r}: 'prior' places the nodes "
                f"under the latents' prior, 'guide' at the guide's q(z | x)."
            )
        self.num_points = int(num_points)
        self.max_latent_dim = int(max_latent_dim)
        self.center = center

    def __repr__(self):
        return f"Quadrature(num_points={self.num_points}, center={self.center!r})"

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        structure = self._structure.get(model, args, kwargs, max_plate_nesting)
        observed = structure.observed
        if not structure.latents:
            raise NotApplicableError(
                "quadrature integrates over local latents and the model has none."
            )
        base = unwrap_independent(structure.trace.nodes[observed.name]["fn"])
        if base.event_shape:
            raise NotApplicableError(
                f"Observed site {observed.name!r} has a {type(base).__name__} likelihood "
                f"that does not factorise over features; quadrature needs one distribution per "
                f"feature (e.g. Bernoulli(...).to_event(1))."
            )
        latent_dim = structure.latent_dim
        if latent_dim > self.max_latent_dim:
            raise NotApplicableError(
                f"quadrature integrates over at most {self.max_latent_dim} latent dimensions "
                f"({self.num_points}**K nodes) and the latent sites "
                f"{list(structure.latent_names)} have K={latent_dim}. Use "
                f"conditionals='importance' for larger latents."
            )
        # Nodes follow the latents' dtype: observations may be integers (counts, classes).
        first = structure.trace.nodes[structure.latents[0].name]["value"]
        nodes, log_weights = gauss_hermite_grid(
            self.num_points, latent_dim, first.dtype, first.device
        )
        if self.center == "guide":
            if guide is None:
                raise NotApplicableError("quadrature with center='guide' needs a guide.")
            center, scale = whitened_guide(model, guide, args, kwargs, structure)
            nodes, log_weights = adapted_nodes(nodes, log_weights, center, scale)
        run = run_at_points(model, args, kwargs, structure, nodes)
        prepared = _self_predictive(run, log_weights)
        prepared.latent_dim = latent_dim
        prepared.nodes = nodes  # whitened points (G, K), or (G,) + batch + (K,) at the guide
        return prepared


def _self_predictive(run, log_weights):
    """The :class:`SelfPredictive` of a model run at the nodes."""
    observed, scale, fn, extra = run.observed, run.scale, run.fn, run.extra_log_prob
    if log_weights.dim() == 1:
        tabulated = _tabulated_self_predictive(fn, observed, scale, log_weights, extra)
        if tabulated is not None:
            return tabulated
    ll = unwrap_independent(fn).log_prob(observed.value.reshape(observed.full_shape))
    ll = flatten_tail(ll, observed.num_feature_dims)
    ll = ll.expand(ll.shape[:1] + (-1,) * (ll.dim() - 1))
    ll = ll.reshape((log_weights.shape[0],) + observed.batch_shape + (-1,))
    return QuadratureSelfPredictive(observed, scale, log_weights, ll, extra)


def _binary_indicators(ones):
    """``[x = 0]`` and ``[x = 1]``, ``(2,) + batch + (D,)``, stacked on dim -2 and viewed
    as such: the layout the tables use."""
    return torch.stack([1 - ones, ones], -2).movedim(-2, 0)


def _tabulated_self_predictive(fn, observed, scale, log_weights, extra):
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
        param = point_parameter(params[name], fn, observed)
    except RuntimeError:
        return None
    if any(size != 1 for size in param.shape[1:-1]):
        return None  # parameters vary across observations
    param = param.reshape(param.shape[:1] + param.shape[-1:])  # (G, D)
    value = observed.value
    ones = value.to(param.dtype)
    if not bool((ones * (1 - ones)).any()):  # binary data (NaN was ruled out by the trace)
        if name == "logits" and isinstance(base, torch.distributions.Bernoulli):
            return BernoulliQuadratureSelfPredictive(observed, scale, log_weights, param, extra)
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
    return TabulatedQuadratureSelfPredictive(
        observed, scale, log_weights, log_table, indicators, extra
    )
