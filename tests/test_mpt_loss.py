"""MPTLoss against exact references: the LML, enumeration of masks, gradients."""

import math
import os

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.models import PPCA, FactorAnalysis
from tests.helpers import all_masks, ppca_max_likelihood_lml


def _ppca_data(num_obs=40, num_features=6, latent_dim=2, cls=PPCA):
    truth = cls(num_features, latent_dim, init_scale=1.0, noise_scale=0.5)
    with torch.no_grad():
        truth.loc.copy_(torch.randn(num_features))
    return truth, truth.sample(num_obs)


def _estimates(loss, model, x, draws):
    return torch.stack([loss.estimate(model, None, x).detach() for _ in range(draws)])


def test_uniform_rate_is_unbiased_for_the_exact_lml():
    truth, x = _ppca_data()
    exact = log_marginal(truth.model, x).detach()
    draws = _estimates(MPTLoss(rate="uniform"), truth.model, x, 2000)  # (draws, N)
    mean = draws.mean(0)
    stderr = draws.std(0) / math.sqrt(draws.shape[0])
    # Per observation and in total, within 4 standard errors.
    assert ((mean - exact).abs() < 4 * stderr).float().mean() > 0.9
    total = draws.sum(1)
    assert abs(total.mean() - exact.sum()) < 4 * total.std() / math.sqrt(total.numel())


def test_uniform_rate_gradient_is_unbiased():
    truth, x = _ppca_data(num_obs=20, num_features=5)
    exact_grad = torch.autograd.grad(log_marginal(truth.model, x).sum(), truth.weight)[0]
    loss = MPTLoss(rate="uniform", num_masks=2)
    grads = []
    for _ in range(1500):
        estimate = loss.estimate(truth.model, None, x).sum()
        grads.append(torch.autograd.grad(estimate, truth.weight)[0])
    grads = torch.stack(grads)
    stderr = grads.std(0) / math.sqrt(grads.shape[0])
    # Every coordinate within 4.5 standard errors (10 coordinates).
    assert ((grads.mean(0) - exact_grad).abs() < 4.5 * stderr).all()


def test_fixed_rate_expectation_matches_enumeration_of_every_mask():
    num_features, rate = 5, 0.4  # M = 2, C(5, 2) = 10 masks
    truth, x = _ppca_data(num_obs=8, num_features=num_features)
    prepared = MPTLoss(conditionals="exact").conditionals.prepare(truth.model, None, (x,), {})
    masks = all_masks(num_features, 2).unsqueeze(1)  # (10, 1, D)
    log_p = prepared.log_prob(masks).detach()
    per_mask = torch.where(masks, log_p, 0.0).sum(-1) * num_features / 2
    expectation = per_mask.mean(0)  # exact expectation of the fixed-rate estimator
    draws = _estimates(MPTLoss(rate=rate), truth.model, x, 3000)
    stderr = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - expectation).abs() < 4.5 * stderr).all()
    # ... and that expectation is biased away from the LML.
    exact = log_marginal(truth.model, x).detach()
    assert (expectation - exact).abs().mean() > 10 * stderr.mean()


def test_p_equal_d_with_one_order_per_step_is_exact_via_enumeration_of_sizes():
    """With every mask of every size, the cumulative sum is the LML (Proposition 1)."""
    num_features = 4
    truth, x = _ppca_data(num_obs=3, num_features=num_features)
    prepared = MPTLoss().conditionals.prepare(truth.model, None, (x,), {})
    total = 0
    for size in range(1, num_features + 1):
        masks = all_masks(num_features, size).unsqueeze(1)
        log_p = prepared.log_prob(masks).detach()
        total = total + (torch.where(masks, log_p, 0.0).sum(-1) / size).mean(0)
    torch.testing.assert_close(total, log_marginal(truth.model, x).detach())


def test_loss_differentiable_loss_and_loss_and_grads_agree():
    truth, x = _ppca_data()
    loss = MPTLoss(rate=(0.1, 0.9), num_masks=3)
    pyro.set_rng_seed(5)
    value = loss.loss(truth.model, truth.guide, x)
    pyro.set_rng_seed(5)
    differentiable = loss.differentiable_loss(truth.model, truth.guide, x)
    expected_grad = torch.autograd.grad(differentiable, truth.weight)[0]
    pyro.set_rng_seed(5)
    truth.weight.grad = None
    value_and_grads = loss.loss_and_grads(truth.model, truth.guide, x)
    assert value == pytest.approx(differentiable.item(), rel=1e-12)
    assert value_and_grads == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(truth.weight.grad, expected_grad)


def test_module_form_matches_differentiable_loss():
    truth, x = _ppca_data()
    loss = MPTLoss(num_masks=2)
    module = loss(truth.model, truth.guide)
    assert isinstance(module, torch.nn.Module)
    pyro.set_rng_seed(3)
    a = module(x)
    pyro.set_rng_seed(3)
    b = loss.differentiable_loss(truth.model, truth.guide, x)
    torch.testing.assert_close(a, b)


