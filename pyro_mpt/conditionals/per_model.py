"""The strategies that the functions of the package (``log_marginal``, ``impute``, ``gibbs``,
``mpt_curve``, ``ordering_log_likelihoods``) use when the strategy is given by name: one
instance per model and name, kept for the :data:`MAX_KEPT_MODELS` models used last.

A strategy remembers the structure it read for the call signature it last saw (the model
and the shapes of its arguments). Kept with the model, a later call on the same model and
shapes does not trace the model again. ``"auto"`` keeps the strategies it tries, but
decides afresh on every call: the parameters may have changed since the last (a trained
model's posterior is narrower, and a quadrature rule that was accurate may no longer be).
``MPTLoss`` keeps strategies of its own.
"""

import collections
import functools

from pyro_mpt.conditionals.accuracy_warnings import warn_if_floored
from pyro_mpt.conditionals.auto import Auto, as_conditionals
from pyro_mpt.conditionals.exact import verify_every_call
from pyro_mpt.errors import StaleStructureError
from pyro_mpt.ops.floored_exp import floored_ledger

__all__ = ["MAX_KEPT_MODELS", "conditionals_for", "forget_strategies", "package_function"]

#: How many models' strategies are kept. A kept strategy holds its model (and a batch of
#: its data, in the trace it read), so the models used last stay alive until others take
#: their place or :func:`forget_strategies` is called, as with ``functools.lru_cache``.
MAX_KEPT_MODELS = 4

#: id of the owner of a model (the object of a bound method, else the function) ->
#: ``(owner, {(function or None, name): strategy})``, the one used last at the end. The
#: owner is kept with its entry, so that no other object can take its id meanwhile.
_STRATEGIES = collections.OrderedDict()


def conditionals_for(conditionals, model):
    """``as_conditionals(conditionals)``, except that a strategy given by name is the one kept
    for ``model`` under that name (made on first use); for ``"auto"``, a new
    :class:`~pyro_mpt.conditionals.Auto` that tries the candidates kept for ``model``. A
    strategy instance is returned as it is."""
    if not isinstance(conditionals, str):
        return as_conditionals(conditionals)
    owner = getattr(model, "__self__", None)
    function = getattr(model, "__func__", None) if owner is not None else None
    if owner is None:
        owner = model
    entry = _STRATEGIES.pop(id(owner), None) or (owner, {})
    _STRATEGIES[id(owner)] = entry
    while len(_STRATEGIES) > MAX_KEPT_MODELS:
        _STRATEGIES.popitem(last=False)
    kept = entry[1]
    if conditionals == "auto":
        return Auto(candidates=kept.setdefault((function, "auto's candidates"), {}))
    key = (function, conditionals)
    strategy = kept.get(key)
    if strategy is None:
        strategy = kept[key] = as_conditionals(conditionals)
    return strategy


def forget_strategies():
    """Drops every kept strategy, so that the next call reads each model afresh (after a
    change to a model that its argument shapes do not show, e.g. a new likelihood), and lets
    the models they held go."""
    _STRATEGIES.clear()


def package_function(function):
    """What the functions of the package that take a strategy by name share, as they may
    prepare a model long after its strategy read it: they check what the kept read skips
    (the linear-Gaussian form is verified on every call, validation on or off; see
    :func:`~pyro_mpt.conditionals.exact.verify_every_call`), and call themselves once more
    when the model changed under the kept read
    (:class:`~pyro_mpt.errors.StaleStructureError`), which is forgotten by then, so that the
    second call reads the model afresh. Conditionals that the floors kept off the CPU are
    counted on the device and warned of once, at the end of the call
    (:func:`_floors_counted`)."""

    @functools.wraps(function)
    def checked_call(*args, **kwargs):
        with verify_every_call():
            try:
                return _floors_counted(function, args, kwargs)
            except StaleStructureError:
                return _floors_counted(function, args, kwargs)

    return checked_call


def _floors_counted(function, args, kwargs):
    """``function(*args, **kwargs)`` in a :func:`~pyro_mpt.ops.floored_exp.floored_ledger`,
    warning at its end of the conditionals that the floors kept off the CPU
    (:func:`~pyro_mpt.conditionals.accuracy_warnings.warn_if_floored`). The count is read
    once, off the CPU only: these functions are evaluations, not training steps."""
    with floored_ledger() as ledger:
        result = function(*args, **kwargs)
    left_floored = ledger.total()
    if left_floored is not None:
        warn_if_floored(int(left_floored), function.__name__)
    return result
