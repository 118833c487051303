"""``MPTDataCollator``: mask sizes per rate schedule, uniform masks, BERT's 80/10/10
corruption, whole words and spans, the weights D_i / M_i, its random streams across
data-parallel processes, and its errors. Over 300 lines because each of those options is
checked against its exact distribution."""

import math
import os
import pathlib
import re
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pyro_mpt.diagnostics.curve import rate_sizes  # noqa: E402
from pyro_mpt.ops.mask_rates import FixedRate, as_rate_schedule  # noqa: E402
from pyro_mpt.transformers import MPTDataCollator  # noqa: E402

LETTERS = "abcdefghijklmnopqrst"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _write_vocab(path, tokens):
    path.write_text("\n".join(tokens) + "\n")
    return str(path.parent)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A WordPiece tokenizer whose words are letters followed by ``##`` letters."""
    folder = tmp_path_factory.mktemp("vocab")
    tokens = SPECIAL + list(LETTERS) + ["##" + c for c in LETTERS]
    return transformers.BertTokenizerFast.from_pretrained(
        _write_vocab(folder / "vocab.txt", tokens)
    )


def _texts(num, generator, max_words=12):
    texts = []
    for _ in range(num):
        num_words = int(torch.randint(1, max_words + 1, (), generator=generator))
        words = []
        for _ in range(num_words):
            length = int(torch.randint(1, 4, (), generator=generator))
            idx = torch.randint(len(LETTERS), (length,), generator=generator)
            words.append("".join(LETTERS[i] for i in idx))
        texts.append(" ".join(words))
    return texts


def _batch(tokenizer, num=64, seed=1, **kwargs):
    texts = _texts(num, torch.Generator().manual_seed(seed), **kwargs)
    return [tokenizer(t) for t in texts]


def _maskable(batch, tokenizer):
    ids = batch["input_ids"]
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    return batch["attention_mask"].bool() & ~special


def _original(examples, tokenizer):
    return tokenizer.pad(examples, return_tensors="pt")


def _word_index(ids, tokenizer):
    """Word number of every token, -1 at special tokens and padding (reference, by loops)."""
    out = torch.full_like(ids, -1)
    for i, row in enumerate(ids.tolist()):
        word = -1
        for j, token_id in enumerate(row):
            token = tokenizer.convert_ids_to_tokens(token_id)
            if token in SPECIAL:
                continue
            if not token.startswith("##") or out[i, j - 1] < 0:
                word += 1
            out[i, j] = word
    return out


def test_no_special_or_pad_token_is_ever_masked(tokenizer):
    examples = _batch(tokenizer)
    padded = _original(examples, tokenizer)
    maskable = _maskable(padded, tokenizer)
    for kwargs in ({"rate": "uniform"}, {"rate": 1.0}, {"rate": 1.0, "whole_word_mask": True}):
        collator = MPTDataCollator(tokenizer, **kwargs)
        for _ in range(20):
            batch = collator(examples)
            assert (batch["labels"][~maskable] == -100).all()
            assert torch.equal(batch["input_ids"][~maskable], padded["input_ids"][~maskable])
            assert torch.equal(batch["attention_mask"], padded["attention_mask"])
            assert torch.equal(batch["token_type_ids"], padded["token_type_ids"])
            masked = batch["labels"] != -100
            assert torch.equal(batch["labels"][masked], padded["input_ids"][masked])


def test_fixed_rate_masks_round_rate_times_d_tokens(tokenizer):
    examples = _batch(tokenizer)
    maskable = _maskable(_original(examples, tokenizer), tokenizer)
    counts = maskable.sum(-1)
    for rate in (0.15, 0.5, 1.0):
        batch = MPTDataCollator(tokenizer, rate=rate)(examples)
        sizes = (batch["labels"] != -100).sum(-1)
        expected = torch.tensor([max(1, math.floor(rate * d + 0.5)) for d in counts.tolist()])
        assert torch.equal(sizes, expected)
        assert torch.allclose(batch["mpt_weights"].double(), counts.double() / expected)


