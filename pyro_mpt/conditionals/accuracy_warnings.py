"""When approximate conditionals warn that a call's figures fail: failing calls are counted
per model, argument shapes, guide and strategy (or by the caller, as an ``MPTLoss`` counts
its own calls) and warned of at the 1st, 10th, 100th, ... failure. Early failures of an
untrained guide then hide no later one, and a long run is not flooded. Each kind of
diagnostics writes its own message (its ``warn`` method); this module only decides when,
and writes the one of conditionals that the floors kept off the CPU
(:func:`warn_if_floored`)."""

import contextlib
import contextvars
import math
import warnings
import weakref

import torch

from pyro_mpt.errors import QuadratureAccuracyWarning, user_stacklevel
from pyro_mpt.ops import floored_exp

__all__ = ["counted_per_call", "failure_history", "warn_if_floored", "warn_if_unreliable"]

#: Owner of a model (the object of a bound method, else the function) -> {(what, method
#: or None, argument shapes, strategy, guide): ``[checks, failures]``} of
#: :func:`warn_if_unreliable`. Weak keys: the counts go with their model, and a new model
#: never inherits an old one's.
_CHECKS = weakref.WeakKeyDictionary()
#: The same for models that cannot be weakly referenced, by ``id``.
_CHECKS_BY_ID = {}

#: The counts of the call under way, where one is (:func:`counted_per_call`).
_PER_CALL = contextvars.ContextVar("accuracy_warning_counts", default=None)


@contextlib.contextmanager
def counted_per_call():
    """Inside the block, :func:`warn_if_unreliable` counts failing calls afresh: one
    evaluation (``log_marginal``, ``mpt_curve``, ``impute``, a ``gibbs`` chain) warns at its
    own first failure, whatever earlier evaluations of the same model and shapes found, once
    for ``auto``'s search and the estimate it then makes, and a chain of many draws is not
    flooded."""
    token = _PER_CALL.set({})
    try:
        yield
    finally:
        _PER_CALL.reset(token)


def failure_history(counts, failed):
    """Counts one call in ``counts`` (``[checks, failures]``) and says whether it warns: None
    unless it failed and is the 1st, 10th, 100th, ... failure; then ``""`` for the first and
    ``" (F of the C calls so far failed)"`` for the later ones."""
    counts[0] += 1
    if not failed:
        return None
    counts[1] += 1
    checks, failures = counts
    if failures != 10 ** int(math.log10(failures) + 1e-9):
        return None
    return "" if failures == 1 else f" ({failures} of the {checks} calls so far failed)"


def warn_if_unreliable(
    diagnostics,
    what,
    model,
    args,
    stacklevel=None,
    counts=None,
    guide=None,
    strategy=None,
    failed=None,
    each_row=False,
    whole=False,
    every_mask_possible=False,
):
    """Warns when ``diagnostics`` fail their thresholds, at the 1st, 10th, 100th, ... failing
    call (:func:`failure_history`), with the figures in the diagnostics' own words (their
    ``warn`` method). The check reads the figures (a device synchronisation), with Pyro's
    validation on or off: an estimate off by nats is never left unsaid.

    :param diagnostics: an
        :class:`~pyro_mpt.conditionals.importance_diagnostics.ImportanceDiagnostics`, an
        :class:`~pyro_mpt.conditionals.encode_decode_diagnostics.EncodeDecodeDiagnostics`,
        or None (nothing to check).
    :param str what: what was estimated, the subject of the message.
    :param int stacklevel: as for :func:`warnings.warn`, from this function's frame; by
        default the user's line (:func:`~pyro_mpt.errors.user_stacklevel`).
    :param list counts: ``[checks, failures]`` kept by the caller (an ``MPTLoss`` counts
        its own calls); by default those of the model, argument shapes, ``guide`` and
        ``strategy`` (within one evaluation, inside :func:`counted_per_call`).
    :param bool failed: whether the figures fail, where the caller has read the
        diagnostics' ``failing()`` already (worked out here otherwise).
    :param bool each_row: whether every row must pass on its own too.
    :param bool whole: whether the estimates are ``log p(x)`` of whole observations (no
        masks, no ratio of estimates), which the message then speaks of.
    :param bool every_mask_possible: whether the caller could average over every mask
        instead (an ``MPTLoss`` that draws them), which importance sampling then advises.
    """
    if diagnostics is None:
        return
    if counts is None:
        counts = _counts(what, model, args, guide, strategy)
    if stacklevel is None:
        stacklevel = user_stacklevel()
    diagnostics.warn(
        what,
        stacklevel + 1,  # the method's own frame
        counts,
        strategy=strategy,
        failed=failed,
        each_row=each_row,
        whole=whole,
        every_mask_possible=every_mask_possible,
    )


