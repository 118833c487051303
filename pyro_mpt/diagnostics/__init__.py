"""Reference evaluators and diagnostics: the exact LML and the MPT curve."""

from pyro_mpt.diagnostics.curve import MPTCurve, mpt_curve
from pyro_mpt.diagnostics.log_marginal import log_marginal
from pyro_mpt.diagnostics.plotting import plot_mpt_curve

__all__ = ["MPTCurve", "log_marginal", "mpt_curve", "plot_mpt_curve"]
from pyro_mpt.diagnostics.mixing import Mixing, mixing_diagnostics  # noqa: E402

__all__ += ["Mixing", "mixing_diagnostics"]