@pytest.mark.parametrize("rate", ["uniform", (0.2, 0.6)])
def test_random_mask_sizes_follow_the_schedule(tokenizer, rate):
    # Every sequence has D = 20 maskable tokens; the mean mask size and the share of each
    # size match the schedule within 4 standard errors.
    examples = [tokenizer(" ".join(LETTERS)) for _ in range(200)]
    collator = MPTDataCollator(tokenizer, rate=rate)
    sizes = torch.cat([(collator(examples)["labels"] != -100).sum(-1) for _ in range(20)])
    num, dim = sizes.numel(), 20
    grid = (torch.arange(20000, dtype=torch.float64) + 0.5) / 20000
    reference = as_rate_schedule(rate).sizes_from_quantiles(grid, dim)
    probs = torch.bincount(reference, minlength=dim + 1).double() / reference.numel()
    mean, var = (torch.arange(dim + 1) * probs).sum(), None
    var = ((torch.arange(dim + 1) - mean) ** 2 * probs).sum()
    assert abs(sizes.double().mean() - mean) < 4 * math.sqrt(var / num)
    freq = torch.bincount(sizes, minlength=dim + 1).double() / num
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / num).sqrt() + 1e-12).all()


def test_masks_are_uniform_over_maskable_positions(tokenizer):
    # At a fixed rate every maskable position of a row is masked with chance M_i / D_i.
    examples = _batch(tokenizer, num=16)
    maskable = _maskable(_original(examples, tokenizer), tokenizer)
    collator = MPTDataCollator(tokenizer, rate=0.3)
    reps = 2000
    hits = sum((collator(examples)["labels"] != -100).double() for _ in range(reps))
    counts = maskable.sum(-1, keepdim=True).double()
    share = torch.clamp(torch.floor(0.3 * counts + 0.5), min=1) / counts
    share = share.expand_as(hits)[maskable]
    se = (share * (1 - share) / reps).sqrt().clamp(min=1e-9)
    z = (hits[maskable] / reps - share) / se
    assert z.abs().max() < 5  # about 200 positions: 5 standard errors for all of them


def test_corruption_is_80_10_10_within_binomial_tolerance(tokenizer):
    examples = [tokenizer(" ".join(LETTERS * 3)) for _ in range(50)]
    original = _original(examples, tokenizer)["input_ids"]
    collator = MPTDataCollator(tokenizer, rate=0.5)
    pool = len(tokenizer) - len(SPECIAL)
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(40):
        batch = collator(examples)
        masked = batch["labels"] != -100
        new, old = batch["input_ids"][masked], original[masked]
        assert not torch.isin(new[new != tokenizer.mask_token_id], torch.tensor(range(5))).any()
        counts += torch.stack(
            [
                (new == tokenizer.mask_token_id).sum(),
                ((new != old) & (new != 4)).sum(),
                (new == old).sum(),
            ]
        ).double()
    total = counts.sum()
    # A random replacement equals the original token with chance 1 / pool.
    expected = torch.tensor([0.8, 0.1 * (1 - 1 / pool), 0.1 + 0.1 / pool], dtype=torch.float64)
    se = (expected * (1 - expected) / total).sqrt()
    assert ((counts / total - expected).abs() < 4 * se).all(), counts / total


def test_corruption_probabilities_are_configurable(tokenizer):
    examples = _batch(tokenizer)
    original = _original(examples, tokenizer)["input_ids"]
    only_mask = MPTDataCollator(tokenizer, rate=0.5, mask_replace_prob=1.0, random_replace_prob=0)
    batch = only_mask(examples)
    assert (batch["input_ids"][batch["labels"] != -100] == tokenizer.mask_token_id).all()
    keep = MPTDataCollator(tokenizer, rate=0.5, mask_replace_prob=0.0, random_replace_prob=0.0)
    batch = keep(examples)
    assert torch.equal(batch["input_ids"], original)
    assert (batch["labels"] != -100).any()


def test_whole_words_are_masked_together_and_weighted_by_words(tokenizer):
    examples = _batch(tokenizer)
    ids = _original(examples, tokenizer)["input_ids"]
    words = _word_index(ids, tokenizer)
    num_words = words.max(-1).values + 1
    for kwargs in ({"rate": "uniform"}, {"rate": 0.4, "span_masking": True}):
        collator = MPTDataCollator(tokenizer, whole_word_mask=True, **kwargs)
        for _ in range(20):
            batch = collator(examples)
            masked = batch["labels"] != -100
            for i in range(ids.shape[0]):
                masked_words = set(words[i][masked[i]].tolist())
                for w in masked_words:
                    assert masked[i][words[i] == w].all()  # all tokens of a masked word
                expected = num_words[i].item() / len(masked_words)
                assert batch["mpt_weights"][i].item() == pytest.approx(expected, rel=1e-6)


