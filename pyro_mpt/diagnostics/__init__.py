"""Reference evaluators and diagnostics: the exact LML, the MPT curve, chain-rule coherence
and chain mixing."""

from pyro_mpt.diagnostics.coherence import OrderingLogLikelihoods, ordering_log_likelihoods
from pyro_mpt.diagnostics.curve import MPTCurve, default_rates
from pyro_mpt.diagnostics.log_marginal import log_marginal
from pyro_mpt.diagnostics.mixing import Mixing, mixing_diagnostics
from pyro_mpt.diagnostics.plotting import plot_mpt_curve
from pyro_mpt.diagnostics.pyro_curve import mpt_curve

__all__ = [
    "MPTCurve",
    "Mixing",
    "OrderingLogLikelihoods",
    "default_rates",
    "log_marginal",
    "mixing_diagnostics",
    "mpt_curve",
    "ordering_log_likelihoods",
    "plot_mpt_curve",
]
