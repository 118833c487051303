"""The check a quadrature rule given by the user makes of itself on the data, for the
package's functions (:func:`~pyro_mpt.log_marginal`, :func:`~pyro_mpt.mpt_curve`,
:func:`~pyro_mpt.impute`, :func:`~pyro_mpt.gibbs`): one more run of the model with a finer
rule, and a
:class:`~pyro_mpt.errors.QuadratureAccuracyWarning` with the figure when the two differ by
more than :data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL` nats of ``log p(x)`` per
observation on average or :data:`~pyro_mpt.conditionals.auto.WORST_TOL` at any one.
``MPTLoss`` checks its rules on its own schedule (``MPTLoss.rule_check``)."""

import warnings

import pyro.poutine as poutine
import torch

from pyro_mpt.conditionals.auto import ACCURACY_TOL, STRUCTURE_AWARE, WORST_TOL, too_coarse
from pyro_mpt.conditionals.base import Conditionals, RuleGap, gap_sentence
from pyro_mpt.conditionals.quadrature import Quadrature
from pyro_mpt.errors import QuadratureAccuracyWarning, user_stacklevel
from pyro_mpt.trace.remembered_structure import call_signature
from pyro_mpt.trace.trace_utils import RandomState, same_random_state

__all__ = ["NUM_COMPLETIONS", "check_completed", "prepare_checked"]

#: How many of :func:`~pyro_mpt.impute`'s draws its check of the completed observations
#: takes (two more runs of the model each).
NUM_COMPLETIONS = 4

_FIX = (
    "more nodes, center='guide' with a guide fitted to the posterior, or "
    "conditionals='importance' with such a guide and many samples."
)
# Draws refuse nodes at the guide, which reads the entries to draw.
_DRAWS_FIX = (
    "more nodes (Quadrature(num_points=...)), conditionals='auto', or "
    "conditionals='importance' with a guide that takes a 'hidden' argument and many samples."
)


def prepare_checked(
    strategy, model, guide, args, kwargs, max_plate_nesting, check_rule, caller, scored=None
):
    """``strategy.prepare(...)``, and with ``check_rule`` the rule's check of itself on the
    same data, from the same random state (the same subsample), leaving the caller's random
    state as the preparation alone leaves it: a quadrature rule against a finer one,
    encode-decode and importance sampling against an importance-sampling estimate of
    ``log p(x)`` with the guide on the whole observation
    (:meth:`~pyro_mpt.conditionals.Conditionals.checked_gap`). Strategies with no such
    measure (exact) are not checked, nor ``auto``, which measures the rule it chooses
    while choosing it and warns itself.

    :param str caller: the function's name, for the warning.
    :param scored: if given, called with the prepared conditionals before the check: it may
        raise to refuse them (then no run is spent on the check), and returns the booleans
        ``batch + (D,)`` of the entries the caller's use rests on, whose ``log p`` the check
        compares (for :func:`~pyro_mpt.impute`, those not drawn), or ``None`` for all.
    """
    measures = (
        type(strategy).refinement_gap is not Conditionals.refinement_gap
        or type(strategy).checked_gap is not Conditionals.checked_gap
    )
    check_rule = check_rule and measures and strategy.in_use is strategy
    before = RandomState() if check_rule else None
    structure = None
    if type(strategy).prepare in STRUCTURE_AWARE:
        # The structure it reads for this call serves the check's rule too: one more run.
        signature = call_signature(model, args, kwargs, max_plate_nesting)
        prepared = strategy.prepare(model, guide, args, kwargs, max_plate_nesting, signature)
        structure = strategy.structure_for(signature)
    else:
        prepared = strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
    context = None if scored is None else scored(prepared)
    if check_rule:
        call = (model, guide, args, kwargs)
        _check_rule(strategy, prepared, call, structure, before, caller, context)
    return prepared