def test_word_boundaries_from_word_ids_and_offsets_match_the_vocabulary(tokenizer):
    texts = _texts(8, torch.Generator().manual_seed(3))
    plain = [tokenizer(t) for t in texts]
    with_ids = [dict(tokenizer(t), word_ids=tokenizer(t).word_ids()) for t in texts]
    with_offsets = [tokenizer(t, return_offsets_mapping=True) for t in texts]
    collator = MPTDataCollator(tokenizer, rate=0.5, whole_word_mask=True)
    outputs = []
    for examples in (plain, with_ids, with_offsets):
        torch.manual_seed(7)
        outputs.append(collator(examples))
    for other in outputs[1:]:
        assert sorted(other) == sorted(outputs[0])
        for key in outputs[0]:
            assert torch.equal(other[key], outputs[0][key]), key


def test_spans_are_placed_uniformly_among_arrangements(tokenizer):
    # Span lengths are all max_span_length = 2 when p is tiny. Five maskable tokens:
    # M = 2 gives one span at 4 places, M = 4 two spans in 3 arrangements, all equally likely.
    examples = [tokenizer("a b c d e")] * 500
    for rate, expected in ((0.4, 4), (0.8, 3)):
        collator = MPTDataCollator(
            tokenizer, rate=rate, span_masking=True, span_geometric_p=1e-9, max_span_length=2
        )
        masks = torch.cat([(collator(examples)["labels"] != -100)[:, 1:6] for _ in range(8)])
        patterns, freq = torch.unique(masks, dim=0, return_counts=True)
        assert patterns.shape[0] == expected
        for pattern in patterns.tolist():  # every masked run has even length
            runs = "".join("1" if x else "0" for x in pattern).split("0")
            assert all(len(run) % 2 == 0 for run in runs)
        share, p = freq.double() / masks.shape[0], 1.0 / expected
        assert ((share - p).abs() < 4 * math.sqrt(p * (1 - p) / masks.shape[0])).all()


def test_span_masks_cover_exactly_the_drawn_size(tokenizer):
    examples = _batch(tokenizer, num=64, max_words=40)
    maskable = _maskable(_original(examples, tokenizer), tokenizer)
    counts = maskable.sum(-1)
    collator = MPTDataCollator(tokenizer, rate=0.35, span_masking=True)
    masked = collator(examples)["labels"] != -100
    expected = torch.clamp(torch.floor(0.35 * counts.double() + 0.5), min=1).long()
    assert torch.equal(masked.sum(-1), expected)
    # Spans make fewer, longer runs than scattered tokens: mean run > 1.5 tokens.
    runs = (masked[:, 1:] & ~masked[:, :-1]).sum() + masked[:, 0].sum()
    assert masked.sum() / runs > 1.5


def test_lists_of_ids_left_padding_and_multiple_of(tokenizer):
    examples = [[2, 5, 6, 7, 3], [2, 8, 3]]
    collator = MPTDataCollator(tokenizer, rate=1.0, pad_to_multiple_of=8)
    batch = collator(examples)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert batch["labels"].tolist()[1] == [-100, 8] + [-100] * 6
    tokenizer.padding_side = "left"
    try:
        batch = collator(examples)
    finally:
        tokenizer.padding_side = "right"
    assert batch["attention_mask"].tolist()[1] == [0] * 5 + [1] * 3
    assert batch["labels"].tolist()[1] == [-100] * 6 + [8, -100]


