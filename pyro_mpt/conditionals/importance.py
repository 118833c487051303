"""Self-predictive conditionals by importance sampling with the guide as proposal."""

import math

import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.errors import check_positive_int
from pyro_mpt.infer.factors import check_factors, factor_log_prob
from pyro_mpt.infer.guided_model import (
    observed_tensor,
    prepare_guided,
    proposal_log_density,
    run_guided,
    sites_log_density,
)
from pyro_mpt.infer.trace_utils import unwrap_independent
from pyro_mpt.ops.bernoulli import log_prob
from pyro_mpt.ops.self_normalised_importance import (
    check_fill,
    fill_masked,
    importance_log_conditionals,
    importance_log_marginal,
)

__all__ = ["Importance", "ImportanceSelfPredictive"]


class ImportanceSelfPredictive(SelfPredictive):
    """Conditionals of one batch by self-normalised importance sampling."""

    def __init__(self, guided, num_samples, fill):
        super().__init__(guided.local.observed, guided.local.scale, factor_log_prob(guided.local))
        self.guided = guided
        self.num_samples = num_samples
        self.fill = fill

    def _sample(self, filled):
        """``(log p(z) - log q(z), l)`` at ``S`` guide samples on ``filled`` data:
        shapes ``(S, P) + batch`` and ``(S, P) + batch + (D,)``."""
        guided, num_samples = self.guided, self.num_samples
        guide_trace, model_trace = run_guided(guided, filled, num_samples)
        check_factors(guided.local, model_trace, "importance sampling")
        lead = (num_samples, filled.shape[0])
        log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
        log_q = proposal_log_density(guide_trace, guided, lead)
        site = model_trace.nodes[self.observed.name]
        ll = log_prob(unwrap_independent(site["fn"]), site["value"])
        return log_p - log_q, observed_tensor(ll, guided, lead)

    def log_prob(self, masks):
        context = self.context(masks)
        log_w, ll = self._sample(fill_masked(self.observed.value, ~context, self.fill))
        return importance_log_conditionals(log_w, ll, context)

    def log_marginal(self):
        """The importance estimate of ``log p(x)`` of each observation, with the guide on
        the full data: ``LSE_s(log p(x, z_s) - log q(z_s | x)) - log S`` (a stochastic
        lower bound in expectation, the IWAE bound), shape ``batch_shape``."""
        entries = self.observed.entries
        value = self.observed.value
        if entries is None:
            filled = value.unsqueeze(0)
        else:  # one "mask": the missing entries
            filled = fill_masked(value, (~entries).unsqueeze(0), self.fill)
        log_w, ll = self._sample(filled)
        if entries is None:
            return importance_log_marginal((log_w + ll.sum(-1))[:, 0])
        ll = ll * entries.to(ll.dtype)
        result = importance_log_marginal((log_w + ll.sum(-1))[:, 0])
        # An observation with no observed entry has log p = 0 exactly, not its estimate.
        return torch.where(entries.any(-1), result, 0.0)


class Importance(Conditionals):
    """Conditionals by self-normalised importance sampling, with the guide on the masked
    input as proposal.

    For every mask the masked features are filled (zeros or feature means), the guide
    encodes the filled data and proposes ``S`` latents ``z_s ~ q(z | x_fill)``, and the model
    scores each feature at them, ``l_sj = log p(x_j | z_s)``. With
    ``log w_s = log p(z_s) + sum_{k in R} l_sk - log q(z_s)``,

    .. math::

        \\log p(x_j \\mid x_R) \\approx \\operatorname{LSE}_s(\\log w_s + l_{sj})
            - \\operatorname{LSE}_s(\\log w_s).

    Consistent for any model with a guide as ``S`` grows, biased at finite ``S`` like every
    ratio estimate. Any likelihood that factorises over features and any latent prior work;
    gradients reach the model and, through reparameterised samples, the guide.

    **Data conventions** (those of :class:`~pyro_mpt.conditionals.EncodeDecode`, which
    LinearVAE and VAE follow). The model and the guide take the observed data tensor as
    first positional argument; the guide computes ``q(z | x)`` from the tensor it is given
    and is called with data of shape ``(P,) + x.shape`` inside plates over samples and
    masks, so it sizes its data plate with ``x.shape[-2]``. A guide that ignores its data
    (e.g. ``AutoNormal``) is a valid, poor proposal.

    :param int num_samples: ``S``, latent samples per mask and observation.
    :param str fill: the value of masked features given to the guide: ``"zeros"`` or
        ``"mean"`` (each feature's mean over the batch, see
        :func:`~pyro_mpt.ops.self_normalised_importance.fill_masked`).

    .. note:: The proposal is only as good as the guide is on *filled* data. An encoder
        fitted to complete data (e.g. PPCA's exact posterior) reads the filled values as
        observed, so its ``q`` is confident about the wrong place: the estimate converges,
        but slowly (tenths of a nat off at ``S`` in the thousands, where a broad proposal
        is hundredths off). A broad guide, or one trained on masked inputs, does better.

    .. note:: Local latents must sit inside the data plate; the data plate cannot be
        subsampled. Cost: one guide run and one model run on ``S * P * N`` latents.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Importance
        >>> loss = MPTLoss(rate="uniform", conditionals=Importance(num_samples=64))
    """

    name = "importance"

    def __init__(self, num_samples=64, fill="zeros"):
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.fill = check_fill(fill)

    def __repr__(self):
        return f"Importance(num_samples={self.num_samples}, fill={self.fill!r})"

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        guided = prepare_guided(model, guide, args, kwargs, max_plate_nesting, "importance")
        return ImportanceSelfPredictive(guided, self.num_samples, self.fill)
