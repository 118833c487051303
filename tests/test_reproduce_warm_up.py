"""The reproductions warm each objective up on a throwaway model before timing it; the
warm-up must leave the random state, and so every measured figure, as it was."""

import random

import numpy as np
import pyro
import pytest
import torch

from experiments import _common as common
from experiments import vae_linear


def test_preserved_rng_restores_torch_numpy_and_python_states():
    common.seed_everything(5)
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    common.seed_everything(5)
    with common.preserved_rng():
        torch.rand(100), np.random.rand(7), random.random()
    got = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


class _Bar:
    def update(self, n=1):
        pass


@pytest.mark.parametrize("rate", [None, "uniform"], ids=["ELBO", "MPT uniform"])
def test_vae_linear_warm_up_leaves_the_training_curves_unchanged(rate, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x = (torch.rand(30, 784, generator=generator) < 0.3).double()
    cfg = dict(K=2, batch=10, lr=0.05, epochs=2)
    calls = []
    warm_up = vae_linear._warm_up
    # As in vae_linear's measure: parameters live in the modules, not in the param store.
    with pyro.settings.context(module_local_params=True):
        monkeypatch.setattr(vae_linear, "_warm_up", lambda *a: calls.append(a) or warm_up(*a))
        _, warmed = vae_linear._train(x[:20], x[:20], x[20:], cfg, rate, 3, _Bar())
        assert len(calls) == 1
        monkeypatch.setattr(vae_linear, "_warm_up", lambda *a: None)
        _, cold = vae_linear._train(x[:20], x[:20], x[20:], cfg, rate, 3, _Bar())
    for key in ("objective", "log_marginal_train", "log_marginal_held_out"):
        assert warmed[key] == cold[key]
