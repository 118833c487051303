"""Masks under ``torch.distributed``: every process seeded alike draws masks of its own, one
seed reproduces them, and the estimate stays unbiased.

Two CPU processes (gloo) run ``tests/_ddp_masks_script.py``: each seeds Pyro with the same
seed, as Pyro's Lightning example does, and evaluates ``MPTLoss().estimate`` on its own shard
for a number of steps. Compared: the masks of the two processes at each step; each process's
masks and estimates with those of one process here that plays its rank after the same seed;
the mean estimate over processes and steps with the exact ``log p(x)`` of the PPCA.
"""

import math
import os
import socket
import subprocess
import sys

import pyro
import pytest
import torch
import torch.distributed

from pyro_mpt.ops.mask_rates import as_rate_schedule
from pyro_mpt.ops.masks import process_generator, sample_masks
from tests import _ddp_masks_script as script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 5
STEPS = 400


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(out, seed, steps, world_size=2):
    """Runs the script on ``world_size`` processes; returns each process's saved results."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world_size),
        PYTHONPATH=ROOT,
    )
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, os.path.join(ROOT, "tests", "_ddp_masks_script.py")]
    command += [str(out), str(seed), str(steps)]
    processes = [
        subprocess.Popen(
            command,
            env=dict(env, RANK=str(rank)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]


def _as_rank(monkeypatch, rank, world_size=2):
    """Makes this process look like process ``rank`` of an initialised process group."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args, **kwargs: world_size)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: rank)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("masks"), SEED, STEPS)


def test_processes_seeded_alike_draw_different_masks(two_processes):
    masks = [result["masks"] for result in two_processes]
    assert masks[0].shape == (STEPS, script.ROWS_PER_RANK, script.NUM_FEATURES)
    assert masks[0].any(-1).all() and masks[1].any(-1).all()
    same_step = (masks[0] == masks[1]).all(-1).all(-1)
    # Independent masks of 8 rows coincide with probability below 1e-10 per step.
    assert same_step.float().mean().item() == 0.0
    # Not only whole steps: rows in the same place agree about as often as independent
    # uniform masks would (below 0.2 here), not always.
    same_row = (masks[0] == masks[1]).all(-1).double().mean().item()
    assert same_row < 0.2


def test_one_seed_reproduces_every_process(two_processes, monkeypatch):
    shards = script.shards(2)
    for rank, result in enumerate(two_processes):
        with monkeypatch.context() as patch:
            _as_rank(patch, rank)
            masks, estimates = script.run(SEED, 20, shards[rank])
        assert torch.equal(masks, result["masks"][:20])
        assert torch.equal(estimates, result["estimates"][:20])
    # Another seed, other masks.
    with monkeypatch.context() as patch:
        _as_rank(patch, 0)
        masks, _ = script.run(SEED + 1, 20, shards[0])
    assert not torch.equal(masks, two_processes[0]["masks"][:20])


def test_mean_over_processes_is_unbiased(two_processes):
    weight, loc = script.ppca_parameters()
    cov = weight @ weight.T + script.NOISE_SCALE**2 * torch.eye(script.NUM_FEATURES)
    exact = torch.distributions.MultivariateNormal(loc, cov).log_prob(torch.cat(script.shards(2)))
    # Each step's estimate of the mean log p(x) over both shards: what DDP's average follows.
    per_step = torch.cat([result["estimates"] for result in two_processes], dim=1).mean(1)
    error = per_step.mean() - exact.mean()
    standard_error = per_step.std() / math.sqrt(STEPS)
    assert error.abs() < 4 * standard_error, (error, standard_error)


def test_one_process_uses_the_global_generator(monkeypatch):
    assert process_generator(torch.device("cpu")) is None
    with monkeypatch.context() as patch:
        _as_rank(patch, 0, world_size=1)
        assert process_generator(torch.device("cpu")) is None
    # A process of several gets a generator of its own; the global one advances by one draw.
    _as_rank(monkeypatch, 1)
    pyro.set_rng_seed(0)
    generator = process_generator(torch.device("cpu"))
    assert isinstance(generator, torch.Generator)
    pyro.set_rng_seed(0)
    torch.randint(2**62, ())
    after_one_draw = torch.get_rng_state()
    pyro.set_rng_seed(0)
    process_generator(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), after_one_draw)


@pytest.mark.parametrize("num_features", [7, 784, 5000])
@pytest.mark.parametrize("missing", [False, True])
def test_sample_masks_draws_from_the_generator_only(num_features, missing):
    """Every draw of ``sample_masks`` (sizes, 16-bit and float keys, tied rows drawn again,
    masks among observed entries) comes from ``generator``: the global state is untouched
    and generators seeded alike give the same masks."""
    batch_shape = (400,)
    entries = None
    if missing:
        entries = torch.rand(batch_shape + (num_features,)) < 0.8
    schedule = as_rate_schedule("uniform")
    state = torch.get_rng_state()
    draws = [
        sample_masks(
            schedule,
            3,
            batch_shape,
            num_features,
            entries=entries,
            generator=torch.Generator().manual_seed(9),
        )
        for _ in range(2)
    ]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    masks, sizes = draws[0]
    # The masks have their sizes and lie among the observed entries.
    assert torch.equal(masks.sum(-1), sizes)
    if missing:
        assert not (masks & ~entries).any()
    other = sample_masks(
        schedule, 3, batch_shape, num_features, entries=entries, generator=torch.Generator()
    )
    assert not torch.equal(other[0], masks)
