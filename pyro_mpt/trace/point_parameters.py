"""The parameters of the observed distribution of a run at points, an import path kept for
them: :func:`~pyro_mpt.trace.whitened_latents.point_parameter` lives beside the runs."""

from pyro_mpt.trace.whitened_latents import point_parameter

__all__ = ["point_parameter"]
