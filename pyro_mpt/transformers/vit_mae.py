"""Exact control of ViT-MAE's masking, and its per-patch reconstruction as a Gaussian
log-likelihood.

:class:`transformers.ViTMAEForPreTraining` masks ``len_keep = int(L (1 - config.mask_ratio))``
of its ``L`` patches, chosen by ``argsort(noise)`` per image. :func:`masked_forward` runs it
on masks drawn elsewhere (by :func:`pyro_mpt.ops.masks.masks_of_sizes`): for one call it
sets the ratio so that ``len_keep = L - M`` exactly and passes a ``noise`` that sorts the
kept patches first, then checks the mask the model used. ViT-MAE drops the masked patches
from its encoder input, so every image of one call has the same number ``M`` masked.
"""

import contextlib
import math
import numbers

import torch

__all__ = [
    "mask_ratio",
    "masked_forward",
    "num_patches",
    "patch_log_likelihood",
    "reconstruction_targets",
    "vit_mae_from_config",
]


def _embeddings(model):
    vit = getattr(model, "vit", model)
    embeddings = getattr(vit, "embeddings", None)
    if embeddings is None or not hasattr(embeddings, "random_masking"):
        raise TypeError(
            f"model must be a ViTMAEForPreTraining or ViTMAEModel, got {type(model).__name__}."
        )
    return embeddings


def num_patches(model):
    """Patches ``L`` per image of a ViT-MAE model."""
    return _embeddings(model).patch_embeddings.num_patches


@contextlib.contextmanager
def mask_ratio(model, num_masked):
    """Makes ``model`` mask exactly ``num_masked`` of its ``L`` patches inside the block.

    The ratio set is ``(M - 1/2) / L``, halfway between two integers of ``L (1 - ratio)``, so
    float rounding cannot move ``int(L (1 - ratio))`` off ``L - M``. The previous ratio is
    restored on leaving.
    """
    embeddings = _embeddings(model)
    total = embeddings.patch_embeddings.num_patches
    if isinstance(num_masked, bool) or not isinstance(num_masked, numbers.Integral):
        raise TypeError(f"num_masked must be an int, got {num_masked!r}.")
    if not 0 <= num_masked < total:
        raise ValueError(
            f"num_masked={num_masked} must lie in 0...{total - 1}: ViT-MAE keeps at least one "
            f"of its {total} patches visible."
        )
    config = embeddings.config
    previous = config.mask_ratio
    config.mask_ratio = (num_masked - 0.5) / total
    try:
        yield
    finally:
        config.mask_ratio = previous


def masked_forward(model, pixel_values, masks, **kwargs):
    """Runs ``model`` with exactly the patches of ``masks`` masked.

    :param model: a :class:`transformers.ViTMAEForPreTraining` (or ``ViTMAEModel``).
    :param torch.Tensor pixel_values: ``(B, C, H, W)``.
    :param torch.Tensor masks: ``(B, L)`` bool, ``True`` at masked patches, the same count
        ``M < L`` in every row.
    :param kwargs: passed to the model (e.g. ``output_hidden_states=True``).
    :returns: the model's output; its ``mask`` equals ``masks``.
    :raises ValueError: for rows with different counts, or a shape that does not match.
    """
    total = num_patches(model)
    if masks.dim() != 2 or masks.shape != (pixel_values.shape[0], total):
        raise ValueError(
            f"masks must have shape (batch, patches) = ({pixel_values.shape[0]}, {total}), got "
            f"{tuple(masks.shape)}."
        )
    counts = masks.sum(1)
    if bool((counts != counts[0]).any()):
        raise ValueError(
            f"every image of a ViT-MAE batch must have the same number of masked patches, got "
            f"{sorted(set(counts.tolist()))}; group images by mask size."
        )
    # argsort(noise) lists kept patches (noise in [0, 1)) before masked ones ([2, 3)).
    noise = torch.rand(masks.shape, device=masks.device) + 2.0 * masks.float()
    with mask_ratio(model, int(counts[0])):
        output = model(pixel_values=pixel_values, noise=noise, **kwargs)
    if not torch.equal(output.mask.bool(), masks.to(output.mask.device)):
        raise RuntimeError(
            "ViT-MAE masked other patches than requested; this transformers version masks "
            "differently from ViTMAEEmbeddings.random_masking(noise) with config.mask_ratio."
        )
    return output


def reconstruction_targets(model, pixel_values):
    """The patches the decoder predicts, ``(B, L, P^2 C)``: the pixels, normalised per patch
    when ``config.norm_pix_loss`` is set (as the model's own loss does)."""
    target = model.patchify(pixel_values)
    if model.config.norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    return target


def patch_log_likelihood(prediction, target, scale):
    """Log-density of each patch under independent Gaussians per pixel:

    .. math::

        \\log p(x_j \\mid x_\\mathcal{R}) = -\\frac{n}{2}\\log(2\\pi\\sigma^2)
            - \\frac{\\lVert x_j - \\hat{x}_j \\rVert^2}{2\\sigma^2}

    for a patch of ``n`` values with prediction :math:`\\hat{x}_j`.

    :param torch.Tensor prediction: ``(..., n)``.
    :param torch.Tensor target: ``(..., n)``.
    :param float scale: the standard deviation ``sigma`` of each pixel.
    :returns: ``(...)``.
    """
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(f"scale must be a positive float (a pixel's sd), got {scale!r}.")
    n = target.shape[-1]
    squared = (prediction.to(target.dtype) - target).pow(2).sum(-1)
    return -0.5 * n * math.log(2 * math.pi * scale**2) - squared / (2 * scale**2)


def vit_mae_from_config(config):
    """A new :class:`transformers.ViTMAEForPreTraining` with fixed 2-D sine-cosine position
    embeddings in its encoder and decoder.

    Built from a configuration, transformers 5 leaves both position tables at zero (the
    encoder's initialiser returns early once the patch projection is initialised, and the
    decoder's is zero by design): such a model cannot tell where a patch is, and a blank
    visible patch becomes an all-zero token whose LayerNorm gradient is NaN. Tables that are
    not all zero are left alone.

    :param transformers.ViTMAEConfig config: a square image of ``g x g`` patches.
    """
    from transformers import ViTMAEForPreTraining
    from transformers.models.vit_mae.modeling_vit_mae import (
        build_2d_sinusoidal_position_embedding,
    )

    model = ViTMAEForPreTraining(config)
    grid = math.isqrt(num_patches(model))
    with torch.no_grad():
        for table in (model.vit.embeddings.position_embeddings, model.decoder.decoder_pos_embed):
            if bool(table.abs().sum() == 0):
                values = build_2d_sinusoidal_position_embedding(
                    grid, grid, table.shape[-1], cls_token=True, dtype=table.dtype
                )
                table.copy_(values.reshape(table.shape))
    return model