def test_tokenizer_without_a_mask_token_is_rejected(tokenizer, tmp_path):
    vocab = _write_vocab(tmp_path / "vocab.txt", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"])
    no_mask = transformers.BertTokenizerFast.from_pretrained(vocab, mask_token=None)
    no_mask.mask_token = None
    with pytest.raises(ValueError, match="has no mask token"):
        MPTDataCollator(no_mask)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rate": 1.5}, ValueError, r"rate must lie in \(0, 1\], got 1.5"),
        ({"rate": 0.0}, ValueError, r"rate must lie in \(0, 1\], got 0.0"),
        ({"rate": (0.6, 0.2)}, ValueError, "has lo > hi"),
        ({"rate": "bert"}, ValueError, "not a known schedule"),
        ({"mask_replace_prob": 0.95}, ValueError, "must not exceed 1"),
        ({"random_replace_prob": -0.1}, ValueError, r"random_replace_prob must lie in \[0, 1\]"),
        ({"mask_replace_prob": "0.8"}, TypeError, "mask_replace_prob must be a float"),
        ({"span_geometric_p": 0.0}, ValueError, "span_geometric_p must be positive"),
        ({"max_span_length": 0}, ValueError, "max_span_length must be at least 1, got 0"),
        ({"pad_to_multiple_of": 2.5}, TypeError, "pad_to_multiple_of must be a positive integer"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer, got -1"),
        ({"seed": 0.5}, TypeError, "seed must be a non-negative integer or None, got 0.5"),
        ({"mlm_probability": 0.0}, ValueError, r"mlm_probability must lie in \(0, 1\], got 0.0"),
        ({"mlm_probability": "uniform"}, TypeError, "pass rate= instead"),
        ({"mlm_probability": 0.15, "rate": "uniform"}, ValueError, "give the masking rate once"),
    ],
)
def test_bad_arguments_raise(tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        MPTDataCollator(tokenizer, **kwargs)


def test_sequence_without_maskable_token_raises(tokenizer):
    collator = MPTDataCollator(tokenizer)
    examples = [tokenizer("a b"), tokenizer(""), tokenizer("c")]
    kept = [dict(e) for e in examples]
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] of the batch have no maskable"):
        collator(examples)
    assert [dict(e) for e in examples] == kept  # the examples are left as they were


def test_whole_words_need_word_boundaries(tmp_path):
    vocab = _write_vocab(tmp_path / "vocab.txt", SPECIAL + list(LETTERS))
    chars = transformers.BertTokenizerFast.from_pretrained(vocab)
    collator = MPTDataCollator(chars, whole_word_mask=True)
    with pytest.raises(ValueError, match="whole_word_mask=True needs word boundaries"):
        collator([chars("a b c")])
    with_ids = [dict(chars("ab c"), word_ids=chars("ab c").word_ids())]
    assert collator(with_ids)["mpt_weights"].shape == (1,)


def test_examples_without_input_ids_and_unequal_lengths_without_pad(tokenizer):
    collator = MPTDataCollator(tokenizer)
    with pytest.raises(ValueError, match="examples must hold 'input_ids'"):
        collator([{"text": "a b"}])
    collator.pad_token_id = None
    with pytest.raises(ValueError, match="has no pad token"):
        collator([[2, 5, 3], [2, 5, 6, 3]])


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_ids_outside_the_vocabulary_raise(tokenizer, bad):
    collator = MPTDataCollator(tokenizer)
    with pytest.raises(ValueError, match=f"input_ids holds id {bad}, outside the tokenizer's"):
        collator([[2, 5, bad, 3]])


def test_float_ids_raise(tokenizer):
    collator = MPTDataCollator(tokenizer)
    with pytest.raises(ValueError, match="input_ids must be integer token ids, got dtype"):
        collator([torch.tensor([2.0, 5.5, 3.0])])


def test_per_example_scalars_are_stacked(tokenizer):
    examples = [dict(tokenizer("a b"), label=1), dict(tokenizer("c"), label=0)]
    batch = MPTDataCollator(tokenizer)(examples)
    assert batch["label"].tolist() == [1, 0]
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 4)


