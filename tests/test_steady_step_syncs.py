"""A steady SVI step reads nothing back from the device, reads the model once, and leaves
the random state alone where it promises to.

Host reads are counted by :func:`experiments.zoo.host_reads.host_reads` (the tensor methods
that copy values to the host, ``torch.equal``, ``torch.allclose`` and boolean indexing,
called from ``pyro_mpt`` code); its CPU-only branches are not counted for CPU tensors (the
meta-device tests below show the other branch reads nothing).
"""

import collections
import math
import os
import random
import traceback
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch.distributions import constraints

from experiments.zoo.host_reads import host_reads
from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import ImportanceSampling, Quadrature
from pyro_mpt.conditionals.exact import _probe_points
from pyro_mpt.conditionals.quadrature import _is_binary
from pyro_mpt.models import VAE
from pyro_mpt.ops.bernoulli import log_sigmoid
from pyro_mpt.ops.masks import _unique_key_masks, masked_sum, masks_of_sizes
from pyro_mpt.trace.data_reads import check_data_not_read
from pyro_mpt.trace.trace_utils import RandomState, check_points, same_random_state
from tests.helpers import CountedCalls

#: ``loss_and_grads`` returns the loss as a float, as ``Trace_ELBO``'s does: one read, with
#: the check that the conditionals left on the device where they left one.
PYRO_CONVENTION = {("loss.py", "MPTLoss._read", "item"), ("loss.py", "MPTLoss._read", "tolist")}
#: Reads that remain, by case (none). Listed so that a case can name one that must go.
REMAINING = {
    "linear-gaussian auto": {},
    "vae importance": {},
    "bernoulli quadrature": {},
}


def _linear_gaussian(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    noise = pyro.param("noise", lambda: torch.tensor(0.5), constraint=constraints.positive)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ weight.T, noise).to_event(1), obs=x)


def _no_guide(x):
    pass


def _bernoulli_decoder(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=z @ weight.T).to_event(1), obs=x)


def _case(name):
    """``(model, guide, loss, data)`` of a small model."""
    if name == "linear-gaussian auto":
        data = torch.randn(64, 2) @ torch.randn(2, 6) + 0.5 * torch.randn(64, 6)
        return CountedCalls(_linear_gaussian), _no_guide, MPTLoss(conditionals="auto"), data
    if name == "bernoulli quadrature":
        data = torch.bernoulli(torch.full((64, 10), 0.3))
        loss = MPTLoss(conditionals=Quadrature(8))
        return CountedCalls(_bernoulli_decoder), _no_guide, loss, data
    vae = VAE(10, latent_dim=8, hidden_dim=16)
    data = torch.bernoulli(torch.full((64, 10), 0.3))
    return CountedCalls(vae.model), vae.guide, MPTLoss(conditionals=ImportanceSampling(8)), data


def _steady_step(name):
    """Runs three steps on mini-batches of the case with validation off, and a fourth while
    host reads are counted: ``(reads, model runs of the fourth step, loss)``."""
    model, guide, loss, data = _case(name)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    pyro.enable_validation(False)
    try:
        for _ in range(3):
            svi.step(data[torch.randint(64, (16,))])
        model.calls = 0
        with host_reads() as counted:
            svi.step(data[torch.randint(64, (16,))])
    finally:
        pyro.enable_validation(True)
    reads = collections.Counter()
    for (file, function, what, _), count in counted.items():
        reads[(file, function, what)] += count
    return reads, model.calls, loss


@pytest.mark.parametrize("name", ["linear-gaussian auto", "vae importance", "bernoulli quadrature"])
def test_steady_step_reads_nothing_back(name):
    reads, _, loss = _steady_step(name)
    if name == "linear-gaussian auto":
        assert type(loss.conditionals.chosen).__name__ == "Exact"
    unexpected = {key: n for key, n in reads.items() if key not in PYRO_CONVENTION}
    assert unexpected == REMAINING[name]
    assert sum(n for key, n in reads.items() if key in PYRO_CONVENTION) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["linear-gaussian auto", "vae importance", "bernoulli quadrature"])
def test_steady_step_on_cuda_does_not_synchronize(name):
    # CUDA's own sync debugging warns at every operation that waits on the device. Counted:
    # those whose nearest caller outside torch is pyro_mpt (a user's model may wait, e.g.
    # on a Python float turned into a device tensor). Forward and backward pass of the
    # steady step, with validation off as above.
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        callers = [
            f
            for f in stack
            if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.endswith("warnings.py")
        ]
        if f"{os.sep}pyro_mpt{os.sep}" in callers[-1].filename:
            frames = " <- ".join(f"{f.filename.split(os.sep)[-1]}:{f.lineno}" for f in stack[-8:])
            found.append(frames)

    with torch.device("cuda"):
        model, guide, loss, data = _case(name)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
        for _ in range(3):
            svi.step(data[torch.randint(64, (16,))])
        batch = data[torch.randint(64, (16,))]
        pyro.enable_validation(False)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                loss.differentiable_loss(model, guide, batch).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            pyro.enable_validation(True)
    assert found == []


def test_steady_importance_step_runs_the_model_once():
    # Once against the guide's samples: no structure read, no parameter trace.
    _, runs, _ = _steady_step("vae importance")
    assert runs == 1


