"""Rate schedules, stratified mask sizes and random masks."""

import math

import pytest
import torch

from pyro_mpt.ops.estimators import mask_scores
from pyro_mpt.ops.mask_rates import FixedRate, RandomRate, UniformRate, as_rate_schedule
from pyro_mpt.ops.masks import (
    masked_sum,
    masks_of_sizes,
    plain_masks_of_sizes,
    sample_masks,
    select_masked,
)


def test_as_rate_schedule_forms():
    assert isinstance(as_rate_schedule("uniform"), UniformRate)
    assert isinstance(as_rate_schedule((0, 1)), UniformRate)
    assert as_rate_schedule(0.15).rate == 0.15
    schedule = as_rate_schedule((0.2, 0.6))
    assert (schedule.low, schedule.high) == (0.2, 0.6)
    assert as_rate_schedule(schedule) is schedule
    assert as_rate_schedule("uniform").unbiased and not schedule.unbiased


@pytest.mark.parametrize(
    "rate, error, match",
    [
        (0.0, ValueError, r"rate must lie in \(0, 1\], got 0.0"),
        (-0.5, ValueError, r"rate must lie in \(0, 1\], got -0.5"),
        (1.5, ValueError, r"rate must lie in \(0, 1\], got 1.5"),
        (float("nan"), ValueError, r"rate must lie in \(0, 1\], got nan"),
        ((0.8, 0.2), ValueError, r"rate=\(0.8, 0.2\) has lo > hi.*\(0.2, 0.8\)"),
        ((0.1, 0.5, 0.9), ValueError, r"pair \(lo, hi\).*got 3 values"),
        ((-0.1, 0.5), ValueError, r"rate\[0\] \(lo\) must lie in \[0, 1\]"),
        ((0.1, 1.2), ValueError, r"rate\[1\] \(hi\) must lie in \[0, 1\]"),
        ((0.0, 0.0), ValueError, r"masks nothing"),
        ("bert", ValueError, r"rate='bert' is not a known schedule.*'uniform'"),
        (None, TypeError, r"rate must be 'uniform'.*got None of type NoneType"),
        (True, TypeError, r"got True of type bool"),
        (("a", 0.5), TypeError, r"rate\[0\] \(lo\) must be a real number, got 'a'"),
    ],
)
def test_bad_rates_raise_clear_errors(rate, error, match):
    with pytest.raises(error, match=match):
        as_rate_schedule(rate)


def test_uniform_with_p_equal_d_uses_every_size_once():
    num_features = 13
    for _ in range(20):
        sizes = UniformRate().sample_sizes(num_features, torch.Size([50]), num_features)
        expected = torch.arange(1, num_features + 1).unsqueeze(-1).expand(-1, 50)
        assert torch.equal(sizes, expected)


def test_uniform_sizes_are_uniform_for_any_p():
    num_features, draws = 7, 40_000
    for num_masks in (1, 3):
        sizes = UniformRate().sample_sizes(num_masks, torch.Size([draws]), num_features)
        freq = torch.bincount(sizes.flatten(), minlength=num_features + 1)[1:].double()
        freq = freq / sizes.numel()
        # Binomial standard error of each frequency; 5 standard errors never flake.
        stderr = (1 / num_features * (1 - 1 / num_features) / sizes.numel()) ** 0.5
        assert (freq - 1 / num_features).abs().max() < 5 * stderr


def test_stratified_sizes_cover_the_strata():
    sizes = UniformRate().sample_sizes(4, torch.Size([1000]), 100)
    # Mask p of 4 takes its size from the p-th quarter of 1..100.
    for p in range(4):
        assert sizes[p].min() >= 25 * p + 1 and sizes[p].max() <= 25 * (p + 1)


def test_fixed_rate_sizes():
    assert FixedRate(0.15).sizes_from_quantiles(torch.rand(5), 512).unique().tolist() == [77]
    assert FixedRate(0.01).sizes_from_quantiles(torch.rand(5), 10).unique().tolist() == [1]
    assert FixedRate(1.0).sizes_from_quantiles(torch.rand(5), 10).unique().tolist() == [10]


