"""Models whose distributions read the data they observe (an autoregressive term): the
conditionals of masked inputs would take each masked entry's own value as known, so the
functions made of them refuse such a model, while the chain-rule totals stay exact."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss, gibbs, impute, log_marginal, mpt_curve
from pyro_mpt.trace.data_reads import data_read_by

T, A, NOISE = 4, 0.8, 0.5


def _ar_model(x):
    """x_t = z + a x_{t-1} + eps_t (x_0 := 0), written with the previous step read off x."""
    previous = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z.unsqueeze(-1) + A * previous, NOISE).to_event(1), obs=x)


def _ar_covariance():
    """The joint covariance of the AR model's x: x = B^-1 (z 1 + eps)."""
    inverse = torch.linalg.inv(torch.eye(T) - A * torch.diag(torch.ones(T - 1), -1))
    return inverse @ (torch.ones(T, T) + NOISE**2 * torch.eye(T)) @ inverse.T


def _ar_data(num):
    return dist.MultivariateNormal(torch.zeros(T), _ar_covariance()).sample((num,))


def _linear_model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        loc = z.unsqueeze(-1) * torch.linspace(0.5, 1.5, x.shape[-1])
        pyro.sample("x", dist.Normal(loc, NOISE).to_event(1), obs=x)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: impute(_ar_model, x, missing=torch.arange(T) == 1),
        lambda x: gibbs(_ar_model, x, block_size=1, num_steps=1, progress=False),
        lambda x: mpt_curve(_ar_model, x, num_masks=2),
        lambda x: MPTLoss(rate=0.15).loss(_ar_model, None, x),
        lambda x: MPTLoss(rate=(0.1, 0.5)).loss(_ar_model, None, x),
    ],
    ids=["impute", "gibbs", "mpt_curve", "fixed-rate", "rate-range"],
)
def test_functions_of_masked_conditionals_refuse_a_likelihood_that_reads_the_data(call):
    x = _ar_data(20)
    with pytest.raises(ValueError, match=r"site 'x' changes when the data.*positional argument 0"):
        call(x)


def test_chain_rule_totals_of_such_a_model_stay_exact():
    # Its conditionals treat the lagged values as covariates: those of another joint, equal
    # to p(x) at the data, so log p(x) and the uniform-rate average over every mask are
    # the closed form's.
    x = _ar_data(30)
    exact = dist.MultivariateNormal(torch.zeros(T), _ar_covariance()).log_prob(x)
    assert torch.allclose(log_marginal(_ar_model, x), exact, atol=1e-8)
    loss = MPTLoss(num_masks="all").loss(_ar_model, None, x)
    assert loss == pytest.approx(-exact.sum().item(), abs=1e-6)


def test_a_prior_that_reads_the_data_is_named():
    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.mean(-1), 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1), NOISE).to_event(1), obs=x)

    assert data_read_by(model, (torch.randn(10, 3),), {}) == ("z", 0)


def test_data_read_through_a_keyword_is_named():
    def model(covariate=None, x=None):
        previous = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.unsqueeze(-1) + A * previous + covariate
            pyro.sample("x", dist.Normal(loc, NOISE).to_event(1), obs=x)

    found = data_read_by(model, (), {"covariate": torch.randn(10, T), "x": _ar_data(10)})
    assert found == ("x", "x")


@pytest.mark.parametrize("kind", ["plain", "covariate", "mask from data", "dropout"])
def test_models_that_only_observe_the_data_pass(kind):
    x = torch.randn(12, 5)
    if kind == "plain":
        model, args = _linear_model, (x,)
    elif kind == "covariate":
        # A covariate of the same shape, read by the likelihood: not the observed data.
        def model(x, c):
            with pyro.plate("data", x.shape[-2]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
                pyro.sample("x", dist.Normal(z.unsqueeze(-1) + c, NOISE).to_event(1), obs=x)

        args = (x, torch.randn(12, 5))
    elif kind == "mask from data":
        # Which entries count is computed from the data (0 marks a missing one): the mask
        # moves when the data are shuffled, the density does not.
        x[torch.rand(12, 5) < 0.3] = 0.0

        def model(x):
            with pyro.plate("data", x.shape[-2]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
                fn = dist.Normal(z.unsqueeze(-1).expand(x.shape), NOISE)
                pyro.sample("x", fn.mask(x != 0).to_event(1), obs=x)

        args = (x,)
    else:
        # Dropout draws inside the model: both runs start from the same random state.
        layer = torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Dropout(0.5)).train()

        def model(x):
            with pyro.plate("data", x.shape[-2]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
                pyro.sample("x", dist.Normal(layer(z.unsqueeze(-1)), NOISE).to_event(1), obs=x)

        args = (x,)
    state = torch.get_rng_state()
    assert data_read_by(model, args, {}) is None
    assert torch.equal(torch.get_rng_state(), state)


def test_the_autoregressive_model_is_found_in_float32():
    x = _ar_data(8).float()
    assert data_read_by(_ar_model, (x,), {}) == ("x", 0)
