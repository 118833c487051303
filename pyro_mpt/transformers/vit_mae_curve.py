"""The MPT curve of a ViT-MAE: the mean Gaussian log-likelihood of a masked patch at each
masking ratio, and its area (paper Fig. 6)."""

import math

import torch

from pyro_mpt.diagnostics.curve import MPTCurve, check_rates, default_rates, rate_sizes
from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers.vit_mae import (
    masked_forward,
    num_patches,
    patch_log_likelihood,
    reconstruction_targets,
)

__all__ = ["mae_mpt_curve"]

#: The pixel standard deviation used when none is given: suits pixels scaled to [0, 1].
DEFAULT_SCALE = 0.1


@torch.no_grad()
def mae_mpt_curve(
    model,
    pixel_values,
    rates=None,
    num_masks=4,
    batch_size=64,
    scale=DEFAULT_SCALE,
    progress=True,
):
    """The MPT curve of a :class:`transformers.ViTMAEForPreTraining` on a batch of images.

    At rate ``r`` each image has ``M = max(1, floor(r L + 1/2))`` of its ``L`` patches masked
    (uniformly at random, ``num_masks`` masks per image), exactly, through
    :func:`~pyro_mpt.transformers.vit_mae.masked_forward`. A masked patch ``x_j`` is scored
    by the decoder's reconstruction as a Gaussian with pixel standard deviation ``scale``
    (:func:`~pyro_mpt.transformers.vit_mae.patch_log_likelihood`):

    .. math::

        \\mathcal{S}(x; r) = \\mathbb{E}_{|\\mathcal{M}| = M}\\Big[\\frac{1}{M}
            \\sum_{j \\in \\mathcal{M}} \\log \\mathcal{N}(x_j \\mid \\hat{x}_j(x_\\mathcal{R}),
            \\sigma^2 I)\\Big],
        \\qquad \\text{area} = \\sum_{M=1}^{L} \\mathcal{S}(x; M),

    with the sizes that no rate gives interpolated between the nearest given ones
    (:func:`~pyro_mpt.diagnostics.curve.area_weights`).

    .. note:: The area's last term, ``S(x; L)`` (every patch hidden), is never measured:
        ViT-MAE keeps one patch visible, so no rate may mask all ``L``. The area holds it at
        the score of the largest size given (at best ``L - 1``), so it is not the sum the
        identity with ``log p(x)`` needs by that one term, a ``1/L`` share of it. Predicting
        a patch from nothing is usually the hardest term, so the area tends to overstate.
        Compare areas with one another (models, training steps), not with a log-likelihood.

    The score is an affine function of the mean squared error of the masked patches, the
    MAE loss: ``S = -(n/2) log(2 pi sigma^2) - n MSE / (2 sigma^2)`` for patches of ``n``
    values, so ``scale`` sets the units, not the shape, of the curve. With
    ``config.norm_pix_loss`` the targets are the per-patch normalised pixels.

    :param model: a ``ViTMAEForPreTraining``; run in ``eval()`` mode, restored afterwards.
    :param torch.Tensor pixel_values: images ``(N, C, H, W)`` on the model's device.
    :param rates: masking rates in ``(0, 1)`` (default: 5%, 10%, ..., 95%).
    :param int num_masks: random masks per image and rate.
    :param int batch_size: masked images per forward pass.
    :param float scale: the pixel standard deviation ``sigma`` of the Gaussian.
    :param bool progress: show a progress bar over forward passes.
    :returns: an :class:`~pyro_mpt.MPTCurve` whose features are patches.

    Example::

        >>> from transformers import ViTMAEConfig, ViTMAEForPreTraining
        >>> config = ViTMAEConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=16,
        ...     num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        ...     decoder_hidden_size=16, decoder_num_hidden_layers=1,
        ...     decoder_num_attention_heads=2, decoder_intermediate_size=32)
        >>> curve = mae_mpt_curve(ViTMAEForPreTraining(config), torch.rand(3, 1, 8, 8),
        ...                   rates=[0.25, 0.5], progress=False)
        >>> curve.masked_fraction.tolist()
        [0.25, 0.5]
    """
    rates = check_rates(default_rates(0.05, 0.95, 0.05) if rates is None else rates)
    num_masks = check_positive_int("num_masks", num_masks)
    batch_size = check_positive_int("batch_size", batch_size)
    total = num_patches(model)
    sizes = rate_sizes(rates, total)
    if int(sizes.max()) >= total:
        raise ValueError(
            f"rates {rates.tolist()} mask all {total} patches at their largest; ViT-MAE needs one "
            f"visible patch: use rates below {1 - 0.5 / total:.3f}."
        )
    if pixel_values.dim() != 4 or pixel_values.shape[0] == 0:
        raise ValueError(
            f"pixel_values must be a non-empty batch of images (N, C, H, W), got shape "
            f"{tuple(pixel_values.shape)}."
        )
    dtype = next(model.parameters()).dtype
    if not pixel_values.is_floating_point():
        raise TypeError(
            f"pixel_values is {pixel_values.dtype}, but the model reads floating pixels: "
            f"pass them scaled as the model was trained on, e.g. pixel_values.to({dtype}) / 255 "
            f"for 8-bit images (then check the scale, {scale!r}, suits that range)."
        )
    if pixel_values.dtype != dtype:
        raise TypeError(
            f"pixel_values is {pixel_values.dtype} but the model's parameters are {dtype}: "
            f"pass pixel_values.to({dtype}), or convert the model with model.to("
            f"{pixel_values.dtype})."
        )
    if not bool(torch.isfinite(pixel_values).all()):
        raise ValueError(
            f"pixel_values holds {int((~torch.isfinite(pixel_values)).sum())} NaN or infinite "
            f"values, which would make the curve NaN; drop or repair those images first."
        )
    num_images = pixel_values.shape[0]
    rows = num_images * num_masks
    scores = torch.zeros(num_images, len(rates), num_masks, dtype=torch.float64)
    steps = len(rates) * math.ceil(rows / batch_size)
    training = model.training
    model.eval()
    try:
        with progress_bar(total=steps, desc="MAE curve", disable=not progress) as bar:
            for k, size in enumerate(sizes.tolist()):
                for start in range(0, rows, batch_size):
                    index = torch.arange(start, min(rows, start + batch_size))
                    images = pixel_values[index // num_masks]
                    count = torch.full((len(index),), size, device=images.device)
                    masks = masks_of_sizes(count, total)
                    output = masked_forward(model, images, masks)
                    target = reconstruction_targets(model, images)
                    log_lik = patch_log_likelihood(output.logits, target, scale)
                    row = (log_lik * masks).sum(1) / size
                    scores[index // num_masks, k, index % num_masks] = row.double().cpu()
                    bar.update()
    finally:
        model.train(training)
    features = torch.full((num_images,), total)
    return MPTCurve.from_scores(scores, rates, sizes.expand(num_images, -1), features)
