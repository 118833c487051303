"""``conditionals="auto"``: the first strategy that applies to the model and is accurate
for it."""

import logging
import math
import re
import warnings
from typing import NamedTuple

import torch

from pyro_mpt.conditionals.accuracy_warnings import warn_if_unreliable
from pyro_mpt.conditionals.base import MAX_EDGE_SHARE, Conditionals, RuleGap, edge_clause
from pyro_mpt.conditionals.encode_decode import EncodeDecode
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.importance import ImportanceSampling
from pyro_mpt.conditionals.importance_diagnostics import MAX_UNRELIABLE_SHARE, MIN_EFFECTIVE_SAMPLES
from pyro_mpt.conditionals.quadrature import (
    MAX_POINTS,
    Quadrature,
    compared_num_points,
    rule_gap,
)
from pyro_mpt.errors import (
    NotApplicableError,
    QuadratureAccuracyWarning,
    user_stacklevel,
    without_trace_shapes,
)
from pyro_mpt.ops.masks import as_rate_schedule, sample_masks
from pyro_mpt.trace.remembered_structure import call_signature
from pyro_mpt.trace.trace_utils import RandomState, same_random_state

__all__ = [
    "ACCURACY_TOL",
    "Auto",
    "CONVERGENCE_TOL",
    "SIGNATURE_AWARE",
    "STRATEGIES",
    "STRUCTURE_AWARE",
    "WORST_TOL",
    "as_conditionals",
    "prepare_call",
    "too_coarse",
]

logger = logging.getLogger("pyro_mpt")

#: Strategies by name, for ``conditionals=<name>``. ``"auto"`` tries exact, quadrature and
#: importance; ``"encode-decode"``, an approximation, is selectable by name only.
STRATEGIES = {
    "exact": Exact,
    "quadrature": Quadrature,
    "importance": ImportanceSampling,
    "encode-decode": EncodeDecode,
}

#: ``auto`` stops refining a quadrature rule when a rule with 1.5 times its nodes per
#: dimension, of the other parity (see
#: :func:`~pyro_mpt.conditionals.quadrature.compared_num_points`), agrees with it on the
#: log-marginal likelihood of every observation to this many nats: the full data usually
#: give the narrowest posterior, the hardest of the rule's integrals (not always: see
#: "How auto chooses" in the accuracy docs), and one sharp observation among many easy ones
#: is as hard as it alone.
CONVERGENCE_TOL = 1e-3
#: A rule whose mean change under that refinement is below this many nats per observation,
#: and whose largest is below :data:`WORST_TOL`, is accurate on the data: ``auto`` accepts
#: it when no finer rule fits the budget, and a rule checked on later data (``MPTLoss``'s
#: schedule, ``check_rule``) warns past either.
ACCURACY_TOL = 1e-2
#: The most nats by which refinement may move the log-marginal likelihood of any one
#: observation for a rule to count as accurate (see :data:`ACCURACY_TOL`).
WORST_TOL = 0.1
#: The most quadrature nodes ``auto`` uses, and the most entries of the ``(G, N, D)``
#: log-likelihood tensor it lets a finer rule make.
MAX_NODES, MAX_LIKELIHOOD_ENTRIES = 4096, 2**24
#: Masks per observation on which ``auto`` measures importance sampling's weights.
NUM_PROBE_MASKS = 4


def too_coarse(gap, tolerance=None):
    """Whether a rule whose refinement moved ``log p(x)`` by ``gap`` (a
    :class:`~pyro_mpt.conditionals.base.RuleGap`) is off by more than the data allow: past
    ``tolerance`` (None: :data:`ACCURACY_TOL`) on average or :data:`WORST_TOL` at any
    observation, or whose finer rule holds more than
    :data:`~pyro_mpt.conditionals.base.MAX_EDGE_SHARE` of an observation's posterior on its
    outermost nodes."""
    tolerance = ACCURACY_TOL if tolerance is None else tolerance
    return gap.mean > tolerance or gap.worst > WORST_TOL or gap.edge > MAX_EDGE_SHARE


def _gap_text(rule):
    """What refining a :class:`_Rule` showed, in words."""
    if math.isinf(rule.gap.mean):
        return "no finer rule fits the node and memory budget, so its error is unmeasured"
    return (
        f"the last refinement, to this rule from one with two thirds of its nodes, moved "
        f"log p(x) by {rule.gap.mean:.2g} nats per observation on average and by "
        f"{rule.gap.worst:.2g} at the observation it fits worst"
        f"{edge_clause(rule.gap)}"
    )


