"""``MPTTrainer``: the update equals the gradient of the MPT loss over the whole step (with
gradient accumulation, and over two ``torchrun`` processes), and training on a toy corpus
lowers the loss."""

import contextlib
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pyro_mpt.transformers import MPTDataCollator, MPTTrainer, mpt_mlm_loss  # noqa: E402
from tests._ddp_mpt_script import (  # noqa: E402
    SGD_LR,
    VOCAB_SIZE,
    ListDataset,
    arguments,
    sgd_step_trainer,
    tiny_bert,
    toy_texts,
    write_vocab,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _float32():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = write_vocab(str(tmp_path_factory.mktemp("vocab")))
    return transformers.BertTokenizerFast.from_pretrained(folder)


def _masked_batch(tokenizer, num, rate="uniform", seed=0):
    torch.manual_seed(seed)
    texts = [t[: 2 * (5 + i % 7)] for i, t in enumerate(toy_texts(num))]  # unequal lengths
    return MPTDataCollator(tokenizer, rate=rate)([tokenizer(t) for t in texts])


def _sgd_reference(initial, batch, lr, normalize="sequences"):
    """One SGD step on the MPT loss of the whole batch, by hand."""
    model = tiny_bert(initial["bert.embeddings.word_embeddings.weight"].shape[0])
    model.load_state_dict(initial)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "mpt_weights")}
    logits = model(**inputs).logits
    loss = mpt_mlm_loss(logits, batch["labels"], batch["mpt_weights"], normalize=normalize)
    loss.backward()
    with torch.no_grad():
        return {
            name: p - lr * p.grad if p.grad is not None else p.clone()
            for name, p in model.named_parameters()
        }


def _assert_same_update(expected, state, initial):
    moved = 0.0
    for name, value in expected.items():
        assert torch.allclose(state[name], value, atol=2e-6, rtol=1e-5), name
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-3  # the step changed the weights, so the comparison means something


@pytest.mark.parametrize("normalize", ["sequences", "tokens"])
def test_accumulated_step_equals_the_whole_batch_gradient(tokenizer, tmp_path, normalize):
    with _float32():
        batch = _masked_batch(tokenizer, 8)
        rows = [{k: v[i] for k, v in batch.items()} for i in range(8)]
        model = tiny_bert(len(tokenizer))
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = sgd_step_trainer(
            model, rows, str(tmp_path), gradient_accumulation_steps=4, normalize=normalize
        )
        trainer.train()
        expected = _sgd_reference(initial, batch, SGD_LR, normalize)
        _assert_same_update(expected, model.state_dict(), initial)


def test_training_on_a_toy_corpus_lowers_the_loss(tokenizer, tmp_path):
    with _float32():
        rows = [tokenizer(t) for t in toy_texts(64)]
        model = tiny_bert(len(tokenizer))
        args = arguments(
            str(tmp_path),
            per_device_train_batch_size=16,
            max_steps=80,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
        )
        trainer = MPTTrainer(
            model=model,
            args=args,
            train_dataset=ListDataset(rows),
            data_collator=MPTDataCollator(tokenizer, rate="uniform"),
            normalize="tokens",
        )
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 80 and all(math.isfinite(x) for x in losses)
    # At random initialisation the loss is about log V = log 21 nats per token; a masked
    # letter copies the visible ones, so the loss falls far below that.
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert abs(first - math.log(len(tokenizer))) < 0.3
    assert last < 0.75 * first
    evaluation = trainer.evaluate(ListDataset(rows[:32]))
    assert math.isfinite(evaluation["eval_loss"]) and evaluation["eval_loss"] < first


def test_batches_without_weights_raise(tokenizer, tmp_path):
    with _float32():
        rows = [tokenizer(t) for t in toy_texts(4)]
        collator = transformers.DataCollatorForLanguageModeling(tokenizer)
        trainer = MPTTrainer(
            model=tiny_bert(len(tokenizer)),
            args=arguments(str(tmp_path), max_steps=1),
            train_dataset=ListDataset(rows),
            data_collator=collator,
        )
        with pytest.raises(ValueError, match="the batch has no 'mpt_weights'"):
            trainer.train()


def test_unknown_normalization_raises(tmp_path):
    with pytest.raises(ValueError, match="normalize must be 'sequences' or 'tokens', got 'x'"):
        MPTTrainer(model=tiny_bert(VOCAB_SIZE), args=arguments(str(tmp_path)), normalize="x")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_torchrun_matches_one_process(tokenizer, tmp_path):
    vocab = write_vocab(str(tmp_path / "vocab"))
    with _float32():
        batch = _masked_batch(tokenizer, 8, seed=3)
    torch.save(dict(batch), tmp_path / "batch.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        os.path.join(ROOT, "tests", "_ddp_mpt_script.py"),
        str(tmp_path),
        vocab,
    ]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[:6000]
    # Two processes x two micro-batches of two sequences: the update is the whole batch's.
    initial = torch.load(tmp_path / "initial.pt")
    with _float32():
        expected = _sgd_reference(initial, batch, SGD_LR)
    _assert_same_update(expected, torch.load(tmp_path / "updated.pt"), initial)
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["world_size"] == 2
    assert len(smoke["losses"]) == 3 and all(math.isfinite(x) for x in smoke["losses"])
