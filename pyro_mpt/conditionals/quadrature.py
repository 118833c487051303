"""Self-predictive conditionals by numerical integration over a low-dimensional latent:
the strategy (:class:`Quadrature`), which runs the model at the nodes of a rule, and the
conditionals of such a run (:func:`quadrature_self_predictive`): per-observation
log-likelihoods at every node, or tables over the distinct observed values when the
likelihood's parameters are shared by every observation (binary pixels, small counts)."""

import copy
import functools
import math
import numbers
import os
import weakref

import torch
from torch.distributions import constraints

from pyro_mpt.conditionals.base import Conditionals, RuleGap, SelfPredictive
from pyro_mpt.conditionals.likelihood_draws import observation_draws, picked_draws
from pyro_mpt.errors import (
    NotApplicableError,
    QuadratureAccuracyWarning,
    check_positive_int,
    joint_likelihood_error,
)
from pyro_mpt.ops.conditional_sampling import mixture_component_sample
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_edge import edge_share, outermost_nodes
from pyro_mpt.ops.quadrature_nodes import adapted_nodes, enumerated_nodes, gauss_hermite_grid
from pyro_mpt.ops.quadrature_tabulated import tabulated_log_conditionals, value_indicators
from pyro_mpt.trace.guide_centres import whitened_guide
from pyro_mpt.trace.model_structure import points_dtype
from pyro_mpt.trace.remembered_structure import RememberedStructure
from pyro_mpt.trace.trace_utils import distribution_mask, flatten_tail, unwrap_independent
from pyro_mpt.trace.whitened_latents import (
    enumerated_log_prob,
    point_parameter,
    run_at_points,
)