def test_masks_off_the_cpu_read_nothing_back():
    # Any read of a meta tensor raises; the CPU-only branches are not taken.
    sizes = torch.tensor([[0, 1, 3, 5]], device="meta")
    masks = masks_of_sizes(sizes, 5)
    assert masks.shape == (1, 4, 5) and masks.device.type == "meta"
    assert masked_sum(torch.empty(2, 1, 4, 5, device="meta"), masks).shape == (2, 1, 4)


def test_binary_data_off_the_cpu_are_taken_from_the_support():
    # Any read of a meta tensor raises: off the CPU, a Bernoulli's data are not read, while
    # on the CPU grey values are found.
    ones = torch.empty(4, 3, device="meta")
    assert _is_binary(ones, dist.Bernoulli(logits=ones, validate_args=False))
    grey = torch.tensor([[0.0, 0.5, 1.0]])
    assert not _is_binary(grey, dist.Bernoulli(logits=torch.zeros(3), validate_args=False))
    assert _is_binary(grey.round(), dist.Bernoulli(logits=torch.zeros(3), validate_args=False))


def test_log_sigmoid_off_the_cpu_reads_nothing_back():
    # Any read of a meta tensor raises: off the CPU, logsigmoid with no test of the logits.
    values, probs = log_sigmoid(torch.empty(3, 4, device="meta"))
    assert values.shape == probs.shape == (3, 4) and values.device.type == "meta"


def test_unique_key_masks_are_uniform_with_exact_sizes():
    # Against the count of masks of each size: C(4, 2) = 6 equally likely masks.
    num_draws = 6000
    sizes = torch.full((num_draws,), 2)
    masks = _unique_key_masks(sizes, 4)
    assert torch.equal(masks.sum(-1), sizes)
    codes = (masks.long() * torch.tensor([1, 2, 4, 8])).sum(-1)
    counts = torch.bincount(codes, minlength=16)
    observed = counts[counts > 0]
    assert len(observed) == 6
    se = math.sqrt(num_draws * (1 / 6) * (5 / 6))
    assert ((observed - num_draws / 6).abs() < 4 * se).all()
    empty = _unique_key_masks(torch.tensor([0, 4]), 4)
    assert empty.sum(-1).tolist() == [0, 4]


def test_steady_importance_estimate_is_that_of_a_fresh_read():
    # A later call with new data of the same shape reuses the structure: its estimate
    # equals that of a strategy that reads the model afresh, from the same seed.
    vae = VAE(10, latent_dim=3, hidden_dim=8)
    first, second = (torch.bernoulli(torch.full((16, 10), p)) for p in (0.3, 0.6))
    remembered = MPTLoss(conditionals=ImportanceSampling(4), num_masks=2)
    remembered.estimate(vae.model, vae.guide, first)
    pyro.set_rng_seed(5)
    reused = remembered.estimate(vae.model, vae.guide, second)
    pyro.set_rng_seed(5)
    fresh = MPTLoss(conditionals=ImportanceSampling(4), num_masks=2).estimate(
        vae.model, vae.guide, second
    )
    assert torch.equal(reused, fresh)


def test_steady_importance_step_checks_data_under_validation():
    vae = VAE(10, latent_dim=3, hidden_dim=8)
    loss = MPTLoss(conditionals=ImportanceSampling(4))
    loss.estimate(vae.model, vae.guide, torch.bernoulli(torch.full((16, 10), 0.3)))
    bad = torch.bernoulli(torch.full((16, 10), 0.3))
    bad[2, 3] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        loss.estimate(vae.model, vae.guide, bad)


def test_same_random_state_restores_the_cpu_generator():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with same_random_state():
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)
    torch.manual_seed(3)
    state = RandomState()
    torch.rand(7)
    state.restore()
    assert torch.equal(torch.rand(4), expected)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError), same_random_state():
        torch.rand(5)
        raise RuntimeError("restored on the way out too")
    assert torch.equal(torch.rand(4), expected)


def test_same_random_state_restores_python_and_numpy_generators():
    # A model may draw from them too (pyro.set_rng_seed seeds all three).
    pyro.set_rng_seed(5)
    expected = (random.random(), np.random.rand())
    pyro.set_rng_seed(5)
    with same_random_state():
        random.random(), np.random.rand(3)
    assert (random.random(), np.random.rand()) == expected


def test_data_read_check_leaves_numpy_draws_of_the_model_unchanged():
    def model(x):
        np.random.rand()  # e.g. a numpy-drawn augmentation the density does not use
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0).expand([3]).to_event(1), obs=x)

    pyro.set_rng_seed(6)
    expected = np.random.rand()
    pyro.set_rng_seed(6)
    check_data_not_read(model, (torch.randn(4, 3),), {}, "a fixed rate")
    assert np.random.rand() == expected


def test_check_points_under_another_default_device():
    # The fixed check points come from a CPU generator; under another default device (meta
    # here, cuda for users who set it) they are the same points.
    expected = check_points(4, 3)
    probes = _probe_points(3, torch.float64, torch.device("cpu"))
    with torch.device("meta"):
        points = check_points(4, 3)
        assert torch.equal(_probe_points(3, torch.float64, torch.device("cpu")), probes)
    assert points.device.type == "cpu" and torch.equal(points, expected)
    generator = torch.Generator(device="cpu").manual_seed(0)
    assert torch.equal(expected, torch.randn(4, 3, generator=generator))
