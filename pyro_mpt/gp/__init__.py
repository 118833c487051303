"""Masked pre-training for Gaussian processes built with GPyTorch.

:class:`MaskedPredictiveLogLikelihood` is a drop-in replacement for GPyTorch's
``ExactMarginalLogLikelihood`` that scores random held-out training points under the GP
posterior predictive given the rest (an active set): unbiased for the exact marginal
likelihood with ``rate="uniform"``, and ``O(|R|^3)`` instead of ``O(N^3)`` per step with a
small fixed context. Multitask GPs are supported: their tokens are the (input, task)
outputs. The GP-LVM counterpart for Pyro is :class:`pyro_mpt.models.GPDecoder`.
"""

from pyro_mpt.gp.masked_predictive import MaskedPredictiveLogLikelihood

__all__ = ["MaskedPredictiveLogLikelihood"]