__all__ = [
    "MAX_ENUMERATED",
    "MAX_POINTS",
    "MEMORY_FRACTION",
    "BernoulliQuadratureSelfPredictive",
    "Quadrature",
    "QuadratureRuleSelfPredictive",
    "QuadratureSelfPredictive",
    "TabulatedQuadratureSelfPredictive",
    "compared_num_points",
    "quadrature_self_predictive",
    "rule_gap",
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


class QuadratureRuleSelfPredictive(SelfPredictive):
    """What every quadrature rule's conditionals offer besides ``log_prob``: the
    log-marginal likelihood, the posterior over the nodes and draws, by the same rule.

    :param observed: the run's :class:`~pyro_mpt.trace.model_structure.ObservedSite`.
    :param scale: its log-probability scale per observation.
    :param torch.Tensor log_weights: ``log w_g``, ``(G,)``, or ``(G,) + batch`` for nodes
        placed per observation.
    :param extra_log_prob: the model's ``pyro.factor`` terms (see
        :class:`~pyro_mpt.conditionals.SelfPredictive`).
    :param torch.Tensor nodes: the whitened nodes, ``(G, K)`` shared by every observation
        or ``(G,) + batch + (K,)`` placed per observation (the coordinates of discrete
        latents hold indices of their values, see
        :func:`~pyro_mpt.trace.whitened_latents.whiten`).
    :param int latent_dim: how many of the ``K`` coordinates are continuous, integrated by
        the rule's nodes rather than enumerated (all of them by default).
    :param torch.Tensor on_edge: booleans ``(G,)``, True at the nodes on the edge of the
        rule's span (:func:`~pyro_mpt.ops.quadrature_edge.outermost_nodes`); None where it
        is not known (no share of the edge is then measured).
    :param callable run_at: ``run_at(points)``, the model run with its latents at whitened
        ``points`` (a :class:`~pyro_mpt.trace.whitened_latents.PointsRun`): :meth:`sample`
        draws the observations there; ``None`` for nodes that cannot serve draws (see
        :meth:`check_draws`).
    """

    def __init__(
        self,
        observed,
        scale,
        log_weights,
        extra_log_prob=0.0,
        *,
        nodes,
        run_at,
        latent_dim=None,
        on_edge=None,
    ):
        super().__init__(observed, scale, extra_log_prob)
        self.log_weights = log_weights
        self.nodes = nodes
        self.run_at = run_at
        # The dimension of the continuous latents, which the rule's nodes integrate over
        # (discrete ones are summed over every value, exactly).
        self.latent_dim = nodes.shape[-1] if latent_dim is None else latent_dim
        self.on_edge = on_edge

    @property
    def log_prob_width(self):
        """``G``, the rule's nodes: each mask's conditionals are sums over them."""
        return self.log_weights.shape[0]

    @property
    def likelihood_entries_per_node(self):
        """How many log-likelihood entries the rule keeps per node: one row of a table
        shared by every observation (1) here; every entry of every observation where the
        log-likelihoods are kept at each node. ``auto`` sizes its finer rules by it."""
        return 1

    def node_log_joint(self):
        """``log w_g + log p(x | z_g)`` over the observed entries, ``(G,) + batch``."""
        raise NotImplementedError

    def log_marginal(self):
        """``log p(x)`` of each observation (of its observed entries) by the same rule."""
        return torch.logsumexp(self.node_log_joint(), dim=0)

    def log_marginal_of(self, entries):
        """``log p`` of the entries ``entries`` marks (booleans ``batch + (D,)``) by the same
        rule; of every observed entry for ``None``."""
        if entries is None:
            return self.log_marginal()
        return self._restricted(entries).log_marginal()

    def edge_share_of(self, entries=None):
        """The posterior probability of the rule's outermost nodes given the entries
        ``entries`` marks (every observed entry for ``None``), per observation
        (:func:`~pyro_mpt.ops.quadrature_edge.edge_share`); None where the rule's edge is
        not known."""
        if self.on_edge is None:
            return None
        restricted = self if entries is None else self._restricted(entries)
        return edge_share(restricted.node_log_joint(), self.on_edge)

    def _restricted(self, entries):
        """These conditionals with the observed entries replaced by ``entries``."""
        restricted = copy.copy(self)
        restricted.observed = self.observed._replace(entries=entries.to(torch.bool))
        return restricted

    def mask_average(self):
        """The rule's ``log p(x)``: its conditionals are those of the mixture over its
        nodes, and average to that mixture's log-marginal over every mask."""
        return self.log_marginal()

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
        log_joint = self._restricted(context).node_log_joint()
        return log_joint - torch.logsumexp(log_joint, 0)

    def check_draws(self):
        """Raises ``ValueError`` for nodes placed at the guide (``Quadrature(center="guide")``):
        the guide read the whole data, the entries to draw too, so the draws would depend on
        values that :func:`~pyro_mpt.impute` and :func:`~pyro_mpt.gibbs` ignore."""
        if self.run_at is None:
            raise ValueError(
                "Quadrature(center='guide') places its nodes at the guide's q(z | x) on the "
                "whole data, the entries to draw included, so the draws would depend on the "
                "values given there, which impute and gibbs ignore. Use a rule centred at the "
                "prior (Quadrature(num_points=...)), conditionals='auto', or "
                "ImportanceSampling with a guide that takes a 'hidden' argument (see 'Guides "
                "for masked inputs')."
            )

    def check_masked_contexts(self, what):
        """Raises ``ValueError`` for nodes placed at the guide (``Quadrature(center="guide")``):
        the guide read the whole data, the hidden entries too, and its nodes sit where
        ``p(z | x)`` puts its mass, which misses the far broader ``p(z | x_R)`` of a heavily
        masked input; the refinement check of ``log p(x)`` cannot see it. Conditionals
        averaged over every mask telescope to the rule's ``log p(x)``, and stay right."""
        if self.run_at is None:
            raise ValueError(
                f"{what} scores masked inputs, but Quadrature(center='guide') places its nodes "
                f"at the guide's q(z | x) on the whole data, hidden entries included: they "
                f"miss the broader p(z | x_R) of a masked input, by nats where many entries "
                f"are hidden, and no check of log p(x) sees it. Use a rule centred at the "
                f"prior (Quadrature(num_points=...)), conditionals='auto', or "
                f"MPTLoss(num_masks='all'), whose average over every mask is the rule's "
                f"log p(x)."
            )

    def sample(self, hidden, num_samples, joint=True):
        """Draws exact for the rule: a node ``g`` with probability ``pi_g(x_R)``
        (:meth:`node_log_posterior`), then the hidden features from the model's own
        likelihood at it; one node per draw (``joint=True``), or per draw and feature. See
        :meth:`SelfPredictive.sample`.

        :raises ValueError: as :meth:`check_draws`.
        """
        self.check_draws()
        observed, nodes = self.observed, self.nodes
        log_posterior = self.node_log_posterior(self.context(hidden))  # (G,) + batch
        if joint:
            # One node per draw and observation, then the model runs once at those points.
            index = mixture_component_sample(log_posterior, (num_samples,))  # (S,) + batch
            if nodes.dim() == 2:
                points = nodes[index]
            else:
                index_k = index.unsqueeze(-1).expand(index.shape + nodes.shape[-1:])
                shape = nodes.shape[:1] + observed.batch_shape + nodes.shape[-1:]
                points = nodes.expand(shape).gather(0, index_k)
            draws = observation_draws(self.run_at(points).fn, observed, (num_samples,))
            return self.keep_given(hidden, draws)
        # Each feature from its own node: the likelihood drawn at every node, then picked.
        log_posterior = log_posterior.unsqueeze(-1).expand(
            log_posterior.shape + (observed.num_features,)
        )
        index = mixture_component_sample(log_posterior, (num_samples,))  # (S,) + batch + (D,)
        run = self.run_at(nodes)
        return self.keep_given(hidden, picked_draws(run.fn, observed, nodes.shape[0], index))


class QuadratureSelfPredictive(QuadratureRuleSelfPredictive):
    """Conditionals from the per-feature log-likelihoods at every quadrature node."""

    def __init__(self, observed, scale, log_weights, log_likelihoods, extra_log_prob=0.0, **rule):
        super().__init__(observed, scale, log_weights, extra_log_prob, **rule)
        self.log_likelihoods = log_likelihoods

    @property
    def likelihood_entries_per_node(self):
        return self.observed.value.numel()

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

    def __init__(
        self,
        observed,
        scale,
        log_weights,
        log_table,
        indicators,
        extra_log_prob=0.0,
        **rule,
    ):
        super().__init__(observed, scale, log_weights, extra_log_prob, **rule)
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

    def __init__(self, observed, scale, log_weights, logits, extra_log_prob=0.0, **rule):
        # The table and indicators serve log_marginal only: built when it is called.
        super().__init__(observed, scale, log_weights, None, None, extra_log_prob, **rule)
        self.logits = logits

    def log_prob(self, masks):
        return bernoulli_log_conditionals(
            self.log_weights, self.logits, self.observed.value, self.context(masks)
        )

    def node_log_joint(self):
        self.log_table = bernoulli_log_table(self.logits)
        self.indicators = _binary_indicators(self.observed.value.to(self.logits.dtype))
        return super().node_log_joint()


def quadrature_self_predictive(
    run, log_weights, nodes, run_at, memory_check=None, latent_dim=None, on_edge=None
):
    """The :class:`SelfPredictive` of a model run at the nodes.

    :param run: the :class:`~pyro_mpt.trace.whitened_latents.PointsRun` at the nodes.
    :param torch.Tensor log_weights: the nodes' log-weights.
    :param torch.Tensor nodes: the whitened nodes, ``(G, K)`` or ``(G,) + batch + (K,)``.
    :param callable run_at: ``run_at(points)``, the model run at whitened points, for draws.
    :param memory_check: if given, called as ``memory_check(num_nodes, dtype)`` before the
        log-likelihood of every observation at every node is formed (it may raise).
    :param int latent_dim: how many coordinates of the nodes are continuous (all of them
        by default; see :class:`QuadratureRuleSelfPredictive`).
    :param torch.Tensor on_edge: which nodes lie on the edge of the rule's span (see
        :class:`QuadratureRuleSelfPredictive`).
    """
    observed, scale, fn, extra = run.observed, run.scale, run.fn, run.extra_log_prob
    rule = dict(nodes=nodes, run_at=run_at, latent_dim=latent_dim, on_edge=on_edge)
    if log_weights.dim() == 1:
        tabulated = _tabulated_self_predictive(fn, observed, scale, log_weights, extra, rule)
        if tabulated is not None:
            return tabulated
    if memory_check is not None:
        memory_check(log_weights.shape[0], log_weights.dtype)
    ll = unwrap_independent(fn).log_prob(observed.value.reshape(observed.full_shape))
    ll = flatten_tail(ll, observed.num_feature_dims)
    ll = ll.expand(ll.shape[:1] + (-1,) * (ll.dim() - 1))
    ll = ll.reshape((log_weights.shape[0],) + observed.batch_shape + (-1,))
    return QuadratureSelfPredictive(observed, scale, log_weights, ll, extra, **rule)


def _binary_indicators(ones):
    """``[x = 0]`` and ``[x = 1]``, ``(2,) + batch + (D,)``, stacked on dim -2 and viewed
    as such: the layout the tables use."""
    return torch.stack([1 - ones, ones], -2).movedim(-2, 0)


def _is_binary(ones, base):
    """Whether the data ``ones`` are zeros and ones (NaN was ruled out by the trace). Read
    from the data on the CPU, where the read waits for no device. Elsewhere a likelihood
    whose support is boolean is taken at its word, as Pyro does: while validation is
    enabled :func:`~pyro_mpt.trace.observed_site.read_observed_site` has checked the data
    against it, and with validation off the data are trusted."""
    if ones.device.type != "cpu" and base.support is constraints.boolean:
        return True
    return not bool((ones * (1 - ones)).any())


def _tabulated_self_predictive(fn, observed, scale, log_weights, extra, rule):
    """A :class:`BernoulliQuadratureSelfPredictive` for ``Bernoulli(logits)`` over binary
    data, or a :class:`TabulatedQuadratureSelfPredictive` with tables ``(G, V, D)`` and
    ``(V,) + batch + (D,)``, when the probed likelihood is one of ``_TABULATED_PARAMETERS``
    with parameters shared by every observation and the data take at most
    ``_MAX_TABULATED_VALUES`` distinct values; ``None`` otherwise. ``rule`` holds the
    constructors' ``nodes`` and ``run_at``."""
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
    if _is_binary(ones, base):
        if name == "logits" and isinstance(base, torch.distributions.Bernoulli):
            return BernoulliQuadratureSelfPredictive(
                observed, scale, log_weights, param, extra, **rule
            )
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
        observed, scale, log_weights, log_table, indicators, extra, **rule
    )


