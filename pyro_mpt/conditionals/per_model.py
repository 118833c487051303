"""The strategies that the functions of the package (``log_marginal``, ``impute``, ``gibbs``,
``mpt_curve``, ``ordering_log_likelihoods``) use when the strategy is given by name: one
instance per model and name, kept as long as the model lives.

A strategy remembers the structure it read for the call signature it last saw (the model
and the shapes of its arguments). Kept with the model, a later call on the same model and
shapes does not trace the model again. ``"auto"`` keeps the strategies it tries, but
decides afresh on every call: the parameters may have changed since the last (a trained
model's posterior is narrower, and a quadrature rule that was accurate may no longer be).
``MPTLoss`` keeps strategies of its own.
"""

import weakref

from pyro_mpt.conditionals.auto import Auto, as_conditionals

__all__ = ["conditionals_for", "forget_strategies"]

#: owner of the model (the object of a bound method, else the function) -> {(function
#: or None, name): strategy}. Weak keys: an entry goes when its model does.
_STRATEGIES = weakref.WeakKeyDictionary()


def conditionals_for(conditionals, model):
    """``as_conditionals(conditionals)``, except that a strategy given by name is the one kept
    for ``model`` under that name (made on first use); for ``"auto"``, a new
    :class:`~pyro_mpt.conditionals.Auto` that tries the candidates kept for ``model``. A
    strategy instance is returned as it is; a model that cannot be weakly referenced gets
    a fresh strategy on every call."""
    if not isinstance(conditionals, str):
        return as_conditionals(conditionals)
    owner = getattr(model, "__self__", None)
    function = getattr(model, "__func__", None) if owner is not None else None
    if owner is None:
        owner = model
    try:
        kept = _STRATEGIES.setdefault(owner, {})
    except TypeError:  # not weakly referenceable (or not hashable): nothing to keep it with
        return as_conditionals(conditionals)
    if conditionals == "auto":
        return Auto(candidates=kept.setdefault((function, "auto's candidates"), {}))
    key = (function, conditionals)
    strategy = kept.get(key)
    if strategy is None:
        strategy = kept[key] = as_conditionals(conditionals)
    return strategy


def forget_strategies():
    """Drops every kept strategy, so that the next call reads each model afresh (after a
    change to a model that its argument shapes do not show, e.g. a new likelihood)."""
    _STRATEGIES.clear()