def test_fixed_seed_gives_identical_results():
    truth, x = _ppca_data()
    loss = MPTLoss(rate="uniform", num_masks=4)
    pyro.set_rng_seed(11)
    first = loss.loss(truth.model, None, x)
    pyro.set_rng_seed(11)
    second = loss.loss(truth.model, None, x)
    assert first == second


def test_subsampling_scales_like_trace_elbo():
    truth, x = _ppca_data(num_obs=30)
    idx = torch.tensor([3, 7, 11, 20])

    def model(data):
        with pyro.plate("data", data.shape[0], subsample=idx):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            loc = z @ truth.weight.T + truth.loc
            pyro.sample("x", dist.Normal(loc, truth.noise_scale).to_event(1), obs=data[idx])

    loss = MPTLoss(num_masks=3)
    pyro.set_rng_seed(2)
    scaled = loss.differentiable_loss(model, None, x)
    pyro.set_rng_seed(2)
    unscaled = loss.estimate(truth.model, None, x[idx])
    torch.testing.assert_close(scaled, -(30 / 4) * unscaled.sum())


@pytest.mark.parametrize("cls", [PPCA, FactorAnalysis])
def test_svi_with_mpt_reaches_the_maximum_likelihood_lml(cls):
    truth, x = _ppca_data(num_obs=500, num_features=8, latent_dim=2, cls=cls)
    target = ppca_max_likelihood_lml(x, 2) if cls is PPCA else None
    model = cls(8, 2)
    svi = SVI(model.model, model.guide, pyro.optim.Adam({"lr": 0.05}), MPTLoss(num_masks=2))
    initial = log_marginal(model.model, x).mean().item()
    for _ in range(500):
        svi.step(x)
    final = log_marginal(model.model, x).mean().item()
    assert final > initial + 1.0
    if target is not None:
        assert abs(final - target.item()) < 0.01 * abs(target.item())
        assert final <= target.item() + 1e-6
    else:
        # Factor analysis has no closed-form optimum: compare with the truth's LML.
        assert final > log_marginal(truth.model, x).mean().item() - 0.01 * abs(final)


def test_noop_guide_and_trace_elbo_guide_both_work():
    truth, x = _ppca_data()

    def noop_guide(data):
        pass

    svi = SVI(truth.model, noop_guide, pyro.optim.Adam({"lr": 0.01}), MPTLoss())
    before = truth.weight.detach().clone()
    assert math.isfinite(svi.step(x))
    assert not torch.equal(before, truth.weight.detach())
    assert math.isfinite(Trace_ELBO().loss(truth.model, truth.guide, x))


def _factor_analysis_model(weight, loc, noise, latent_prior="normal"):
    def model(x):
        with pyro.plate("data", x.shape[0]):
            if latent_prior == "normal":
                z = pyro.sample("z", dist.Normal(0.5, 2.0).expand([2]).to_event(1))
            else:
                scale_tril = torch.tensor([[1.0, 0.0], [0.7, 0.4]])
                z = pyro.sample("z", dist.MultivariateNormal(torch.ones(2), scale_tril=scale_tril))
            w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            mean = z @ weight[:, :2].T + w @ weight[:, 2:].T + loc
            pyro.sample("x", dist.Normal(mean, noise).to_event(1), obs=x)

    return model


@pytest.mark.parametrize("latent_prior", ["normal", "mvn"])
def test_general_gaussian_priors_and_several_latents(latent_prior):
    weight, loc, noise = torch.randn(5, 3), torch.randn(5), torch.rand(5) + 0.3
    model = _factor_analysis_model(weight, loc, noise, latent_prior)
    if latent_prior == "normal":
        prior_mean, prior_cov = torch.full((2,), 0.5), 4.0 * torch.eye(2)
    else:
        tril = torch.tensor([[1.0, 0.0], [0.7, 0.4]])
        prior_mean, prior_cov = torch.ones(2), tril @ tril.T
    mean = weight[:, :2] @ prior_mean + loc
    cov = weight[:, :2] @ prior_cov @ weight[:, :2].T + weight[:, 2:] @ weight[:, 2:].T
    cov = cov + torch.diag(noise**2)
    x = torch.distributions.MultivariateNormal(mean, cov).sample((7,))
    expected = torch.distributions.MultivariateNormal(mean, cov).log_prob(x)
    torch.testing.assert_close(log_marginal(model, x), expected)