def test_a_fixed_rate_rounds_halves_up(tokenizer):
    # r D = 0.15 * 30 = 4.5: M = floor(4.5 + 1/2) = 5 tokens, where Python's round, which
    # rounds halves to even, would give 4.
    assert 0.15 * 30 == 4.5 and round(0.15 * 30) == 4
    example = tokenizer(" ".join((LETTERS * 2)[:30]))
    batch = MPTDataCollator(tokenizer, rate=0.15)([example])
    assert int((batch["labels"] != -100).sum()) == 5
    assert batch["mpt_weights"].item() == pytest.approx(30 / 5)
    zero = torch.zeros(1, dtype=torch.float64)
    assert FixedRate(0.15).sizes_from_quantiles(zero, 30).tolist() == [5]
    assert FixedRate(0.15).sizes_from_quantiles(zero, torch.tensor([30])).tolist() == [5]
    assert rate_sizes([0.15], 30).tolist() == [5]  # the sizes of the MPT curves


def test_the_docs_state_the_rounding_of_the_code():
    # "round(0.15 D)" reads as Python's round, which gives 4 at D = 30; the code gives 5.
    root = pathlib.Path(__file__).resolve().parent.parent
    files = [root / "README.md", *sorted((root / "tutorials").glob("*.ipynb"))]
    files += sorted(p for p in (root / "docs").rglob("*.rst") if "_build" not in p.parts)
    files += sorted((root / "pyro_mpt").rglob("*.py"))
    pattern = re.compile(r"round\}?\((?:0\.\d+|r|rate) ?[A-Z]\)")
    stale = [
        f"{p.relative_to(root)}: {m.group()}"
        for p in files
        for m in pattern.finditer(p.read_text(encoding="utf-8"))
    ]
    assert not stale


def test_mlm_probability_is_a_fixed_rate(tokenizer):
    # DataCollatorForLanguageModeling's argument names: the same masks as rate=0.15.
    examples = _batch(tokenizer)
    counts = _maskable(_original(examples, tokenizer), tokenizer).sum(-1)
    hf_style = MPTDataCollator(tokenizer, mlm_probability=0.15, seed=0)
    assert repr(hf_style.schedule) == "FixedRate(0.15)"
    batch = hf_style(examples)
    assert _same_batch(batch, MPTDataCollator(tokenizer, rate=0.15, seed=0)(examples))
    expected = torch.tensor([max(1, math.floor(0.15 * d + 0.5)) for d in counts.tolist()])
    assert torch.equal((batch["labels"] != -100).sum(-1), expected)
    # Positional arguments keep their places: the second is the rate.
    assert repr(MPTDataCollator(tokenizer, 0.4).schedule) == "FixedRate(0.4)"
    assert repr(MPTDataCollator(tokenizer).schedule) == "UniformRate()"


# Random streams across data-parallel processes ----------------------------------------------


