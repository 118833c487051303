"""``MaskedPredictiveLogLikelihood`` on multitask GPs, against an exact reference built here:
the Gaussian over the ``n t`` stacked outputs, ``K_x (x) B`` plus the noise, in GPyTorch's
interleaved order (entry ``(i, k)`` of the ``(n, t)`` targets at ``i t + k``)."""

import math

import gpytorch
import pytest
import torch

from pyro_mpt.gp import MaskedPredictiveLogLikelihood
from pyro_mpt.ops.masks import sample_masks
from tests.helpers import all_masks, dense_schur_log_conditionals


class _MultitaskGP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, num_tasks):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.MultitaskMean(
            gpytorch.means.ConstantMean(), num_tasks=num_tasks
        )
        self.covar_module = gpytorch.kernels.MultitaskKernel(
            gpytorch.kernels.RBFKernel(), num_tasks=num_tasks, rank=1
        )

    def forward(self, x):
        return gpytorch.distributions.MultitaskMultivariateNormal(
            self.mean_module(x), self.covar_module(x)
        )


def _problem(num_inputs=3, num_tasks=2):
    x = torch.rand(num_inputs, 1, dtype=torch.float64)
    y = torch.cat([torch.sin(6 * x), torch.cos(4 * x), x], -1)[:, :num_tasks]
    y = y + 0.2 * torch.randn(num_inputs, num_tasks, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=num_tasks).double()
    model = _MultitaskGP(x, y, likelihood, num_tasks).double()
    model.covar_module.data_covar_module.lengthscale = 0.4
    model.covar_module.task_covar_module.covar_factor.data = torch.tensor(
        [[1.0], [-0.7], [0.4]], dtype=torch.float64
    )[:num_tasks]
    likelihood.task_noises = torch.tensor([0.05, 0.2, 0.1], dtype=torch.float64)[:num_tasks]
    likelihood.noise = 0.03
    for k, constant in enumerate((0.3, -0.2, 0.1)[:num_tasks]):
        model.mean_module.base_means[k].constant.data.fill_(constant)
    model.train()
    likelihood.train()
    return x, y, likelihood, model


def _reference(x, likelihood, model):
    """Mean and covariance of the ``n t`` stacked outputs, interleaved, from the formulas."""
    num_inputs, num_tasks = x.shape[0], likelihood.num_tasks
    lengthscale = model.covar_module.data_covar_module.lengthscale.squeeze()
    data_cov = torch.exp(-0.5 * (x - x.T) ** 2 / lengthscale**2)
    tasks = model.covar_module.task_covar_module
    task_cov = tasks.covar_factor @ tasks.covar_factor.T + torch.diag(tasks.var)
    noise = likelihood.task_noises.repeat(num_inputs) + likelihood.noise
    cov = torch.kron(data_cov, task_cov) + torch.diag(noise)
    means = torch.stack([m.constant for m in model.mean_module.base_means]).reshape(num_tasks)
    return means.repeat(num_inputs), cov


def test_conditionals_match_the_stacked_outputs_gaussian():
    x, y, likelihood, model = _problem(num_inputs=5, num_tasks=3)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    loc, cov = _reference(x, likelihood, model)
    marginal = likelihood(model(x))  # the reference agrees with GPyTorch's interleaving
    torch.testing.assert_close(marginal.covariance_matrix, cov, rtol=0, atol=1e-12)
    for mask in (
        torch.tensor([[1, 0, 0], [0, 0, 1], [1, 1, 0], [0, 0, 0], [0, 1, 0]]),
        torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),  # whole inputs
        torch.ones(5, 3),
    ):
        mask = mask.bool()
        log_p = mll.masked_log_prob(model(x), y, mask)
        expected = dense_schur_log_conditionals(y.reshape(-1), loc, cov, mask.reshape(-1))
        # Row-major order of the (n, t) mask, the order of mask.nonzero().
        torch.testing.assert_close(
            log_p.detach(), torch.stack(list(expected.values())), rtol=0, atol=1e-10
        )


