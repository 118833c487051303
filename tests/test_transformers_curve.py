"""``pyro_mpt.transformers.mlm_mpt_curve`` on tiny BERTs built from configs (nothing
downloaded), checked against forward passes over every mask written out in the test."""

import itertools
import math
import os
import types
import warnings

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    RobertaConfig,
    RobertaForMaskedLM,
)

from pyro_mpt import MPTCurve, default_rates  # noqa: E402
from pyro_mpt.ops.mask_rates import FixedRate  # noqa: E402
from pyro_mpt.transformers import mlm_mpt_curve  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(SPECIAL + list(LETTERS)) + "\n")
    return BertTokenizer.from_pretrained(str(folder), do_lower_case=False)


def _bert(vocab_size, seed=0, hidden=32, layers=2):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(config).to(DEVICE).eval()


def _texts(count, low, high, seed=0):
    """Random letter strings with lengths in ``[low, high]``, space-separated."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [" ".join(LETTERS[i] for i in torch.randint(26, (n,), generator=gen)) for n in lengths]


def test_random_bert_gives_a_flat_curve_at_minus_log_v(tokenizer):
    model = _bert(len(tokenizer))
    texts = _texts(24, 20, 40)
    curve = mlm_mpt_curve(
        model, tokenizer, texts, rates=default_rates(0.05, 0.95, 0.1), num_masks=8
    )
    assert isinstance(curve, MPTCurve) and curve.scores.shape == (10,)
    log_v = math.log(len(tokenizer))
    # Tolerance, derived: the LM head's LayerNorm output h has |h|^2 = H and the tied output
    # embeddings are N(0, s0^2) with zero bias, so the logits are N(0, s^2), s^2 = s0^2 H.
    # Then E log p(x_j) = -log V - s^2/2 + O(s^2/V). For one draw of the weights, token x's
    # logit l_x = h . e_x carries an offset of sd s shared by its occurrences; the mean over
    # the data's tokens (frequencies f) has sd s sqrt(sum f^2): allow 4 of those, plus 4
    # Monte Carlo standard errors over the masks.
    config = model.config
    s = config.initializer_range * math.sqrt(config.hidden_size)
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    freq = torch.bincount(torch.tensor(ids)).double() / len(ids)
    model_sd = s * float(freq.pow(2).sum().sqrt())
    tol = s**2 / 2 + 4 * model_sd + 4 * curve.stderr
    assert (curve.scores + log_v).abs().le(tol).all(), (curve.scores + log_v, tol)
    assert float(tol.max()) < 0.05 * log_v  # the check is tight: within 5% of log V
    # The area: the mean over sequences of D_i times the sequence's mean score.
    mean_d = float(curve.num_features.double().mean())
    area_tol = mean_d * (s**2 / 2 + 4 * model_sd + 4 * float(curve.stderr.max()))
    assert abs(curve.area + mean_d * log_v) < area_tol


def _enumerated_scores(model, tokenizer, text):
    """Every mask of the text's ``D`` letters scored by its own forward pass:
    ``{M: (C(D, M),)}``, each entry the mean log-probability of the masked letters."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0].to(DEVICE)
    letters = range(1, len(ids) - 1)  # [CLS] and [SEP] are never masked
    out = {}
    for size in range(1, len(letters) + 1):
        scores = []
        for masked in itertools.combinations(letters, size):
            row = ids.clone()
            row[list(masked)] = tokenizer.mask_token_id
            with torch.no_grad():
                logp = model(input_ids=row[None]).logits[0].double().log_softmax(-1)
            scores.append(logp[list(masked), ids[list(masked)]].mean())
        out[size] = torch.stack(scores).cpu()
    return out


