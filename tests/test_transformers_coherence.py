"""``pyro_mpt.transformers.mlm_ordering_log_likelihoods`` against chain rules summed by hand,
one forward pass per prefix, on tiny BERTs built from configs (nothing downloaded), and on a
masked "LM" whose conditionals are coherent by construction."""

import itertools
import os
import types

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from pyro_mpt import OrderingLogLikelihoods  # noqa: E402
from pyro_mpt.ops.orderings import random_orderings  # noqa: E402
from pyro_mpt.transformers import mlm_ordering_log_likelihoods  # noqa: E402
from tests._tiny_transformers import SPECIAL, letter_tokenizer, tiny_bert  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PAD, CLS, SEP, MASK = (SPECIAL.index(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return letter_tokenizer(tmp_path_factory.mktemp("vocab"), LETTERS)


def _bert(tokenizer, dtype=torch.float32, seed=0):
    """A tiny BERT whose weights are wide enough (initializer range 0.3) that its conditionals
    depend clearly on the context; in training mode, as built."""
    model = tiny_bert(len(tokenizer), seed=seed, initializer_range=0.3)
    return model.to(device=DEVICE, dtype=dtype)


def _chain_rule_by_hand(model, ids, order):
    """``sum_i log q(x_order[i] | x_order[:i])`` for one unpadded sequence ``ids`` (L,), one
    forward pass per step, the log-softmax in float64."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i, position in enumerate(order):
            x = ids.clone()
            x[list(order[i:])] = MASK
            out = model(input_ids=x[None], attention_mask=torch.ones_like(x)[None])
            total += float(out.logits[0, position].double().log_softmax(-1)[ids[position]])
    return total


def _ids(tokenizer, text):
    return torch.tensor(tokenizer(text)["input_ids"], device=DEVICE)


def test_explicit_orderings_match_the_chain_rule_summed_by_hand(tokenizer):
    model = _bert(tokenizer)
    ids = _ids(tokenizer, "c a b e d")  # [CLS] c a b e d [SEP]
    content = [[3, 1, 5, 2, 4], [5, 4, 3, 2, 1], [1, 2, 3, 4, 5], [2, 5, 1, 4, 3]]
    orderings = torch.tensor([order + [0, 6] for order in content])[:, None]  # (4, 1, 7)
    result = mlm_ordering_log_likelihoods(
        model, tokenizer, ids[None], 4, orderings=orderings, batch_size=3, progress=False
    )
    assert isinstance(result, OrderingLogLikelihoods)
    assert result.values.shape == (4, 1) and result.values.dtype == torch.float32
    assert result.log_marginal is None and result.gap is None
    expected = torch.tensor([[_chain_rule_by_hand(model, ids, order)] for order in content])
    assert torch.allclose(result.values.double(), expected.double(), atol=1e-5, rtol=0), (
        result.values,
        expected,
    )
    # The orderings disagree by far more than the tolerance, so the check tells them apart.
    assert float(expected.max() - expected.min()) > 1e-2
    assert torch.allclose(result.mean, result.values.mean(0))
    # Without num_orderings, the orderings say how many there are.
    alone = mlm_ordering_log_likelihoods(
        model, tokenizer, ids[None], orderings=orderings[:1], progress=False
    )
    assert torch.allclose(alone.values.double(), expected[:1].double(), atol=1e-5, rtol=0)


def test_random_orderings_are_orderings_of_the_content_tokens(tokenizer):
    """Every sum from the default (random) orderings is the hand-summed chain rule of one of
    the 4! orderings of the content tokens, and several different ones are drawn."""
    model = _bert(tokenizer)
    ids = _ids(tokenizer, "f a c b")
    by_hand = {
        order: _chain_rule_by_hand(model, ids, order)
        for order in itertools.permutations(range(1, 5))
    }
    values = torch.tensor(sorted(by_hand.values()), dtype=torch.float64)
    assert float(values.diff().min()) > 4e-5  # every ordering's sum is told apart
    torch.manual_seed(0)
    result = mlm_ordering_log_likelihoods(model, tokenizer, ["f a c b"], 16, progress=False)
    distance = (result.values - values).abs()  # (16, 24)
    assert float(distance.min(-1).values.max()) < 1e-5
    assert len(set(distance.argmin(-1).tolist())) >= 6


def test_sequences_of_different_lengths_in_one_batch_match_each_alone(tokenizer):
    model = _bert(tokenizer, dtype=torch.float64)
    texts = ["a b c", "d e f g h i j", "k", "l m n o"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    maskable = batch["attention_mask"].bool() & (batch["input_ids"] > MASK)
    torch.manual_seed(1)
    orderings = random_orderings(3, (len(texts),), maskable.shape[1], entries=maskable)
    inputs = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append((kwargs["input_ids"], kwargs["attention_mask"])),
        with_kwargs=True,
    )
    together = mlm_ordering_log_likelihoods(
        model, tokenizer, batch, 3, orderings=orderings, batch_size=5, progress=False
    )
    handle.remove()
    # Each prefix step is one row: 3 orderings of 3 + 7 + 1 + 4 content tokens.
    assert sum(ids.shape[0] for ids, _ in inputs) == 3 * 15
    for ids, attention in inputs:
        # Special tokens and padding are never masked: the rows' [CLS], [SEP] and [PAD]
        # sit where the batch has them, and every row has [CLS] and [SEP] once.
        assert ((ids == CLS).sum(1) == 1).all() and ((ids == SEP).sum(1) == 1).all()
        assert torch.equal(ids == PAD, attention == 0)
    for b in range(len(texts)):
        length = int(batch["attention_mask"][b].sum())
        alone_orderings = orderings[:, b][orderings[:, b] < length].reshape(3, 1, length)
        alone = mlm_ordering_log_likelihoods(
            model,
            tokenizer,
            batch["input_ids"][b : b + 1, :length],
            3,
            orderings=alone_orderings,
            progress=False,
        )
        assert torch.allclose(alone.values[:, 0], together.values[:, b], atol=1e-9, rtol=0)
    # The same batch given as texts, and as a tensor with its attention mask.
    given_mask = dict(attention_mask=batch["attention_mask"])
    for sequences, kwargs in [(texts, {}), (batch["input_ids"], given_mask)]:
        again = mlm_ordering_log_likelihoods(
            model, tokenizer, sequences, 3, orderings=orderings, progress=False, **kwargs
        )
        assert torch.allclose(again.values, together.values, atol=1e-9, rtol=0)


class _UnigramMLM(torch.nn.Module):
    """A masked "LM" whose logits at a masked position are a fixed distribution for that
    position, whatever the context: the conditionals of the independent joint
    ``prod_j u_j(x_j)``. At unmasked positions its logits point at the input token, so
    reading the wrong position gives a different sum."""

    def __init__(self, length, vocab_size, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(2 * torch.randn(length, vocab_size, generator=gen))
        self.modes = []

    def log_unigrams(self):
        return self.logits.detach().double().log_softmax(-1)

    def forward(self, input_ids, attention_mask):
        self.modes.append(self.training)
        length = input_ids.shape[1]
        unigram = self.logits[:length].expand(input_ids.shape + self.logits.shape[-1:])
        pointing = 10 * torch.nn.functional.one_hot(input_ids, self.logits.shape[-1])
        masked = (input_ids == MASK).unsqueeze(-1)
        return types.SimpleNamespace(logits=torch.where(masked, unigram, pointing.to(unigram)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coherent_conditionals_give_the_same_sum_for_every_ordering(tokenizer, dtype):
    texts = ["a b c d e f", "g h", "i j k l"]
    model = _UnigramMLM(8, len(tokenizer)).to(device=DEVICE, dtype=dtype)
    model.train()
    result = mlm_ordering_log_likelihoods(
        model, tokenizer, texts, num_orderings=6, batch_size=4, progress=False
    )
    log_u = model.log_unigrams().cpu()
    expected = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        # Content tokens only: position 0 is [CLS] and the last one [SEP].
        expected.append(sum(float(log_u[j, ids[j]]) for j in range(1, len(ids) - 1)))
    expected = torch.tensor(expected, dtype=dtype).expand(6, -1)
    assert result.values.dtype == dtype
    assert torch.allclose(result.values, expected, atol=1e-5, rtol=0), (result.values, expected)
    assert float(result.spread.max()) < 1e-5
    # Rounding in the model's precision is not called incoherence.
    assert "coherent" in result.describe() and "not coherent" not in result.describe()
    # Run in eval mode, and the model's training mode is restored.
    assert model.modes and not any(model.modes) and model.training


def test_padding_marked_by_the_attention_mask_is_never_ordered(tokenizer):
    """Padding positions that hold ordinary tokens (attention 0) are not ordered or scored."""
    model = _UnigramMLM(7, len(tokenizer)).to(DEVICE)
    ids = torch.tensor([[CLS, 5, 6, 7, SEP, 8, 9], [CLS, 10, SEP, 11, 12, 13, 14]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]])
    result = mlm_ordering_log_likelihoods(
        model, tokenizer, ids, 3, attention_mask=attention, progress=False
    )
    log_u = model.log_unigrams().cpu()
    expected = torch.tensor(
        [sum(float(log_u[j, ids[0, j]]) for j in (1, 2, 3)), float(log_u[1, ids[1, 1]])],
        dtype=torch.float64,
    )
    assert torch.allclose(result.values, expected.expand(3, -1), atol=1e-5, rtol=0)


def test_a_random_bert_is_not_coherent(tokenizer):
    model = _bert(tokenizer, dtype=torch.float64, seed=3)
    torch.manual_seed(0)
    texts = ["a b c d e f", "q w e r t"]
    result = mlm_ordering_log_likelihoods(model, tokenizer, texts, 32, progress=False)
    # The spread is a standard deviation over 32 orderings: positive by many standard errors.
    assert (result.spread > 4 * result.spread_se).all(), (result.spread, result.spread_se)
    assert (result.spread > 1e-3).all()
    assert "not coherent" in result.describe()


def test_argument_errors_name_the_argument_and_the_fix(tokenizer):
    model = _UnigramMLM(8, len(tokenizer))
    with pytest.raises(ValueError, match="num_orderings must be at least 1, got 0"):
        mlm_ordering_log_likelihoods(model, tokenizer, ["a b"], 0, progress=False)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        mlm_ordering_log_likelihoods(model, tokenizer, ["a b"], 2, batch_size=0)
    with pytest.raises(ValueError, match=r"sequences\[1\] has no maskable token \(.* give it"):
        mlm_ordering_log_likelihoods(model, tokenizer, ["a b", ""], 2, progress=False)
    with pytest.raises(ValueError, match=r"after truncation to max_length=2 .* raise max_length"):
        mlm_ordering_log_likelihoods(model, tokenizer, ["a b"], 2, max_length=2)
    # Read as ids 0 and 1 before, and refused for holding no maskable token.
    with pytest.raises(ValueError, match="sequences must be token ids, .* got a torch.bool"):
        mlm_ordering_log_likelihoods(model, tokenizer, torch.ones(1, 4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="sequences must be a non-empty list"):
        mlm_ordering_log_likelihoods(model, tokenizer, [], 2, progress=False)
    with pytest.raises(TypeError, match=r"sequences\[1\] must be a string .* sequences mixes"):
        mlm_ordering_log_likelihoods(model, tokenizer, [[2, 5, 3], "a b"], 2, progress=False)
    with pytest.raises(ValueError, match="sequences must be token ids"):
        mlm_ordering_log_likelihoods(model, tokenizer, torch.zeros(2, 3), 2, progress=False)
    with pytest.raises(ValueError, match="sequences must hold 'input_ids'"):
        mlm_ordering_log_likelihoods(model, tokenizer, {"ids": [[2, 5, 3]]}, 2)
    ids = torch.tensor([[CLS, 5, 6, SEP]])
    with pytest.raises(ValueError, match="mask of sequences has 3 entries in row 0, .* 4 tokens"):
        mlm_ordering_log_likelihoods(model, tokenizer, ids, 2, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"orderings must be long permutations of shape"):
        mlm_ordering_log_likelihoods(
            model, tokenizer, ids, 2, orderings=torch.tensor([[[1, 2, 0, 3]]])
        )
    with pytest.raises(ValueError, match="orderings must permute the positions"):
        mlm_ordering_log_likelihoods(
            model, tokenizer, ids, 1, orderings=torch.tensor([[[1, 1, 0, 3]]])
        )
    with pytest.raises(ValueError, match="maskable positions .* first"):
        mlm_ordering_log_likelihoods(
            model, tokenizer, ids, 1, orderings=torch.tensor([[[1, 0, 2, 3]]])
        )
    no_mask = types.SimpleNamespace(mask_token_id=None)
    with pytest.raises(ValueError, match="has no mask token"):
        mlm_ordering_log_likelihoods(model, no_mask, ids, 2)


def test_left_padding_and_padding_inside_score_as_unpadded(tokenizer):
    """A batch padded on the left, in every accepted form, scores as the same batch padded
    on the right (itself checked against each sequence alone above): its rows are read from
    position 0, with the orderings of the right-padded batch. A padding token inside a
    sequence is not attended to: checked against the chain rule by hand."""
    model = _bert(tokenizer, dtype=torch.float64)
    texts = ["a b c", "d e f g h i j"]
    right = tokenizer(texts, padding=True, return_tensors="pt")
    maskable = right["attention_mask"].bool() & (right["input_ids"] > MASK)
    torch.manual_seed(2)
    orderings = random_orderings(3, (2,), maskable.shape[1], entries=maskable)
    options = dict(orderings=orderings, progress=False)
    expected = mlm_ordering_log_likelihoods(model, tokenizer, right, 3, **options).values
    left = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    assert left["input_ids"][0, 0] == PAD
    lists = {key: value.tolist() for key, value in left.items()}
    for given in (left, left["input_ids"], lists["input_ids"], lists):
        values = mlm_ordering_log_likelihoods(model, tokenizer, given, 3, **options).values
        assert torch.allclose(values, expected, atol=1e-9, rtol=0), (type(given), values)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    ids = [CLS, a, PAD, b, SEP]
    order = torch.tensor([[[3, 1, 0, 2, 4]]])  # b first, then a
    steps = [([CLS, MASK, PAD, MASK, SEP], 3, b), ([CLS, MASK, PAD, b, SEP], 1, a)]
    attention = torch.tensor([[1, 1, 0, 1, 1]], device=DEVICE)
    by_hand = 0.0
    model.eval()
    with torch.no_grad():
        for x, position, token in steps:
            x = torch.tensor([x], device=DEVICE)
            logits = model(input_ids=x, attention_mask=attention).logits
            by_hand += float(logits[0, position].double().log_softmax(-1)[token])
    for given in ([ids], torch.tensor([ids])):
        values = mlm_ordering_log_likelihoods(
            model, tokenizer, given, 1, orderings=order, progress=False
        ).values
        assert values.item() == pytest.approx(by_hand, abs=1e-9)


def test_max_length_keeps_the_closing_sep_of_ids_as_of_strings(tokenizer):
    """Truncated ids (lists or a padded tensor) keep their closing [SEP], as the tokenizer
    keeps it for strings; all score as the texts cut to their first three letters."""
    model = _bert(tokenizer, dtype=torch.float64)
    texts = ["a b c d e f", "g h i j"]
    cut = tokenizer(["a b c", "g h i"], return_tensors="pt")
    maskable = cut["input_ids"] > MASK
    torch.manual_seed(3)
    orderings = random_orderings(2, (2,), 5, entries=maskable)
    options = dict(orderings=orderings, progress=False)
    expected = mlm_ordering_log_likelihoods(model, tokenizer, cut, 2, **options).values
    padded = tokenizer(texts, padding=True, return_tensors="pt")
    ids = [tokenizer(t)["input_ids"] for t in texts]
    for given in (texts, ids, padded["input_ids"], padded):
        values = mlm_ordering_log_likelihoods(
            model, tokenizer, given, 2, max_length=5, **options
        ).values
        assert torch.allclose(values, expected, atol=1e-9, rtol=0), (type(given), values)


def test_sequences_the_model_cannot_read_raise_clear_errors(tokenizer):
    """Too long for the position embeddings (32), or ids outside the vocabulary: the
    sequence, the limit and the fix are named before the model's own error."""
    model = _bert(tokenizer)
    too_long = " ".join("a" * 40)
    batch = tokenizer(["b", too_long], padding=True, return_tensors="pt")
    for given, index in (([too_long], 0), (batch, 1)):
        with pytest.raises(
            ValueError,
            match=rf"sequences\[{index}\] is 42 tokens long .* 32 positions .* max_length=32",
        ):
            mlm_ordering_log_likelihoods(model, tokenizer, given, 1, progress=False)
    vocab = len(tokenizer)
    for given, bad in (([[CLS, 5, vocab, SEP]], vocab), (torch.tensor([[CLS, 5, -1, SEP]]), -1)):
        with pytest.raises(
            ValueError,
            match=rf"sequences\[0\] holds token id {bad} at position 2, outside the vocabulary",
        ):
            mlm_ordering_log_likelihoods(model, tokenizer, given, 1, progress=False)
