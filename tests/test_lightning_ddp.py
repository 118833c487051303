"""``examples/lightning_ddp.py``: Pyro's Lightning recipe with ``MPTLoss`` as its loss, under
Lightning's DDP on two CPU processes (gloo).

The example runs as it stands (one seed for every process, an ``AutoNormal`` guide that exact
conditionals leave unused, Lightning's own sharding of a plain ``DataLoader``) for three SGD
steps on 64 observations, 32 per process, every process reseeded alike at each step. It must
get past the second step, where ``DistributedDataParallel`` stops when a parameter got no
gradient. One process here then plays each rank in turn, draws that rank's masks after the
same seed through ``MPTLoss.estimate`` on its rows, and differentiates the mean over all 64
rows. Compared: each process's loss with its rows' estimates; the gradient that both
processes applied (DDP's average of theirs) with the gradient of the whole-batch mean, and
zero for the guide; the parameters after the first step with one SGD step of the reference.
"""

import importlib.util
import os
import re
import socket
import subprocess
import sys

import pyro
import pytest
import torch
import torch.distributed

from pyro_mpt import MPTLoss
from tests.helpers import ppca_max_likelihood_lml

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
    "--max-steps=3",
    "--optimizer=sgd",
    "--learning-rate=0.002",
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


def _reference(example, args, shards, ranks, monkeypatch):
    """Each shard's loss, and the gradient of minus ``num_data`` times the mean estimate over
    all shards' rows, in one process; shard ``i`` gets the masks that process ``ranks[i]``
    of two draws after the seed of step 0."""
    with pyro.settings.context(module_local_params=True):
        model, guide = example.make_model(args)
        estimates = []
        for x, rank in zip(shards, ranks):
            with monkeypatch.context() as patch:
                patch.setattr(torch.distributed, "is_initialized", lambda: True)
                patch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
                patch.setattr(torch.distributed, "get_rank", lambda *a, r=rank, **k: r)
                pyro.set_rng_seed(example.step_seed(args.seed, 0))
                estimates.append(MPTLoss().estimate(model, guide, x))
        loss = -args.num_data * torch.cat(estimates).mean()
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(loss, list(params.values()))
    shard_losses = torch.stack([-args.num_data * e.mean() for e in estimates]).detach()
    named = {f"model.{name}": p.detach() for name, p in params.items()}
    return shard_losses, named, {f"model.{name}": g for name, g in zip(params, grads)}


def _close(a, b):
    return all(torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-12) for k in b)


def _check_printed_figures(stdout):
    """The example prints the exact log p(x) per observation before and after training and
    the closed-form maximum over PPCAs; this recomputes the maximum independently (the
    profile likelihood of Tipping and Bishop through ``tests.helpers``) and checks that
    training moved the model towards it."""
    match = re.search(
        r"exact log p\(x\) per observation: (\S+) before training, (\S+) after; .* "
        r"reaches (\S+)",
        stdout,
    )
    assert match, stdout
    start, trained, maximum = (float(v) for v in match.groups())
    example = _load_example()
    args = example.build_parser().parse_args(ARGV)
    with torch.random.fork_rng():
        data = example.make_data(args).double()
    assert maximum == pytest.approx(float(ppca_max_likelihood_lml(data, args.latent_dim)), abs=1e-4)
    assert start < trained <= maximum
    assert abs(maximum - trained) < abs(maximum - start)
    assert re.search(r"MPT loss on the whole data set: \S+ before training, \S+ after", stdout)


def test_pyro_recipe_with_mpt_loss_runs_and_steps_as_the_whole_batch(tmp_path, monkeypatch):
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
    # Before a guide without gradients was handled, DDP stopped here at the second step.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_printed_figures(done.stdout)
    ranks = [torch.load(dump / f"rank{r}.pt") for r in range(2)]
    assert [d["world_size"] for d in ranks] == [2, 2]
    assert [d["steps"] for d in ranks] == [3, 3]

    example = _load_example()
    args = example.build_parser().parse_args(ARGV)
    assert torch.get_default_dtype() == torch.float64  # as in the run (--dtype=float64)
    # Lightning's sampler gave the two processes the two halves of the data set.
    data = example.make_data(args)
    seen = torch.cat([d["x"] for d in ranks])
    assert seen.shape == data.shape
    assert torch.equal(seen[seen[:, 0].argsort()], data[data[:, 0].argsort()])

    shards = [d["x"] for d in ranks]
    shard_losses, initial, grad = _reference(example, args, shards, [0, 1], monkeypatch)
    for d in ranks:
        assert _close(d["params_before"], initial)
    # Each process's loss is minus num_data times its rows' mean estimate, with its masks.
    losses = torch.stack([d["loss"] for d in ranks])
    assert torch.allclose(losses, shard_losses, rtol=1e-12, atol=0.0)
    guide_names = [name for name in ranks[0]["grads"] if name.startswith("guide.")]
    assert len(guide_names) == 2  # AutoNormal's locs and scales of z
    for d in ranks:
        # DDP's averaged gradient is the gradient of the whole batch's mean ...
        assert _close(d["grads"], grad)
        # ... and the unused guide's parameters got exactly zero.
        for name in guide_names:
            assert torch.equal(d["grads"][name], torch.zeros_like(d["grads"][name]))
    # One SGD step of the reference gives the same parameters; the guide's stay as they were.
    expected = {k: initial[k] - args.learning_rate * grad[k] for k in initial}
    for d in ranks:
        assert _close(d["params_after"], expected)
        for name in guide_names:
            assert torch.equal(d["params_after"][name], d["params_before"][name])
    # The comparison sees the masks: with the processes' masks swapped the gradient differs.
    _, _, swapped = _reference(example, args, shards, [1, 0], monkeypatch)
    assert not _close(ranks[0]["grads"], swapped)
