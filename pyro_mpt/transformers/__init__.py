"""Masked pre-training for Hugging Face ``transformers`` models.

The same rate schedules as :class:`pyro_mpt.MPTLoss` (``"uniform"``, a fixed rate, a
``(lo, hi)`` range) applied to masked language models (BERT, RoBERTa) and to ViT-MAE, with
their MPT curves (:func:`mlm_mpt_curve`, :func:`mae_mpt_curve`, each an
:class:`~pyro_mpt.MPTCurve`) and the chain-rule coherence of a masked language model
(:func:`mlm_ordering_log_likelihoods`) as diagnostics. Needs the optional extra::

    pip install "pyro-mpt[transformers]"

``import pyro_mpt`` never imports ``transformers``; this subpackage does, on first use.
"""

from pyro_mpt.transformers._requirements import require

require("transformers")

from pyro_mpt.transformers.collator import MPTDataCollator  # noqa: E402

__all__ = []
__all__ += ["MPTDataCollator"]

from pyro_mpt.transformers.mlm_loss import (  # noqa: E402
    masked_token_log_probs,
    mpt_mlm_loss,
    mpt_sequence_estimates,
)
from pyro_mpt.transformers.trainer import MPTTrainer  # noqa: E402

__all__ += ["MPTTrainer", "masked_token_log_probs", "mpt_mlm_loss", "mpt_sequence_estimates"]

from pyro_mpt.transformers.mlm_curve import mlm_mpt_curve  # noqa: E402

__all__ += ["mlm_mpt_curve"]

from pyro_mpt.transformers.mlm_coherence import mlm_ordering_log_likelihoods  # noqa: E402

__all__ += ["mlm_ordering_log_likelihoods"]

from pyro_mpt.transformers.mae_training import mae_loss, train_mae  # noqa: E402
from pyro_mpt.transformers.vit_mae_curve import mae_mpt_curve  # noqa: E402

__all__ += ["mae_loss", "mae_mpt_curve", "train_mae"]

from pyro_mpt.transformers.generation import MLMSamples, sample_mlm  # noqa: E402
from pyro_mpt.transformers.generation_diagnostics import (  # noqa: E402
    GenerationDiagnostics,
    generation_diagnostics,
    pseudo_log_likelihood,
    stutter_rate,
    token_frequency_distance,
)
from pyro_mpt.transformers.mlm_sampling_steps import mask_predict_schedule  # noqa: E402

__all__ += ["MLMSamples", "mask_predict_schedule", "sample_mlm"]
__all__ += [
    "GenerationDiagnostics",
    "generation_diagnostics",
    "pseudo_log_likelihood",
    "stutter_rate",
    "token_frequency_distance",
]
