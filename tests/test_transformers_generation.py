"""``pyro_mpt.transformers.sample_mlm`` and the generation diagnostics on a tiny randomly
initialised BERT built from a config (nothing downloaded). Over 300 lines because each
sampler (sequential, parallel, mask-predict) is checked on its shapes, seeds, passes and
draws, and each diagnostic against a computation by hand."""

import math
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertModel  # noqa: E402

from pyro_mpt.transformers import (  # noqa: E402
    GenerationDiagnostics,
    MLMSamples,
    generation_diagnostics,
    mask_predict_schedule,
    pseudo_log_likelihood,
    sample_mlm,
    stutter_rate,
    token_frequency_distance,
)
from tests._tiny_transformers import SPECIAL, letter_tokenizer, tiny_bert  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
LETTERS = "abcdef"
PAD, CLS, SEP, MASK = 0, 2, 3, 4
A, B, C, D, E, F = range(5, 11)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return letter_tokenizer(tmp_path_factory.mktemp("vocab"), LETTERS)


@pytest.fixture(scope="module")
def model():
    # A large initialiser range makes the conditionals far from uniform (logits of sd about
    # 0.5 sqrt(16) = 2), so that the tests can tell one conditional from another.
    model = tiny_bert(len(SPECIAL) + len(LETTERS), seed=0, initializer_range=0.5)
    return model.to(DEVICE).eval()


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _ids(rows):
    return torch.tensor(rows, device=DEVICE)


class _PassCounter:
    """Counts forward passes and records the number of mask tokens each one sees."""

    def __init__(self, model):
        self.masks = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.masks.append((kwargs["input_ids"] == MASK).sum(1).tolist())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


START = [
    [CLS, A, MASK, B, MASK, MASK, C, SEP],
    [CLS, MASK, D, SEP, PAD, PAD, PAD, PAD],
]
ATTENTION = [[1] * 8, [1] * 4 + [0] * 4]


@pytest.mark.parametrize("method", ["sequential", "parallel", "mask-predict"])
def test_shapes_and_special_tokens_are_kept(model, tokenizer, method):
    start, attention = _ids(START), _ids(ATTENTION)
    out = sample_mlm(
        model,
        tokenizer,
        start,
        attention_mask=attention,
        method=method,
        num_steps=3,
        block_size=2,
        generator=_gen(0),
    )
    assert isinstance(out, MLMSamples) and out.sequences.shape == start.shape
    special = torch.isin(start, _ids([PAD, CLS, SEP]))
    assert torch.equal(out.sequences[special], start[special])
    content = ~special
    assert out.sequences[content].ge(A).all()  # no special token drawn, no mask left
    assert torch.equal(out.attention_mask, attention)
    assert out.seconds > 0 and out.seconds_per_sequence == out.seconds / 2
    if method == "mask-predict":  # the start's ordinary tokens are conditioned on
        given = content & (start != MASK)
        assert torch.equal(out.sequences[given], start[given])


def test_fully_masked_starts_and_lists_of_ids(model, tokenizer):
    out = sample_mlm(model, tokenizer, length=5, num_sequences=3, generator=_gen(0))
    assert out.sequences.shape == (3, 7) and out.num_passes == 5
    assert out.sequences[:, 0].eq(CLS).all() and out.sequences[:, -1].eq(SEP).all()
    assert out.sequences[:, 1:-1].ge(A).all()
    lists = [[CLS, MASK, A, SEP], [CLS, MASK, SEP]]
    out = sample_mlm(model, tokenizer, lists, method="parallel", generator=_gen(0))
    assert out.sequences.shape == (2, 4) and out.attention_mask.tolist()[1] == [1, 1, 1, 0]
    assert out.sequences[1, 3] == PAD and out.sequences[1, 2] == SEP
    # Without an attention mask, a tensor start attends to everything but padding.
    out = sample_mlm(model, tokenizer, _ids(START), method="parallel", generator=_gen(0))
    assert torch.equal(out.attention_mask, _ids(ATTENTION))


