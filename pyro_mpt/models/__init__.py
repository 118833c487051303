"""Ready-made Pyro models with MPT-friendly structure."""

from pyro_mpt.models.ppca import PPCA, FactorAnalysis
from pyro_mpt.models.vae import VAE, LinearVAE
from pyro_mpt.models.gp_decoder import GPDecoder

__all__ = ["FactorAnalysis", "PPCA"]
__all__ += ["LinearVAE", "VAE"]
__all__ += ["GPDecoder"]
