"""The functions that take a tokenizer's output (``sample_mlm``, ``mlm_mpt_curve``,
``mlm_ordering_log_likelihoods``, ``pseudo_log_likelihood``) read it alike: the same mapping
without ``input_ids``, sentence pair or attention mask with a hole inside a row is refused by
each with one message, naming the function's own argument."""

import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from pyro_mpt.transformers import (  # noqa: E402
    mlm_mpt_curve,
    mlm_ordering_log_likelihoods,
    pseudo_log_likelihood,
    sample_mlm,
)
from pyro_mpt.transformers._padding import check_padding_only, read_encoding  # noqa: E402
from tests._tiny_transformers import SPECIAL, letter_tokenizer, tiny_bert  # noqa: E402

LETTERS = "abc"
CLS, SEP, MASK = (SPECIAL.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
SPECIAL_IDS = list(range(len(SPECIAL)))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return letter_tokenizer(tmp_path_factory.mktemp("vocab"), LETTERS)


@pytest.fixture(scope="module")
def model():
    return tiny_bert(len(SPECIAL) + len(LETTERS)).eval()


def _message(call):
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_a_mapping_without_input_ids_gets_one_message_naming_each_argument(model, tokenizer):
    bad = {"ids": [[CLS, MASK, SEP]], "attention_mask": [[1, 1, 1]]}
    messages = {
        "input_ids": _message(lambda: sample_mlm(model, tokenizer, bad, progress=False)),
        "texts": _message(lambda: mlm_mpt_curve(model, tokenizer, bad, progress=False)),
        "sequences": _message(
            lambda: mlm_ordering_log_likelihoods(model, tokenizer, bad, 2, progress=False)
        ),
    }
    for name, message in messages.items():
        assert message.startswith(f"{name} is a mapping with keys ['attention_mask', 'ids']")
        assert f"{name} must hold 'input_ids'" in message
        assert "\n" not in message
    shapes = {
        message.replace(f"{name} is", "ARG is", 1).replace(f"{name} must", "ARG must", 1)
        for name, message in messages.items()
    }
    assert len(shapes) == 1, messages


def test_read_encoding_prefers_the_given_attention_mask():
    encoding = {"input_ids": [[1, 2]], "attention_mask": [[1, 0]]}
    assert read_encoding(encoding, None, "x") == ([[1, 2]], [[1, 0]])
    assert read_encoding(encoding, [[1, 1]], "x") == ([[1, 2]], [[1, 1]])
    assert read_encoding({"input_ids": [[1, 2]]}, None, "x") == ([[1, 2]], None)
    assert read_encoding([[1, 2]], None, "x") == ([[1, 2]], None)


def test_a_sentence_pair_is_refused_by_every_function_that_reads_one_segment(model, tokenizer):
    # Each scores or draws with token type 0: a pair's second segment would be read as the
    # first's, and its conditionals would be another input's (2.9 nats off on one pair).
    pair = tokenizer(["a b"], ["c a"], return_tensors="pt")
    assert bool(pair["token_type_ids"].any())
    calls = [
        lambda: sample_mlm(model, tokenizer, pair, progress=False),
        lambda: mlm_mpt_curve(model, tokenizer, pair, progress=False),
        lambda: mlm_ordering_log_likelihoods(model, tokenizer, pair, 2, progress=False),
    ]
    for call in calls:
        assert "marks a second segment (sentence pairs)" in _message(call)
    single = tokenizer(["a b", "c a b"], padding=True, return_tensors="pt")
    values = mlm_ordering_log_likelihoods(model, tokenizer, single, 2, progress=False)
    assert values.values.shape[0] == 2


def test_an_attention_mask_with_a_hole_inside_a_row_is_refused_everywhere(model, tokenizer):
    ids = torch.tensor([[CLS, 5, 6, 7, SEP]])
    holed = torch.tensor([[1, 1, 0, 1, 1]])
    encoding = {"input_ids": ids, "attention_mask": holed}
    calls = [
        lambda: sample_mlm(model, tokenizer, ids, attention_mask=holed, progress=False),
        lambda: mlm_mpt_curve(model, tokenizer, encoding, progress=False),
        lambda: mlm_ordering_log_likelihoods(
            model, tokenizer, ids, 2, attention_mask=holed, progress=False
        ),
        lambda: pseudo_log_likelihood(model, tokenizer, ids, attention_mask=holed),
    ]
    for call in calls:
        assert "leaves out position 2 of row 0, inside the sequence" in _message(call)


def test_an_attention_mask_shorter_than_its_row_is_refused_everywhere(model, tokenizer):
    # It used to cut the sequence: [CLS] A B C [SEP] with a mask of 3 entries was scored as
    # [CLS] A B, with no word.
    ids = [[CLS, 5, 6, 7, SEP]]
    short = [[1, 1, 1]]
    calls = [
        lambda: mlm_mpt_curve(model, tokenizer, {"input_ids": ids, "attention_mask": short}),
        lambda: mlm_mpt_curve(
            model,
            tokenizer,
            {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(short)},
            progress=False,
        ),
        lambda: mlm_ordering_log_likelihoods(
            model, tokenizer, ids, 2, attention_mask=short, progress=False
        ),
        lambda: mlm_ordering_log_likelihoods(
            model, tokenizer, torch.tensor(ids), 2, attention_mask=torch.tensor(short)
        ),
        lambda: sample_mlm(model, tokenizer, ids, attention_mask=short),
        lambda: sample_mlm(model, tokenizer, torch.tensor(ids), attention_mask=torch.tensor(short)),
    ]
    for call in calls:
        assert "has 3 entries in row 0, whose sequence has 5 tokens" in _message(call)
    two_rows = [[CLS, 5, SEP], [CLS, 6, 7, SEP]]
    message = _message(
        lambda: mlm_ordering_log_likelihoods(
            model, tokenizer, two_rows, 2, attention_mask=[[1, 1, 1]]
        )
    )
    assert "has 1 rows for 2 sequences" in message


@pytest.mark.parametrize(
    "mask, holed",
    [
        ([[1, 1, 1, 0, 0]], False),
        ([[0, 0, 1, 1, 1]], False),
        ([[0, 0, 0, 0, 0]], False),
        ([1, 1, 0, 1], True),
        ([[1, 1, 1], [1, 0, 1]], True),
    ],
)
def test_padding_at_either_end_passes_and_a_hole_does_not(mask, holed):
    for form in (mask, torch.tensor(mask)):
        if holed:
            with pytest.raises(ValueError, match="only padding"):
                check_padding_only(form, "x")
        else:
            check_padding_only(form, "x")


def test_pseudo_log_likelihood_takes_an_attention_mask_given_as_lists(model, tokenizer):
    ids = torch.tensor([[CLS, 5, 6, SEP, 0], [CLS, 6, 7, 5, SEP]])
    attention = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    as_lists = pseudo_log_likelihood(model, tokenizer, ids, attention_mask=attention)
    as_tensor = pseudo_log_likelihood(model, tokenizer, ids, attention_mask=torch.tensor(attention))
    assert torch.equal(as_lists, as_tensor)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\)"):
        pseudo_log_likelihood(model, tokenizer, ids, attention_mask=[[1, 1, 1, 1, 1]])


def test_sample_mlm_never_draws_ids_past_the_tokenizers_vocabulary(tokenizer):
    # A model whose embedding matrix is padded past the tokenizer (10 more ids): those ids
    # decode to no token. Unbanned, they took about half the draws of this model.
    padded = tiny_bert(len(SPECIAL) + len(LETTERS) + 10).eval()
    start = torch.tensor([[CLS] + [MASK] * 6 + [SEP]] * 50)
    samples = sample_mlm(padded, tokenizer, start, method="parallel", progress=False)
    drawn = samples.sequences[:, 1:-1]
    assert int(drawn.max()) < len(tokenizer)
    assert not bool(torch.isin(drawn, torch.tensor(SPECIAL_IDS)).any())
