"""``MaskedPredictiveLogLikelihood`` against GPyTorch's exact objectives and refits."""

import math
import warnings

import gpytorch
import pytest
import torch
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning

from pyro_mpt.gp import MaskedPredictiveLogLikelihood
from pyro_mpt.ops.gaussian import normal_log_prob
from pyro_mpt.ops.masks import sample_masks
from tests.helpers import all_masks, dense_schur_log_conditionals


class _GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, batch_shape=()):
        super().__init__(x, y, likelihood)
        batch_shape = torch.Size(batch_shape)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch_shape), batch_shape=batch_shape
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _problem(num_data=7, batch_shape=(), dtype=torch.float64):
    batch_shape = torch.Size(batch_shape)
    x = torch.randn(batch_shape + (num_data, 2), dtype=dtype)
    y = (
        torch.sin(2 * x[..., 0])
        + x[..., 1]
        + 0.3 * torch.randn(batch_shape + (num_data,), dtype=dtype)
    )
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch_shape).to(dtype)
    model = _GP(x, y, likelihood, batch_shape).to(dtype)
    # Hyperparameters away from the defaults, different per batch member.
    model.covar_module.base_kernel.lengthscale = 0.6 + torch.rand(batch_shape + (1, 1))
    model.covar_module.outputscale = 0.5 + torch.rand(batch_shape)
    model.mean_module.constant.data.fill_(0.3)
    likelihood.noise = 0.05 + 0.2 * torch.rand(batch_shape + (1,))
    model.train()
    likelihood.train()
    return x, y, likelihood, model


def test_conditionals_match_a_dense_schur_complement():
    x, y, likelihood, model = _problem(num_data=9)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    marginal = likelihood(model(x))
    cov, loc = marginal.covariance_matrix, marginal.mean
    for size in (0, 1, 4, 8, 9):  # a mask that holds nothing out has no conditional
        mask = torch.zeros(9, dtype=torch.bool)
        mask[torch.randperm(9)[:size]] = True
        log_p = mll.masked_log_prob(model(x), y, mask)
        expected = dense_schur_log_conditionals(y, loc, cov, mask)
        assert log_p.shape == (size,)
        for value, j in zip(log_p, torch.nonzero(mask).flatten().tolist()):
            assert value.item() == pytest.approx(expected[j].item(), abs=1e-10)


def test_a_batch_with_nothing_held_out_scores_no_output():
    x, y, likelihood, model = _problem(num_data=5, batch_shape=(3,))
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    log_p = mll.masked_log_prob(model(x), y, torch.zeros(5, dtype=torch.bool))
    assert log_p.shape == (3, 0)
    assert log_p.dtype == torch.float64


def test_conditionals_match_refitting_an_exact_gp_on_the_context():
    x, y, likelihood, model = _problem(num_data=10)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 4, 5, 9]] = True
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    log_p = mll.masked_log_prob(model(x), y, mask)

    refit_likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.dtype)
    refit = _GP(x[~mask], y[~mask], refit_likelihood).to(x.dtype)
    refit.load_state_dict(model.state_dict())
    refit_likelihood.load_state_dict(likelihood.state_dict())
    refit.eval()
    refit_likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        predictive = refit_likelihood(refit(x[mask]))
    expected = normal_log_prob(y[mask], predictive.mean, predictive.variance)
    torch.testing.assert_close(log_p.detach(), expected, rtol=0, atol=1e-9)


def _exact_mll(likelihood, model, x, y):
    return gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)(model(x), y)


def test_sum_over_all_masks_of_all_sizes_is_the_exact_mll():
    """Proposition 1 for data points, by enumerating every mask of every size."""
    num_data = 6
    x, y, likelihood, model = _problem(num_data=num_data)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    total = 0
    for size in range(1, num_data + 1):
        scores = [mll.masked_log_prob(model(x), y, m).mean() for m in all_masks(num_data, size)]
        total = total + torch.stack(scores).mean()
    exact = _exact_mll(likelihood, model, x, y)
    torch.testing.assert_close(total / num_data, exact, rtol=0, atol=1e-10)