def test_curve_and_area_match_every_mask_enumerated(tokenizer):
    """Sequences of 3 and 5 letters: at each rate the score is within 4 exact standard
    errors of the mean over all masks of that size, the standard errors match the exact
    ones (400 masks: about 5% sampling noise; allowed 15%), and the area is the D-weighted
    mean of the exact scores within 4 of its own."""
    model = _bert(len(tokenizer), seed=9, hidden=16, layers=1)
    texts = ["c a b", "e d a c b"]
    rates = [0.2, 0.4, 0.6, 0.8, 1.0]
    sizes = {3: [1, 1, 2, 2, 3], 5: [1, 2, 3, 4, 5]}  # max(1, round half up of r D)
    num_masks = 400
    torch.manual_seed(10)
    curve = mlm_mpt_curve(model, tokenizer, texts, rates=rates, num_masks=num_masks, progress=False)
    assert curve.sizes.tolist() == [sizes[3], sizes[5]]
    exact, variance = torch.zeros(2, 5), torch.zeros(2, 5)
    for i, text in enumerate(texts):
        every = _enumerated_scores(model, tokenizer, text)
        for k, size in enumerate(sizes[len(every)]):
            exact[i, k] = every[size].mean()
            variance[i, k] = every[size].var(unbiased=False) / num_masks
    exact_se = variance.sum(0).sqrt() / 2
    expected = exact.mean(0)
    assert ((curve.scores - expected).abs() <= 4 * exact_se + 1e-6).all()
    moving = exact_se > 0  # rate 1 has a single mask per sequence
    torch.testing.assert_close(curve.stderr[moving], exact_se[moving], rtol=0.15, atol=0)
    assert (curve.stderr[~moving] < 1e-6).all()
    d = torch.tensor([3.0, 5.0]).unsqueeze(-1)
    area = float((d * exact).mean(1).mean())
    area_se = float(((d / 10).pow(2) * variance).sum().sqrt())
    assert abs(curve.area - area) <= 4 * area_se
    assert curve.area_stderr == pytest.approx(area_se, rel=0.15)
    expected_fraction = (torch.tensor([sizes[3], sizes[5]]) / d).mean(0)
    torch.testing.assert_close(curve.masked_fraction, expected_fraction)


def test_rate_one_masks_everything_and_matches_a_hand_forward_pass(tokenizer):
    model = _bert(len(tokenizer), seed=1)
    texts = _texts(3, 5, 12, seed=1)
    curve = mlm_mpt_curve(model, tokenizer, texts, rates=[1.0], num_masks=2, progress=False)
    for i, text in enumerate(texts):
        enc = tokenizer(text, return_tensors="pt")
        ids = enc["input_ids"].to(DEVICE)
        inner = torch.arange(1, ids.shape[1] - 1)
        masked = ids.clone()
        masked[0, inner] = tokenizer.mask_token_id
        with torch.no_grad():
            logp = model(input_ids=masked).logits[0].log_softmax(-1)
        expected = logp[inner, ids[0, inner]].mean()
        torch.testing.assert_close(curve.observation_scores[i, 0], expected.double().cpu())
    # Both masks at rate 1 are the same: no Monte Carlo spread.
    assert float(curve.stderr[0]) == pytest.approx(0.0, abs=1e-12)


def test_a_observation_scores_the_same_alone_or_padded_in_a_batch(tokenizer):
    model = _bert(len(tokenizer), seed=2)
    short, long = _texts(1, 4, 4, seed=2)[0], _texts(1, 30, 30, seed=3)[0]
    alone = mlm_mpt_curve(model, tokenizer, [short], rates=[1.0], num_masks=1, progress=False)
    both = mlm_mpt_curve(model, tokenizer, [long, short], rates=[1.0], num_masks=1, progress=False)
    torch.testing.assert_close(both.observation_scores[1], alone.observation_scores[0])