def test_seeded_runs_repeat_and_different_seeds_differ(model, tokenizer):
    def draw(seed, method):
        return sample_mlm(
            model, tokenizer, length=12, num_sequences=4, method=method, num_steps=4,
            block_size=3, generator=_gen(seed),
        ).sequences  # fmt: skip

    for method in ("sequential", "parallel", "mask-predict"):
        assert torch.equal(draw(1, method), draw(1, method))
        assert not torch.equal(draw(1, method), draw(2, method))


def _conditionals(model, x, temperature, top_k):
    """``p(x_i = v | x_-i)`` for every content position of ``x``, computed directly from the
    model's logits with the sampling settings: ``(positions, probabilities (P, V))``."""
    positions = list(range(1, len(x) - 1))
    rows = torch.tensor([x] * len(positions), device=DEVICE)
    rows[range(len(positions)), positions] = MASK
    with torch.no_grad():
        logits = model(input_ids=rows).logits[range(len(positions)), positions].double()
    logits = logits / temperature
    logits[:, :A] = -math.inf
    kth = logits.topk(top_k, -1).values[:, -1:]
    return positions, logits.masked_fill(logits < kth, -math.inf).softmax(-1).cpu()


def test_sequential_k1_step_is_one_draw_from_a_conditional(model, tokenizer):
    # One step picks a position i uniformly among the D content positions and draws x_i from
    # p(x_i | x_-i). The outcome "position i changed to v != x_i" has probability
    # p_i(v) / D and "unchanged" sum_i p_i(x_i) / D; every outcome's frequency over N draws
    # must be within 5 standard errors (35 outcomes), and those of probability 0 (tokens
    # outside the top k) must never occur.
    x = [CLS, A, B, B, C, F, SEP]
    temperature, top_k, n = 0.7, 4, 20000
    positions, probs = _conditionals(model, x, temperature, top_k)
    out = sample_mlm(
        model, tokenizer, _ids([x] * n), num_steps=1, block_size=1,
        temperature=temperature, top_k=top_k, generator=_gen(3),
    ).sequences.cpu()  # fmt: skip
    changed = out != torch.tensor(x)
    assert changed.sum(1).le(1).all()  # at most one position changes per step
    d = len(positions)
    expected = {"unchanged": sum(float(probs[j, x[i]]) for j, i in enumerate(positions)) / d}
    observed = {"unchanged": int((changed.sum(1) == 0).sum())}
    for j, i in enumerate(positions):
        for v in range(A, len(SPECIAL) + len(LETTERS)):
            if v != x[i]:
                expected[(i, v)] = float(probs[j, v]) / d
                observed[(i, v)] = int((out[:, i] == v).sum())
    assert sum(p > 0 for p in expected.values()) > 15  # the check is not vacuous
    for key, p in expected.items():
        if p == 0:
            assert observed[key] == 0, key
        else:
            se = math.sqrt(p * (1 - p) / n)
            assert abs(observed[key] / n - p) < 5 * se, (key, observed[key] / n, p)


def test_parallel_step_costs_one_pass_and_sequential_k_passes(model, tokenizer):
    start = _ids(START)
    attention = _ids(ATTENTION)
    num_masked = 3  # the most masks in one start sequence: sequential fills take 3 passes
    for method, steps, k, passes in [
        ("sequential", 0, 1, num_masked),
        ("sequential", 4, 2, num_masked + 4 * 2),
        ("sequential", 3, 2, num_masked + 3 * 2),
        ("parallel", 0, 1, 1),
        ("parallel", 4, 2, 1 + 4),
        ("parallel", 3, 1, 1 + 3),
        ("mask-predict", 2, 1, 2),
    ]:
        with _PassCounter(model) as counter:
            out = sample_mlm(
                model, tokenizer, start, attention_mask=attention, method=method,
                num_steps=steps, block_size=k, generator=_gen(0),
            )  # fmt: skip
        assert len(counter.masks) == out.num_passes == passes, (method, steps, k)
    # Without masks in the start, every Gibbs step of k positions masks exactly k of them.
    full = _ids([[CLS, A, B, C, D, E, SEP]] * 2)
    with _PassCounter(model) as counter:
        sample_mlm(model, tokenizer, full, method="parallel", num_steps=3, block_size=4)
    assert counter.masks == [[4, 4]] * 3
    with _PassCounter(model) as counter:
        sample_mlm(model, tokenizer, full, method="sequential", num_steps=2, block_size=3)
    assert counter.masks == [[3, 3], [2, 2], [1, 1]] * 2


