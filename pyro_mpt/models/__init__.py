"""Ready-made Pyro models with MPT-friendly structure."""

from pyro_mpt.models.ppca import PPCA, FactorAnalysis

__all__ = ["FactorAnalysis", "PPCA"]