def test_single_token_masks_estimate_the_exact_leave_one_out_score(tokenizer):
    """S(x; 1) = mean_j log q(x_j | x_-j): the curve at M = 1 is an unbiased estimate."""
    model = _bert(len(tokenizer), seed=3)
    text = _texts(1, 10, 10, seed=4)[0]
    ids = tokenizer(text, return_tensors="pt")["input_ids"].to(DEVICE)
    exact = []
    for j in range(1, ids.shape[1] - 1):
        masked = ids.clone()
        masked[0, j] = tokenizer.mask_token_id
        with torch.no_grad():
            exact.append(model(input_ids=masked).logits[0, j].log_softmax(-1)[ids[0, j]])
    exact = float(torch.stack(exact).mean())
    curve = mlm_mpt_curve(model, tokenizer, [text], rates=[0.1], num_masks=200, progress=False)
    assert curve.masked_fraction.tolist() == [0.1]
    assert abs(float(curve.scores[0]) - exact) < 4 * float(curve.stderr[0])


def test_each_row_masks_the_rate_s_share_of_non_special_tokens(tokenizer):
    model = _bert(len(tokenizer), seed=4)
    texts = _texts(5, 7, 23, seed=5)
    rates = [0.01, 0.15, 0.33, 0.5, 0.8, 0.99]
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["input_ids"].cpu(), kwargs["attention_mask"].cpu()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        curve = mlm_mpt_curve(model, tokenizer, texts, rates=rates, num_masks=3, batch_size=7)
    finally:
        handle.remove()
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    num_features = [n - 2 for n in lengths]
    assert curve.num_features.tolist() == num_features
    zero = torch.zeros(1, dtype=torch.float64)
    sizes = {
        d: [int(FixedRate(r).sizes_from_quantiles(zero, d)) for r in rates] for d in num_features
    }
    expected_fraction = torch.tensor(
        [[sizes[d][k] / d for k in range(len(rates))] for d in num_features]
    ).mean(0)
    torch.testing.assert_close(curve.masked_fraction, expected_fraction.double())
    counts = {}
    mask_id, cls_id = tokenizer.mask_token_id, tokenizer.cls_token_id
    sep_id = tokenizer.sep_token_id
    for input_ids, attention in seen:
        assert input_ids.shape[0] <= 7
        for row, keep in zip(input_ids, attention):
            row = row[keep.bool()]
            # [CLS] and [SEP] stay in place; padding sits outside the attention mask.
            assert row[0] == cls_id and row[-1] == sep_id
            counts.setdefault(len(row) - 2, []).append(int((row == mask_id).sum()))
    assert sum(len(v) for v in counts.values()) == len(texts) * len(rates) * 3
    for d, observed in counts.items():
        per_text = num_features.count(d)
        assert sorted(observed) == sorted(sizes[d] * 3 * per_text)


def test_ids_and_strings_and_batch_sizes_give_the_same_curve(tokenizer):
    model = _bert(len(tokenizer), seed=5)
    texts = _texts(4, 6, 15, seed=6)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    curves = []
    for inputs, batch in ((texts, 64), (ids, 3), ([torch.tensor(i) for i in ids], 1)):
        torch.manual_seed(7)
        curves.append(mlm_mpt_curve(model, tokenizer, inputs, rates=[0.2, 0.6], batch_size=batch))
    for other in curves[1:]:
        torch.testing.assert_close(other.observation_scores, curves[0].observation_scores)
        assert other.area == pytest.approx(curves[0].area, rel=1e-10)


