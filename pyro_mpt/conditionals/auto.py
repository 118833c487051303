"""``conditionals="auto"``: the first strategy that applies to the model."""

import math

from pyro_mpt.conditionals.base import Conditionals
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.quadrature import Quadrature
from pyro_mpt.errors import NotApplicableError

__all__ = ["Auto", "STRATEGIES", "as_conditionals"]

#: Strategies by name, in the order ``"auto"`` tries them.
STRATEGIES = {"exact": Exact, "quadrature": Quadrature}


class Auto(Conditionals):
    """Tries each strategy in :data:`STRATEGIES` order and uses the first that applies.

    :ivar chosen: the strategy used by the last call, or None before the first.
    """

    name = "auto"

    def __init__(self):
        self.chosen = None

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        reasons = []
        for name, strategy_cls in STRATEGIES.items():
            strategy = strategy_cls()
            try:
                prepared = strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
            except NotApplicableError as error:
                reasons.append(f"  {name}: {error}")
                continue
            self.chosen = strategy
            return prepared
        raise NotApplicableError(
            "conditionals='auto' found no strategy for this model. Available strategies: "
            + ", ".join(repr(name) for name in STRATEGIES)
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