def rule_gap(coarser, finer, context=None):
    """The :class:`~pyro_mpt.conditionals.base.RuleGap` between two rules' conditionals
    (:class:`QuadratureRuleSelfPredictive`): the change of each observation's ``log p`` of
    its observed entries (of those ``context`` marks, if given) from the coarser rule to
    the finer, and the share of the finer rule's posterior on its outermost nodes
    (:mod:`~pyro_mpt.ops.quadrature_edge`)."""
    with torch.no_grad():
        change = finer.log_marginal_of(context) - coarser.log_marginal_of(context)
        return RuleGap.of(change, finer.edge_share_of(context))


#: The most nodes per dimension: Gauss-Hermite weights underflow beyond a few hundred.
MAX_POINTS = 200


def compared_num_points(num_points, factor):
    """The nodes per dimension of the rule a rule of ``num_points`` is compared with:
    ``factor`` times as many (rounded up, at least one), of the other parity.

    Gauss–Hermite rules are symmetric about the prior's centre; one of an odd number of
    nodes has a node there and one of an even number has none. Two rules of the same parity
    share that blind spot: an integrand whose feature sits at the centre (a step of the
    likelihood at ``z = 0``) is integrated alike by both, and equally wrongly, so they agree
    while both are off by nats. A rule compared with one of the other parity sees it.
    """
    compared = max(1, math.ceil(factor * num_points))
    if compared % 2 == num_points % 2:
        if factor >= 1:
            compared += 1
        elif compared > 1:  # a one-node rule has no coarser one
            compared -= 1
    return compared


