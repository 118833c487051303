"""Training ViT-MAE with a rate schedule: a fixed ratio (MAE's 75%), a random ratio (R2MAE)
or the uniform schedule of masked pre-training."""

import torch

from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.masks import as_rate_schedule, masks_of_sizes
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers.vit_mae import masked_forward, num_patches

__all__ = ["mae_loss", "train_mae"]


def mae_loss(model, pixel_values, rate="uniform"):
    """The ViT-MAE loss with the mask size drawn from a rate schedule.

    One mask size ``M`` is drawn per call from ``rate`` (shared by the batch, since ViT-MAE
    drops the masked patches from its encoder), capped at ``L - 1`` so one patch stays
    visible, and each image gets its own uniformly random mask of that size. The loss is the
    model's: the mean squared error of the masked patches, ``-S(x; M)`` of
    :func:`~pyro_mpt.transformers.mae_mpt_curve` up to the Gaussian's affine map. A fixed rate
    gives the MAE objective, a range ``(lo, hi)`` the random ratio of R2MAE.

    .. note:: The uniform schedule is not the unbiased MPT objective here. ``M`` is drawn
        from ``{1, ..., L}`` and then capped at ``L - 1`` (ViT-MAE keeps a patch), so
        ``M = L - 1`` comes up twice as often and ``M = L`` never: up to the affine map the
        expectation over ``M`` is
        :math:`-\\frac{1}{L}\\big(\\log p(x) - \\mathcal{S}(x; L) + \\mathcal{S}(x; L-1)\\big)`,
        not :math:`-\\log p(x) / L`. The difference is one term in ``L``.

    :param model: a :class:`transformers.ViTMAEForPreTraining` in training mode.
    :param torch.Tensor pixel_values: ``(B, C, H, W)``.
    :param rate: ``"uniform"``, a fixed rate such as ``0.75``, or a range ``(lo, hi)``, as
        in :class:`~pyro_mpt.MPTLoss`.
    :returns: the model output, whose ``loss`` is differentiable and whose ``mask`` holds
        the ``M`` masked patches of each image.

    Example::

        >>> import torch
        >>> from transformers import ViTMAEConfig, ViTMAEForPreTraining
        >>> config = ViTMAEConfig(  # a tiny one: 16 patches of 4x4 pixels
        ...     image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32,
        ...     decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        ...     decoder_intermediate_size=64)
        >>> model = ViTMAEForPreTraining(config).train()
        >>> images = torch.randn(4, 3, 16, 16)
        >>> output = mae_loss(model, images, rate=(0.5, 0.95))
        >>> output.loss.backward()
        >>> sizes = output.mask.sum(-1)  # the same number M of masked patches in each image
        >>> bool((sizes == sizes[0]).all()) and 8 <= int(sizes[0]) <= 15
        True
    """
    schedule = as_rate_schedule(rate)
    total = num_patches(model)
    device = pixel_values.device
    size = schedule.sample_sizes(1, torch.Size(), total, device).reshape(())
    size = size.clamp(max=total - 1)
    masks = masks_of_sizes(size.expand(pixel_values.shape[0]), total)
    return masked_forward(model, pixel_values, masks)


def train_mae(
    model,
    images,
    rate="uniform",
    epochs=1,
    batch_size=128,
    lr=1e-3,
    weight_decay=0.05,
    generator=None,
    progress=True,
    steps=None,
    lr_schedule="cosine",
    warmup_steps=0,
):
    """Trains a ViT-MAE on ``images`` with :func:`mae_loss` and AdamW.

    :param model: a :class:`transformers.ViTMAEForPreTraining`; trained in ``train()``
        mode, its mode restored afterwards.
    :param torch.Tensor images: ``(N, C, H, W)`` on the model's device.
    :param rate: the rate schedule (``"uniform"``, ``0.75``, ``(lo, hi)``).
    :param int epochs: passes over the shuffled images (when ``steps`` is None).
    :param int batch_size: images per step.
    :param float lr: AdamW learning rate.
    :param float weight_decay: AdamW weight decay.
    :param torch.Generator generator: shuffling order (default: torch's global RNG).
    :param bool progress: show a progress bar over steps.
    :param int steps: train for exactly this many steps instead, reshuffling at every pass.
    :param str lr_schedule: ``"cosine"`` (decay to zero over the run) or ``"constant"`` (so
        that a flat loss means the run has levelled off, not that the rate has decayed).
    :param int warmup_steps: with ``"constant"``, steps over which the rate rises linearly
        to ``lr``.
    :returns: the loss of every step, a list of floats.
    """
    as_rate_schedule(rate)  # a bad rate fails before any step
    batch_size = check_positive_int("batch_size", batch_size)
    if lr_schedule not in ("cosine", "constant"):
        raise ValueError(f"lr_schedule must be 'cosine' or 'constant', got {lr_schedule!r}.")
    if warmup_steps and lr_schedule != "constant":
        raise ValueError(
            f"warmup_steps={warmup_steps!r} needs lr_schedule='constant'; the cosine schedule "
            f"starts at lr. Pass lr_schedule='constant', or warmup_steps=0."
        )
    num_images = images.shape[0]
    if steps is None:
        steps = check_positive_int("epochs", epochs) * -(-num_images // batch_size)
    steps = check_positive_int("steps", steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if lr_schedule == "cosine":
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    else:
        warmup = max(1, warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: min(1.0, (k + 1) / warmup)
        )
    training = model.training
    model.train()
    losses = []
    try:
        with progress_bar(total=steps, desc=f"MAE rate {rate}", disable=not progress) as bar:
            while len(losses) < steps:
                order = torch.randperm(num_images, generator=generator).to(images.device)
                for index in order.split(batch_size):
                    if len(losses) == steps:
                        break
                    loss = mae_loss(model, images[index], rate).loss
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    losses.append(float(loss.detach()))
                    bar.update()
    finally:
        model.train(training)
    return losses
