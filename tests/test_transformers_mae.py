"""ViT-MAE: exact control of the masking, the Gaussian patch score, the curve and training
with rate schedules, on tiny models built from configs."""

import itertools
import math
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pyro_mpt.ops.masks import masks_of_sizes  # noqa: E402
from pyro_mpt.transformers import mae_loss, mae_mpt_curve, train_mae  # noqa: E402
from pyro_mpt.transformers.vit_mae import (  # noqa: E402
    mask_ratio,
    masked_forward,
    num_patches,
    patch_log_likelihood,
    reconstruction_targets,
)
from tests._tiny_transformers import tiny_vit_mae  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def _mae(image_size=8, patch_size=2, norm_pix_loss=False, seed=0):
    model = tiny_vit_mae(image_size, patch_size, seed, norm_pix_loss=norm_pix_loss)
    return model.to(DEVICE)


def test_masked_forward_masks_exactly_the_requested_patches_for_every_count():
    model = _mae(image_size=10, patch_size=2)  # L = 25: ratios like 0.3, 0.6 round badly
    total = num_patches(model)
    assert total == 25
    images = torch.rand(6, 1, 10, 10, device=DEVICE)
    for size in range(total):
        masks = masks_of_sizes(torch.full((6,), size, device=DEVICE), total)
        out = masked_forward(model, images, masks)
        assert torch.equal(out.mask.bool(), masks)
    assert model.config.mask_ratio == 0.75  # restored after each call


def test_mask_ratio_sets_len_keep_exactly_and_rejects_all_masked():
    model = _mae()
    total = num_patches(model)
    for size in range(total):
        with mask_ratio(model, size):
            assert int(total * (1 - model.config.mask_ratio)) == total - size
    with pytest.raises(ValueError, match=r"num_masked=16 must lie in 0...15"):
        with mask_ratio(model, total):
            pass
    assert model.config.mask_ratio == 0.75


def test_masked_forward_rejects_uneven_counts_and_wrong_shapes():
    model = _mae()
    images = torch.rand(2, 1, 8, 8, device=DEVICE)
    uneven = torch.zeros(2, 16, dtype=torch.bool, device=DEVICE)
    uneven[0, :3] = True
    uneven[1, :5] = True
    with pytest.raises(ValueError, match=r"same number of masked patches, got \[3, 5\]"):
        masked_forward(model, images, uneven)
    with pytest.raises(ValueError, match=r"masks must have shape \(batch, patches\) = \(2, 16\)"):
        masked_forward(model, images, torch.zeros(2, 15, dtype=torch.bool, device=DEVICE))


def test_patch_log_likelihood_is_the_gaussian_density():
    prediction, target = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    expected = torch.distributions.Normal(prediction, 0.3).log_prob(target).sum(-1)
    torch.testing.assert_close(patch_log_likelihood(prediction, target, 0.3), expected)
    with pytest.raises(ValueError, match="scale must be a positive float"):
        patch_log_likelihood(prediction, target, 0.0)


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_curve_scores_match_the_model_s_own_loss(norm_pix_loss):
    """The score is the affine map of the model's masked-patch MSE: at one rate with one
    mask per image, mean S = -(n/2) log(2 pi s^2) - n MSE / (2 s^2)."""
    model = _mae(norm_pix_loss=norm_pix_loss, seed=1).eval()
    images = torch.rand(5, 1, 8, 8, device=DEVICE)
    torch.manual_seed(3)
    curve = mae_mpt_curve(model, images, rates=[0.5], num_masks=1, scale=0.2, progress=False)
    torch.manual_seed(3)
    masks = masks_of_sizes(torch.full((5,), 8, device=DEVICE), 16)
    with torch.no_grad():
        out = masked_forward(model, images, masks)
    n = 4
    expected = -0.5 * n * math.log(2 * math.pi * 0.04) - n * float(out.loss) / (2 * 0.04)
    assert float(curve.scores[0]) == pytest.approx(expected, rel=1e-9)
    target = reconstruction_targets(model, images)
    if norm_pix_loss:
        torch.testing.assert_close(target.mean(-1), torch.zeros(5, 16), atol=1e-6, rtol=0)


