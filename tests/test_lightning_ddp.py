"""``examples/lightning_ddp.py``: ``MPTLoss`` under Lightning's DDP on two CPU processes.

The example runs one SGD step with two processes (gloo) on 64 observations, 32 per process,
every process seeded with ``seed + rank`` at that step. One process here then evaluates
``MPTLoss.estimate`` on each process's rows with that process's seed, which draws the same
masks, and differentiates the mean over all 64 rows. Compared: each process's loss with the
mean estimate over its rows; the gradient that both processes applied (DDP's average of
theirs) with the gradient of the whole-batch mean; the parameters after the step with one
SGD step of the reference.
"""

import importlib.util
import os
import socket
import subprocess
import sys

import pyro
import pytest
import torch

from pyro_mpt import MPTLoss

pytest.importorskip(
    "lightning", reason='the DDP example needs lightning: pip install "pyro-mpt[lightning]"'
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "lightning_ddp.py")
ARGV = [
    "--accelerator=cpu",
    "--strategy=ddp",
    "--devices=2",
    "--num-data=64",
    "--num-features=6",
    "--latent-dim=2",
    "--batch-size=32",
    "--max-steps=1",
    "--optimizer=sgd",
    "--learning-rate=0.1",
    "--dtype=float64",
    "--seed=3",
    "--reseed-each-step",
]


def _load_example():
    spec = importlib.util.spec_from_file_location("lightning_ddp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reference(example, args, shards, seeds):
    """Loss per shard, and the gradient of the mean over all shards' rows, in one process;
    shard ``r``'s masks come from ``seeds[r]``."""
    with pyro.settings.context(module_local_params=True):
        model, guide = example.make_model(args)
        estimates = []
        for x, seed in zip(shards, seeds):
            pyro.set_rng_seed(seed)
            estimates.append(MPTLoss().estimate(model, guide, x))
        loss = -torch.cat(estimates).mean()
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(loss, list(params.values()))
    shard_losses = torch.stack([-e.mean() for e in estimates]).detach()
    named = {f"model.{name}": p.detach() for name, p in params.items()}
    return shard_losses, named, {f"model.{name}": g for name, g in zip(params, grads)}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_process_step_equals_whole_batch_step(tmp_path):
    dump = tmp_path / "dump"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=ROOT,
    )
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, EXAMPLE, *ARGV, f"--dump={dump}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(dump / f"rank{r}.pt") for r in range(2)]
    assert [d["world_size"] for d in ranks] == [2, 2]

    example = _load_example()
    args = example.build_parser().parse_args(ARGV)
    assert torch.get_default_dtype() == torch.float64  # as in the run (--dtype=float64)
    # The two shards partition the data set.
    data = example.make_data(args)
    seen = torch.cat([d["x"] for d in ranks])
    assert seen.shape == data.shape
    assert torch.equal(seen[seen[:, 0].argsort()], data[data[:, 0].argsort()])

    shards = [d["x"] for d in ranks]
    seeds = [example.step_seed(args.seed, r, 0, 2) for r in range(2)]
    shard_losses, initial, grad = _reference(example, args, shards, seeds)
    for d in ranks:
        assert _max_diff(d["params_before"], initial) == 0.0
    # Each process's loss is the mean MPT loss over its rows, with the masks of its seed.
    losses = torch.stack([d["loss"] for d in ranks])
    assert torch.allclose(losses, shard_losses, rtol=1e-12, atol=1e-12)
    # DDP's averaged gradient is the gradient of the whole batch's mean, on both processes.
    for d in ranks:
        assert _max_diff(d["grads"], grad) < 1e-10
    # One SGD step of the reference gives the same parameters.
    expected = {k: initial[k] - args.learning_rate * grad[k] for k in initial}
    for d in ranks:
        assert _max_diff(d["params_after"], expected) < 1e-10
    # The comparison sees the masks: with the two seeds swapped the gradient differs.
    _, _, swapped = _reference(example, args, shards, seeds[::-1])
    assert _max_diff(ranks[0]["grads"], swapped) > 1e-3