def test_fixed_rate_rounds_decimal_halves_up_whatever_the_binary_rounding():
    # r D + 1/2 with r and D as written, in exact decimal arithmetic: 0.35 * 90 is 31.5, but
    # 31.499999999999996 in binary, which floor(x + 0.5) took to 31.
    from fractions import Fraction

    for rate in (0.15, 0.35, 0.45, 0.55, 0.65):
        for num_features in range(1, 400):
            exact = math.floor(Fraction(str(rate)) * num_features + Fraction(1, 2))
            expected = max(1, min(num_features, exact))
            schedule = FixedRate(rate)
            assert schedule.sizes_from_quantiles(torch.zeros(1), num_features).item() == expected
            counts = torch.tensor([num_features])
            assert schedule.sizes_from_quantiles(torch.zeros(1), counts).item() == expected


def test_random_rate_sizes_stay_in_range():
    sizes = RandomRate(0.2, 0.5).sample_sizes(3, torch.Size([2000]), 20)
    assert sizes.min() >= 5 and sizes.max() <= 11


@pytest.mark.parametrize("draw", [masks_of_sizes, plain_masks_of_sizes])
def test_masks_have_the_requested_sizes_and_are_uniform(draw):
    """The fast masks (16-bit keys, NumPy sort) and the plain ones (float64 keys)."""
    sizes = torch.tensor([0, 1, 3, 6]).repeat(5000)
    masks = draw(sizes, 6)
    assert torch.equal(masks.sum(-1), sizes)
    # Each feature is masked with probability M / D: check M = 3 within 5 standard errors.
    rows = masks[sizes == 3].double()
    stderr = (0.25 / rows.shape[0]) ** 0.5
    assert (rows.mean(0) - 0.5).abs().max() < 5 * stderr


def test_sample_masks_shapes_and_shared_masks():
    masks, sizes = sample_masks(UniformRate(), 4, torch.Size([10]), 8)
    assert masks.shape == (4, 10, 8) and sizes.shape == (4, 10)
    masks, sizes = sample_masks(FixedRate(0.5), 2, torch.Size(), 8)
    assert masks.shape == (2, 8) and torch.equal(masks.sum(-1), torch.tensor([4, 4]))


def test_numpy_and_torch_row_sorts_agree():
    from pyro_mpt.ops.masks import sort_rows

    keys = torch.rand(7, 33)
    assert torch.equal(sort_rows(keys, use_numpy=True), sort_rows(keys, use_numpy=False))


def test_select_masked_equals_where_on_finite_values():
    masks = torch.rand(3, 4, 5) < 0.5
    masked, unmasked = torch.randn(3, 4, 5), 1e30 * torch.randn(4, 5)
    assert torch.equal(select_masked(masks, masked, unmasked), torch.where(masks, masked, unmasked))
    assert torch.equal(select_masked(masks, 2.5, unmasked), torch.where(masks, 2.5, unmasked))
    assert torch.equal(select_masked(masks, masked, 1.0), torch.where(masks, masked, 1.0))


def test_mask_scores_ignore_non_finite_values_outside_the_mask():
    log_conditionals = torch.tensor([[-1.0, float("nan"), -3.0], [-1.0, -math.inf, math.inf]])
    masks = torch.tensor([[True, False, True], [True, True, False]])
    scores = mask_scores(log_conditionals, masks)
    torch.testing.assert_close(scores[0], torch.tensor(-2.0))
    assert scores[1] == -math.inf
    finite = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    (grad,) = torch.autograd.grad(mask_scores(finite, masks[:1]).sum(), finite)
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.0, 0.5]]))