def _enumerated_scores(model, images, scale):
    """Every mask of the ``L`` patches scored by its own forward pass, each masked patch by
    a Gaussian density written out here: ``{M: (C(L, M), N)}`` for ``M = 1 ... L - 1``."""
    total = num_patches(model)
    target = reconstruction_targets(model, images)
    out = {}
    for size in range(1, total):
        scores = []
        for masked in itertools.combinations(range(total), size):
            mask = torch.zeros(total, dtype=torch.bool, device=DEVICE)
            mask[list(masked)] = True
            with torch.no_grad():
                prediction = masked_forward(model, images, mask.expand(len(images), -1)).logits
            density = torch.distributions.Normal(prediction.double(), scale)
            per_patch = density.log_prob(target.double()).sum(-1)
            scores.append(per_patch[:, list(masked)].mean(-1))
        out[size] = torch.stack(scores).cpu()
    return out


def test_curve_and_area_match_every_mask_enumerated():
    """L = 4 patches: at each rate the score is within 4 exact standard errors of the mean
    over all masks of that size, the standard errors match the exact ones (300 masks: about
    6% sampling noise; allowed 20%), and the area, L times the mean score over rates, is
    within 4 of its exact standard errors."""
    model = _mae(image_size=4, patch_size=2, seed=2).eval()
    images = torch.rand(3, 1, 4, 4, device=DEVICE)
    rates = [0.25, 0.5, 0.75]
    num_masks = 300
    torch.manual_seed(4)
    curve = mae_mpt_curve(
        model, images, rates=rates, num_masks=num_masks, scale=0.3, progress=False
    )
    assert curve.sizes.tolist() == [[1, 2, 3]] * 3 and curve.num_features.tolist() == [4] * 3
    torch.testing.assert_close(curve.masked_fraction, torch.tensor(rates))
    every = _enumerated_scores(model, images, 0.3)
    expected = torch.stack([every[m].mean() for m in (1, 2, 3)])
    variance = torch.stack([every[m].var(0, unbiased=False) / num_masks for m in (1, 2, 3)])
    exact_se = variance.sum(1).sqrt() / 3
    assert ((curve.scores - expected).abs() <= 4 * exact_se).all()
    torch.testing.assert_close(curve.stderr, exact_se, rtol=0.2, atol=0)
    area_se = float(variance.sum().sqrt() * 4 / (3 * 3))
    assert abs(curve.area - 4 * float(expected.mean())) <= 4 * area_se
    assert curve.area_stderr == pytest.approx(area_se, rel=0.2)


def test_curve_refuses_rates_that_hide_every_patch_and_non_image_batches():
    model = _mae(seed=2)
    images = torch.rand(4, 1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="mask all 16 patches at their largest"):
        mae_mpt_curve(model, images, rates=[0.5, 1.0])
    with pytest.raises(ValueError, match="pixel_values must be a non-empty batch of images"):
        mae_mpt_curve(model, images[0], rates=[0.5])
    # An empty batch gave an area of NaN, with torch's own warning only.
    with pytest.raises(ValueError, match=r"non-empty batch .* got shape \(0, 1, 8, 8\)"):
        mae_mpt_curve(model, images[:0], rates=[0.5])
    other = torch.float32 if images.dtype == torch.float64 else torch.float64
    with pytest.raises(TypeError, match=rf"pixel_values is {other} but the model's parameters"):
        mae_mpt_curve(model, images.to(other), rates=[0.5])
    # The fix named was to convert the model to uint8.
    with pytest.raises(TypeError, match=r"torch.uint8, but the model reads floating .* / 255"):
        mae_mpt_curve(model, (255 * images).to(torch.uint8), rates=[0.5])
    holed = images.clone()
    holed[1, 0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="pixel_values holds 1 NaN or infinite values"):
        mae_mpt_curve(model, holed, rates=[0.5])