def test_bad_arguments_raise_clear_errors(tokenizer):
    model = _bert(len(tokenizer), hidden=16, layers=1)
    texts = ["a b c", "d e"]
    no_mask = types.SimpleNamespace(mask_token_id=None)
    with pytest.raises(ValueError, match="has no mask token"):
        mlm_mpt_curve(model, no_mask, texts)
    with pytest.raises(ValueError, match=r"rates must be a non-empty sequence .* in \(0, 1\]"):
        mlm_mpt_curve(model, tokenizer, texts, rates=[0.5, 1.5])
    with pytest.raises(ValueError, match=r"rates must be a non-empty"):
        mlm_mpt_curve(model, tokenizer, texts, rates=[])
    with pytest.raises(ValueError, match=r"texts\[1\] has no maskable token \(.* give it some"):
        mlm_mpt_curve(model, tokenizer, ["a b", ""])
    with pytest.raises(ValueError, match=r"after truncation to max_length=2 .* raise max_length"):
        mlm_mpt_curve(model, tokenizer, ["a b"], max_length=2)
    with pytest.raises(ValueError, match="texts must be a non-empty list"):
        mlm_mpt_curve(model, tokenizer, "a b c")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a string or a list of token ids"):
        mlm_mpt_curve(model, tokenizer, [[2, 5, 3], "a b"])
    with pytest.raises(ValueError, match="num_masks must be at least 1, got 0"):
        mlm_mpt_curve(model, tokenizer, texts, num_masks=0)
    with pytest.raises(TypeError, match="batch_size must be a positive int"):
        mlm_mpt_curve(model, tokenizer, texts, batch_size=2.5)
    ids = torch.tensor([[2, 5, 6, 3]])
    with pytest.raises(TypeError, match=r"shape \(1, 4\) and dtype torch.float32; token ids"):
        mlm_mpt_curve(model, tokenizer, ids.float())
    with pytest.raises(TypeError, match=r"shape \(1, 1, 4\) and dtype torch.int64"):
        mlm_mpt_curve(model, tokenizer, ids[None])
    with pytest.raises(TypeError, match=r"texts\[0\] holds float 6.0 at position 2"):
        mlm_mpt_curve(model, tokenizer, [[2, 5, 6.0, 3]])