def test_mask_predict_remasks_a_linearly_decaying_number(model, tokenizer):
    assert mask_predict_schedule(10, 4) == [10, 7, 5, 2]
    assert mask_predict_schedule(3, 5) == [3, 2, 1, 1, 0]
    start = _ids([[CLS, A] + [MASK] * 10 + [SEP], [CLS] + [MASK] * 6 + [B] * 5 + [SEP]])
    with _PassCounter(model) as counter:
        out = sample_mlm(model, tokenizer, start, method="mask-predict", num_steps=4)
    assert counter.masks == [[10, 6], [7, 4], [5, 3], [2, 1]]
    assert out.num_passes == 4 and out.sequences[:, 1:-1].ge(A).all()
    # An iteration that re-masks nothing costs no pass.
    with _PassCounter(model) as counter:
        sample_mlm(model, tokenizer, _ids([[CLS] + [MASK] * 3 + [SEP]]), method="mask-predict",
                   num_steps=5)  # fmt: skip
    assert counter.masks == [[3], [2], [1], [1]]


def test_keep_unmasked_resamples_only_the_masked_positions(model, tokenizer):
    start = _ids([[CLS, A, MASK, B, MASK, C, SEP]] * 50)
    out = sample_mlm(model, tokenizer, start, num_steps=5, block_size=2, keep_unmasked=True)
    given = start != MASK
    assert torch.equal(out.sequences[given], start[given])


def test_training_mode_is_restored(model, tokenizer):
    model.train()
    try:
        sample_mlm(model, tokenizer, length=3)
        assert model.training
    finally:
        model.eval()


def test_bad_input_errors(model, tokenizer):
    start = _ids([[CLS, A, B, SEP]])
    with pytest.raises(TypeError, match="model must be a masked language model"):
        sample_mlm(BertModel(model.config), tokenizer, start)
    with pytest.raises(ValueError, match="method must be one of"):
        sample_mlm(model, tokenizer, start, method="greedy")
    for t in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be a positive number"):
            sample_mlm(model, tokenizer, start, temperature=t)
    with pytest.raises(ValueError, match=r"block_size must be between 1 and 2 \(the free"):
        sample_mlm(model, tokenizer, start, num_steps=1, block_size=3)
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        sample_mlm(model, tokenizer, start, num_steps=1, block_size=0)
    with pytest.raises(ValueError, match="with keep_unmasked=True only its mask tokens are"):
        sample_mlm(model, tokenizer, start, num_steps=1, keep_unmasked=True)
    # Float ids were cast (4.7 to 4, the mask token, then filled); an id outside the
    # vocabulary failed with a bare IndexError.
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got a torch"):
        sample_mlm(model, tokenizer, start.double())
    with pytest.raises(TypeError, match="sequences must be a long .* got a torch.float64"):
        pseudo_log_likelihood(model, tokenizer, start.double())
    with pytest.raises(ValueError, match=r"sequences\[0\] holds token id 99 at position 1"):
        pseudo_log_likelihood(model, tokenizer, _ids([[CLS, 99, B, SEP]]))
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got 0"):
        sample_mlm(model, tokenizer, start, generator=0)
    with pytest.raises(ValueError, match="top_k must be at most 6"):
        sample_mlm(model, tokenizer, start, top_k=7)
    with pytest.raises(ValueError, match="give exactly one of input_ids"):
        sample_mlm(model, tokenizer, start, length=4)
    with pytest.raises(ValueError, match="give exactly one of input_ids"):
        sample_mlm(model, tokenizer)
    with pytest.raises(ValueError, match="mask-predict fills masked positions"):
        sample_mlm(model, tokenizer, start, method="mask-predict")
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer"):
        sample_mlm(model, tokenizer, start, num_steps=-1)
    with pytest.raises(ValueError, match="num_steps must be at least 1"):
        sample_mlm(model, tokenizer, length=3, method="mask-predict", num_steps=0)
    with pytest.raises(ValueError, match=r"input_ids must be \(L,\) or \(B, L\)"):
        sample_mlm(model, tokenizer, start[None])

    class NoMask:
        mask_token_id = None

    with pytest.raises(ValueError, match="has no mask token"):
        sample_mlm(model, NoMask(), start)


