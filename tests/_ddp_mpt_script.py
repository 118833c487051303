"""Two-process ``MPTTrainer`` run, launched by ``tests/test_transformers_trainer.py`` with
``torchrun --nproc_per_node=2`` (CPU, gloo).

Phase ``exact``: one SGD step with gradient accumulation over a fixed, pre-masked data set,
per token and per sequence; rank 0 saves the initial and the updated weights so that the test
can compare each update with one process on the whole batch. Phase ``recipe``: the recipe of
``docs/scaling.rst`` (:func:`train_recipe`, shown there as it is here), a few steps with
``MPTDataCollator`` on a toy corpus; rank 0 saves the logged losses. Phase ``masks``: each
rank saves the masks that a seeded collator and a default one draw on the same examples.

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
    rank = int(os.environ.get("RANK", "0"))
    for normalize in ("tokens", "sequences"):
        model = tiny_bert(VOCAB_SIZE)  # the same weights each time
        if rank == 0 and normalize == "tokens":
            torch.save(model.state_dict(), os.path.join(out_dir, "initial.pt"))
        trainer = sgd_step_trainer(
            model, rows, out_dir, gradient_accumulation_steps=2, normalize=normalize
        )
        trainer.train()
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(out_dir, f"updated_{normalize}.pt"))


#: Rows evaluated: an odd count, so that two processes' samplers repeat one to fill a batch.
EVAL_ROWS = 5


def eval_phase(out_dir, vocab_dir):
    """``eval_loss`` of the first :data:`EVAL_ROWS` pre-masked rows, per token and per
    sequence, in evaluation batches of two: written to ``eval.json`` by rank 0."""
    data = torch.load(os.path.join(out_dir, "batch.pt"))
    rows = [{k: v[i] for k, v in data.items()} for i in range(EVAL_ROWS)]
    losses = {}
    for normalize in ("tokens", "sequences"):
        args = arguments(out_dir, per_device_eval_batch_size=2)
        trainer = MPTTrainer(
            model=tiny_bert(VOCAB_SIZE),
            args=args,
            eval_dataset=ListDataset(rows),
            data_collator=stack,
            normalize=normalize,
        )
        losses[normalize] = trainer.evaluate()["eval_loss"]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, "eval.json"), "w") as handle:
            json.dump(losses, handle)


def train_recipe(output_dir, vocab_dir):
    """Pre-trains a masked language model by MPT on every process of ``torchrun``."""
    tokenizer = transformers.BertTokenizerFast.from_pretrained(vocab_dir)
    train_dataset = [tokenizer(text) for text in toy_texts(32)]
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,  # per process
        max_steps=3,
        learning_rate=1e-3,
        seed=0,  # the same on every process
        use_cpu=True,  # two CPU processes with gloo; on GPUs leave out both lines
        ddp_backend="gloo",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    # A seed of the collator's own, mixed with each process's rank: the processes draw
    # different masks, and args.seed reproduces all of them.
    collator = MPTDataCollator(tokenizer, rate="uniform", seed=args.seed)
    trainer = MPTTrainer(
        model=tiny_bert(len(tokenizer)),  # any *ForMaskedLM
        args=args,
        train_dataset=train_dataset,
        data_collator=collator,
    )
    trainer.train()  # loss in nats per maskable token (normalize="tokens")
    return trainer


def recipe_phase(out_dir, vocab_dir):
    trainer = train_recipe(out_dir, vocab_dir)
    if trainer.args.process_index == 0:
        history = trainer.state.log_history
        info = dict(
            losses=[entry["loss"] for entry in history if "loss" in entry],
            grad_norms=[entry["grad_norm"] for entry in history if "grad_norm" in entry],
            world_size=trainer.args.world_size,
        )
        with open(os.path.join(out_dir, "recipe.json"), "w", encoding="utf-8") as handle:
            json.dump(info, handle)


def mask_texts():
    """Eight texts of ten tokens, on which every rank draws masks."""
    return [" ".join(LETTERS[i : i + 10]) for i in range(8)]


def masks_phase(out_dir, vocab_dir):
    """Each rank's masks on the same examples: from ``MPTDataCollator(seed=0)``, and from a
    default collator after ``torch.manual_seed(0)``, inside the initialised process group."""
    tokenizer = transformers.BertTokenizerFast.from_pretrained(vocab_dir)
    examples = [tokenizer(text) for text in mask_texts()]
    seeded = MPTDataCollator(tokenizer, seed=0)(examples)["labels"]
    torch.manual_seed(0)
    default = MPTDataCollator(tokenizer)(examples)["labels"]
    rank = torch.distributed.get_rank()
    torch.save(
        dict(seeded=seeded, default=default, rank=rank),
        os.path.join(out_dir, f"masks_rank{rank}.pt"),
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, vocab = sys.argv[1], sys.argv[2]
    exact_phase(out, vocab)
    eval_phase(out, vocab)
    recipe_phase(out, vocab)
    masks_phase(out, vocab)
    if torch.distributed.is_initialized():
        # Leave together: a rank that exits while its peer still holds open gloo pairs can
        # make the peer abort.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
