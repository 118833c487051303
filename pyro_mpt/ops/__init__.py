"""Pure tensor maths: masks and rate schedules, Gaussian conditionals, estimators."""

from pyro_mpt.ops import estimators, gaussian, masks

__all__ = ["estimators", "gaussian", "masks"]
