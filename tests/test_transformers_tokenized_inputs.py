"""The functions that take a tokenizer's output (``sample_mlm``, ``mlm_mpt_curve``,
``mlm_ordering_log_likelihoods``) read it alike: the same mapping without ``input_ids`` is
refused by each with one message, naming the function's own argument."""

import os

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from pyro_mpt.transformers import (  # noqa: E402
    mlm_mpt_curve,
    mlm_ordering_log_likelihoods,
    sample_mlm,
)
from pyro_mpt.transformers._padding import read_encoding  # noqa: E402
from tests._tiny_transformers import SPECIAL, letter_tokenizer, tiny_bert  # noqa: E402

LETTERS = "abc"
CLS, SEP, MASK = (SPECIAL.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))


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
