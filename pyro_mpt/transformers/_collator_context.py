"""What :class:`~pyro_mpt.transformers.MPTDataCollator` learns of the process it runs in: the
process's rank among data-parallel processes, the random stream its masks come from, and the
``transformers.Trainer`` (if any) whose loop asks for the batch."""

import inspect
import os
import sys

import numpy as np
import torch
import torch.distributed
import torch.utils.data

__all__ = [
    "RankStream",
    "calling_trainer",
    "mixed_seed",
    "process_rank",
    "trainer_ignores",
    "world_size",
]


def _env_int(name, default):
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(
            f"the environment variable {name}={value!r} is not an integer; launchers such as "
            "torchrun set it to the process's rank or count: unset it or give an integer."
        ) from None


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_rank():
    """This process's rank: ``torch.distributed.get_rank()`` once a process group is
    initialised, else the ``RANK`` environment variable that ``torchrun`` and
    ``accelerate launch`` set, else 0."""
    return torch.distributed.get_rank() if _distributed() else _env_int("RANK", 0)


def world_size():
    """The number of data-parallel processes: ``torch.distributed.get_world_size()`` once a
    process group is initialised, else the ``WORLD_SIZE`` environment variable, else 1."""
    return torch.distributed.get_world_size() if _distributed() else _env_int("WORLD_SIZE", 1)


def mixed_seed(*entropy):
    """A 64-bit seed mixed from non-negative integers by numpy's ``SeedSequence``: tuples that
    differ in any entry (a rank, a worker's seed) give unrelated streams."""
    sequence = np.random.SeedSequence([int(value) for value in entropy])
    return int(sequence.generate_state(1, np.uint64)[0])


class RankStream:
    """The random stream of a collator's draws in this process, rank-aware (see
    :class:`~pyro_mpt.transformers.MPTDataCollator`).

    :param int seed: seeds a generator of the collator's own from ``(seed, rank)``, and the
        worker's seed inside a ``DataLoader`` worker; ``None`` for torch's global generator in
        one process and, under several, a fresh generator per batch seeded from one draw of
        the global generator and the rank.
    """

    def __init__(self, seed=None):
        self.seed = seed
        self._generator = self._key = None

    def generator(self, device):
        """The generator of the next batch's draws, on ``device``; ``None`` for torch's
        global generator."""
        if self.seed is None:
            if world_size() < 2:
                return None
            # One draw from torch's global CPU generator, whatever the default device.
            base = int(torch.empty((), dtype=torch.int64, device="cpu").random_())
            return torch.Generator(device).manual_seed(mixed_seed(base, process_rank()))
        key = (os.getpid(), str(device))  # a forked worker starts its own stream
        if self._key != key:
            entropy = [self.seed, process_rank()]
            worker = torch.utils.data.get_worker_info()
            if worker is not None:
                entropy.append(worker.seed)
            self._generator = torch.Generator(device).manual_seed(mixed_seed(*entropy))
            self._key = key
        return self._generator


def _collates_with(trainer, collator):
    """Whether ``trainer``'s data collator is ``collator``, or wraps it (``Trainer`` wraps it
    to drop unused columns)."""
    used = getattr(trainer, "data_collator", None)
    for _ in range(4):
        if used is collator:
            return True
        used = getattr(used, "data_collator", None)
    return False


def calling_trainer(frame, collator):
    """The innermost ``transformers.Trainer`` with a method on the call stack from ``frame``
    outwards whose data collator is ``collator``, or ``None``: the Trainer whose data loader
    asks for the batch, not one that merely runs code (a callback, say) that calls the
    collator.

    A ``DataLoader`` worker started by ``fork`` (Linux's default) continues the stack of the
    process that started it, so the Trainer whose loop forked it is found there too.
    """
    module = sys.modules.get("transformers.trainer")
    if module is None:  # transformers' Trainer never imported: no Trainer can be running
        return None
    trainer_class = module.Trainer
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, trainer_class) and _collates_with(owner, collator):
                return owner
        frame = frame.f_back
    return None


def trainer_ignores(trainer, key):
    """Whether ``trainer`` trains on the model's own loss and hands the batch feature ``key``
    to a model that does not name it: ``transformers.Trainer`` itself, or a subclass that
    keeps its ``compute_loss``, with a model whose ``forward`` has no parameter ``key`` (it
    lands in ``**kwargs``, which Hugging Face models ignore)."""
    from transformers import Trainer

    from pyro_mpt.transformers.trainer import MPTTrainer

    if isinstance(trainer, MPTTrainer) or type(trainer).compute_loss is not Trainer.compute_loss:
        return False
    forward = getattr(trainer.model, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # no signature to read: do not guess
        return False
    named = {
        name
        for name, p in parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    return key not in named
