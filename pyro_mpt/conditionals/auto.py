"""``conditionals="auto"``: the first strategy that applies to the model and is accurate
for it."""

import logging
import math
import warnings

import torch

from pyro_mpt.conditionals.base import Conditionals
from pyro_mpt.conditionals.encode_decode import EncodeDecode
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.importance import Importance
from pyro_mpt.conditionals.quadrature import MAX_POINTS, Quadrature
from pyro_mpt.conditionals.quadrature_self_predictive import QuadratureSelfPredictive
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.remembered_structure import call_signature

__all__ = ["Auto", "STRATEGIES", "as_conditionals"]

logger = logging.getLogger("pyro_mpt")

#: Strategies by name, for ``conditionals=<name>``. ``"auto"`` tries exact, quadrature and
#: importance; ``"encode-decode"``, an approximation, is selectable by name only.
STRATEGIES = {
    "exact": Exact,
    "quadrature": Quadrature,
    "importance": Importance,
    "encode-decode": EncodeDecode,
}

#: ``auto`` takes a quadrature rule when a rule with 1.5 times its nodes per dimension
#: agrees with it on the log-marginal likelihood of nine observations in ten to this many
#: nats: the full data give the narrowest posterior, the hardest of the rule's integrals.
CONVERGENCE_TOL = 1e-3
#: The most quadrature nodes ``auto`` uses, and the most entries of the ``(G, N, D)``
#: log-likelihood tensor it lets a finer rule make.
MAX_NODES, MAX_LIKELIHOOD_ENTRIES = 4096, 2**24


def _describe_model(model):
    name = getattr(model, "__qualname__", None)
    return name if isinstance(name, str) else type(model).__name__


class Auto(Conditionals):
    """Picks the strategy for a model: ``"exact"`` for linear-Gaussian models; for latents
    of dimension up to 3, a prior-centred quadrature rule that has converged (from 20 nodes
    per dimension, refined by 1.5 times until a finer rule changes ``log p(x)`` by less than
    :data:`CONVERGENCE_TOL`, within :data:`MAX_NODES` nodes and
    :data:`MAX_LIKELIHOOD_ENTRIES` likelihood entries); ``"importance"`` otherwise, when a
    guide is given; without one, the finest rule, with a warning that it is coarse.
    ``"encode-decode"`` is never picked: it is an approximation, selectable by name.

    The choice and its reason are logged once per model and argument shapes (logger
    ``"pyro_mpt"``, level INFO) and remembered: later calls go straight to the chosen
    strategy, and search again only if it no longer applies.

    :ivar chosen: the strategy used by the last call, or None before the first.
    """

    name = "auto"

    def __init__(self):
        self.chosen = None
        self.reason = None
        self._chosen_for = None
        self._strategies = {}

    def _strategy(self, name):
        if name not in self._strategies:
            self._strategies[name] = STRATEGIES[name]()
        return self._strategies[name]

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        key = call_signature(model, args, kwargs, max_plate_nesting)
        if self.chosen is not None and key == self._chosen_for:
            state = torch.get_rng_state()
            try:
                return self.chosen.prepare(model, guide, args, kwargs, max_plate_nesting)
            except NotApplicableError:
                torch.set_rng_state(state)  # the model changed: search again
        return self._search(model, guide, args, kwargs, max_plate_nesting, key)

    def _try(self, strategy, model, guide, args, kwargs, max_plate_nesting, reasons):
        """``strategy.prepare(...)``, or None (with the reason kept) when it does not apply.
        A strategy that does not apply leaves the random state as it found it: a seeded call
        draws the same numbers whether or not it searched."""
        state = torch.get_rng_state()
        try:
            return strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
        except NotApplicableError as error:
            torch.set_rng_state(state)
            # Pyro appends the trace's shapes to errors raised inside a model run.
            reason = str(error).split("\nTrace Shapes:")[0].rstrip()
            reasons.append(f"  {strategy.name}: {reason}")
            return None

    def _search(self, model, guide, args, kwargs, max_plate_nesting, key):
        reasons = []
        call = (model, guide, args, kwargs, max_plate_nesting, reasons)
        prepared = self._try(self._strategy("exact"), *call)
        if prepared is not None:
            return self._choose(self._strategy("exact"), key, model, "linear-Gaussian", prepared)
        rule = self._strategy("quadrature")
        state = torch.get_rng_state()
        prepared = self._try(rule, *call)
        coarse = None
        if prepared is not None:
            rule, prepared, gap = _converged_rule(rule, prepared, *call[:5], state)
            if gap < CONVERGENCE_TOL:
                reason = f"converged: 1.5 times its nodes change log p(x) by {gap:.1e} nats"
                return self._choose(rule, key, model, reason, prepared)
            coarse = (rule, prepared, gap)
            reasons.append(
                f"  quadrature: {rule!r} is coarse here: a finer rule changes log p(x) by "
                f"{gap:.2g} nats, and finer rules exceed {MAX_NODES} nodes or "
                f"{MAX_LIKELIHOOD_ENTRIES} likelihood entries"
            )
        importance = self._strategy("importance")
        prepared = self._try(importance, *call)
        if prepared is not None:
            return self._choose(importance, key, model, "a guide is given", prepared)
        if coarse is None:
            raise NotApplicableError(
                "conditionals='auto' found no strategy for this model. Available strategies: "
                "'exact', 'quadrature', 'importance'. Why each does not apply:\n"
                + "\n".join(reasons)
            )
        rule, prepared, gap = coarse
        warnings.warn(
            f"conditionals='auto' uses {rule!r} for {_describe_model(model)}, but a finer "
            f"rule changes its log p(x) by {gap:.2g} nats, so its conditionals are coarse. Give "
            f"MPTLoss a guide (importance sampling then applies), or pass "
            f"Quadrature(center='guide') with a trained guide.",
            stacklevel=4,
        )
        return self._choose(rule, key, model, "coarse, and nothing else applies", prepared)

    def _choose(self, strategy, key, model, reason, prepared):
        if self.chosen is not strategy or self._chosen_for != key:
            logger.info(
                "conditionals='auto' chose %r for %s: %s.", strategy, _describe_model(model), reason
            )
        self.chosen, self._chosen_for, self.reason = strategy, key, reason
        return prepared