def test_masks_have_their_exact_sizes_when_keys_tie(monkeypatch):
    # 4096 features, the most that take 16-bit keys: the M-th and (M+1)-th keys of a row tie
    # in about 6 rows of 100, which are drawn again with float64 keys.
    from pyro_mpt.ops import masks as masks_module

    draws = masks_module.masks_of_sizes
    redrawn = []

    def counted(sizes, num_features, entries=None, generator=None, key_dtype=None):
        if key_dtype == torch.float64:
            redrawn.append(sizes.numel())
        return draws(sizes, num_features, entries, generator, key_dtype)

    monkeypatch.setattr(masks_module, "masks_of_sizes", counted)
    torch.manual_seed(0)
    sizes = torch.randint(0, 4097, (500,))
    masks = masks_module.masks_of_sizes(sizes, 4096)
    assert torch.equal(masks.sum(-1), sizes)
    assert redrawn and redrawn[0] > 0  # the tied rows were drawn again


def test_masked_sum_ignores_non_finite_values_outside_the_mask():
    values = torch.tensor([[1.0, float("nan"), 2.0], [-math.inf, 3.0, 4.0]])
    masks = torch.tensor([[True, False, True], [False, True, True]])
    assert torch.equal(masked_sum(values, masks), torch.tensor([3.0, 7.0]))
    assert masked_sum(values, ~masks)[1] == -math.inf


def test_masks_of_every_subset_are_equally_likely():
    # 16-bit keys, three from each random 64-bit integer: every subset of size 2 of 5
    # features (10 of them) is drawn with probability 1/10, within 5 standard errors.
    torch.manual_seed(0)
    masks = masks_of_sizes(torch.full((40_000,), 2), 5)
    codes = (masks.long() * (2 ** torch.arange(5))).sum(-1)
    counts = torch.bincount(codes, minlength=32)[codes.unique()].double()
    assert counts.numel() == 10
    stderr = (0.1 * 0.9 / masks.shape[0]) ** 0.5
    assert (counts / masks.shape[0] - 0.1).abs().max() < 5 * stderr


def test_long_rows_have_exact_sizes_and_uniform_features():
    # 784 features: 16-bit keys tie at the threshold in about 1 row of 100, which is drawn
    # again; every feature is masked with probability 1/2 within 5 standard errors.
    torch.manual_seed(0)
    masks = masks_of_sizes(torch.full((20_000,), 392), 784)
    assert torch.equal(masks.sum(-1), torch.full((20_000,), 392))
    stderr = (0.25 / masks.shape[0]) ** 0.5
    assert (masks.double().mean(0) - 0.5).abs().max() < 5 * stderr


@pytest.mark.parametrize("schedule", [UniformRate(), FixedRate(0.15), RandomRate(0.2, 0.9)])
@pytest.mark.parametrize("missing", [False, True])
def test_sample_masks_returns_the_sizes_its_masks_have(schedule, missing):
    # The loss scores masks by the sizes sample_masks returns; each must be its mask's count.
    generator = torch.Generator().manual_seed(3)
    batch, num_features = (40, 3), 30
    entries = None
    if missing:
        entries = torch.rand(batch + (num_features,), generator=generator) < 0.6
        entries[0, 0] = False  # an observation with no entry: size 0
    masks, sizes = sample_masks(schedule, 5, batch, num_features, entries=entries)
    assert torch.equal(sizes.expand(masks.shape[:-1]), masks.sum(-1))
    if missing:
        assert not bool((masks & ~entries).any())
        assert int(sizes[:, 0, 0].max()) == 0
    values = torch.randn(masks.shape, generator=generator)
    counted = mask_scores(values, masks)
    assert torch.allclose(mask_scores(values, masks, sizes), counted, rtol=1e-12, atol=0)


@pytest.mark.parametrize("key_dtype", [torch.int16, torch.float32, torch.float64])
def test_masks_have_their_exact_sizes_with_every_key_dtype(key_dtype):
    torch.manual_seed(0)
    sizes = torch.randint(0, 301, (200,))
    masks = masks_of_sizes(sizes, 300, key_dtype=key_dtype)
    assert torch.equal(masks.sum(-1), sizes)


def test_masks_refuse_keys_of_another_dtype():
    with pytest.raises(ValueError, match=r"key_dtype must be .*torch\.int32"):
        masks_of_sizes(torch.tensor([1, 2]), 5, key_dtype=torch.int32)
