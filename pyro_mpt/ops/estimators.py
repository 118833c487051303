"""The masked pre-training estimator, an import path kept for it: it lives in
:mod:`pyro_mpt.ops.masks`, beside the masks it scores."""

from pyro_mpt.ops.masks import mask_scores, mpt_estimate

__all__ = ["mask_scores", "mpt_estimate"]
