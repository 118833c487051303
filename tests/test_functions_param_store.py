"""The package's functions leave Pyro's param store as they found it, as ``log_marginal``
does: a guide whose parameters are sized by the data it is called with would otherwise
leave parameters of that size behind, and the user's next ``Trace_ELBO`` step on other
data would fail on their shape."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_mpt import gibbs, impute, log_marginal, mpt_curve
from pyro_mpt.conditionals import ImportanceSampling

WEIGHT = torch.tensor([0.5, -1.0, 1.5, 0.3])


def _model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0), 1.0))
        pyro.sample("x", dist.Normal(z.unsqueeze(-1) * WEIGHT, 0.5).to_event(1), obs=x)


def _guide_sized_by_x(x):
    loc = pyro.param("q_loc", lambda: torch.zeros(x.shape[-2]))
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(loc, 1.0))


CALLS = {
    "log_marginal": lambda x: log_marginal(
        _model, x, guide=_guide_sized_by_x, conditionals=ImportanceSampling(16)
    ),
    "impute": lambda x: impute(
        _model,
        x,
        missing=torch.arange(x.shape[-1]) == 0,  # the first feature of every observation
        guide=_guide_sized_by_x,
        conditionals=ImportanceSampling(16),
        num_samples=2,
    ),
    "gibbs": lambda x: gibbs(
        _model,
        x,
        block_size=1,
        num_steps=2,
        guide=_guide_sized_by_x,
        conditionals=ImportanceSampling(16),
        progress=False,
    ),
    "mpt_curve": lambda x: mpt_curve(
        _model, x, guide=_guide_sized_by_x, conditionals=ImportanceSampling(16), num_masks=1
    ),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_function_leaves_the_param_store_as_it_found_it(name):
    pyro.param("kept", torch.tensor(2.0))
    kept = pyro.param("kept")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guide is a poor proposal; not the point here
        CALLS[name](torch.randn(10, 4))
    store = pyro.get_param_store()
    assert set(store.keys()) == {"kept"}
    assert pyro.param("kept") is kept  # existing parameters keep their very tensors
    # So training on data of another size goes on: the guide creates its parameter anew.
    svi = SVI(_model, _guide_sized_by_x, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    svi.step(torch.randn(7, 4))
    assert pyro.param("q_loc").shape == (7,)
