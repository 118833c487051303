"""Generation from the self-predictive conditionals: imputation and block Gibbs chains."""

from pyro_mpt.generation.gibbs import gibbs
from pyro_mpt.generation.impute import impute

__all__ = ["gibbs", "impute"]