def test_masks_of_size_one_average_to_gpytorch_leave_one_out():
    num_data = 8
    x, y, likelihood, model = _problem(num_data=num_data)
    loo = gpytorch.mlls.LeaveOneOutPseudoLikelihood(likelihood, model)(model(x), y)
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=1 / num_data)
    # Exactly, over the N masks of size one: the estimate of mask {j} is log p(y_j | y_-j).
    enumerated = torch.stack(
        [mll.masked_log_prob(model(x), y, m).sum() for m in all_masks(num_data, 1)]
    )
    torch.testing.assert_close(enumerated.mean(), loo, rtol=0, atol=1e-10)
    # The stochastic objective draws one of those N values per call.
    draws = torch.stack([mll(model(x), y) for _ in range(50)]).detach()
    assert all(torch.isclose(enumerated, d, rtol=0, atol=1e-10).any() for d in draws)


@pytest.mark.parametrize("batch_shape", [torch.Size(), torch.Size([2])])
def test_uniform_rate_is_unbiased_for_the_exact_mll(batch_shape):
    x, y, likelihood, model = _problem(num_data=8, batch_shape=batch_shape)
    exact = _exact_mll(likelihood, model, x, y).detach()
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate="uniform", num_masks=2)
    with torch.no_grad():
        draws = torch.stack([mll(model(x), y) for _ in range(400)])
    assert draws.shape == (400,) + batch_shape
    std_err = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - exact).abs() < 4 * std_err).all()
    # The estimator is not degenerate: a biased schedule is detected by the same test.
    biased = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.125)
    with torch.no_grad():
        draws = torch.stack([biased(model(x), y) for _ in range(400)])
    std_err = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - exact).abs() > 4 * std_err).all()


def test_batch_gp_matches_each_member_alone():
    x, y, likelihood, model = _problem(num_data=7, batch_shape=torch.Size([3]))
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    mask = torch.tensor([True, False, False, True, False, True, False])
    batched = mll.masked_log_prob(model(x), y, mask)
    assert batched.shape == (3, 3)
    marginal = likelihood(model(x))
    for b in range(3):
        expected = dense_schur_log_conditionals(
            y[b], marginal.mean[b], marginal.covariance_matrix[b], mask
        )
        torch.testing.assert_close(batched[b].detach(), torch.stack(list(expected.values())))


def test_gradients_match_the_dense_schur_complement():
    x, y, likelihood, model = _problem(num_data=9)
    mask = torch.zeros(9, dtype=torch.bool)
    mask[[0, 2, 3, 7]] = True
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    params = [p for p in mll.parameters() if p.requires_grad]
    grads = torch.autograd.grad(mll.masked_log_prob(model(x), y, mask).sum(), params)
    marginal = likelihood(model(x))
    dense = dense_schur_log_conditionals(y, marginal.mean, marginal.covariance_matrix, mask)
    expected = torch.autograd.grad(sum(dense.values()), params)
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference)


def test_fixed_rate_scores_the_held_out_points_of_its_mask():
    x, y, likelihood, model = _problem(num_data=20)
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.75)
    torch.manual_seed(1)
    value = mll(model(x), y)
    # The same seed draws the same mask: 15 of 20 points held out, an active set of 5.
    torch.manual_seed(1)
    masks, _ = sample_masks(mll.schedule, 1, (), 20)
    assert masks[0].sum() == 15
    expected = mll.masked_log_prob(model(x), y, masks[0]).sum() * (20 / 15) / 20
    torch.testing.assert_close(value, expected)


def test_follows_the_dtype_of_its_inputs():
    x, y, likelihood, model = _problem(num_data=6, dtype=torch.float32)
    value = MaskedPredictiveLogLikelihood(likelihood, model)(model(x), y)
    assert value.dtype == torch.float32
    assert value.device == y.device


def test_training_raises_the_exact_mll():
    x, y, likelihood, model = _problem(num_data=30)
    model.covar_module.base_kernel.lengthscale = 5.0
    likelihood.noise = 1.0
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate="uniform", num_masks=4)
    before = _exact_mll(likelihood, model, x, y).item()
    optimizer = torch.optim.Adam(mll.parameters(), lr=0.05)
    for _ in range(100):
        optimizer.zero_grad()
        (-mll(model(x), y)).backward()
        optimizer.step()
    assert _exact_mll(likelihood, model, x, y).item() > before + 0.2


def test_a_non_gaussian_likelihood_is_rejected():
    x, y, _, model = _problem()
    with pytest.raises(TypeError, match="likelihood must be a Gaussian likelihood.*Bernoulli"):
        MaskedPredictiveLogLikelihood(gpytorch.likelihoods.BernoulliLikelihood(), model)