def test_unknown_tokens_are_warned_of_as_never_masked(tokenizer):
    """Text the vocabulary lacks (capitals, for these lowercase letters) becomes [UNK], a
    special token: never masked, always seen, so the score is not that of the text."""
    model = _bert(len(tokenizer), hidden=16, layers=1)
    with pytest.warns(
        UserWarning,
        match=r"1 of the 2 sequences hold the unknown token '\[UNK\]' "
        r"\(2 in all; the first: texts\[1\]\)",
    ):
        mlm_mpt_curve(model, tokenizer, ["a b c", "a B C"], num_masks=1)
    unk = tokenizer.unk_token_id
    with pytest.warns(UserWarning, match="never masked but stays visible"):
        mlm_mpt_curve(model, tokenizer, [[2, 5, unk, 3]], num_masks=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlm_mpt_curve(model, tokenizer, ["a b c", "d e"], num_masks=1)


def test_half_precision_models_score_in_float32(tokenizer):
    """A bfloat16 model's logits go through log-softmax in float32; the curve matches the
    float64 model's to bfloat16's precision (8 bits of mantissa: about 1% of log V)."""
    model = _bert(len(tokenizer), seed=6)
    texts = _texts(3, 8, 16, seed=7)
    torch.manual_seed(8)
    exact = mlm_mpt_curve(model, tokenizer, texts, rates=[0.3, 0.7], progress=False)
    torch.manual_seed(8)
    half = mlm_mpt_curve(
        model.to(torch.bfloat16), tokenizer, texts, rates=[0.3, 0.7], progress=False
    )
    assert half.scores.dtype == torch.float64 and torch.isfinite(half.scores).all()
    torch.testing.assert_close(half.scores, exact.scores, atol=0.05, rtol=0)


@pytest.mark.parametrize("form", ["padded_tensor", "padded_lists", "tokenizer_output"])
def test_padded_ids_and_a_tokenizers_output_score_as_the_texts(tokenizer, form):
    """A batch padded by the tokenizer: the pads are no part of the sequences (the model
    attended to them, and the short text scored -6.15 for -11.42), and a tokenizer's
    output is its ids, not its key names. At rate 1 the masks are fixed, so the scores
    must equal those of the texts given as strings."""
    model = _bert(len(tokenizer), seed=4)
    texts = [_texts(1, 3, 3, seed=5)[0], _texts(1, 14, 14, seed=6)[0]]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    given = {
        "padded_tensor": encoded["input_ids"],
        "padded_lists": encoded["input_ids"].tolist(),
        "tokenizer_output": encoded,
    }[form]
    options = dict(rates=[1.0], num_masks=1, progress=False)
    expected = mlm_mpt_curve(model, tokenizer, texts, **options)
    curve = mlm_mpt_curve(model, tokenizer, given, **options)
    assert curve.num_features.tolist() == expected.num_features.tolist()
    torch.testing.assert_close(curve.observation_scores, expected.observation_scores)


def test_left_padding_scores_as_the_texts_and_padding_inside_is_not_attended_to(tokenizer):
    """A batch padded on the left (tensor, lists, tokenizer's output) scores as the texts:
    the leading pads are cut off, not attended to at shifted positions (-9.20 for -11.42 in
    the user's probe). A pad left inside a sequence is not attended to either: checked
    against the model's own logits at rate 1, where the mask is every letter."""
    model = _bert(len(tokenizer), seed=4)
    texts = [_texts(1, 3, 3, seed=5)[0], _texts(1, 14, 14, seed=6)[0]]
    options = dict(rates=[1.0], num_masks=1, progress=False)
    expected = mlm_mpt_curve(model, tokenizer, texts, **options)
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    assert encoded["input_ids"][0, 0] == tokenizer.pad_token_id
    for given in (encoded["input_ids"], encoded["input_ids"].tolist(), encoded):
        curve = mlm_mpt_curve(model, tokenizer, given, **options)
        assert curve.num_features.tolist() == expected.num_features.tolist()
        torch.testing.assert_close(curve.observation_scores, expected.observation_scores)
    pad, cls, sep, mask, a, b = tokenizer.convert_tokens_to_ids(
        ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
    )
    curve = mlm_mpt_curve(model, tokenizer, [[cls, a, pad, b, sep]], **options)
    masked = torch.tensor([[cls, mask, pad, mask, sep]], device=DEVICE)
    attention = torch.tensor([[1, 1, 0, 1, 1]], device=DEVICE)
    with torch.no_grad():
        logp = model(input_ids=masked, attention_mask=attention).logits[0].log_softmax(-1)
    by_hand = (logp[1, a] + logp[3, b]).double().cpu() / 2
    assert curve.num_features.tolist() == [2]
    torch.testing.assert_close(curve.observation_scores[0, 0], by_hand)


def test_max_length_keeps_the_closing_sep_of_ids_as_of_strings(tokenizer):
    """Truncated ids keep their closing [SEP], as the tokenizer keeps it for strings: the
    same texts have the same D and scores given either way (the ids lost [SEP] and scored
    one more letter, D 5 for 4)."""
    model = _bert(len(tokenizer), seed=7)
    texts = _texts(3, 6, 12, seed=8)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    options = dict(rates=[1.0], num_masks=1, max_length=6, progress=False)
    expected = mlm_mpt_curve(model, tokenizer, texts, **options)
    assert expected.num_features.tolist() == [4, 4, 4]
    for given in (ids, tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]):
        curve = mlm_mpt_curve(model, tokenizer, given, **options)
        assert curve.num_features.tolist() == [4, 4, 4]
        torch.testing.assert_close(curve.observation_scores, expected.observation_scores)
    # The reference: the first four letters of each text, untruncated.
    first_four = [" ".join(t.split()[:4]) for t in texts]
    options.pop("max_length")
    torch.testing.assert_close(
        mlm_mpt_curve(model, tokenizer, first_four, **options).observation_scores,
        expected.observation_scores,
    )


