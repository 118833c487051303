"""One model run per call after the first: the same conditionals and gradients as two runs,
and the two-run path wherever the model's structure changes."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.infer.probe_cache import ProbeCache
from pyro_mpt.models import PPCA, LinearVAE
from pyro_mpt.ops.masks import masks_of_sizes


@pytest.fixture
def fused_runs(monkeypatch):
    """Records the outcome of every one-run call: True (used) or False (discarded)."""
    outcomes = []
    run = ProbeCache.run

    def spy(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        outcomes.append(result is not None)
        return result

    monkeypatch.setattr(ProbeCache, "run", spy)
    return outcomes


def _conditionals_and_grads(strategy, model, x, masks):
    params = [p.unconstrained() for p in pyro.get_param_store().values()]
    prepared = strategy.prepare(model, None, (x,), {})
    values = prepared.log_prob(masks)
    grads = torch.autograd.grad(values.sum(), params, allow_unused=True)
    return values, [g for g in grads if g is not None]


@pytest.mark.parametrize("likelihood", ["bernoulli", "normal"])
def test_one_run_matches_two_runs(likelihood, fused_runs):
    pyro.clear_param_store()
    torch.manual_seed(0)
    vae = LinearVAE(12, latent_dim=2, likelihood=likelihood, init_scale=1.0)
    data = vae.sample(60)
    masks = masks_of_sizes(torch.randint(1, 12, (1, 30)), 12)
    cached = Quadrature(num_points=6)
    cached.prepare(vae.model, None, (data[:30],), {})  # the first call: two runs
    assert fused_runs == []
    values, grads = _conditionals_and_grads(cached, vae.model, data[30:], masks)
    assert fused_runs == [True]
    fresh_values, fresh_grads = _conditionals_and_grads(
        Quadrature(num_points=6), vae.model, data[30:], masks
    )
    torch.testing.assert_close(values, fresh_values, rtol=0, atol=0)
    assert len(grads) == len(fresh_grads) > 0
    for grad, fresh in zip(grads, fresh_grads):
        torch.testing.assert_close(grad, fresh, rtol=0, atol=0)


def _switching_model(x):
    """A second latent appears when the data sum is odd: the structure changes between
    calls with arguments of the same shape."""
    weight = torch.linspace(-1, 1, 2 * x.shape[-1]).reshape(2, -1)
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
        if int(x.sum()) % 2:
            w = pyro.sample("w", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            z = torch.cat([z, w], -1)
        else:
            z = torch.cat([z, z], -1)
        pyro.sample("x", dist.Bernoulli(logits=z @ weight).to_event(1), obs=x)


def test_a_changed_structure_takes_the_two_run_path(fused_runs):
    even = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    odd = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    masks = torch.tensor([[[True, False, False], [False, True, True]]])
    cached = Quadrature(num_points=5)
    cached.prepare(_switching_model, None, (even,), {})
    values = cached.prepare(_switching_model, None, (odd,), {}).log_prob(masks)
    assert fused_runs == [False]
    expected = Quadrature(num_points=5).prepare(_switching_model, None, (odd,), {})
    torch.testing.assert_close(values, expected.log_prob(masks), rtol=0, atol=0)
    # The structure of the odd call is remembered in turn.
    cached.prepare(_switching_model, None, (odd,), {})
    assert fused_runs == [False, True]


def test_nan_data_on_a_later_call_still_raise(fused_runs):
    pyro.clear_param_store()
    vae = LinearVAE(5, latent_dim=1)
    strategy = Quadrature(num_points=4)
    x = torch.bernoulli(torch.full((8, 5), 0.5))
    strategy.prepare(vae.model, None, (x,), {})
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match="contains 1 NaN values"):
        strategy.prepare(vae.model, None, (x,), {})
    assert fused_runs == [False]


def test_other_shapes_take_the_two_run_path(fused_runs):
    pyro.clear_param_store()
    vae = LinearVAE(5, latent_dim=1)
    strategy = Quadrature(num_points=4)
    strategy.prepare(vae.model, None, (torch.zeros(8, 5),), {})
    strategy.prepare(vae.model, None, (torch.zeros(6, 5),), {})
    assert fused_runs == []
    strategy.prepare(vae.model, None, (torch.ones(6, 5),), {})
    assert fused_runs == [True]


@pytest.mark.parametrize("subsample_size", [None, 16])
def test_exact_conditionals_in_one_run_match_two_runs(subsample_size, fused_runs):
    pyro.clear_param_store()
    torch.manual_seed(0)
    ppca = PPCA(num_features=7, latent_dim=2, subsample_size=subsample_size)
    x = torch.randn(40, 7)
    masks = masks_of_sizes(torch.randint(1, 7, (1, 40 if subsample_size is None else 16)), 7)
    cached = Exact()
    cached.prepare(ppca.model, None, (x,), {})
    torch.manual_seed(1)  # the same subsample in both calls below
    values, grads = _conditionals_and_grads(cached, ppca.model, x, masks)
    assert fused_runs == [True]
    torch.manual_seed(1)
    fresh_values, fresh_grads = _conditionals_and_grads(Exact(), ppca.model, x, masks)
    torch.testing.assert_close(values, fresh_values, rtol=0, atol=0)
    assert len(grads) == len(fresh_grads) > 0
    for grad, fresh in zip(grads, fresh_grads):
        torch.testing.assert_close(grad, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("conditionals", ["auto", "quadrature", "exact"])
def test_seeded_calls_repeat_whether_or_not_the_structure_is_remembered(conditionals):
    # The first call runs the model twice (and "auto" tries strategies that do not apply);
    # later calls run it once. A seeded call must draw the same masks either way.
    pyro.clear_param_store()
    likelihood = "normal" if conditionals == "exact" else "bernoulli"
    vae = LinearVAE(6, latent_dim=2, likelihood=likelihood)
    x = torch.bernoulli(torch.full((10, 6), 0.5))
    loss = MPTLoss(conditionals=conditionals)
    values = []
    for _ in range(3):
        pyro.set_rng_seed(3)
        values.append(loss.loss(vae.model, vae.guide, x))
    assert values[0] == values[1] == values[2]
