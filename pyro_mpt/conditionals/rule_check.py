"""The check a quadrature rule given by the user makes of itself on the data, for the
package's functions (:func:`~pyro_mpt.log_marginal`, :func:`~pyro_mpt.mpt_curve`,
:func:`~pyro_mpt.impute`, :func:`~pyro_mpt.gibbs`): one more run of the model with a finer
rule, and a
:class:`~pyro_mpt.errors.QuadratureAccuracyWarning` with the figure when the two differ by
more than :data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL` nats of ``log p(x)`` per
observation on average or :data:`~pyro_mpt.conditionals.auto.WORST_TOL` at any one.
``MPTLoss`` checks its rules on its own schedule (``MPTLoss.rule_check``)."""

import warnings

from pyro_mpt.conditionals.auto import ACCURACY_TOL, STRUCTURE_AWARE, WORST_TOL, too_coarse
from pyro_mpt.conditionals.base import Conditionals, gap_sentence
from pyro_mpt.errors import QuadratureAccuracyWarning
from pyro_mpt.trace.remembered_structure import call_signature
from pyro_mpt.trace.trace_utils import RandomState

__all__ = ["prepare_checked"]

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
    state as the preparation alone leaves it. Strategies with no such measure (exact,
    importance) are not checked, nor ``auto``, which measures the rule it chooses while
    choosing it and warns itself.

    :param str caller: the function's name, for the warning.
    :param scored: if given, called with the prepared conditionals before the check: it may
        raise to refuse them (then no run is spent on the check), and returns the booleans
        ``batch + (D,)`` of the entries the caller's use rests on, whose ``log p`` the check
        compares (for :func:`~pyro_mpt.impute`, those not drawn), or ``None`` for all.
    """
    measures = type(strategy).refinement_gap is not Conditionals.refinement_gap
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


def _check_rule(strategy, prepared, call, structure, before, caller, context=None):
    """Warns when a rule's ``log p(x)`` moves by more than ``ACCURACY_TOL`` nats per
    observation on average, or ``WORST_TOL`` at any observation, under a finer rule (under
    a coarser one for a rule that cannot be refined:
    :meth:`~pyro_mpt.conditionals.Conditionals.checked_gap`): its values are about that far
    off. The other rule runs once, from the ``structure`` ``prepared`` was read with (where
    the strategy keeps one) and from the random state ``prepared`` was made from (the same
    subsample); the caller's state is kept."""
    after = RandomState()
    try:
        gap, compared_with = strategy.checked_gap(
            prepared, *call, structure=structure, restore=before.restore, context=context
        )
    finally:
        after.restore()
    if gap is None or not gap.measured() or not too_coarse(gap):
        return
    sentence = gap_sentence(strategy, gap, compared_with)
    if context is not None:
        sentence = sentence.replace("log p(x)", "log p(x_R) of the entries not drawn")
    warnings.warn(
        f"{caller} with {sentence} (the limits are {ACCURACY_TOL:g} on average and "
        f"{WORST_TOL:g} at any observation), so its values are at least about that far off, "
        f"and up to a few times further where the integrand converges slowly (a kink, a "
        f"heavy tail). Fix: "
        f"{_DRAWS_FIX if caller in ('impute', 'gibbs') else _FIX}",
        QuadratureAccuracyWarning,
        stacklevel=5,  # the caller of the package's function, through package_function
    )
