"""``MPTLoss``: masked pre-training as a Pyro objective, beside ``Trace_ELBO``."""

import math
import warnings

import pyro.poutine as poutine
import torch
from pyro.infer import ELBO

from pyro_mpt.conditionals.auto import as_conditionals
from pyro_mpt.infer.trace_utils import param_store_rollback
from pyro_mpt.ops.estimators import mpt_estimate
from pyro_mpt.ops.masks import as_rate_schedule, check_num_masks, sample_masks

__all__ = ["MPTLoss"]


class MPTLoss(ELBO):
    """The masked pre-training (MPT) objective: a stochastic estimate of the log-marginal
    likelihood built from the model's self-predictive conditionals.

    For each observation ``x`` with ``D`` features, a mask of ``M`` features is drawn and
    scored under the conditionals of the masked features given the rest, with the latents
    integrated out:

    .. math::

        \\widehat{\\log p}(x) = \\frac{D}{M} \\sum_{j \\in \\mathcal{M}}
            \\log p_\\theta(x_j \\mid x_{\\mathcal{R}}),
        \\qquad \\log p_\\theta(x) = \\sum_{M=1}^{D} \\mathcal{S}_\\theta(x; M),

    where :math:`\\mathcal{S}_\\theta(x; M)` is the mean of
    :math:`\\frac{1}{M}\\sum_{j\\in\\mathcal{M}} \\log p_\\theta(x_j \\mid x_\\mathcal{R})` over
    masks of size ``M`` (Moreno-Muñoz et al., 2023, Proposition 1). With ``rate="uniform"``
    (``M ~ Uniform{1..D}``) the estimate is unbiased for ``log p(x)``; with a fixed rate
    (BERT's 0.15) it is biased by a constant that does not stop it from rising with
    ``log p(x)``. The loss is minus the sum of the estimates over the data plate, scaled like
    ``Trace_ELBO`` under subsampling, so both are in nats and directly comparable.

    :param rate: the mask-size schedule: ``"uniform"``, a float in ``(0, 1]`` (fixed rate),
        or a pair ``(lo, hi)`` (a random rate per mask, as in R2MAE). See
        :func:`pyro_mpt.ops.masks.as_rate_schedule`.
    :param int num_masks: masks per observation and step, all scored in one vectorized
        pass. Their sizes are stratified, so ``num_masks=D`` with ``rate="uniform"`` sums
        over every mask size exactly once.
    :param conditionals: how the conditionals are computed: ``"auto"`` (the first strategy
        that applies), ``"exact"``, or a :class:`pyro_mpt.conditionals.Conditionals`.
    :param bool share_masks: draw one mask per step for the whole batch instead of one per
        observation (the convention of the paper's scripts; higher variance).
    :param int max_plate_nesting: bound on the number of nested plates in the model;
        guessed from a trace when left at infinity.

    Example::

        >>> import torch, pyro
        >>> from pyro.infer import SVI
        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=6, latent_dim=2)
        >>> svi = SVI(ppca.model, ppca.guide, pyro.optim.Adam({"lr": 0.01}),
        ...           loss=MPTLoss(rate="uniform"))
        >>> loss = svi.step(torch.randn(100, 6))

    .. note:: The guide is run only by strategies that need one; with ``"exact"``
        conditionals the latents are integrated out and any guide (a no-op included) works.

    **References**

    P. Moreno-Muñoz, P. G. Recasens, S. Hauberg. *On Masked Pre-training and the Marginal
    Likelihood.* NeurIPS 2023.
    """

    def __init__(
        self,
        rate="uniform",
        num_masks=1,
        conditionals="auto",
        share_masks=False,
        max_plate_nesting=math.inf,
    ):
        super().__init__(num_particles=1, max_plate_nesting=max_plate_nesting)
        self.schedule = as_rate_schedule(rate)
        self.num_masks = check_num_masks(num_masks)
        self.conditionals = as_conditionals(conditionals)
        self.share_masks = bool(share_masks)

    def __repr__(self):
        return (
            f"MPTLoss(rate={self.schedule!r}, num_masks={self.num_masks}, "
            f"conditionals={self.conditionals!r})"
        )

    def _get_trace(self, model, guide, args, kwargs):
        """A guide trace and the model trace replayed against it, as ``Trace_ELBO`` makes.

        The MPT objective does not score these traces; they are offered for inspection.
        """
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        return model_trace, guide_trace

    def estimate(self, model, guide, *args, **kwargs):
        """The per-observation MPT estimates of ``log p(x)``, before scaling and summing.

        :returns: a tensor of the data plate's batch shape (differentiable).
        """
        return self._prepare_and_estimate(model, guide, args, kwargs)[1]

    def _prepare_and_estimate(self, model, guide, args, kwargs):
        # A failing call leaves no half-initialised parameters behind.
        with param_store_rollback():
            prepared = self.conditionals.prepare(model, guide, args, kwargs, self.max_plate_nesting)
            return prepared, self._estimate(prepared)

    def _estimate(self, prepared):
        batch_shape = prepared.batch_shape
        mask_batch = torch.Size() if self.share_masks else batch_shape
        masks, _ = sample_masks(
            self.schedule,
            self.num_masks,
            mask_batch,
            prepared.num_features,
            device=prepared.observed.value.device,
        )
        if self.share_masks:
            masks = masks.reshape((self.num_masks,) + (1,) * len(batch_shape) + masks.shape[-1:])
        return mpt_estimate(prepared.log_prob(masks), masks)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """Minus the summed MPT estimate, as a differentiable scalar tensor."""
        prepared, estimates = self._prepare_and_estimate(model, guide, args, kwargs)
        return -(prepared.scale * estimates).sum()

    def loss(self, model, guide, *args, **kwargs):
        """Minus the summed MPT estimate, as a float (no gradients are computed)."""
        with torch.no_grad():
            return self.differentiable_loss(model, guide, *args, **kwargs).item()

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Computes the loss and back-propagates it into every parameter it depends on.

        :returns: the loss as a float.
        """
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        else:
            warnings.warn(
                "MPTLoss does not depend on any trainable parameter; no gradients were computed.",
                stacklevel=2,
            )
        return loss.item()