@pytest.mark.parametrize(
    "rate, match",
    [
        (1.5, r"rate must lie in \(0, 1\], got 1.5"),
        (0.0, r"rate must lie in \(0, 1\], got 0.0"),
        ("bert", "rate='bert' is not a known schedule"),
    ],
)
def test_a_rate_out_of_range_is_rejected(rate, match):
    _, _, likelihood, model = _problem()
    with pytest.raises(ValueError, match=match):
        MaskedPredictiveLogLikelihood(likelihood, model, rate=rate)


def test_bad_num_masks_is_rejected():
    _, _, likelihood, model = _problem()
    with pytest.raises(ValueError, match="num_masks must be at least 1, got 0"):
        MaskedPredictiveLogLikelihood(likelihood, model, num_masks=0)


def test_bad_call_arguments_are_rejected():
    x, y, likelihood, model = _problem(num_data=7)
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    with pytest.raises(ValueError, match=r"target has shape \(6,\) but the GP has 7 data points"):
        mll(model(x), y[:6])
    with pytest.raises(TypeError, match="function_dist must be a gpytorch.distributions.Multi"):
        mll(torch.distributions.Normal(y, 1.0), y)
    with pytest.raises(ValueError, match=r"mask must be a boolean tensor of shape \(7,\)"):
        mll.masked_log_prob(model(x), y, torch.ones(7))
    with pytest.raises(TypeError, match="target must be a torch.Tensor, got list"):
        mll(model(x), y.tolist())
    # A NaN target made the objective NaN with no word (GPyTorch's debug setting is on by
    # default; with it off, the check, a read of the device, is skipped).
    with pytest.raises(ValueError, match="target holds 1 NaN values"):
        mll(model(x), torch.where(torch.arange(7) == 3, torch.nan, y))
    with pytest.raises(TypeError, match="are swapped: pass MaskedPredictiveLogLikelihood"):
        MaskedPredictiveLogLikelihood(model, likelihood)


def _tiny_noise_problem(dtype):
    """200 points, a smooth kernel and noise 1e-6: in float32 the kernel matrix is not
    positive definite after rounding (``ExactMarginalLogLikelihood`` adds jitter to it)."""
    x = torch.linspace(0, 1, 200, dtype=dtype).unsqueeze(-1)
    y = torch.sin(6 * x.squeeze(-1))
    constraint = gpytorch.constraints.GreaterThan(1e-9)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=constraint).to(dtype)
    likelihood.noise = 1e-6
    model = _GP(x, y, likelihood).to(dtype)
    model.covar_module.base_kernel.lengthscale = 0.3
    model.covar_module.outputscale = 1.0
    model.train()
    return x, y, likelihood, model


def test_float32_with_tiny_noise_adds_jitter_and_warns_as_gpytorch_does():
    mask = torch.zeros(200, dtype=torch.bool)
    mask[torch.randperm(200, generator=torch.Generator().manual_seed(0))[:20]] = True
    x, y, likelihood, model = _tiny_noise_problem(torch.float32)
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.1)
    with pytest.warns(NumericalWarning, match="added jitter of 1.0e-06 to the diagonal"):
        log_p = mll.masked_log_prob(model(x), y, mask)
    with pytest.warns(NumericalWarning, match="added jitter"):
        value = mll(model(x), y)
    assert torch.isfinite(log_p).all() and torch.isfinite(value)
    with pytest.warns(NumericalWarning, match="added jitter"):  # GPyTorch's own convention
        _exact_mll(likelihood, model, x, y)
    # float64 needs no jitter and gives the exact conditionals; float32 with jitter differs
    # by its round-off only (the predictive variances are about 1e-6 here).
    x, y, likelihood, model = _tiny_noise_problem(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        exact = MaskedPredictiveLogLikelihood(likelihood, model).masked_log_prob(model(x), y, mask)
    marginal = likelihood(model(x))
    dense = dense_schur_log_conditionals(y, marginal.mean, marginal.covariance_matrix, mask)
    # A dense inverse and a Cholesky factor differ by ~1e-3 nats at this conditioning (~1e8).
    torch.testing.assert_close(exact, torch.stack(list(dense.values())), rtol=0, atol=5e-3)
    assert (log_p.double() - exact).abs().max() < 0.5
    assert exact.min() > 5  # nats: far from what scoring without the context would give


def test_a_covariance_not_positive_definite_with_jitter_names_noise_dtype_and_fix():
    x, y, likelihood, model = _tiny_noise_problem(torch.float32)
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.1)
    message = (
        r"Matrix not positive definite after repeatedly adding jitter up to 1.0e-12\. The "
        r"covariance of the 180 context outputs .*noise=1.0e-06, dtype torch.float32\) is "
        r"not positive definite in this precision\. Train in float64.*GreaterThan\(1e-4\)"
    )
    tiny_jitter = gpytorch.settings.cholesky_jitter(float_value=1e-12)
    with tiny_jitter, gpytorch.settings.cholesky_max_tries(1):
        with pytest.warns(NumericalWarning), pytest.raises(NotPSDError, match=message):
            mll(model(x), y)


