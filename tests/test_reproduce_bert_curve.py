"""``pyro-mpt reproduce bert-curve`` at smoke size, and the AntiBERTy loader."""

import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("antiberty", reason="the antibody BERT's weights ship with antiberty")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pyro_mpt.cli import main  # noqa: E402
from pyro_mpt.transformers.antiberty import (  # noqa: E402
    ANTIBODY_SEQUENCES,
    load_antiberty_tokenizer,
    spaced,
)

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def test_antiberty_tokenizer_reads_residues_and_its_special_tokens():
    tokenizer = load_antiberty_tokenizer()
    assert len(tokenizer) == 25
    assert tokenizer.all_special_tokens and set(tokenizer.all_special_ids) == {0, 1, 2, 3, 4}
    assert (tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id) == (0, 2, 3)
    assert tokenizer.mask_token_id == 4 and tokenizer.unk_token_id == 1
    ids = tokenizer(spaced("EVQLW"))["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "E", "V", "Q", "L", "W", "[SEP]"]
    for name, sequence in ANTIBODY_SEQUENCES.items():
        ids = tokenizer(spaced(sequence))["input_ids"]
        assert len(ids) == len(sequence) + 2 and tokenizer.unk_token_id not in ids, name
        assert 100 <= len(sequence) <= 130, name


def test_spaced_rejects_non_residues():
    assert spaced("evq l") == "E V Q L"
    with pytest.raises(ValueError, match=r"characters \['1', 'X'\] that are not amino-acid"):
        spaced("EVQX1")


def test_bert_curve_smoke(tmp_path):
    argv = ["reproduce", "bert-curve", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + ["--device", DEVICE]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-curve.json", "bert-curve.png"]
    assert (tmp_path / "bert-curve.png").read_bytes()[:4] == b"\x89PNG"
    res = json.loads((tmp_path / "bert-curve.json").read_text())
    mean_d = res["config"]["mean_num_features"]
    random, pretrained = res["summary"]["random init."], res["summary"]["pre-trained"]
    # Random weights predict every residue at about 1/25 (a flat curve at -log 25, within
    # the s^2/2 + sampling slack derived in test_transformers_curve: here s = 0.02 sqrt(512)
    # = 0.45, so allow 0.3 nats per residue).
    log_v = math.log(25)
    for score in res["curves"]["random init."]["scores"]:
        assert abs(score + log_v) < 0.3
    assert abs(random["area"] + mean_d * log_v) < 0.3 * mean_d
    # The pre-trained model's area is far above random: more than 150 nats per sequence
    # better (a uniform guess over the 20 residues would only gain D log(25/20) = 25).
    assert pretrained["area"] > random["area"] + 150
    assert pretrained["mean_score"] > -1.6
    fractions = res["curves"]["pre-trained"]["masked_fraction"]
    torch.testing.assert_close(
        torch.tensor(fractions), torch.tensor([0.1, 0.5, 0.9]), atol=0.01, rtol=0
    )