def warn_if_floored(left_floored, what, counts=None):
    """Warns, with a :class:`~pyro_mpt.errors.QuadratureAccuracyWarning` at the user's line,
    when ``left_floored`` conditionals (the total of a
    :class:`~pyro_mpt.ops.floored_exp.FlooredLedger`, read) stayed floored off the CPU:
    quadrature sums, whose floored factors make them too high, or importance sums over
    shared draws, whose plain exponentials underflow and make them too low.

    :param int left_floored: how many.
    :param str what: who computed them, the subject of the message (``"mpt_curve"``).
    :param list counts: ``[checks, failures]`` kept by the caller (an ``MPTLoss``'s steps),
        which then warns at the 1st, 10th, 100th, ... such call only; by default every such
        call warns (a function of the package, once at its end).
    """
    history = "" if counts is None else failure_history(counts, left_floored > 0)
    if not left_floored or history is None:
        return
    warnings.warn(
        f"{what} kept {left_floored} conditionals floored{history}: off the CPU nothing is "
        f"read back to find the sums over nodes or draws that the floors of the fast matrix "
        f"products (or the underflow of their exponentials) move, and only the "
        f"{floored_exp.MAX_EXACT_OFF_CPU} of each call nearest them are computed again "
        f"exactly. The others may be off by tens of nats or more: too high for "
        f"quadrature (floored factors add mass), too low or -inf for importance sampling "
        f"over shared draws (underflow), and so is an estimate of log p(x) that sums them. "
        f"Fix: use float64 (its floors lie 354 nats below the best node or draw, float32's "
        f"43.7), fewer observations or masks per call (fewer conditionals near the floors at "
        f"once), or compute on the CPU, where every such conditional is computed again.",
        QuadratureAccuracyWarning,
        stacklevel=user_stacklevel(),
    )


def _owner_and_method(fn):
    """The object of a bound method and its function, or ``(fn, None)``."""
    owner = getattr(fn, "__self__", None)
    if owner is None:
        return fn, None
    return owner, getattr(fn, "__func__", None)


def _counts(what, model, args, guide=None, strategy=None):
    """The ``[checks, failures]`` of ``what`` for ``model`` on arguments of these shapes,
    with this guide and this strategy (by its ``repr``): a new guide, or another number of
    samples, is counted afresh and warns at its first failing call."""
    shapes = tuple(tuple(a.shape) if torch.is_tensor(a) else type(a).__name__ for a in args)
    owner, method = _owner_and_method(model)
    guide_owner, guide_method = _owner_and_method(guide)
    per_call = _PER_CALL.get()
    if per_call is not None:
        # One count for the whole evaluation of this model: what auto's search found and
        # what the function then estimates are one failure, told once.
        key = (id(owner), method, shapes, id(guide_owner), guide_method)
        return per_call.setdefault(key, [0, 0])
    try:
        per_model = _CHECKS.setdefault(owner, {})
    except TypeError:
        per_model = _CHECKS_BY_ID.setdefault(id(owner), {})
    key = (what, method, shapes, repr(strategy), id(guide_owner), guide_method)
    entry = per_model.get(key)
    # The guide is held weakly where it can be: an id its guide outlived starts afresh.
    if entry is None or entry[1]() is not guide_owner:
        entry = per_model[key] = ([0, 0], _weak_or_strong(guide_owner))
    return entry[0]


def _weak_or_strong(value):
    """A callable returning ``value``: a weak reference where one can be taken."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value