class _KernelGP(gpytorch.models.ExactGP):
    """An exact GP with the covariance ``kernel`` (a kernel, or a function of the inputs)."""

    def __init__(self, x, y, likelihood, kernel):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.kernel = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.kernel(x))


def _kernel_problem(kernel, num_data=20):
    generator = torch.Generator().manual_seed(1)
    x = torch.sort(torch.rand(num_data, 1, generator=generator), 0).values * 4
    y = torch.sin(2 * x[:, 0]) + 0.05 * torch.randn(num_data, generator=generator)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    likelihood.noise = 0.01
    model = _KernelGP(x, y, likelihood, kernel).double()
    model.train()
    return x.double(), y.double(), likelihood.double(), model


def _kiss_gp():
    from gpytorch.kernels import GridInterpolationKernel, RBFKernel, ScaleKernel

    kernel = ScaleKernel(GridInterpolationKernel(RBFKernel(), grid_size=8, num_dims=1))
    kernel.base_kernel.base_kernel.lengthscale = 0.7
    return kernel


def _sgpr():
    from gpytorch.kernels import InducingPointKernel, RBFKernel, ScaleKernel

    inducing = torch.linspace(0, 4, 5).unsqueeze(-1)
    return InducingPointKernel(ScaleKernel(RBFKernel()), inducing, likelihood=None)


@pytest.mark.parametrize("make_kernel", [_kiss_gp, _sgpr], ids=["kiss-gp", "sgpr"])
def test_a_kernel_fitted_to_all_its_inputs_gives_the_conditionals_of_its_whole_covariance(
    make_kernel,
):
    # KISS-GP's grid is fitted to the inputs it is given, so evaluated on a subset of them
    # its entries differ (by 0.19 here): the blocks were, and the conditionals were off, or
    # NaN where the blocks did not fit together. SGPR's kernel refused unequal inputs while
    # training. The reference: the covariance ExactMarginalLogLikelihood factorises.
    x, y, likelihood, model = _kernel_problem(make_kernel())
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    marginal = likelihood(model(x))
    cov, loc = marginal.covariance_matrix, marginal.mean
    for size in (1, 6, 19, 20):
        mask = torch.zeros(20, dtype=torch.bool)
        mask[torch.randperm(20, generator=torch.Generator().manual_seed(size))[:size]] = True
        log_p = mll.masked_log_prob(model(x), y, mask)
        expected = dense_schur_log_conditionals(y, loc, cov, mask)
        torch.testing.assert_close(log_p, torch.stack(list(expected.values())), rtol=0, atol=1e-8)


