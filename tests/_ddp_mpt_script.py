"""Two-process ``MPTTrainer`` run, launched by ``tests/test_transformers_trainer.py`` with
``torchrun --nproc_per_node=2`` (CPU, gloo).

Phase ``exact``: one SGD step with gradient accumulation over a fixed, pre-masked data set;
rank 0 saves the initial and the updated weights so that the test can compare the update
with one process on the whole batch. Phase ``smoke``: a few steps with ``MPTDataCollator``
on a toy corpus; rank 0 saves the logged losses.

The launcher puts the repository root on ``PYTHONPATH`` (this script imports ``tests``).
"""

import json
import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from pyro_mpt.transformers import MPTDataCollator, MPTTrainer  # noqa: E402
from tests import _tiny_transformers  # noqa: E402

LETTERS = "abcdefghijklmnop"
VOCAB_SIZE = len(_tiny_transformers.SPECIAL) + len(LETTERS)
#: The learning rate of the one-step SGD comparisons.
SGD_LR = 0.5


def write_vocab(folder):
    """A WordPiece vocabulary of letters; returns the folder for ``from_pretrained``."""
    return _tiny_transformers.write_vocab(folder, LETTERS)


def tiny_bert(vocab_size, seed=0):
    """A randomly initialised two-layer BERT without dropout, in float32."""
    model = _tiny_transformers.tiny_bert(
        vocab_size, seed, width=32, dropout=0.0, num_hidden_layers=2, max_position_embeddings=64
    )
    return model.float()


def toy_texts(num):
    """One letter repeated per text: every masked token is a copy of the visible ones."""
    return [" ".join(LETTERS[i % len(LETTERS)] * 12) for i in range(num)]


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def stack(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def arguments(out_dir, **kwargs):
    defaults = dict(
        output_dir=out_dir,
        use_cpu=True,
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,  # keep the pre-masked rows' labels and mpt_weights
        seed=0,
    )
    defaults.update(kwargs)
    return transformers.TrainingArguments(**defaults)


def sgd_step_trainer(model, rows, out_dir, gradient_accumulation_steps, **kwargs):
    """An ``MPTTrainer`` for one plain SGD step at ``SGD_LR`` (constant rate, no weight
    decay, no clipping) over micro-batches of two pre-masked rows, stacked as they are."""
    args = arguments(
        out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_steps=1,
        learning_rate=SGD_LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
    )
    return MPTTrainer(
        model=model, args=args, train_dataset=ListDataset(rows), data_collator=stack, **kwargs
    )


def exact_phase(out_dir, vocab_dir):
    data = torch.load(os.path.join(out_dir, "batch.pt"))
    rows = [{k: v[i] for k, v in data.items()} for i in range(data["input_ids"].shape[0])]
    model = tiny_bert(VOCAB_SIZE)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out_dir, "initial.pt"))
    sgd_step_trainer(model, rows, out_dir, gradient_accumulation_steps=2).train()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out_dir, "updated.pt"))


def smoke_phase(out_dir, vocab_dir):
    tokenizer = transformers.BertTokenizerFast.from_pretrained(vocab_dir)
    rows = [tokenizer(text) for text in toy_texts(32)]
    model = tiny_bert(len(tokenizer))
    args = arguments(out_dir, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3)
    trainer = MPTTrainer(
        model=model,
        args=args,
        train_dataset=ListDataset(rows),
        data_collator=MPTDataCollator(tokenizer, rate="uniform"),
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        info = dict(losses=losses, world_size=trainer.args.world_size)
        with open(os.path.join(out_dir, "smoke.json"), "w", encoding="utf-8") as handle:
            json.dump(info, handle)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, vocab = sys.argv[1], sys.argv[2]
    exact_phase(out, vocab)
    smoke_phase(out, vocab)
    if torch.distributed.is_initialized():
        # Leave together: a rank that exits while its peer still holds open gloo pairs can
        # make the peer abort.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
