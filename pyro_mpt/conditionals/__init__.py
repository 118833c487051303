"""Strategies that compute the self-predictive conditionals ``p(x_j | x_R)``."""

from pyro_mpt.conditionals.auto import STRATEGIES, Auto, as_conditionals
from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.conditionals.encode_decode import EncodeDecode
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.importance import (
    Importance,  # noqa: F401 (deprecated alias)
    ImportanceSampling,
)
from pyro_mpt.conditionals.per_model import forget_strategies
from pyro_mpt.conditionals.quadrature import Quadrature

__all__ = [
    "Auto",
    "Conditionals",
    "EncodeDecode",
    "Exact",
    "ImportanceSampling",
    "Quadrature",
    "SelfPredictive",
    "STRATEGIES",
    "as_conditionals",
    "forget_strategies",
]