#: The most combinations of the discrete latents' values per observation that a rule sums
#: over (each multiplies the continuous nodes).
MAX_ENUMERATED = 4096
#: The share of the memory available on the device that a run evaluating the likelihood of
#: every observation at every node may need, by the estimate, unless ``max_memory_gb`` says.
MEMORY_FRACTION = 0.5
#: ``(G, N, D)`` tensors such a run holds at once, at least: the likelihood's parameters,
#: the log-likelihoods, and the gradients of both.
_PER_OBSERVATION_TENSORS = 4


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
    prior at the nodes of the whitened space (:mod:`pyro_mpt.trace.whitened_latents`), so
    hierarchical latents are integrated right; the first call with a model (and argument
    shapes) also traces it once to read its structure. A prior whose parameters are the same
    for every observation keeps its nodes shared whether it is broadcast along the data
    plate (``Normal(torch.zeros(K), 1)``) or materialised with equal rows
    (``Normal(x.new_zeros(N, K), x.new_ones(N, K))``); the rows are compared on every call.

    A run that evaluates the likelihood of every observation at every node (a prior or
    likelihood parameters that differ per observation, or ``center="guide"``) is estimated
    first, at ``4 G N D`` numbers of the data's dtype, and refused with a
    :class:`~pyro_mpt.errors.NotApplicableError` naming the estimate and the fix when it
    exceeds ``max_memory_gb`` (``conditionals="auto"`` then moves on to importance sampling).

    :param int num_points: nodes per latent dimension.
    :param int max_latent_dim: the largest total latent dimension ``K`` accepted
        (``num_points ** K`` nodes; the default 3).
    :param str center: where the nodes go. ``"prior"`` places them under the latent prior.
        ``"guide"`` centres and scales them per observation at the guide's ``q(z | x)``
        (the weights absorb the density ratio, so the rule still integrates against the
        prior): far more accurate for ``log p(x)`` when the posterior is much narrower than
        the prior, as for images with hundreds of pixels. The nodes are placed for the full
        data, so the conditionals of heavily masked inputs, whose posterior is broader, can
        fall outside them: ``conditionals="auto"`` never picks this rule, and
        :func:`~pyro_mpt.impute` and :func:`~pyro_mpt.gibbs` refuse it (the guide would read
        the entries they draw). Needs ``Normal`` priors and a guide with ``Normal`` latents;
        no gradient flows into the guide.
    :param float max_memory_gb: the most memory, in GB (``1e9`` bytes), that a run evaluating
        the likelihood of every observation at every node may need by the estimate; ``None``
        (the default): :data:`MEMORY_FRACTION` of the memory available on the data's device
        when the run starts.

    Discrete latents of finitely many values with scalar events (``Categorical``,
    ``Bernoulli``, ``Binomial``: a mixture's assignment) are summed over every value: each
    node is repeated for every combination of their values (at most
    :data:`MAX_ENUMERATED` per observation), weighted by their prior's probability at its
    parents' values. A model whose latents are all discrete is thus integrated exactly,
    whatever ``num_points``, and with no guide.

    .. note:: Continuous latents must have ``Normal``, ``MultivariateNormal`` or
        transformed-normal (e.g. ``LogNormal``) priors, discrete ones a finite support, possibly
        depending on other latents, and all sit inside the data plate. For larger latents
        use ``conditionals="importance"``.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Quadrature
        >>> loss = MPTLoss(rate="uniform", conditionals=Quadrature(num_points=20))
    """

    name = "quadrature"
    accuracy_warning = QuadratureAccuracyWarning
    accuracy_fix = (
        "raise num_points, use center='guide' with a guide fitted to the posterior, or "
        "conditionals='auto', which refines the rule as training goes on."
    )

    def __init__(self, num_points=20, max_latent_dim=3, center="prior", max_memory_gb=None):
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
        if max_memory_gb is not None and (
            isinstance(max_memory_gb, bool)
            or not isinstance(max_memory_gb, numbers.Real)
            or not max_memory_gb > 0
        ):
            raise ValueError(
                f"max_memory_gb must be a positive number of GB or None (a share of the "
                f"available memory), got {max_memory_gb!r}; e.g. max_memory_gb=8."
            )
        self.num_points = int(num_points)
        self.max_latent_dim = int(max_latent_dim)
        self.center = center
        self.max_memory_gb = None if max_memory_gb is None else float(max_memory_gb)
        # The rule's nodes and log-weights in the dtypes and on the devices used so far, and
        # each structure's plan (see _plan), by its point layout.
        self._grids = {}
        self._plans = weakref.WeakKeyDictionary()

    def __getstate__(self):
        # A copy (pickled for a spawned process) keeps the rule's settings and works out
        # its grids and plans afresh: the plans are keyed by weak reference.
        state = dict(self.__dict__)
        state["_grids"], state["_plans"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._plans = weakref.WeakKeyDictionary()

    def __repr__(self):
        return f"Quadrature(num_points={self.num_points}, center={self.center!r})"

    @property
    def guide_loss(self):
        """Nodes at the guide need a guide fitted to the posterior: ``"elbo"`` trains it."""
        return "elbo" if self.center == "guide" else None

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """See :meth:`Conditionals.prepare`.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        call = (model, guide, args, kwargs, max_plate_nesting, signature)
        return self._structure.prepared(self, *call)

    def refinement_gap(
        self, prepared, model, guide, args, kwargs, structure=None, factor=1.5, context=None
    ):
        """The change of ``log p(x)`` when the rule is refined to 1.5 times its nodes per
        dimension (the test ``conditionals="auto"`` chose it by), on the data of
        ``prepared``'s call, as a :class:`~pyro_mpt.conditionals.base.RuleGap` (the mean over
        the observations and the largest); NaN when no finer rule fits (more than
        :data:`MAX_POINTS` nodes per dimension, or more memory than allowed). The
        finer rule is prepared from the random state the caller leaves, so a subsampled model
        must be given the state ``prepared`` was made from. ``factor`` below 1 compares
        with a coarser rule instead (``factor`` times the nodes, at least one): for a rule
        at the limit, a sign that it is still moving, not a measure of its own error.
        ``context``, booleans ``batch + (D,)``: ``log p`` of those entries only (the ones a
        draw rests on), rather than of every observed entry."""
        if prepared.latent_dim == 0:
            return RuleGap(0.0, 0.0)  # discrete latents only: summed over every value, exactly
        other = self.scaled(factor)
        if other is None:
            return RuleGap.unmeasured()
        try:
            with torch.no_grad():
                if structure is None:
                    other_prepared = other.prepare(model, guide, args, kwargs)
                else:
                    other_prepared = other.prepare_with(structure, model, guide, args, kwargs)
        except NotApplicableError:
            return RuleGap.unmeasured()
        if factor < 1:
            return rule_gap(other_prepared, prepared, context)
        return rule_gap(prepared, other_prepared, context)

    def scaled(self, factor):
        """The rule this one is compared with: ``factor`` times its nodes per dimension, of
        the other parity (:func:`compared_num_points`), or None past :data:`MAX_POINTS`."""
        num_points = compared_num_points(self.num_points, factor)
        if num_points > MAX_POINTS:
            return None
        return Quadrature(
            num_points=num_points,
            max_latent_dim=self.max_latent_dim,
            center=self.center,
            max_memory_gb=self.max_memory_gb,
        )

    def structure_for(self, signature):
        """The structure :meth:`prepare` read for calls of ``signature`` (the very object it
        was passed), or None: a caller that holds it calls :meth:`prepare_with`."""
        return self._structure.held(signature)

    def structure(self, model, args, kwargs, max_plate_nesting=math.inf):
        """The structure this rule reads for such a call: the one it holds when the call's
        signature is that of its last call, else read afresh."""
        return self._structure.get(model, args, kwargs, max_plate_nesting)

    def prepare_with(self, structure, model, guide, args, kwargs):
        """:meth:`prepare` for a call like the one ``structure`` was read from (the same
        model and argument shapes): the model runs once, at the nodes."""
        layout = structure.point_layout
        plan = self._plans.get(layout) if layout is not None else None
        if plan is None:  # once per structure: it depends on nothing else
            plan = self._plan(structure)
            if layout is not None:
                self._plans[layout] = plan
        nodes, log_weights, memory_check, latent_dim, on_edge = plan
        if self.center == "guide":
            if guide is None:
                raise NotApplicableError("quadrature with center='guide' needs a guide.")
            center, scale = whitened_guide(model, guide, args, kwargs, structure)
            nodes, log_weights = adapted_nodes(nodes, log_weights, center, scale)
        run = run_at_points(model, args, kwargs, structure, nodes, memory_check)
        if latent_dim < nodes.shape[-1]:
            # Each value of the discrete latents weighs as much as their prior gives it.
            log_weights = _with_prior_of_values(log_weights, structure, run)
        # Draws run the model again at the nodes they pick, with the structure read here;
        # nodes placed by a guide that read the entries to draw serve none.
        run_at = None
        if self.center == "prior":
            run_at = functools.partial(run_at_points, model, args, kwargs, structure)
        # Nodes: whitened points (G, K), or (G,) + batch + (K,) at the guide.
        rule = (run_at, memory_check, latent_dim, on_edge)
        return quadrature_self_predictive(run, log_weights, nodes, *rule)

    def _plan(self, structure):
        """What a structure's every call uses: the prior's nodes and log-weights, the
        memory check of :meth:`_memory_check`, the dimension of the continuous latents and
        which nodes lie on the edge of the rule's span, after checking that the rule
        applies. The coordinates of discrete latents are enumerated
        (:func:`~pyro_mpt.ops.quadrature_nodes.enumerated_nodes`).

        :raises NotApplicableError: for a model without local latents, a likelihood that does
            not factorise over features, more than ``max_latent_dim`` continuous latent
            dimensions, more than :data:`MAX_ENUMERATED` combinations of discrete values,
            or discrete latents under ``center="guide"``.
        """
        observed = structure.observed
        if not structure.latents:
            raise NotApplicableError(
                "quadrature integrates over local latents and the model has none."
            )
        base = unwrap_independent(structure.trace.nodes[observed.name]["fn"])
        if base.event_shape:
            raise joint_likelihood_error(observed.name, base, "quadrature")
        for latent in structure.latents:
            prior = unwrap_independent(structure.trace.nodes[latent.name]["fn"])
            if prior.support.is_discrete and prior.event_shape:
                # A one-hot latent is discrete with an event of its own: neither a
                # continuous coordinate nor one that the rule enumerates.
                raise NotApplicableError(
                    f"Latent site {latent.name!r} has a {type(prior).__name__} prior, discrete "
                    f"with an event of shape {tuple(prior.event_shape)}; quadrature sums "
                    f"discrete latents with scalar values only. Sample a Categorical and "
                    f"one-hot it in the model (torch.nn.functional.one_hot), or use "
                    f"conditionals='importance' with a guide."
                )
        columns, num_values = _enumerated_coordinates(structure)
        latent_dim = structure.latent_dim - len(columns)
        if latent_dim > self.max_latent_dim:
            raise NotApplicableError(
                f"quadrature integrates over at most {self.max_latent_dim} latent dimensions "
                f"({self.num_points}**K nodes) and the latent sites "
                f"{list(structure.latent_names)} have K={latent_dim}. Use "
                f"conditionals='importance' for larger latents."
            )
        num_combinations = math.prod(num_values)
        if num_combinations > MAX_ENUMERATED:
            discrete = [latent.name for latent in structure.latents if latent.num_values]
            raise NotApplicableError(
                f"quadrature sums the discrete latent sites {discrete} over every combination "
                f"of their values, and they take {num_combinations} combinations per "
                f"observation, more than MAX_ENUMERATED={MAX_ENUMERATED}. Use "
                f"conditionals='importance' with a guide that samples them, or a model with "
                f"fewer discrete coordinates per observation."
            )
        masked = [
            latent.name
            for latent in structure.latents
            if latent.num_values
            and distribution_mask(structure.trace.nodes[latent.name]["fn"]) is not None
        ]
        if masked:
            raise NotApplicableError(
                f"The priors of the discrete latent sites {masked} are masked (.mask(...)), "
                f"and the sum over their values weighs each value by its prior everywhere. "
                f"Mask the observation instead (obs_mask, or .mask(...) on the observed "
                f"site), or use conditionals='importance' with a guide."
            )
        if columns and self.center == "guide":
            raise NotApplicableError(
                "Quadrature(center='guide') places its nodes at the guide's Normal latents, "
                "and the model has discrete latents, which are summed over their values. Use "
                "Quadrature(center='prior')."
            )
        # Nodes follow the continuous latents' dtype: observations may be integers (counts,
        # classes), and so are the values of discrete latents.
        grid_key = (latent_dim, *points_dtype(structure))
        grid = self._grids.get(grid_key)
        if grid is None:  # once per latent dimension, dtype and device
            grid = gauss_hermite_grid(self.num_points, *grid_key)
            self._grids[grid_key] = grid
        nodes, log_weights = enumerated_nodes(*grid, columns, num_values)
        memory_check = self._memory_check(structure, latent_dim, num_combinations)
        continuous = [column for column in range(nodes.shape[-1]) if column not in columns]
        on_edge = outermost_nodes(nodes, continuous)
        return nodes, log_weights, memory_check, latent_dim, on_edge

    def _memory_check(self, structure, latent_dim, num_combinations=1):
        """A check, ``check(num_nodes, dtype)``, that raises before a run evaluates the
        likelihood of every observation at ``num_nodes`` nodes when its estimated memory is
        above the limit."""
        observed = structure.observed
        num_obs, num_features = math.prod(observed.batch_shape), observed.num_features
        device = observed.value.device

        def check(num_nodes, dtype):
            per_node = num_obs * num_features * dtype.itemsize * _PER_OBSERVATION_TENSORS
            needed = num_nodes * per_node
            if self.max_memory_gb is not None:
                limit, source = self.max_memory_gb * 1e9, f"max_memory_gb={self.max_memory_gb:g}"
            else:
                available = _available_memory(device)
                if available is None:
                    return
                limit = MEMORY_FRACTION * available
                source = (
                    f"{MEMORY_FRACTION:g} of the {available / 1e9:.1f} GB available on "
                    f"{device.type}, MEMORY_FRACTION"
                )
            if needed <= limit:
                return
            budget = limit / per_node / num_combinations
            fits = math.floor(budget ** (1 / latent_dim) + 1e-9) if latent_dim else 0
            fewer = (
                f"fewer nodes (num_points={min(fits, self.num_points - 1)} fits this batch)"
                if fits >= 2
                else "fewer nodes"
            )
            raise NotApplicableError(
                f"{self!r} would evaluate the likelihood of each of the {num_obs} observations "
                f"at each of its {num_nodes} nodes (num_points={self.num_points}, K="
                f"{latent_dim}), because the latents' prior or the likelihood's parameters "
                f"differ between observations (or center='guide'). That needs an estimated "
                f"{needed / 1e9:.3g} GB ({num_nodes} nodes x {num_obs} observations x "
                f"{num_features} features x {dtype.itemsize} bytes x "
                f"{_PER_OBSERVATION_TENSORS} tensors), above the limit of {limit / 1e9:.3g} "
                f"GB ({source}). Use {fewer}, a smaller batch, or conditionals='importance'; "
                f"or raise max_memory_gb if the memory is there."
            )

        return check


def _enumerated_coordinates(structure):
    """The positions, among the latents' ``K`` coordinates, of those of discrete latents,
    and how many values each takes: ``(columns, num_values)``."""
    columns, num_values, offset = [], [], 0
    for latent in structure.latents:
        if latent.num_values is not None:
            columns += range(offset, offset + latent.size)
            num_values += [latent.num_values] * latent.size
        offset += latent.size
    return columns, num_values


def _with_prior_of_values(log_weights, structure, run):
    """The rule's log-weights plus the log-probability of the discrete latents' values at
    each node (:func:`~pyro_mpt.trace.whitened_latents.enumerated_log_prob`): ``(G,)`` when
    it is the same for every observation, else ``(G,) + batch``."""
    prior = enumerated_log_prob(structure, run.trace)
    if all(size == 1 for size in prior.shape[1:]):
        return log_weights + prior.reshape(prior.shape[:1])
    batch = structure.observed.batch_shape
    log_weights = log_weights.reshape(log_weights.shape + (1,) * len(batch))
    return (log_weights + prior).expand((prior.shape[0],) + batch)


def _available_memory(device):
    """Bytes of memory available for new tensors on ``device``: free GPU memory plus what
    PyTorch's allocator holds unused, or the host's available memory (Linux); ``None``
    where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
