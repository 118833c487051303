"""Test configuration: float64, a device chosen by ``PYRO_MPT_TEST_DEVICE``
(``cpu`` unless set, e.g. ``PYRO_MPT_TEST_DEVICE=cuda``), and a fresh seed and param store
for every test."""

import os

import pyro
import pytest
import torch

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")

torch.set_default_dtype(torch.float64)
# The suite runs in parallel workers (pytest -n 2); one thread each avoids oversubscribing
# the cores, which slows small batched linear algebra by orders of magnitude.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)


@pytest.fixture(autouse=True)
def _seed_and_clear():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    yield
    pyro.clear_param_store()