def _converged_rule(rule, prepared, model, guide, args, kwargs, max_plate_nesting, state):
    """Refines a quadrature rule by 1.5 times its nodes per dimension until two successive
    rules agree on ``log p(x)`` (:data:`CONVERGENCE_TOL`), within the node and memory
    budget: ``(rule, prepared, gap)`` of the coarser rule of the last pair compared.

    Every rule is prepared from the random ``state`` the first one was, so that a subsampled
    model scores the same observations under each; the state after the first is restored.
    """
    after = torch.get_rng_state()
    try:
        return _refine(rule, prepared, model, guide, args, kwargs, max_plate_nesting, state)
    finally:
        torch.set_rng_state(after)


def _refine(rule, prepared, model, guide, args, kwargs, max_plate_nesting, state):
    dim = prepared.latent_dim
    # A rule that keeps every observation's likelihood at every node; tables keep one row.
    per_node = 1
    if isinstance(prepared, QuadratureSelfPredictive):
        per_node = prepared.observed.value.numel()
    budget = min(MAX_NODES, MAX_LIKELIHOOD_ENTRIES // per_node)
    with torch.no_grad():
        log_marginal = prepared.log_marginal()
    gap = math.inf
    while True:
        num_points = math.ceil(1.5 * rule.num_points)
        if num_points**dim > budget or num_points > MAX_POINTS:
            return rule, prepared, gap
        finer = Quadrature(num_points=num_points, max_latent_dim=rule.max_latent_dim)
        torch.set_rng_state(state)
        finer_prepared = finer.prepare(model, guide, args, kwargs, max_plate_nesting)
        with torch.no_grad():
            finer_log_marginal = finer_prepared.log_marginal()
            differences = (finer_log_marginal - log_marginal).abs().reshape(-1)
            gap = float(differences.quantile(0.9))
        if gap < CONVERGENCE_TOL:
            return rule, prepared, gap
        rule, prepared, log_marginal = finer, finer_prepared, finer_log_marginal


def as_conditionals(conditionals):
    """Normalises the ``conditionals`` argument: a strategy name or a :class:`Conditionals`.

    :raises ValueError: for an unknown name.
    :raises TypeError: for a value of another type.
    """
    if isinstance(conditionals, Conditionals):
        return conditionals
    if isinstance(conditionals, str):
        if conditionals == "auto":
            return Auto()
        if conditionals in STRATEGIES:
            return STRATEGIES[conditionals]()
        names = ", ".join(repr(n) for n in ["auto", *STRATEGIES])
        raise ValueError(
            f"conditionals={conditionals!r} is not a known strategy. Use one of {names}, or "
            f"pass a pyro_mpt.conditionals.Conditionals instance."
        )
    raise TypeError(
        f"conditionals must be a strategy name or a pyro_mpt.conditionals.Conditionals "
        f"instance, got {conditionals!r} of type {type(conditionals).__name__}."
    )
