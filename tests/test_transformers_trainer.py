"""``MPTTrainer``: the update equals the gradient of the MPT loss over the whole step (with
gradient accumulation, and over two ``torchrun`` processes), training on a toy corpus lowers
the loss, the documented ``torchrun`` recipe runs and draws different masks on each process,
and a plain ``Trainer`` refuses the collator's batches."""

import contextlib
import json
import math
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pyro_mpt.transformers import (  # noqa: E402
    MPTDataCollator,
    MPTTrainer,
    mpt_mlm_loss,
    mpt_sequence_estimates,
)
from tests._ddp_mpt_script import (  # noqa: E402
    EVAL_ROWS,
    SGD_LR,
    VOCAB_SIZE,
    ListDataset,
    arguments,
    eval_phase,
    mask_texts,
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


def _sgd_reference(initial, batch, lr, normalize):
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
        )
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 80 and all(math.isfinite(x) for x in losses)
    # By default the loss is per token: about log V = log 21 nats at random initialisation;
    # a masked letter copies the visible ones, so the loss falls far below that.
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


def _eval_reference(batch, normalize):
    """The loss of the first ``EVAL_ROWS`` rows of ``batch`` as one step's, row by row:
    their summed nats over their summed items (``w_i K_i``, or 1 per sequence)."""
    model = tiny_bert(VOCAB_SIZE).eval()
    nats = items = 0.0
    for i in range(EVAL_ROWS):
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"][i : i + 1],
                attention_mask=batch["attention_mask"][i : i + 1],
            ).logits
        labels, weights = batch["labels"][i : i + 1], batch["mpt_weights"][i : i + 1]
        nats -= float(mpt_sequence_estimates(logits, labels, weights).double().sum())
        scored = int((labels != -100).sum())
        items += 1.0 if normalize == "sequences" else float(weights[0]) * scored
    return nats / items


def test_eval_loss_is_the_whole_sets_loss_not_a_mean_of_batch_losses(tokenizer, tmp_path):
    # Five rows of unequal lengths in batches of two: a mean of the batches' own losses,
    # each repeated by its size, is off per token (0.4% in a probe) where the set's summed
    # nats over its summed tokens is the loss of one step.
    with _float32():
        torch.save(dict(_masked_batch(tokenizer, 8, seed=3)), tmp_path / "batch.pt")
        eval_phase(str(tmp_path), None)
        batch = torch.load(tmp_path / "batch.pt")
        losses = json.loads((tmp_path / "eval.json").read_text())
        for normalize in ("tokens", "sequences"):
            expected = _eval_reference(batch, normalize)
            assert losses[normalize] == pytest.approx(expected, rel=1e-5), normalize


def test_two_process_torchrun_matches_one_process(tokenizer, tmp_path, monkeypatch):
    vocab = write_vocab(str(tmp_path / "vocab"))
    with _float32():
        batch = _masked_batch(tokenizer, 8, seed=3)
    torch.save(dict(batch), tmp_path / "batch.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in ("PYTEST_XDIST_WORKER", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
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
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[:6000]
    # Two processes x two micro-batches of two sequences: the update is the whole batch's,
    # per token (the default) and per sequence.
    initial = torch.load(tmp_path / "initial.pt")
    for normalize in ("tokens", "sequences"):
        with _float32():
            expected = _sgd_reference(initial, batch, SGD_LR, normalize)
        _assert_same_update(expected, torch.load(tmp_path / f"updated_{normalize}.pt"), initial)
    # Evaluated on two processes, the odd row that fills the last batch is not counted twice.
    losses = json.loads((tmp_path / "eval.json").read_text())
    with _float32():
        for normalize in ("tokens", "sequences"):
            expected = _eval_reference(batch, normalize)
            assert losses[normalize] == pytest.approx(expected, rel=1e-5), normalize
    # The recipe of docs/scaling.rst ran on both processes; per token, its first loss is near
    # log V, as BERT's cross-entropy is at random initialisation.
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert recipe["world_size"] == 2
    assert len(recipe["losses"]) == 3 and all(math.isfinite(x) for x in recipe["losses"])
    assert abs(recipe["losses"][0] - math.log(VOCAB_SIZE)) < 0.5
    # Inside the process group the two ranks drew different masks on the same examples, with
    # a seed and without one (every process seeded alike), and each rank's are those that
    # its rank and the seed give in one process.
    saved = [torch.load(tmp_path / f"masks_rank{rank}.pt") for rank in (0, 1)]
    assert [masks["rank"] for masks in saved] == [0, 1]
    for key in ("seeded", "default"):
        assert not torch.equal(saved[0][key], saved[1][key]), key
    examples = [tokenizer(text) for text in mask_texts()]
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        seeded = MPTDataCollator(tokenizer, seed=0)(examples)["labels"]
        assert torch.equal(seeded, saved[rank]["seeded"])
        torch.manual_seed(0)
        assert torch.equal(MPTDataCollator(tokenizer)(examples)["labels"], saved[rank]["default"])


# A plain Trainer and the collator's weights --------------------------------------------------


class _ReadsTheWeights(torch.nn.Module):
    """A masked language model whose ``forward`` takes the MPT weights and returns the MPT
    loss: a plain ``Trainer`` can train it."""

    def __init__(self, mlm):
        super().__init__()
        self.mlm = mlm

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, mpt_weights=None
    ):
        logits = self.mlm(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).logits
        return {"loss": mpt_mlm_loss(logits, labels, mpt_weights), "logits": logits}


