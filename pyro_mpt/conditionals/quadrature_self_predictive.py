"""The conditionals of a model run at quadrature nodes: per-observation log-likelihoods at
every node, or tables over the distinct observed values when the likelihood's parameters
are shared by every observation (binary pixels, small counts)."""

import copy

import torch
from torch.distributions import constraints

from pyro_mpt.conditionals.base import SelfPredictive
from pyro_mpt.conditionals.likelihood_draws import observation_draws, picked_draws
from pyro_mpt.ops.conditional_sampling import mixture_component_sample
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_tabulated import tabulated_log_conditionals, value_indicators
from pyro_mpt.trace.trace_utils import flatten_tail, unwrap_independent
from pyro_mpt.trace.whitened_latents import point_parameter

__all__ = [
    "BernoulliQuadratureSelfPredictive",
    "QuadratureRuleSelfPredictive",
    "QuadratureSelfPredictive",
    "TabulatedQuadratureSelfPredictive",
    "quadrature_self_predictive",
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
        or ``(G,) + batch + (K,)`` placed per observation.
    :param callable run_at: ``run_at(points)``, the model run with its latents at whitened
        ``points`` (a :class:`~pyro_mpt.trace.whitened_latents.PointsRun`): :meth:`sample`
        draws the observations there.
    """

    def __init__(self, observed, scale, log_weights, extra_log_prob=0.0, *, nodes, run_at):
        super().__init__(observed, scale, extra_log_prob)
        self.log_weights = log_weights
        self.nodes = nodes
        self.run_at = run_at

    @property
    def latent_dim(self):
        """``K``, the total dimension of the latents the rule integrates over."""
        return self.nodes.shape[-1]

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

    def sample(self, hidden, num_samples, joint=True):
        """Draws exact for the rule: a node ``g`` with probability ``pi_g(x_R)``
        (:meth:`node_log_posterior`), then the hidden features from the model's own
        likelihood at it; one node per draw (``joint=True``), or per draw and feature. See
        :meth:`SelfPredictive.sample`."""
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

    def __init__(
        self, observed, scale, log_weights, log_likelihoods, extra_log_prob=0.0, *, nodes, run_at
    ):
        super().__init__(observed, scale, log_weights, extra_log_prob, nodes=nodes, run_at=run_at)
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
        *,
        nodes,
        run_at,
    ):
        super().__init__(observed, scale, log_weights, extra_log_prob, nodes=nodes, run_at=run_at)
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

    def __init__(self, observed, scale, log_weights, logits, extra_log_prob=0.0, *, nodes, run_at):
        # The table and indicators serve log_marginal only: built when it is called.
        super().__init__(
            observed, scale, log_weights, None, None, extra_log_prob, nodes=nodes, run_at=run_at
        )
        self.logits = logits

    def log_prob(self, masks):
        return bernoulli_log_conditionals(
            self.log_weights, self.logits, self.observed.value, self.context(masks)
        )

    def node_log_joint(self):
        self.log_table = bernoulli_log_table(self.logits)
        self.indicators = _binary_indicators(self.observed.value.to(self.logits.dtype))
        return super().node_log_joint()


def quadrature_self_predictive(run, log_weights, nodes, run_at, memory_check=None):
    """The :class:`SelfPredictive` of a model run at the nodes.

    :param run: the :class:`~pyro_mpt.trace.whitened_latents.PointsRun` at the nodes.
    :param torch.Tensor log_weights: the nodes' log-weights.
    :param torch.Tensor nodes: the whitened nodes, ``(G, K)`` or ``(G,) + batch + (K,)``.
    :param callable run_at: ``run_at(points)``, the model run at whitened points, for draws.
    :param memory_check: if given, called as ``memory_check(num_nodes, dtype)`` before the
        log-likelihood of every observation at every node is formed (it may raise).
    """
    observed, scale, fn, extra = run.observed, run.scale, run.fn, run.extra_log_prob
    rule = dict(nodes=nodes, run_at=run_at)
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