def test_every_output_hidden_scores_the_marginals_whatever_the_covariance():
    # With every output hidden there is no context; a covariance written as a sum of two
    # kernel calls was indexed with an empty index and failed inside linear_operator (1
    # step in N under the uniform rate).
    from gpytorch.kernels import PeriodicKernel, RBFKernel, ScaleKernel

    first, second = RBFKernel(), ScaleKernel(PeriodicKernel())
    x, y, likelihood, model = _kernel_problem(lambda x: first(x) + second(x), num_data=6)
    model.first, model.second = first.double(), second.double()
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=1.0)
    marginal = likelihood(model(x))
    expected = normal_log_prob(y, marginal.mean, marginal.covariance_matrix.diagonal())
    log_p = mll.masked_log_prob(model(x), y, torch.ones(6, dtype=torch.bool))
    torch.testing.assert_close(log_p, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(mll(model(x), y), expected.mean(), rtol=0, atol=1e-12)


def test_a_negative_predictive_variance_in_float32_raises_the_documented_error():
    # Noise 1e-9 in float32: the context block takes GPyTorch's jitter, and a held-out
    # output's predictive variance rounds below zero, where its log density was NaN.
    x = torch.linspace(0, 1, 60, dtype=torch.float32).unsqueeze(-1)
    y = torch.sin(x.squeeze(-1))
    constraint = gpytorch.constraints.GreaterThan(1e-10)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=constraint).float()
    likelihood.noise = 1e-9
    model = _GP(x, y, likelihood).float()
    model.covar_module.base_kernel.lengthscale = 5.0
    model.train()
    mll = MaskedPredictiveLogLikelihood(likelihood, model, rate=0.1)
    message = (
        r"A held-out output's predictive variance came out at -?\d\.\de-\d\d\. The covariance "
        r"of the held-out outputs given the 54 context outputs .*noise=1.0e-09, dtype "
        r"torch.float32\) is not positive definite in this precision\. Train in float64"
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        with pytest.raises(NotPSDError, match=message):
            mll(model(x), y)


@pytest.mark.parametrize("active_dims", [[1, 0], [1]], ids=["permuted", "one of two"])
def test_active_dims_of_the_outer_kernel_are_taken_once(active_dims):
    # The stored inputs of a lazy kernel matrix have its active_dims taken already. Taken a
    # second time, a permutation swapped the dims back (y_0 scored -1.128 against -0.712),
    # and one dim of two ran out of range. The reference: ExactMLL's own dense covariance.
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(5, 2, generator=generator, dtype=torch.float64) * 3
    y = torch.randn(5, generator=generator, dtype=torch.float64)
    kernel = gpytorch.kernels.RBFKernel(ard_num_dims=len(active_dims), active_dims=active_dims)
    kernel.lengthscale = torch.tensor([[0.3, 3.0][: len(active_dims)]])
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    likelihood.noise = 0.1
    model = _KernelGP(x, y, likelihood, kernel).double()
    likelihood.double()
    model.train()
    mll = MaskedPredictiveLogLikelihood(likelihood, model)
    marginal = likelihood(model(x))
    cov, loc = marginal.covariance_matrix, marginal.mean
    for mask in torch.cat([all_masks(5, size) for size in range(1, 6)]):
        log_p = mll.masked_log_prob(model(x), y, mask)
        expected = dense_schur_log_conditionals(y, loc, cov, mask)
        torch.testing.assert_close(log_p, torch.stack(list(expected.values())), rtol=0, atol=1e-10)


def _smooth_problem(dtype, noise):
    x = torch.linspace(0, 1, 60, dtype=torch.float64)
    y = torch.sin(6 * x) + 0.01 * torch.randn(60, generator=torch.Generator().manual_seed(14))
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=gpytorch.constraints.GreaterThan(1e-12)
    )
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    model = _KernelGP(x.to(dtype), y.to(dtype), likelihood, kernel).to(dtype)
    likelihood.to(dtype)
    kernel.base_kernel.lengthscale = 0.3
    likelihood.noise = noise
    model.train()
    return x.to(dtype), y.to(dtype), likelihood, model


@pytest.mark.parametrize("noise, warned", [(1e-6, True), (1e-4, False)])
def test_a_float32_variance_that_rounding_decides_warns(noise, warned):
    # Held-out variances far below their prior ones are differences that rounding decides:
    # at noise 1e-6 float32 put 30 held-out outputs 139 nats from float64 with no word.
    mask = torch.zeros(60, dtype=torch.bool)
    mask[::2] = True
    totals = {}
    for dtype in (torch.float32, torch.float64):
        x, y, likelihood, model = _smooth_problem(dtype, noise)
        mll = MaskedPredictiveLogLikelihood(likelihood, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            totals[dtype] = mll.masked_log_prob(model(x), y, mask).double().sum().item()
        flagged = [w for w in caught if "rounding error" in str(w.message)]
        assert len(flagged) == (1 if warned and dtype == torch.float32 else 0)
    error = abs(totals[torch.float32] - totals[torch.float64])
    # Unwarned, float32 stays within its plain rounding (0.025 nats over the 30 here).
    assert error > 10.0 if warned else error < 0.1, error