def test_mae_loss_draws_mask_sizes_from_the_schedule():
    model = _mae(seed=3)
    images = torch.rand(3, 1, 8, 8, device=DEVICE)
    assert int(mae_loss(model, images, 0.75).mask.sum(1).unique()) == 12
    counts = [int(mae_loss(model, images, (0.25, 0.5)).mask[0].sum()) for _ in range(60)]
    # r ~ U[0.25, 0.5): M = floor(16 r) + 1 takes the values 5...8, each with probability 1/4.
    assert set(counts) == {5, 6, 7, 8}
    uniform = torch.tensor(
        [int(mae_loss(model, images, "uniform").mask[0].sum()) for _ in range(400)]
    )
    # Uniform on 1...16, with 16 capped to 15 (one patch stays visible): P(15) = 2/16.
    assert int(uniform.min()) == 1 and int(uniform.max()) == 15
    share = float((uniform == 15).double().mean())
    assert abs(share - 2 / 16) < 4 * math.sqrt((2 / 16) * (14 / 16) / 400)
    with pytest.raises(ValueError, match=r"rate must lie in \(0, 1\], got 1.5"):
        mae_loss(model, images, 1.5)


def test_training_lowers_the_loss_and_raises_the_curve():
    torch.manual_seed(0)
    # Images with structure: a bright square at a random place on a dark background.
    images = torch.zeros(64, 1, 8, 8, device=DEVICE)
    for i, (r, c) in enumerate(torch.randint(0, 5, (64, 2)).tolist()):
        images[i, 0, r : r + 4, c : c + 4] = 1.0
    model = _mae(seed=4)
    torch.manual_seed(5)
    before = mae_mpt_curve(model, images, rates=[0.25, 0.5], num_masks=2, progress=False)
    losses = train_mae(model, images, rate=(0.2, 0.8), epochs=30, batch_size=32, lr=3e-3)
    assert len(losses) == 60 and model.training  # built in train mode, and left so
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    torch.manual_seed(5)
    after = mae_mpt_curve(model, images, rates=[0.25, 0.5], num_masks=2, progress=False)
    assert after.area > before.area
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        train_mae(model, images, epochs=0)


def test_models_from_config_get_sine_cosine_positions():
    model = _mae()
    for table in (model.vit.embeddings.position_embeddings, model.decoder.decoder_pos_embed):
        assert float(table[0, 1:].var(-1).min()) > 0.1  # every patch position is distinct
        assert torch.unique(table[0, 1:], dim=0).shape[0] == 16


def _learning_rates(monkeypatch):
    """The learning rate of every AdamW step, recorded as the step is taken."""
    rates, step = [], torch.optim.AdamW.step

    def recording(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    return rates


@pytest.mark.parametrize("lr_schedule", ["cosine", "constant"])
def test_train_mae_runs_the_steps_asked_at_the_schedule_asked(monkeypatch, lr_schedule):
    # 7 steps over 3 passes of 16 images in batches of 6 (3 batches a pass, the last cut).
    images = torch.rand(16, 1, 8, 8, device=DEVICE)
    rates = _learning_rates(monkeypatch)
    warmup = 3 if lr_schedule == "constant" else 0
    losses = train_mae(
        _mae(seed=1), images, batch_size=6, lr=0.01, steps=7, progress=False,
        lr_schedule=lr_schedule, warmup_steps=warmup,
    )  # fmt: skip
    assert len(losses) == 7 and len(rates) == 7
    if lr_schedule == "cosine":
        expected = [0.01 * (1 + math.cos(math.pi * k / 7)) / 2 for k in range(7)]
    else:
        expected = [0.01 * min(1.0, (k + 1) / 3) for k in range(7)]
    assert rates == pytest.approx(expected, rel=1e-9)


def test_train_mae_schedule_arguments_are_checked():
    images = torch.rand(4, 1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="lr_schedule must be 'cosine' or 'constant'"):
        train_mae(_mae(), images, lr_schedule="linear")
    with pytest.raises(ValueError, match="warmup_steps=5 needs lr_schedule='constant'"):
        train_mae(_mae(), images, warmup_steps=5)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        train_mae(_mae(), images, steps=0)


def test_the_model_s_mode_is_restored_by_the_curve_and_by_training():
    # The curve runs in eval mode and training in train mode; each left the model in eval
    # mode whatever mode it came in.
    images = torch.rand(4, 1, 8, 8, device=DEVICE)
    model = _mae(seed=3).train()
    mae_mpt_curve(model, images, rates=[0.5], num_masks=2, progress=False)
    assert model.training
    model.eval()
    train_mae(model, images, batch_size=4, steps=1, progress=False)
    assert not model.training
    model.train()
    train_mae(model, images, batch_size=4, steps=1, progress=False)
    assert model.training