def test_task_major_storage_gives_the_same_conditionals():
    """A ``MultitaskMultivariateNormal`` stored task by task (``interleaved=False``) is the
    same distribution; the mask and the result stay in the ``(n, t)`` layout of the targets."""
    x, y, likelihood, model = _problem(num_inputs=4, num_tasks=3)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    prior = model(x)
    loc, cov = prior.mean, prior.covariance_matrix.detach()
    order = torch.arange(12).reshape(4, 3).T.reshape(-1)  # task-major position -> interleaved
    task_major = gpytorch.distributions.MultitaskMultivariateNormal(
        loc.detach(), cov[order][:, order], interleaved=False
    )
    torch.testing.assert_close(task_major.mean, loc.detach())
    mask = torch.tensor([[1, 0, 0], [0, 1, 1], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    expected = mll.masked_log_prob(prior, y, mask).detach()
    torch.testing.assert_close(mll.masked_log_prob(task_major, y, mask), expected)
    ref_loc, ref_cov = _reference(x, likelihood, model)
    dense = dense_schur_log_conditionals(y.reshape(-1), ref_loc, ref_cov, mask.reshape(-1))
    torch.testing.assert_close(expected, torch.stack(list(dense.values())).detach())


def test_sum_over_all_masks_of_all_sizes_is_the_exact_mll():
    """Proposition 1 over the ``n t`` outputs: the objective is unbiased for GPyTorch's
    ``ExactMarginalLogLikelihood`` (which divides by ``n t``) and for the exact formula."""
    x, y, likelihood, model = _problem(num_inputs=3, num_tasks=2)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    total = 0
    for size in range(1, 7):
        masks = all_masks(6, size).reshape(-1, 3, 2)
        scores = [mll.masked_log_prob(model(x), y, m).mean() for m in masks]
        total = total + torch.stack(scores).mean()
    exact = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)(model(x), y)
    loc, cov = _reference(x, likelihood, model)
    formula = torch.distributions.MultivariateNormal(loc, cov).log_prob(y.reshape(-1)) / 6
    torch.testing.assert_close(total / 6, exact, rtol=0, atol=1e-10)
    torch.testing.assert_close(total / 6, formula, rtol=0, atol=1e-10)


def test_forward_scores_the_outputs_of_its_mask():
    x, y, likelihood, model = _problem(num_inputs=6, num_tasks=2)
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.25)
    torch.manual_seed(3)
    value = mll(model(x), y)
    torch.manual_seed(3)
    masks, _ = sample_masks(mll.schedule, 1, (), 12)
    assert masks[0].sum() == 3  # a quarter of the 12 outputs
    expected = mll.masked_log_prob(model(x), y, masks[0].reshape(6, 2)).sum() * (12 / 3) / 12
    torch.testing.assert_close(value, expected)


def test_uniform_rate_is_unbiased_for_the_exact_mll():
    x, y, likelihood, model = _problem(num_inputs=4, num_tasks=2)
    exact = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)(model(x), y).detach()
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate="uniform", num_masks=2)
    with torch.no_grad():
        draws = torch.stack([mll(model(x), y) for _ in range(400)])
    std_err = draws.std() / math.sqrt(draws.shape[0])
    assert (draws.mean() - exact).abs() < 4 * std_err


def test_gradients_match_the_stacked_outputs_gaussian():
    x, y, likelihood, model = _problem(num_inputs=4, num_tasks=2)
    mask = torch.tensor([[1, 0], [0, 0], [1, 1], [0, 1]], dtype=torch.bool)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    params = [p for p in mll.parameters() if p.requires_grad]
    grads = torch.autograd.grad(mll.masked_log_prob(model(x), y, mask).sum(), params)
    loc, cov = _reference(x, likelihood, model)
    dense = dense_schur_log_conditionals(y.reshape(-1), loc, cov, mask.reshape(-1))
    expected = torch.autograd.grad(sum(dense.values()), params, allow_unused=True)
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, torch.zeros_like(grad) if reference is None else reference)


def test_flattened_targets_and_wrong_masks_are_rejected():
    x, y, likelihood, model = _problem(num_inputs=6, num_tasks=2)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    message = (
        r"target has shape \(12,\) but the multitask GP has 6 inputs and 2 tasks; pass one "
        r"row of task targets per training input, shape \(\.\.\., 6, 2\)"
    )
    with pytest.raises(ValueError, match=message):
        mll(model(x), y.reshape(12))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 6, 2\)"):
        mll(model(x), y.T)
    with pytest.raises(ValueError, match=r"mask must be a boolean tensor of shape \(6, 2\)"):
        mll.masked_log_prob(model(x), y, torch.ones(12, dtype=torch.bool))