def test_stutter_rate_and_token_distance_by_hand(tokenizer):
    ids = _ids([[CLS, A, A, B, B, B, SEP, PAD], [CLS, A, B, C, D, SEP, PAD, PAD]])
    rates = stutter_rate(ids, tokenizer)
    assert rates.tolist() == [3 / 4, 0.0]  # pairs next to [CLS], [SEP] or padding not counted
    # Frequencies: samples a 3/9, b 4/9, c 1/9, d 1/9; reference a 1/2, e 1/2.
    reference = [[CLS, A, E, SEP], [CLS, A, E, SEP]]
    tv = token_frequency_distance(ids, reference, tokenizer)
    assert tv == pytest.approx(0.5 * (abs(3 / 9 - 1 / 2) + 4 / 9 + 1 / 9 + 1 / 9 + 1 / 2))
    assert token_frequency_distance(ids, ids, tokenizer) == 0.0


def test_pseudo_log_likelihood_matches_one_pass_per_position(model, tokenizer):
    ids, attention = _ids(START), _ids(ATTENTION)
    ids = ids.masked_fill(ids == MASK, E)
    pll = pseudo_log_likelihood(model, tokenizer, ids, attention, batch_size=3)
    expected = []
    for row, att in zip(ids.tolist(), attention.tolist()):
        total = 0.0
        for i, token in enumerate(row):
            if att[i] and token >= A:
                masked = list(row)
                masked[i] = MASK
                with torch.no_grad():
                    logits = model(input_ids=_ids([masked]), attention_mask=_ids([att])).logits
                total += float(logits[0, i].double().log_softmax(-1)[token])
        expected.append(total)
    torch.testing.assert_close(pll, torch.tensor(expected, dtype=torch.float64))
    out = sample_mlm(model, tokenizer, ids, attention_mask=attention, num_steps=2)
    d = generation_diagnostics(model, tokenizer, out, reference=ids)
    assert isinstance(d, GenerationDiagnostics) and d.num_passes == 2
    assert d.num_tokens.tolist() == [6, 2] and d.pseudo_log_likelihood.shape == (2,)
    assert 0 <= d.token_distance <= 1 and d.seconds_per_sequence > 0


def test_padded_lists_and_a_tokenizers_output_start_as_the_tensor(model, tokenizer):
    """Padding already in lists of ids is not attended to (its attention mask was 1), and a
    tokenizer's output starts from its ids and attention mask (its key names were read as
    ids): every form draws, with the same seed, what the padded tensor draws."""
    options = dict(method="sequential", num_steps=2)
    expected = sample_mlm(model, tokenizer, _ids(START), generator=_gen(3), **options)
    assert torch.equal(expected.attention_mask, _ids(ATTENTION))
    encoded = tokenizer(["a [MASK] b [MASK] [MASK] c", "[MASK] d"], padding=True)
    assert encoded["input_ids"] == START
    for given in (START, encoded, encoded.convert_to_tensors("pt"), {"input_ids": START}):
        out = sample_mlm(model, tokenizer, given, generator=_gen(3), **options)
        assert torch.equal(out.attention_mask, _ids(ATTENTION)), type(given)
        assert torch.equal(out.sequences, expected.sequences), type(given)


