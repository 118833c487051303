"""Ready-made Pyro models with MPT-friendly structure."""

from pyro_mpt.models.gp_decoder import GPDecoder
from pyro_mpt.models.ppca import PPCA, FactorAnalysis
from pyro_mpt.models.vae import VAE, LinearVAE

__all__ = ["FactorAnalysis", "GPDecoder", "LinearVAE", "PPCA", "VAE"]