def test_sequences_the_model_cannot_read_raise_clear_errors(tokenizer):
    """Too long for the position embeddings, or ids outside the vocabulary: a ValueError
    naming the sequence, its length or id, the model's limit and the fix, not the model's
    shape mismatch or index error."""
    model = _bert(len(tokenizer), hidden=16, layers=1)  # 64 positions
    texts = ["a b", " ".join("c" * 70)]
    with pytest.raises(
        ValueError,
        match=r"texts\[1\] is 72 tokens long .* 64 positions .*"
        r"max_position_embeddings=64\); pass max_length=64",
    ):
        mlm_mpt_curve(model, tokenizer, texts, progress=False)
    curve = mlm_mpt_curve(model, tokenizer, texts, max_length=64, rates=[0.5], progress=False)
    assert curve.num_features.tolist() == [2, 62]
    vocab = len(tokenizer)
    for bad in (vocab, 99, -1):
        with pytest.raises(
            ValueError,
            match=rf"texts\[0\] holds token id {bad} at position 2, "
            rf"outside the vocabulary .* ids 0 to {vocab - 1}",
        ):
            mlm_mpt_curve(model, tokenizer, [[2, 5, bad, 3]], progress=False)
    with pytest.raises(
        ValueError,
        match=r"texts must be a list of sequences, got one sequence"
        r" .* pass \[ids\]",
    ):
        mlm_mpt_curve(model, tokenizer, [2, 5, 6, 3], progress=False)
    with pytest.raises(
        ValueError,
        match=r"texts\['input_ids'\] is one sequence .* "
        r"tokenizer\(\[text\]\)",
    ):
        mlm_mpt_curve(model, tokenizer, tokenizer("a b c"), progress=False)


def test_roberta_positions_start_after_the_padding_index(tokenizer):
    """RoBERTa numbers positions from padding_idx + 1: with 34 position embeddings and
    padding_idx 0 it reads 33 tokens, and the 34th is refused before its index error."""
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=34,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = RobertaForMaskedLM(config).to(DEVICE).eval()
    fits = [[2] + [5] * 31 + [3]]
    curve = mlm_mpt_curve(model, tokenizer, fits, rates=[0.5], num_masks=1, progress=False)
    assert curve.num_features.tolist() == [31]
    with pytest.raises(ValueError, match=r"texts\[0\] is 34 tokens long .* the 33 positions"):
        mlm_mpt_curve(model, tokenizer, [[2] + [5] * 32 + [3]], progress=False)


def test_the_model_s_mode_is_restored_after_a_curve_and_after_a_failing_one(tokenizer):
    # The curve runs in eval mode: a model in train mode went back to training left in
    # eval mode (dropout off), whether the call returned or raised.
    model = _bert(len(tokenizer)).train()
    mlm_mpt_curve(model, tokenizer, _texts(2, 3, 5), rates=[0.5], num_masks=2)
    assert model.training
    with pytest.raises(ValueError):
        mlm_mpt_curve(model, tokenizer, _texts(2, 3, 5), rates=[1.5])
    assert model.training
    model.eval()
    mlm_mpt_curve(model, tokenizer, _texts(2, 3, 5), rates=[0.5], num_masks=2)
    assert not model.training


def test_a_sentence_pair_is_refused_rather_than_scored_as_one_segment(tokenizer):
    # The curve feeds input_ids and attention_mask only: a pair's second segment was scored
    # with token type 0, the conditionals of another input (-3.99 for -3.93 in a probe).
    model = _bert(len(tokenizer))
    pair = tokenizer(["a b"], ["c d"], return_tensors="pt")
    assert pair["token_type_ids"].any()
    with pytest.raises(ValueError, match=r"texts\['token_type_ids'\] marks a second segment"):
        mlm_mpt_curve(model, tokenizer, pair, rates=[0.5], progress=False)
    single = tokenizer(["a b c d"], return_tensors="pt")  # token types all 0: accepted
    mlm_mpt_curve(model, tokenizer, single, rates=[0.5], num_masks=1, progress=False)


def test_a_model_without_token_logits_is_refused_by_name(tokenizer):
    """A sequence classifier's logits have one row per sequence: the curve names the model
    and the shape it needs rather than failing on a shape inside the scorer."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    classifier = BertForSequenceClassification(config).to(DEVICE).eval()
    with pytest.raises(
        ValueError,
        match=r"model must be a masked language model .* got \(\d+, 2\) from "
        r"BertForSequenceClassification",
    ):
        mlm_mpt_curve(classifier, tokenizer, ["a b c"], rates=[0.5], progress=False)
