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


def _ar_reads(transform):
    """The AR model with the data reached through ``transform(x)`` (what the model
    observes and reads)."""

    def model(x):
        y = transform(x)
        previous = torch.cat([torch.zeros_like(y[..., :1]), y[..., :-1]], -1)
        with pyro.plate("data", y.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) + A * previous, NOISE).to_event(1), obs=y)

    return model


@pytest.mark.parametrize(
    "transform, hole",
    [
        (lambda x: x / 10, 0.0),
        (lambda x: x.double(), 0.0),
        (lambda x: x.nan_to_num(), float("nan")),
        (lambda x: x.detach(), 0.0),
    ],
    ids=["scaled", "cast", "nan_to_num", "detached"],
)
def test_a_read_of_data_the_model_transforms_before_observing_is_found(transform, hole):
    # The observed value is no longer the argument itself: the argument is found to be the
    # data because the observed values are computed from it (or, through detach, by values).
    x = _ar_data(12).float()
    x[2, 1] = hole
    assert data_read_by(_ar_reads(transform), (x,), {}) == ("x", 0)
    with pytest.raises(ValueError, match="site 'x' changes when the data"):
        impute(_ar_reads(transform), x, missing=torch.arange(T) == 1, num_samples=2)


def test_a_read_of_data_passed_inside_a_dict_is_found():
    def model(batch):
        _ar_model(batch["x"])

    assert data_read_by(model, ({"x": _ar_data(10)},), {}) == ("x", 0)


@pytest.mark.parametrize("num", [1, 20])
def test_a_statistic_that_no_permutation_of_the_data_moves_is_found(num):
    # A batch mean (and, for one observation, its row mean) is the same for any shuffle of
    # the data: the check follows the computation, not a shuffle.
    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.unsqueeze(-1) + A * x.mean()
            pyro.sample("x", dist.Normal(loc.expand(x.shape), NOISE).to_event(1), obs=x)

    assert data_read_by(model, (_ar_data(num),), {}) == ("x", 0)


def test_a_factor_on_the_data_that_couples_features_is_found():
    # exp(-K (x_1 - x_0)^2) multiplies the likelihood: the conditionals of x_0 and x_1 read
    # each other's values through it, which the latent's integral alone does not see.
    def model(x):
        _linear_model(x)
        pyro.factor("smooth", -2.0 * (x[..., 1] - x[..., 0]).pow(2))

    assert data_read_by(model, (torch.randn(8, T),), {}) == ("smooth", 0)


def test_an_encoder_of_the_data_inside_the_model_is_found():
    from pyro_mpt.models import GPDecoder

    pyro.clear_param_store()
    y = torch.randn(10, 3)
    encoder = torch.nn.Linear(3, 2)
    decoder = GPDecoder(num_data=10, num_outputs=3, latent_dim=2, encoder=encoder)
    assert data_read_by(decoder.model, (y,), {}) == ("y", 0)
    free = GPDecoder(num_data=10, num_outputs=3, latent_dim=2)
    assert data_read_by(free.model, (y,), {}) is None


def test_a_covariate_equal_to_the_data_is_not_taken_for_it():
    # The model reads c, observes x: equal values, but the observed values are not computed
    # from c, so reading it is reading a covariate.
    def model(x, c):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) + 0.5 * c, NOISE).to_event(1), obs=x)

    x = torch.randn(12, T)
    assert data_read_by(model, (x, x.clone()), {}) is None
    assert data_read_by(model, (x, x), {}) is None


def test_a_call_with_nothing_to_compare_does_not_exempt_later_ones():
    # Integer counts are compared by values only; a first batch of constant counts has no
    # other value to put in, so no verdict is kept, and the next batch is checked.
    def model(x):
        previous = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
        with pyro.plate("data", x.shape[-2]):
            rate = pyro.sample("rate", dist.LogNormal(0.0, 1.0))
            fn = dist.Poisson(rate.unsqueeze(-1) + 0.5 * previous.float())
            pyro.sample("x", fn.to_event(1), obs=x)

    constant = torch.ones(6, T, dtype=torch.long)
    varied = torch.randint(0, 5, (6, T))
    missing = torch.arange(T) == 1
    impute(model, constant, missing=missing, num_samples=2)
    with pytest.raises(ValueError, match="site 'x' changes when the data"):
        impute(model, varied, missing=missing, num_samples=2)


def test_a_covariate_column_beside_the_data_in_one_tensor_is_not_taken_for_it():
    # The first column is a covariate that the likelihood reads, the others are observed:
    # only the entries that the observed values are computed from count as the data.
    def model(xc, lag=0.0):
        c, x = xc[..., :1], xc[..., 1:]
        previous = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
        with pyro.plate("data", xc.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.unsqueeze(-1) + 0.5 * c + lag * previous
            pyro.sample("x", dist.Normal(loc, NOISE).to_event(1), obs=x)

    xc = torch.randn(12, T + 1)
    assert data_read_by(model, (xc,), {}) is None
    assert data_read_by(model, (xc,), {"lag": A}) == ("x", 0)


def test_a_read_under_inference_mode_is_found():
    x = _ar_data(12)
    with torch.inference_mode():
        assert data_read_by(_ar_reads(lambda x: x / 10), (x,), {}) == ("x", 0)


def test_integer_counts_observed_as_floats_are_found_by_values():
    def model(counts):
        x = counts.float()
        previous = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
        with pyro.plate("data", x.shape[-2]):
            rate = pyro.sample("rate", dist.LogNormal(0.0, 1.0))
            pyro.sample("x", dist.Poisson(rate.unsqueeze(-1) + 0.5 * previous).to_event(1), obs=x)

    assert data_read_by(model, (torch.randint(0, 5, (10, T)),), {}) == ("x", 0)


def test_a_tuple_subclass_argument_is_checked_and_a_failed_check_is_not_remembered():
    class Batch(tuple):
        def __new__(cls, x, c):
            return super().__new__(cls, (x, c))

    def model(batch):
        x, c = batch
        _ar_model(x + 0.0 * c)

    batch = Batch(_ar_data(10), torch.zeros(10, T))
    for _ in range(2):  # the second call is checked again, not exempted by the first
        with pytest.raises(ValueError, match="site 'x' changes when the data"):
            impute(model, batch, missing=torch.arange(T) == 1, num_samples=2)


def test_the_check_leaves_the_callers_data_as_it_was():
    def model(x):
        x.mul_(0.5)  # a model that writes into its data
        _linear_model(x)

    x = torch.randn(8, T)
    before = x.clone()
    assert data_read_by(model, (x,), {}) is None
    assert torch.equal(x, before)