@pytest.mark.parametrize("kind", ["mvn", "lowrank"])
def test_observed_multivariate_normal_sites(kind):
    factor, diag, loc = torch.randn(6, 2), torch.rand(6) + 0.5, torch.randn(6)
    cov = factor @ factor.T + torch.diag(diag)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            if kind == "mvn":
                likelihood = dist.MultivariateNormal(loc, covariance_matrix=cov)
            else:
                likelihood = dist.LowRankMultivariateNormal(loc, factor, diag)
            pyro.sample("x", likelihood, obs=x)

    x = torch.distributions.MultivariateNormal(loc, cov).sample((9,))
    exact = torch.distributions.MultivariateNormal(loc, cov).log_prob(x)
    torch.testing.assert_close(log_marginal(model, x), exact)
    draws = _estimates(MPTLoss(num_masks=3), model, x, 800).sum(1)
    assert abs(draws.mean() - exact.sum()) < 4 * draws.std() / math.sqrt(draws.numel())


#: Off the CPU, the compact run's index out of range is a device-side assert that ends the
#: process instead of an IndexError (see "Your own model" in the docs).
_INDEXING_NEEDS_CPU = pytest.mark.skipif(
    os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu") != "cpu",
    reason="a per-observation index out of range is fatal on a GPU",
)


@pytest.mark.parametrize(
    "kind",
    [
        "covariates",
        pytest.param("per_observation_indexing", marks=_INDEXING_NEEDS_CPU),
        "per_obs_prior",
    ],
)
def test_per_observation_structure_is_probed_correctly(kind):
    num_obs, weight, noise = 6, torch.randn(4, 2), 0.7
    covariates = torch.randn(num_obs, 4)
    prior_loc = torch.randn(num_obs, 2) if kind == "per_obs_prior" else torch.zeros(num_obs, 2)
    perm = torch.randperm(num_obs)

    def model(x):
        with pyro.plate("data", num_obs):
            z = pyro.sample("z", dist.Normal(prior_loc, 1.0).to_event(1))
            if kind == "per_observation_indexing":
                # Indexing the batch of latents needs full-size probe values.
                z = z[..., perm, :][..., torch.argsort(perm), :]
            loc = z @ weight.T + covariates
            pyro.sample("x", dist.Normal(loc, noise).to_event(1), obs=x)

    mean = prior_loc @ weight.T + covariates
    cov = weight @ weight.T + noise**2 * torch.eye(4)
    x = mean + torch.randn(num_obs, 4) @ torch.linalg.cholesky(cov).T
    expected = torch.distributions.MultivariateNormal(mean, cov).log_prob(x)
    torch.testing.assert_close(log_marginal(model, x), expected)


def test_a_module_replaced_between_steps_with_module_local_params_gets_its_gradient():
    # With module_local_params the parameters live in the modules, not in Pyro's param
    # store. Under guide_loss="elbo" the model's parameters follow the MPT gradient: a
    # decoder replaced after the first step must get it on the next one, here the gradient
    # of the closed-form -log p(x) (every mask, exact conditionals, unit prior).
    class Model(PyroModule):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Linear(2, 4)

        def forward(self, x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
                pyro.sample("x", dist.Normal(self.decoder(z), 0.5).to_event(1), obs=x)

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with pyro.settings.context(module_local_params=True):
        torch.manual_seed(0)
        model = Model()
        guide = AutoNormal(model)
        loss = MPTLoss(conditionals="exact", num_masks="all", guide_loss="elbo")
        loss.loss_and_grads(model, guide, x)
        model.decoder = torch.nn.Linear(2, 4)
        loss.loss_and_grads(model, guide, x)
    weight, bias = model.decoder.weight, model.decoder.bias
    covariance = weight @ weight.T + 0.25 * torch.eye(4)
    closed_form = -dist.MultivariateNormal(bias, covariance).log_prob(x).sum()
    expected = torch.autograd.grad(closed_form, [weight, bias])
    assert weight.grad is not None and bias.grad is not None
    torch.testing.assert_close(weight.grad, expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bias.grad, expected[1], rtol=1e-4, atol=1e-4)


def test_a_loss_left_to_guess_its_plate_nesting_guesses_again_for_another_model():
    # The nesting guessed for a one-plate model was kept, and the same loss refused a
    # model with a feature plate, asking to "leave it unset", which it was. Both models
    # have the same marginal: x ~ N(0, W W^T + 0.36 I).
    weight = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(1))

    def event_model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.6).to_event(1), obs=x)

    def plate_model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            with pyro.plate("features", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Normal((z @ weight.T).squeeze(-2), 0.6), obs=x)

    covariance = weight @ weight.T + 0.36 * torch.eye(5)
    expected = -dist.MultivariateNormal(torch.zeros(5), covariance).log_prob(x).sum().item()
    loss = MPTLoss(num_masks="all")
    for model in (event_model, plate_model, event_model):
        assert loss.loss(model, None, x) == pytest.approx(expected, abs=1e-9)
    assert loss.max_plate_nesting == 1  # guessed for the last model