def test_starts_the_model_cannot_read_raise_clear_errors(model, tokenizer):
    """Too long for the 32 positions, ids outside the 11-token vocabulary, texts for ids: the
    start, the limit and the fix are named before the model's own error."""
    with pytest.raises(ValueError, match=r"input_ids\[1\] holds token id 11 at position 2"):
        sample_mlm(model, tokenizer, [[CLS, MASK, SEP], [CLS, MASK, 11, SEP]])
    with pytest.raises(ValueError, match=r"input_ids\[0\] holds token id -1 at position 1"):
        sample_mlm(model, tokenizer, _ids([[CLS, -1, MASK, SEP]]))
    with pytest.raises(
        ValueError, match=r"input_ids\[0\] is 34 tokens long .* 32 positions .* at most 32"
    ):
        sample_mlm(model, tokenizer, _ids([[CLS] + [MASK] * 32 + [SEP]]))
    with pytest.raises(ValueError, match=r"length=31 makes sequences of 33 .* length=30 or less"):
        sample_mlm(model, tokenizer, length=31)
    assert sample_mlm(model, tokenizer, length=30, method="parallel").sequences.shape == (1, 32)
    with pytest.raises(TypeError, match=r"input_ids\[0\] must be a list of token ids, got str"):
        sample_mlm(model, tokenizer, ["a [MASK] b"])
    with pytest.raises(ValueError, match=r"mask of input_ids has 3 entries in row 0, .* 4 tokens"):
        sample_mlm(model, tokenizer, [[CLS, MASK, A, SEP]], attention_mask=[[1, 1, 1]])
    with pytest.raises(ValueError, match="input_ids is a mapping with keys \\['ids'\\]"):
        sample_mlm(model, tokenizer, {"ids": [[CLS, MASK, SEP]]})


def _left_padded(rows, attention):
    """Each row with its padding moved to the front (as a tokenizer with
    ``padding_side="left"`` pads)."""
    moved_rows, moved_attention = [], []
    for row, att in zip(rows, attention):
        length = sum(att)
        moved_rows.append([PAD] * (len(row) - length) + row[:length])
        moved_attention.append([0] * (len(row) - length) + [1] * length)
    return moved_rows, moved_attention


def test_left_padded_rows_score_and_draw_as_unpadded(model, tokenizer):
    """BERT's positions count from column 0 whatever the attention mask says: a left-padded
    row read as it is sits at shifted positions. Its pseudo-log-likelihood was off (by 1.9
    nats in a probe) and its draws came from other conditionals; it scores as the row
    right-padded and draws the same tokens, returned in its own layout."""
    ids = _ids(START).masked_fill(_ids(START) == MASK, E)
    right = pseudo_log_likelihood(model, tokenizer, ids, _ids(ATTENTION))
    rows, attention = _left_padded(ids.tolist(), ATTENTION)
    left = pseudo_log_likelihood(model, tokenizer, _ids(rows), _ids(attention))
    torch.testing.assert_close(left, right, rtol=0, atol=1e-10)

    options = dict(method="sequential", num_steps=2)
    expected = sample_mlm(model, tokenizer, _ids(START), generator=_gen(5), **options)
    rows, attention = _left_padded(START, ATTENTION)
    given = dict(attention_mask=_ids(attention), generator=_gen(5))
    out = sample_mlm(model, tokenizer, _ids(rows), **given, **options)
    assert torch.equal(out.attention_mask, _ids(attention))
    moved_back, _ = _left_padded(expected.sequences.tolist(), ATTENTION)
    assert out.sequences.tolist() == moved_back