def _as_rank(monkeypatch, rank, world=2):
    """Process ``rank`` of ``world`` as ``torchrun`` starts it, before any process group: the
    collator reads the launcher's environment variables."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def _draw(collator, examples, global_seed):
    """A batch, after seeding torch's global generator (``Trainer`` seeds every process
    alike)."""
    torch.manual_seed(global_seed)
    return collator(examples)


def _same_batch(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": "uniform"},
        {"rate": 0.5, "mask_replace_prob": 0.5, "random_replace_prob": 0.4},
        {"rate": (0.2, 0.6), "whole_word_mask": True, "span_masking": True},
    ],
)
def test_a_seed_gives_each_rank_its_own_reproducible_masks(tokenizer, monkeypatch, kwargs):
    examples = _batch(tokenizer, num=32)
    first_batches = []
    for rank in (0, 1):
        _as_rank(monkeypatch, rank)
        collator = MPTDataCollator(tokenizer, seed=5, **kwargs)
        batches = [_draw(collator, examples, 0), _draw(collator, examples, 0)]
        assert not torch.equal(batches[0]["labels"], batches[1]["labels"])  # the stream goes on
        # The same seed and rank repeat the batches whatever torch's global generator holds:
        # every draw (sizes, positions, spans, corruption) comes from the collator's stream.
        again = MPTDataCollator(tokenizer, seed=5, **kwargs)
        repeated = [_draw(again, examples, 123), _draw(again, examples, 7)]
        assert all(_same_batch(a, b) for a, b in zip(batches, repeated))
        first_batches.append(batches[0])
    assert not torch.equal(first_batches[0]["labels"], first_batches[1]["labels"])


def test_without_a_seed_ranks_seeded_alike_draw_different_masks(tokenizer, monkeypatch):
    examples = _batch(tokenizer, num=32)
    collator = MPTDataCollator(tokenizer)
    by_rank = []
    for rank in (0, 1):
        _as_rank(monkeypatch, rank)
        batch = _draw(collator, examples, 0)
        assert _same_batch(batch, _draw(collator, examples, 0))  # reseeding torch repeats it
        by_rank.append(batch)
    assert not torch.equal(by_rank[0]["labels"], by_rank[1]["labels"])


@pytest.mark.parametrize("seed", [None, 3])
def test_masks_of_two_ranks_overlap_as_independent_draws(tokenizer, monkeypatch, seed):
    # D = 20 tokens at rate 0.5: each rank masks M = 10. Two independent uniform masks share a
    # hypergeometric number of positions, mean M^2 / D = 5; identical masks share all 10.
    examples = [tokenizer(" ".join(LETTERS))] * 400
    masks = []
    for rank in (0, 1):
        _as_rank(monkeypatch, rank)
        batch = _draw(MPTDataCollator(tokenizer, rate=0.5, seed=seed), examples, 0)
        masks.append(batch["labels"] != -100)
    overlap = (masks[0] & masks[1]).sum(-1).double()
    d, m = 20, 10
    mean = m * m / d
    var = m * (m / d) * (1 - m / d) * (d - m) / (d - 1)
    assert abs(overlap.mean().item() - mean) < 4 * math.sqrt(var / len(examples))


def test_a_seed_gives_the_same_masks_in_float32_and_float64_programs(tokenizer):
    examples = _batch(tokenizer, num=16)
    kwargs = dict(rate=(0.2, 0.6), span_masking=True, random_replace_prob=0.2, seed=4)
    in_float64 = MPTDataCollator(tokenizer, **kwargs)(examples)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        in_float32 = MPTDataCollator(tokenizer, **kwargs)(examples)
    finally:
        torch.set_default_dtype(previous)
    assert _same_batch(in_float64, in_float32)


def test_dataloader_workers_mix_their_seed_into_the_stream(tokenizer, monkeypatch):
    examples = _batch(tokenizer, num=16)

    def in_worker(worker_seed):
        info = types.SimpleNamespace(id=0, num_workers=2, seed=worker_seed)
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)
        return MPTDataCollator(tokenizer, seed=1)(examples)

    first, other, again = in_worker(10), in_worker(11), in_worker(10)
    assert _same_batch(first, again)
    assert not torch.equal(first["labels"], other["labels"])


def test_a_launcher_variable_that_is_not_an_integer_raises(tokenizer, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="the environment variable WORLD_SIZE='two' is not an"):
        MPTDataCollator(tokenizer)(_batch(tokenizer, num=2))


def test_uniform_subsets_mask_exactly_the_size_asked_even_where_keys_tie():
    # Float32 keys tie now and then (about 1 row in 4000 of 4096 units): a key tied with the
    # threshold masked one unit too many, while the row's weight said D / M. Seed 2 draws
    # three such rows among these 4000.
    from pyro_mpt.transformers.mask_units import uniform_subsets

    counts = torch.full((4000,), 4096)
    sizes = torch.randint(1, 4096, (4000,), generator=torch.Generator().manual_seed(102))
    masks = uniform_subsets(counts, sizes, 4096, generator=torch.Generator().manual_seed(2))
    assert torch.equal(masks.sum(-1), sizes)


def test_examples_that_are_not_one_sequence_each_get_the_fix(tokenizer):
    collator = MPTDataCollator(tokenizer)
    # Tokenized with return_tensors="pt": (1, L) each, which stacked into a (B, 1, L) batch.
    pt = [tokenizer("a b c", return_tensors="pt") for _ in range(2)]
    examples = [{key: value for key, value in example.items()} for example in pt]
    with pytest.raises(
        ValueError,
        match=r"must be one sequence of token ids, got a torch.int64 tensor of shape \(1, 5\)",
    ):
        collator(examples)
    with pytest.raises(ValueError, match="examples is one mapping with keys"):
        collator(tokenizer(["a b", "c a"]))
    with pytest.raises(
        ValueError, match=r"examples\[0\]\['input_ids'\] must be one sequence.*got str"
    ):
        collator(["a b", "c a"])