def _trainer(trainer_class, tokenizer, tmp_path, model, **kwargs):
    rows = [tokenizer(text) for text in toy_texts(8)]
    args = arguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, **kwargs)
    return trainer_class(
        model=model,
        args=args,
        train_dataset=ListDataset(rows),
        data_collator=MPTDataCollator(tokenizer),
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_a_plain_trainer_refuses_the_mpt_batches(tokenizer, tmp_path, workers):
    # transformers.Trainer would hand mpt_weights to BertForMaskedLM's **kwargs, which ignore
    # them, and minimise plain cross-entropy. A DataLoader worker forked by the Trainer's loop
    # finds the Trainer on its stack too.
    with _float32():
        trainer = _trainer(
            transformers.Trainer,
            tokenizer,
            tmp_path,
            tiny_bert(len(tokenizer)),
            dataloader_num_workers=workers,
        )
        with pytest.raises(
            TypeError,
            match=r"Trainer minimises the loss that BertForMaskedLM computes from 'labels' and "
            r"passes the collator's 'mpt_weights' into its forward\(\*\*kwargs\), which "
            r"ignores them: .* Use pyro_mpt\.transformers\.MPTTrainer",
        ):
            trainer.train()
    assert trainer.state.global_step == 0


def test_a_plain_trainer_whose_model_reads_the_weights_trains(tokenizer, tmp_path):
    with _float32():
        model = _ReadsTheWeights(tiny_bert(len(tokenizer)))
        trainer = _trainer(transformers.Trainer, tokenizer, tmp_path, model)
        trainer.train()
    assert trainer.state.global_step == 1


def test_the_collator_called_by_a_callback_of_a_plain_trainer_is_let_through(tokenizer, tmp_path):
    # A plain BERT run that computes MPT batches in a callback (to track the MPT estimate,
    # say): the Trainer's own collator is BERT's, so nothing is ignored.
    collator = MPTDataCollator(tokenizer)
    seen = []

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(collator([tokenizer("a b c")])["mpt_weights"])

    with _float32():
        rows = [tokenizer(text) for text in toy_texts(8)]
        trainer = transformers.Trainer(
            model=tiny_bert(len(tokenizer)),
            args=arguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4),
            train_dataset=ListDataset(rows),
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer),
            callbacks=[Probe()],
        )
        trainer.train()
    assert len(seen) == 1 and seen[0].shape == (1,)


def test_the_collator_pickled_for_a_spawned_worker_is_checked(tokenizer, tmp_path):
    # A DataLoader whose workers start by spawn or forkserver pickles the collator in the
    # Trainer's process, whose stack the worker never sees.
    def start_worker(self):
        return pickle.dumps(self.data_collator)

    plain = type("Spawning", (transformers.Trainer,), {"start_worker": start_worker})
    mpt = type("MPTSpawning", (MPTTrainer,), {"start_worker": start_worker})
    with _float32():
        trainer = _trainer(plain, tokenizer, tmp_path, tiny_bert(len(tokenizer)))
        with pytest.raises(TypeError, match="Use pyro_mpt.transformers.MPTTrainer"):
            trainer.start_worker()
        trainer = _trainer(mpt, tokenizer, tmp_path, tiny_bert(len(tokenizer)))
        copy = pickle.loads(trainer.start_worker())
    assert copy([tokenizer("a b"), tokenizer("c")])["mpt_weights"].shape == (2,)
