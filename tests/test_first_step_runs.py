"""How many times the first SVI step runs a model: five for exact and quadrature
conditionals when the guide draws nothing and the priors are shared by every observation
(docs/performance.rst, "The first step"), and the checks folded into those runs still
refuse the models they are there to refuse."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _linear_gaussian(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x)


def _bernoulli(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=3 * torch.tanh(z @ weight.T)).to_event(1), obs=x)


def _no_guide(*args):
    pass


def _first_step_runs(model, data, conditionals, guide=_no_guide):
    pyro.clear_param_store()
    counted = _Counted(model)
    guide = AutoNormal(counted) if guide is AutoNormal else guide
    svi = SVI(
        counted, guide, pyro.optim.Adam({"lr": 0.01}), loss=MPTLoss(conditionals=conditionals)
    )
    svi.step(data)
    first = counted.calls
    counted.calls = 0
    svi.step(data)
    return first, counted.calls


@pytest.mark.parametrize(
    "model, data, conditionals",
    [
        (_linear_gaussian, torch.randn(32, 6), Exact()),
        (_linear_gaussian, torch.randn(32, 6), "auto"),
        (_bernoulli, torch.bernoulli(torch.full((32, 8), 0.3)), Quadrature(8)),
    ],
)
def test_a_first_step_runs_the_model_five_times(model, data, conditionals):
    torch.manual_seed(0)
    first, steady = _first_step_runs(model, data, conditionals)
    assert first == 5
    assert steady == 1


def test_a_guide_that_draws_latents_adds_one_run():
    torch.manual_seed(0)
    first, steady = _first_step_runs(_linear_gaussian, torch.randn(32, 6), Exact(), AutoNormal)
    # One more for the model against the guide's draws, and one that AutoNormal makes itself
    # to build its sites.
    assert first == 5 + 1 + 1
    assert steady == 1


def test_a_prior_that_differs_between_observations_adds_one_run():
    def model(x, c):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(c, 1.0).to_event(1))
            loc = z.sum(-1, keepdim=True).expand(z.shape[:-1] + x.shape[-1:])
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    torch.manual_seed(0)
    x, c = torch.randn(16, 3), torch.randn(16, 2)
    pyro.clear_param_store()
    counted = _Counted(model)
    svi = SVI(counted, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=MPTLoss(conditionals=Exact()))
    svi.step(x, c)
    assert counted.calls == 6


def _dropout_model(x):
    layer = torch.nn.Dropout(0.5)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        loc = layer(z).sum(-1, keepdim=True).expand(z.shape[:-1] + x.shape[-1:])
        pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)


@pytest.mark.parametrize("seed", [0, 1])
def test_dropout_is_refused_whatever_the_callers_seed(seed):
    # The plain run draws from the caller's random state, the vectorised run from one
    # draw further on: their dropout masks differ whatever the caller seeded.
    pyro.clear_param_store()
    x = torch.randn(16, 4)
    torch.manual_seed(seed)
    loss = MPTLoss(conditionals=Quadrature(8))
    with pytest.raises(ValueError, match=r"same latent values.*dropout"):
        loss.differentiable_loss(_dropout_model, _no_guide, x)