def check_completed(strategy, prepared, draws, hidden, call, caller):
    """Warns when the quadrature rule that drew the hidden entries draws them from too few
    nodes. A rule can score the visible entries well and still miss the joint law of many
    hidden ones given few visible ones, a sharper integrand: so for each of the first
    :data:`NUM_COMPLETIONS` draws, the model's observed site is set to it and the change of
    ``log p(x_S | x_R)`` at the drawn ``x_S`` (``log p`` of the whole draw less that of the
    visible entries) under a rule with 1.5 times the nodes per dimension (two thirds of them
    for a rule at :data:`~pyro_mpt.conditionals.quadrature.MAX_POINTS`) is measured; the
    largest of these gaps is the figure, held to the limits of :func:`_check_rule`. Other
    strategies are not checked; the caller's random state is kept.

    :param draws: the draws, ``(S,)`` and the observed site's shape.
    :param hidden: booleans ``batch + (D,)``, True at the entries drawn.
    :param call: ``(model, guide, args, kwargs, max_plate_nesting)``.
    """
    rule = strategy.in_use
    if not isinstance(rule, Quadrature):
        return
    other, compared_with = rule.scaled(1.5), "finer"
    if other is None:
        other, compared_with = rule.scaled(2 / 3), "coarser"
    model, guide, args, kwargs, max_plate_nesting = call
    # The structure the rule read for the data serves the completed data: one run each.
    structure = rule.structure(model, args, kwargs, max_plate_nesting)
    visible = prepared.context(hidden)
    worst = None
    with same_random_state(), torch.no_grad():
        for completed in draws[:NUM_COMPLETIONS]:
            conditioned = poutine.condition(model, data={prepared.observed.name: completed})
            start = RandomState()
            mine = rule.prepare_with(structure, conditioned, guide, args, kwargs)
            start.restore()  # the same subsample
            theirs = other.prepare_with(structure, conditioned, guide, args, kwargs)
            whole = theirs.log_marginal() - mine.log_marginal()
            given = theirs.log_marginal_of(visible) - mine.log_marginal_of(visible)
            gap = RuleGap.of(whole - given)
            if worst is None or gap.mean > worst.mean:
                worst = gap
    _warn_if_coarse(rule, worst, compared_with, caller, completed=True)


def _check_rule(strategy, prepared, call, structure, before, caller, context=None):
    """Warns when a rule's ``log p(x)`` moves by more than ``ACCURACY_TOL`` nats per
    observation on average, or ``WORST_TOL`` at any observation, under a finer rule (under
    a coarser one for a rule that cannot be refined:
    :meth:`~pyro_mpt.conditionals.Conditionals.checked_gap`): its values are about that far
    off. The other rule runs once, from the ``structure`` ``prepared`` was read with (where
    the strategy keeps one) and from the random state ``prepared`` was made from (the same
    subsample); the caller's state is kept."""
    gap, compared_with = _measure(strategy, prepared, call, structure, before, context)
    _warn_if_coarse(strategy, gap, compared_with, caller, context=context)


#: What the figure of each comparison with an importance-sampling reference is
#: (:func:`~pyro_mpt.conditionals.reference_check.mpt_gap_to_reference`), in words, where
#: its sentence (:func:`~pyro_mpt.conditionals.base.gap_sentence`) does not say it.
_REFERENCE_KINDS = {
    "importance": "the figure is a lower bound of the error; ",
    "importance, one draw": "",
    "importance above": "the figure is a conservative estimate of the error; ",
}


def _measure(strategy, prepared, call, structure, before, context=None):
    """``strategy.checked_gap(...)`` from the random state ``before``, leaving the caller's."""
    after = RandomState()
    try:
        return strategy.checked_gap(
            prepared, *call, structure=structure, restore=before.restore, context=context
        )
    finally:
        after.restore()


def _warn_if_coarse(strategy, gap, compared_with, caller, context=None, completed=False):
    """The warning of a rule whose gap is past the limits (none otherwise)."""
    if gap is None or not gap.measured() or not too_coarse(gap, strategy.gap_tolerance):
        return
    sentence = gap_sentence(strategy, gap, compared_with)
    if compared_with in _REFERENCE_KINDS:
        tolerance = ACCURACY_TOL if strategy.gap_tolerance is None else strategy.gap_tolerance
        below = compared_with != "importance above"
        warnings.warn(
            f"{caller} with {sentence}, so its values are "
            f"{'at least ' if below else ''}about that far off "
            f"({_REFERENCE_KINDS[compared_with]}{tolerance:g} nats per observation is "
            f"tolerated). Fix: "
            f"{strategy.accuracy_fix}",
            strategy.accuracy_warning,
            stacklevel=user_stacklevel(),
        )
        return
    if completed:
        sentence = sentence.replace("log p(x)", "log p(x_S | x_R) of its own draws of x_S")
        sentence += ": it draws the hidden entries jointly from too few nodes"
    elif context is not None:
        sentence = sentence.replace("log p(x)", "log p(x_R) of the entries not drawn")
    warnings.warn(
        f"{caller} with {sentence} (the limits are {ACCURACY_TOL:g} on average and "
        f"{WORST_TOL:g} at any observation), so its values are at least about that far off, "
        f"and up to a few times further where the integrand converges slowly (a kink, a "
        f"heavy tail). Fix: "
        f"{_DRAWS_FIX if caller in ('impute', 'gibbs') else _FIX}",
        QuadratureAccuracyWarning,
        stacklevel=user_stacklevel(),
    )
