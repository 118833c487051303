"""A linear-Gaussian form found at the first step is verified again as training goes on,
with Pyro's validation off too: a parameter may make the model nonlinear after the first
step. The reference is a brute-force grid over the one latent dimension."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.conditionals.exact import NotGaussianError

WEIGHT = torch.tensor([[1.0], [-0.5], [0.8]])


def _model(x):
    # Linear in z while ``bend`` is 0, and so is its derivative in ``bend`` (the form's
    # gradient is right there); bent by tanh(3 z) once it is not.
    bend = pyro.param("bend", lambda: torch.zeros(3))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
        loc = z @ WEIGHT.T + bend**2 * torch.tanh(3 * z)
        pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)


def _no_guide(x):
    pass


def _grid_log_marginal(x, bend):
    """log p(x) of every row by a Riemann sum on 20001 points of [-8, 8]."""
    z = torch.linspace(-8, 8, 20001, dtype=torch.float64)[:, None]
    loc = z @ WEIGHT.T.double() + bend.double() ** 2 * torch.tanh(3 * z)
    log_joint = dist.Normal(loc[:, None], 0.5).log_prob(x.double()).sum(-1)
    log_joint = log_joint + dist.Normal(0.0, 1.0).log_prob(z)
    return torch.logsumexp(log_joint, 0) + math.log(16 / 20000)


def _bend(value):
    with torch.no_grad():
        pyro.param("bend").fill_(value)


def test_a_form_given_by_the_user_is_verified_again_on_the_second_step():
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    loss = MPTLoss(num_masks="all", conditionals=Exact())
    with pyro.validation_enabled(False):
        loss.differentiable_loss(_model, _no_guide, x)
        _bend(1.0)
        with pytest.raises(NotGaussianError, match="not affine"):
            loss.differentiable_loss(_model, _no_guide, x)


def test_auto_leaves_a_form_that_no_longer_holds_at_its_next_check():
    # differentiable_loss reads nothing: auto checks its choice on the 2nd call, and the
    # model bent after the first is then integrated by quadrature, within auto's accuracy of
    # the grid.
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    loss = MPTLoss(num_masks="all", conditionals="auto")
    with pyro.validation_enabled(False):
        loss.differentiable_loss(_model, _no_guide, x)
        assert isinstance(loss.conditionals.in_use, Exact)
        _bend(1.0)
        for _ in range(15):
            value = loss.differentiable_loss(_model, _no_guide, x)
    assert isinstance(loss.conditionals.in_use, Quadrature)
    expected = -_grid_log_marginal(x, pyro.param("bend").detach()).sum()
    assert abs(float(value) - float(expected)) < 0.05 * x.shape[0]


@pytest.mark.parametrize("conditionals", ["auto", "exact"])
def test_a_form_that_stops_holding_between_checks_is_caught_on_that_step(conditionals):
    # The model bends on the 5th call, between the checks of the 2nd and the 16th. The
    # form's check, left on the device with validation off, is read with the loss (one
    # synchronisation, as before): auto integrates that very step by quadrature, and
    # exact conditionals raise before any gradient is computed.
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    loss = MPTLoss(num_masks="all", conditionals=conditionals)
    with pyro.validation_enabled(False):
        for _ in range(4):
            loss.loss_and_grads(_model, _no_guide, x)
        pyro.param("bend").unconstrained().grad = None
        _bend(1.0)
        if conditionals == "exact":
            with pytest.raises(NotGaussianError, match="not affine"):
                loss.loss_and_grads(_model, _no_guide, x)
            assert pyro.param("bend").unconstrained().grad is None
            return
        value = loss.loss_and_grads(_model, _no_guide, x)
    assert isinstance(loss.conditionals.in_use, Quadrature)
    expected = -_grid_log_marginal(x, pyro.param("bend").detach()).sum()
    assert abs(value - float(expected)) < 0.05 * x.shape[0]


def test_a_bend_between_fixed_points_meets_a_fresh_check_draw():
    """A loc affine in z except for a triangular bump on (-1.9, -0.5), zero at the origin,
    the unit vector and the far points: fixed check points would pass it on every call
    (the estimate was 7.7 nats per observation off, 48 at worst). The prior draws among the
    check points are new on every call, each inside the bump with probability 0.28: of 20
    calls, all pass only with probability 0.72^60 < 1e-8."""
    from pyro_mpt import log_marginal

    w = torch.tensor([1.0, -0.5, 0.8, 0.3], dtype=torch.float64)
    a = torch.tensor([3.0, 2.0, -2.0, 1.0], dtype=torch.float64)

    def bump(z):
        return torch.relu(z + 1.9) - 2 * torch.relu(z + 1.2) + torch.relu(z + 0.5)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            loc = z.unsqueeze(-1) * w + bump(z).unsqueeze(-1) * a
            pyro.sample("x", dist.Normal(loc, 0.3).to_event(1), obs=x)

    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    refused = 0
    for _ in range(20):
        try:
            log_marginal(model, x, conditionals="exact")
        except NotGaussianError as error:
            assert "is not affine in the latent sites ['z']" in str(error)
            refused += 1
    assert refused >= 1


def test_a_form_that_holds_only_at_the_present_parameters_is_refused_where_a_gradient_is_taken():
    """``W z + c z**2`` at ``c = 0`` is affine in value, but the derivative of log p(x) in
    ``c`` is not that of an affine model: exact conditionals gave the gradient in ``W`` for
    it. Under a gradient, exact conditionals refuse it and auto integrates it by quadrature,
    whose gradient matches that of the grid; without one, the value is exact and served."""
    from pyro_mpt import log_marginal

    generator = torch.Generator().manual_seed(11)
    w0 = torch.randn(4, generator=generator, dtype=torch.float64)
    b0 = torch.randn(4, generator=generator, dtype=torch.float64)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64) + b0

    def model(x):
        c = pyro.param("c", lambda: torch.zeros(4, dtype=torch.float64))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0)).unsqueeze(-1)
            pyro.sample("x", dist.Normal(w0 * z + c * z**2 + b0, 0.6).to_event(1), obs=x)

    def grid(c):
        z = torch.linspace(-12, 12, 8001, dtype=torch.float64)[:, None, None]
        log_lik = dist.Normal(w0 * z + c * z**2 + b0, 0.6).log_prob(x).sum(-1)
        log_prior = dist.Normal(0.0, 1.0).log_prob(z[:, 0, 0]) + math.log(24 / 8000)
        return torch.logsumexp(log_lik + log_prior[:, None], 0).sum()

    c = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(grid(c), c)
    pyro.clear_param_store()
    pyro.param("c", torch.zeros(4, dtype=torch.float64))
    with torch.no_grad():
        value = log_marginal(model, x, conditionals="exact").sum()
    assert abs(float(value) - float(grid(c))) < 1e-8
    with pytest.raises(NotGaussianError, match="not near them"):
        log_marginal(model, x, conditionals="exact")
    unconstrained = pyro.param("c").unconstrained()
    (gradient,) = torch.autograd.grad(
        log_marginal(model, x, conditionals="auto").sum(), unconstrained
    )
    # auto's rule agrees with a finer one to 1e-3 nats per observation (CONVERGENCE_TOL);
    # its gradient is as close, to about 6e-3 of gradients of order 1 (an affine form's
    # gradient in c would be 0).
    torch.testing.assert_close(gradient, expected, atol=1e-2, rtol=0)


@pytest.mark.parametrize("noise", ["per_observation", "per_entry"])
def test_a_noise_scale_that_differs_by_observation_is_exact(noise):
    # Heteroscedastic noise, or known measurement errors per entry, with a loc shared by
    # every observation: the noise had more rows than the loc, and the form failed with a
    # RuntimeError from expand (which also kept auto from trying anything else).
    generator = torch.Generator().manual_seed(0)
    weight, loc = torch.randn(6, 2, generator=generator), torch.randn(6, generator=generator)
    x = torch.randn(10, 6, generator=generator)
    if noise == "per_observation":
        scale = 0.6 * (torch.rand(10, 1, generator=generator) + 0.5)
    else:
        scale = torch.rand(10, 6, generator=generator) + 0.3
    noise_scale = pyro.param("noise_scale", scale.clone())

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + loc, noise_scale).to_event(1), obs=x)

    variances = (scale**2).expand(10, 6)
    covariance = weight @ weight.T + torch.diag_embed(variances)
    expected = -dist.MultivariateNormal(loc, covariance).log_prob(x).sum()
    for conditionals in ("exact", "auto"):
        loss = MPTLoss(num_masks="all", conditionals=conditionals)
        value = loss.differentiable_loss(model, None, x)
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-10)
        (grad,) = torch.autograd.grad(value, noise_scale)
        closed_form = dist.MultivariateNormal(
            loc, weight @ weight.T + torch.diag_embed((noise_scale**2).expand(10, 6))
        )
        (expected_grad,) = torch.autograd.grad(-closed_form.log_prob(x).sum(), noise_scale)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("conditionals", ["exact", "auto"])
def test_parameters_made_nan_by_unchecked_data_are_named_as_such(conditionals):
    # With validation off the data are not checked: a NaN in a batch turns the parameters
    # NaN, and the next check of the form says so rather than calling the model nonlinear.
    pyro.clear_param_store()
    torch.manual_seed(0)
    data = torch.randn(48, 3)
    data[3, 2] = float("nan")
    loss = MPTLoss(conditionals=conditionals)
    svi = SVI(_model, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    with pyro.validation_enabled(False), pytest.raises(ValueError, match="NaN or infinite"):
        for batch in data.split(16):
            svi.step(batch)
