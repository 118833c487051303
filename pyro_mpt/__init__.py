"""pyro_mpt: train Bayesian models by masked pre-training, a stochastic estimate of the
log-marginal likelihood."""

from pyro_mpt.diagnostics import (
    MPTCurve,
    OrderingLogLikelihoods,
    default_rates,
    log_marginal,
    mpt_curve,
    ordering_log_likelihoods,
    plot_mpt_curve,
)
from pyro_mpt.generation import gibbs, impute
from pyro_mpt.loss import MPTLoss

__version__ = "0.1.0"

__all__ = [
    "MPTCurve",
    "MPTLoss",
    "OrderingLogLikelihoods",
    "__version__",
    "default_rates",
    "gibbs",
    "impute",
    "log_marginal",
    "mpt_curve",
    "ordering_log_likelihoods",
    "plot_mpt_curve",
]