def _describe_model(model):
    name = getattr(model, "__qualname__", None)
    return name if isinstance(name, str) else type(model).__name__


class _Rule(NamedTuple):
    """A quadrature candidate: the rule, its prepared conditionals, and its measured error
    (the :class:`~pyro_mpt.conditionals.base.RuleGap` of ``log p(x)`` under refinement)."""

    rule: object
    prepared: object
    gap: RuleGap


class Auto(Conditionals):
    """Picks the strategy for a model, by measured accuracy:

    1. ``"exact"`` for linear-Gaussian models.
    2. For latents of dimension up to 3, a Gauss-Hermite rule centred at the prior,
       refined by 1.5 times its nodes per dimension (from 20) until a finer rule changes
       ``log p(x)`` of every observation by less than :data:`CONVERGENCE_TOL`, within
       :data:`MAX_NODES` nodes and :data:`MAX_LIKELIHOOD_ENTRIES` likelihood entries. Past
       the budget, the last rule is taken if its change is below :data:`ACCURACY_TOL` nats
       per observation on average and :data:`WORST_TOL` at every observation (a first rule
       that cannot be refined, as with three dimensions, is compared with two thirds of
       its nodes instead).
    3. ``"importance"`` (with a guide) if its weights on :data:`NUM_PROBE_MASKS` uniform
       masks per observation pass the thresholds of
       :class:`~pyro_mpt.conditionals.importance.ImportanceDiagnostics`.
    4. Otherwise the most accurate candidate, with a warning that states its figure: a
       coarse rule (its change in nats), or importance sampling (its k-hat and ESS).

    ``"encode-decode"`` is never picked: it is an approximation with no measure of its
    error, selectable by name. The choice, and why each candidate before it was rejected,
    is logged once per model and argument shapes (logger ``"pyro_mpt"``, level INFO) and
    remembered: later calls go straight to the chosen strategy, and search again only if
    it no longer applies.

    :param dict candidates: the instances of the strategies it tries, by name, to share
        with other ``Auto`` objects (each keeps the structures it read); by default its own.
    :ivar chosen: the strategy used by the last call, or None before the first.
    """

    name = "auto"

    def __init__(self, candidates=None):
        self.chosen = None
        self.reason = None
        self._chosen_for = None
        self._strategies = {} if candidates is None else candidates

    def __getstate__(self):
        # A copy (pickled for a spawned process) chooses afresh for the models it is
        # called on: its choice was tied to a model by identity.
        state = dict(self.__dict__)
        state.update(chosen=None, reason=None, _chosen_for=None)
        return state

    @property
    def in_use(self):
        """The strategy chosen by the last call, or this one before the first."""
        return self.chosen or self

    @property
    def guide_loss(self):
        """The guide loss that suits the chosen strategy (None before the first call)."""
        return None if self.chosen is None else self.chosen.guide_loss

    def _strategy(self, name):
        if name not in self._strategies:
            self._strategies[name] = STRATEGIES[name]()
        return self._strategies[name]

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """The chosen strategy's :meth:`~Conditionals.prepare` for a call like the one it was
        chosen for; otherwise a search for the strategy that suits the model.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        key = signature
        if key is None:
            key = call_signature(model, args, kwargs, max_plate_nesting)
        if self.chosen is not None and key == self._chosen_for:
            self._chosen_for = key  # compared by identity when the caller passes it again
            # No snapshot of the random state on this path (a copy of it on every step): the
            # strategies read a model under same_random_state, and only a model whose
            # structure changed while its argument shapes did not fails here, after which
            # the search starts from the random state that the failed attempt left.
            try:
                return prepare_call(self.chosen, model, guide, args, kwargs, max_plate_nesting, key)
            except NotApplicableError:
                pass  # the model changed: search again
        return self._search(model, guide, args, kwargs, max_plate_nesting, key)

    def search(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """Tries the strategies anew and remembers the one that suits the model: what
        :meth:`prepare` does on a first call, and when the chosen strategy no longer applies
        (a caller that prepares with :attr:`chosen` itself calls this then).

        :param signature: as for :meth:`prepare`.
        """
        key = signature
        if key is None:
            key = call_signature(model, args, kwargs, max_plate_nesting)
        return self._search(model, guide, args, kwargs, max_plate_nesting, key)

    def _try(self, strategy, model, guide, args, kwargs, max_plate_nesting, reasons, key=None):
        """``strategy.prepare(...)``, or None (with the reason kept) when it does not apply.
        A strategy that does not apply leaves the random state as it found it: a seeded call
        draws the same numbers whether or not it searched. A strategy that takes the call's
        signature gets ``key``, the object later calls pass, so it finds what it remembered
        by identity."""
        state = RandomState()
        try:
            return prepare_call(strategy, model, guide, args, kwargs, max_plate_nesting, key)
        except NotApplicableError as error:
            state.restore()
            reason = without_trace_shapes(str(error))
            # Advice to use 'auto' is no advice here: auto has just tried every strategy.
            reason = _ADVISES_AUTO.sub("", reason).rstrip()
            reasons.append(f"  {strategy.name}: {reason}")
            return None

    def _search(self, model, guide, args, kwargs, max_plate_nesting, key):
        reasons = []
        call = (model, guide, args, kwargs, max_plate_nesting, reasons, key)
        prepared = self._try(self._strategy("exact"), *call)
        if prepared is not None:
            return self._choose(self._strategy("exact"), key, model, "linear-Gaussian", prepared)
        best = self._best_rule(call)
        if best is not None and best.prepared.latent_dim == 0:
            reason = "exact: its discrete latents are summed over every value"
            return self._choose(best.rule, key, model, reason, best.prepared, reasons)
        if (
            best is not None
            and best.gap.worst < CONVERGENCE_TOL
            and best.gap.edge <= MAX_EDGE_SHARE
        ):
            reason = (
                f"converged: 1.5 times its nodes change log p(x) by at most "
                f"{best.gap.worst:.1e} nats"
            )
            return self._choose(best.rule, key, model, reason, best.prepared, reasons)
        if best is not None and not too_coarse(best.gap):
            reason = (
                f"accurate: 1.5 times its nodes change log p(x) by {best.gap.mean:.1e} nats per "
                f"observation on average (at most {best.gap.worst:.1e})"
            )
            return self._choose(best.rule, key, model, reason, best.prepared, reasons)
        if best is not None:
            reasons.append(
                f"  quadrature: {best.rule!r} is coarse here: {_gap_text(best)}, and finer rules "
                f"exceed {MAX_NODES} nodes or {MAX_LIKELIHOOD_ENTRIES} likelihood entries"
            )
        importance = self._strategy("importance")
        prepared = self._try(importance, *call)
        diagnostics = None if prepared is None else _probe(prepared, args)
        if diagnostics is not None and diagnostics.reliable():
            reason = f"a guide is given and its weights pass: {diagnostics.describe()}"
            return self._choose(importance, key, model, reason, prepared, reasons)
        if diagnostics is not None:
            reasons.append(f"  importance: its weights fail: {diagnostics.describe()}")
        if best is not None and (
            diagnostics is None
            or best.gap.mean < COARSE_RULE_TOL
            or (math.isfinite(best.gap.mean) and _rests_on_few_draws(diagnostics))
        ):
            if math.isinf(best.gap.mean):
                how_far = "by an amount no rule within the budget can measure"
            else:
                how_far = (
                    "by about that much, or a few times more where the integrand converges slowly"
                )
            warnings.warn(
                f"conditionals='auto' uses {best.rule!r} for {_describe_model(model)}, but "
                f"{_gap_text(best)}, so its conditionals may be coarse: off {how_far}. Pass "
                f"a guide that proposes well (importance sampling then applies).",
                QuadratureAccuracyWarning,
                stacklevel=user_stacklevel(),
            )
            reason = "coarse, and nothing more accurate applies"
            if diagnostics is not None and best.gap.mean >= COARSE_RULE_TOL:
                reason = "coarse, but measured, where importance weights rest on a few draws"
            return self._choose(best.rule, key, model, reason, best.prepared, reasons)
        if diagnostics is not None:
            if best is None:
                what = "conditionals='auto' (importance sampling, the only strategy that applies)"
            else:
                what = (
                    f"conditionals='auto' (importance sampling, as {best.rule!r} measured "
                    f"itself coarse: {_gap_text(best)}, past {COARSE_RULE_TOL:g})"
                )
            warn_if_unreliable(diagnostics, what, model, args, guide=guide, strategy=importance)
            reason = "its weights fail, and nothing more accurate applies"
            return self._choose(importance, key, model, reason, prepared, reasons)
        raise NotApplicableError(
            "conditionals='auto' found no strategy for this model. Available strategies: "
            "'exact', 'quadrature', 'importance'. Why each does not apply:\n"
            + "\n".join(reasons)
            + "\nFix what stops the strategy that suits the model: 'exact' for a Normal "
            "likelihood affine in Normal latents, 'quadrature' for at most 3 latent dimensions "
            "with Normal (or transformed Normal) priors and discrete latents of few values, "
            "and otherwise 'importance', which "
            "needs a guide that samples every local latent of the model (an amortized "
            "q(z | x), or AutoNormal(model)): pass it to the SVI or MPTLoss call (guide= of "
            "log_marginal). Then call again (with conditionals='auto', or that strategy by "
            "name)."
        )

    def _best_rule(self, call):
        """The prior-centred quadrature rule, refined until converged or out of budget, as
        a :class:`_Rule`; None if quadrature does not apply.

        Rules centred at the guide are not candidates: their nodes sit where ``q(z | x)``
        of the *full* data puts its mass, and the conditionals of heavily masked inputs,
        whose ``p(z | x_R)`` is far broader, fall outside them while the full-data
        ``log p(x)`` that the refinement checks stays right.
        """
        model, guide, args, kwargs, max_plate_nesting, reasons, _ = call
        rule = self._strategy("quadrature")
        state = RandomState()
        prepared = self._try(rule, *call)
        if prepared is None:
            return None
        return _converged_rule(rule, prepared, *call[:5], state, call[-1])

    def _choose(self, strategy, key, model, reason, prepared, reasons=()):
        if self.chosen is not strategy or self._chosen_for != key:
            rejected = "".join(f"\n{line}" for line in reasons)
            if rejected:
                rejected = "\nRejected before it:" + rejected
            logger.info(
                "conditionals='auto' chose %r for %s: %s.%s",
                strategy,
                _describe_model(model),
                reason,
                rejected,
            )
        self.chosen, self._chosen_for, self.reason = strategy, key, reason
        return prepared


#: The ``prepare`` methods that take the call's signature (``signature=``), so that a caller
#: that has it already passes it on instead of having it worked out again.
SIGNATURE_AWARE = frozenset(
    {Auto.prepare, Exact.prepare, Quadrature.prepare, ImportanceSampling.prepare}
)


def prepare_call(strategy, model, guide, args, kwargs, max_plate_nesting, signature=None):
    """``strategy.prepare(...)``, passing the call's ``signature`` (when given) to the
    strategies that take it (:data:`SIGNATURE_AWARE`), so that they find what they
    remembered for it by identity instead of working it out again."""
    if signature is not None and type(strategy).prepare in SIGNATURE_AWARE:
        return strategy.prepare(model, guide, args, kwargs, max_plate_nesting, signature)
    return strategy.prepare(model, guide, args, kwargs, max_plate_nesting)


#: The ``prepare`` methods that read the model's structure and hand it to ``prepare_with``:
#: a caller that holds the structure (``structure_for``) calls ``prepare_with`` itself.
STRUCTURE_AWARE = frozenset({Exact.prepare, Quadrature.prepare})

#: A sentence of a strategy's error that advises ``conditionals='auto'``.
_ADVISES_AUTO = re.compile(r"Use conditionals='auto'[^.]*\.")


#: With a guide whose importance weights fail, ``auto`` still prefers a coarse rule that a
#: finer rule changes by less than this many nats per observation.
COARSE_RULE_TOL = 0.5


def _rests_on_few_draws(diagnostics):
    """Whether failing importance weights rest on a draw or a handful for many rows: more
    than :data:`~pyro_mpt.conditionals.importance_diagnostics.MAX_UNRELIABLE_SHARE` of
    them on one draw, or a median effective sample size below
    :data:`~pyro_mpt.conditionals.importance_diagnostics.MIN_EFFECTIVE_SAMPLES`. Such rows
    are off by nats each, by an amount nothing measures, where a coarse rule's error is
    measured: on the 2-latent tanh model of ``tests/test_auto.py`` with an untrained guide,
    the rule chosen so is within a tenth of a nat per observation of a dense grid, though
    its last refinement moved log p(x) by more than half a nat."""
    figures = diagnostics.summary()
    return (
        figures["single_draw"] > MAX_UNRELIABLE_SHARE
        or figures["median_ess"] < MIN_EFFECTIVE_SAMPLES
    )


def _probe(prepared, args):
    """The diagnostics of importance weights on :data:`NUM_PROBE_MASKS` uniform-size masks
    per observation, leaving the random state as it found it."""
    observed = prepared.observed
    with same_random_state(), torch.no_grad():
        masks, _ = sample_masks(
            as_rate_schedule("uniform"),
            NUM_PROBE_MASKS,
            prepared.batch_shape,
            prepared.num_features,
            device=observed.value.device,
            entries=observed.entries,
        )
        prepared.log_prob(masks)
    return prepared.diagnostics


def _converged_rule(rule, prepared, model, guide, args, kwargs, max_plate_nesting, state, key):
    """Refines a quadrature rule by 1.5 times its nodes per dimension (of the other parity,
    so that no two rules compared share a blind spot) until two successive
    rules agree on ``log p(x)`` (:data:`CONVERGENCE_TOL`), within the node and memory
    budget: a :class:`_Rule` for the coarser rule of the last pair compared.

    Every rule is prepared from the random ``state`` the first one was, so that a subsampled
    model scores the same observations under each; the state after the first is restored.
    Each rule gets the call's signature ``key``, the object later calls pass.
    """
    after = RandomState()
    try:
        call = (model, guide, args, kwargs, max_plate_nesting)
        return _refine(rule, prepared, call, state, key)
    finally:
        after.restore()


def _refine(rule, prepared, call, state, key):
    dim = prepared.latent_dim
    if dim == 0:  # discrete latents only: summed over every value, exactly
        return _Rule(rule, prepared, RuleGap(0.0, 0.0))
    # Each continuous node is repeated for every combination of discrete values.
    combinations = prepared.log_prob_width // rule.num_points**dim
    budget = min(MAX_NODES, MAX_LIKELIHOOD_ENTRIES // prepared.likelihood_entries_per_node)
    gap = RuleGap(math.inf, math.inf)
    while True:
        num_points = compared_num_points(rule.num_points, 1.5)
        if num_points**dim * combinations > budget or num_points > MAX_POINTS:
            if math.isinf(gap.mean):
                # The first rule cannot be refined (three latent dimensions): compared with
                # two thirds of its nodes, as a rule refined once is with its predecessor.
                gap = _gap_from_coarser(rule, prepared, call, state, key)
            return _Rule(rule, prepared, gap)
        finer = Quadrature(
            num_points=num_points, max_latent_dim=rule.max_latent_dim, center=rule.center
        )
        state.restore()
        finer_prepared = finer.prepare(*call, key)
        gap = rule_gap(prepared, finer_prepared)
        if gap.worst < CONVERGENCE_TOL and gap.edge <= MAX_EDGE_SHARE:
            return _Rule(rule, prepared, gap)
        rule, prepared = finer, finer_prepared


def _gap_from_coarser(rule, prepared, call, state, key):
    """The :func:`~pyro_mpt.conditionals.quadrature.rule_gap` from the rule with two thirds
    of ``rule``'s nodes per dimension to ``rule`` (whose conditionals are ``prepared``), or
    an infinite gap (unmeasured, never accurate) where the coarser rule does not apply."""
    unmeasured = RuleGap(math.inf, math.inf)
    coarser = rule.scaled(2 / 3)
    if coarser is None or coarser.num_points >= rule.num_points:
        return unmeasured
    state.restore()
    try:
        coarser_prepared = coarser.prepare(*call, key)
    except NotApplicableError:
        return unmeasured
    return rule_gap(coarser_prepared, prepared)


def as_conditionals(conditionals, every_mask=False):
    """Normalises the ``conditionals`` argument: a strategy name or a :class:`Conditionals`.

    :param bool every_mask: for ``MPTLoss(num_masks="all")``: the names ``"importance"``
        and ``"auto"`` then stand for (or try) importance sampling whose draws all come from
        the guide on the unmasked input, the setting whose average over every mask has a
        closed form (:meth:`~pyro_mpt.conditionals.SelfPredictive.mask_average`).
    :raises ValueError: for an unknown name.
    :raises TypeError: for a value of another type.
    """
    if isinstance(conditionals, Conditionals):
        return conditionals
    if isinstance(conditionals, str):
        shared = None
        if every_mask:
            shared = ImportanceSampling(share_samples=True, num_proposals=0, unmasked_proposal=True)
        if conditionals == "auto":
            return Auto() if shared is None else Auto(candidates={"importance": shared})
        if conditionals == "importance" and shared is not None:
            return shared
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
