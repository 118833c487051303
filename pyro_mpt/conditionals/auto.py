"""``conditionals="auto"``: the first strategy that applies to the model."""

import math

from pyro_mpt.conditionals.base import Conditionals
from pyro_mpt.conditionals.encode_decode import EncodeDecode
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.importance import Importance
from pyro_mpt.conditionals.quadrature import Quadrature
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.probe_cache import call_key, random_state, restore_random_state

__all__ = ["Auto", "STRATEGIES", "as_conditionals"]

#: Strategies by name, in the order ``"auto"`` tries them. ``"auto"`` skips those whose
#: class sets ``auto = False`` (approximations such as ``"encode-decode"``), which are
#: selectable by name only.
STRATEGIES = {
    "exact": Exact,
    "quadrature": Quadrature,
    "importance": Importance,
    "encode-decode": EncodeDecode,
}


def _tried_by_auto(strategy_cls):
    return getattr(strategy_cls, "auto", True)


class Auto(Conditionals):
    """Tries each strategy in :data:`STRATEGIES` order and uses the first that applies:
    ``"exact"`` (linear-Gaussian models), ``"quadrature"`` (latents of dimension up to 3),
    then ``"importance"`` (any model, when a guide is given). ``"encode-decode"`` is never
    tried: it is an approximation, selectable by name.

    The choice is remembered: later calls with the same model and arguments of the same
    shapes go straight to the chosen strategy (the same object, with whatever it keeps
    between calls), and search again only if it no longer applies.

    :ivar chosen: the strategy used by the last call, or None before the first.
    """

    name = "auto"

    def __init__(self):
        self.chosen = None
        self._chosen_for = None
        self._strategies = {}

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        key = call_key(model, args, kwargs, max_plate_nesting)
        if self.chosen is not None and key == self._chosen_for:
            state = random_state()
            try:
                return self.chosen.prepare(model, guide, args, kwargs, max_plate_nesting)
            except NotApplicableError:
                restore_random_state(state)  # the model changed: search again
        reasons = []
        names = [name for name, cls in STRATEGIES.items() if _tried_by_auto(cls)]
        for name in names:
            if name not in self._strategies:
                self._strategies[name] = STRATEGIES[name]()
            strategy = self._strategies[name]
            # A strategy that does not apply leaves the random state as it found it: a
            # seeded call draws the same numbers whether or not it searched.
            state = random_state()
            try:
                prepared = strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
            except NotApplicableError as error:
                restore_random_state(state)
                reasons.append(f"  {name}: {error}")
                continue
            self.chosen, self._chosen_for = strategy, key
            return prepared
        raise NotApplicableError(
            "conditionals='auto' found no strategy for this model. Available strategies: "
            + ", ".join(repr(name) for name in names)
            + ". Why each does not apply:\n"
            + "\n".join(reasons)
        )


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
