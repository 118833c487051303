"""The closed-form conditionals against dense references."""

import math

import pytest
import torch

from pyro_mpt.ops.estimators import mask_scores, mpt_estimate
from pyro_mpt.ops.gaussian import (
    dense_gaussian_conditionals,
    latent_gaussian_conditionals,
    latent_gaussian_log_marginal,
    normal_log_prob,
)
from pyro_mpt.ops.masks import masks_of_sizes
from tests.helpers import all_masks, dense_schur_log_conditionals


def _model(num_obs=4, num_features=7, latent_dim=3):
    weight = torch.randn(num_features, latent_dim)
    bias = torch.randn(num_features)
    noise_var = torch.rand(num_features) + 0.1
    cov = weight @ weight.T + torch.diag(noise_var)
    x = torch.distributions.MultivariateNormal(bias, cov).sample((num_obs,))
    return x, weight, bias, noise_var, cov


@pytest.mark.parametrize("path", ["woodbury", "dense"])
def test_conditionals_match_dense_schur_complement(path):
    x, weight, bias, noise_var, cov = _model()
    sizes = torch.tensor([[1, 3, 6, 7], [2, 4, 5, 7]])  # (P=2, N=4), up to M = D
    masks = masks_of_sizes(sizes, x.shape[-1])
    if path == "woodbury":
        mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~masks)
    else:
        mean, var = dense_gaussian_conditionals(x, bias, cov, ~masks)
    log_p = normal_log_prob(x, mean, var)
    for p in range(2):
        for n in range(4):
            expected = dense_schur_log_conditionals(x[n], bias, cov, masks[p, n])
            for j, value in expected.items():
                assert log_p[p, n, j].item() == pytest.approx(value.item(), abs=1e-10)


def test_masks_shared_across_the_batch_broadcast():
    x, weight, bias, noise_var, _ = _model(num_obs=5)
    masks = masks_of_sizes(torch.tensor([2, 5]), x.shape[-1])  # (P, D)
    shared = masks.unsqueeze(1)  # (P, 1, D)
    mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~shared)
    expanded = shared.expand(2, 5, -1)
    mean2, var2 = latent_gaussian_conditionals(x, weight, bias, noise_var, ~expanded)
    assert mean.shape == (2, 5, 7)
    torch.testing.assert_close(mean, mean2)
    # The variances do not depend on x: one row per mask serves the whole batch.
    assert var.shape == (2, 1, 7)
    torch.testing.assert_close(var.expand_as(var2), var2)


def test_log_marginal_matches_dense_multivariate_normal():
    x, weight, bias, noise_var, cov = _model(num_obs=6, num_features=9, latent_dim=2)
    expected = torch.distributions.MultivariateNormal(bias, cov).log_prob(x)
    torch.testing.assert_close(latent_gaussian_log_marginal(x, weight, bias, noise_var), expected)


@pytest.mark.parametrize("path", ["woodbury", "dense"])
def test_chain_rule_along_one_order_is_the_exact_log_marginal(path):
    num_features = 8
    x, weight, bias, noise_var, cov = _model(num_obs=3, num_features=num_features)
    order = torch.randperm(num_features)
    # Step t scores feature order[t] given order[t+1:], i.e. the mask is order[:t+1].
    masks = torch.zeros(num_features, 1, num_features, dtype=torch.bool)
    for t in range(num_features):
        masks[t, 0, order[: t + 1]] = True
    if path == "woodbury":
        mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~masks)
    else:
        mean, var = dense_gaussian_conditionals(x, bias, cov, ~masks)
    log_p = normal_log_prob(x, mean, var)  # (D, N, D)
    chain = sum(log_p[t, :, order[t]] for t in range(num_features))
    exact = torch.distributions.MultivariateNormal(bias, cov).log_prob(x)
    torch.testing.assert_close(chain, exact, rtol=0, atol=1e-10)


def test_sum_over_all_masks_of_all_sizes_is_the_exact_log_marginal():
    """Proposition 1 by enumeration: sum_M mean_{|mask|=M} (1/M) sum_j log p(x_j|x_R)."""
    num_features = 5
    x, weight, bias, noise_var, cov = _model(num_obs=2, num_features=num_features)
    total = torch.zeros(2)
    for size in range(1, num_features + 1):
        masks = all_masks(num_features, size).unsqueeze(1)  # (C, 1, D)
        mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~masks)
        total = total + mask_scores(normal_log_prob(x, mean, var), masks).mean(0)
    exact = latent_gaussian_log_marginal(x, weight, bias, noise_var)
    torch.testing.assert_close(total, exact, rtol=0, atol=1e-10)


def test_mpt_estimate_scales_mask_scores_by_num_features():
    log_p = torch.arange(12.0).reshape(2, 1, 6)
    masks = torch.tensor([[[1, 1, 0, 0, 0, 0]], [[0, 0, 0, 0, 0, 1]]], dtype=torch.bool)
    # mask 1: (0 + 1) / 2 = 0.5, mask 2: 11 / 1 = 11 -> 6 * mean = 6 * 5.75
    assert mpt_estimate(log_p, masks).item() == pytest.approx(6 * 5.75)


def test_float32_stays_accurate_at_d512():
    num_features, latent_dim = 512, 10
    weight = torch.randn(num_features, latent_dim, dtype=torch.float64)
    bias = torch.randn(num_features, dtype=torch.float64)
    noise_var = torch.full((num_features,), 0.2, dtype=torch.float64)
    u = torch.randn(16, latent_dim, dtype=torch.float64)
    x = u @ weight.T + bias + 0.2**0.5 * torch.randn(16, num_features, dtype=torch.float64)
    masks = masks_of_sizes(torch.randint(1, num_features + 1, (4, 16)), num_features)

    def estimate(dtype):
        args = [t.to(dtype) for t in (x, weight, bias, noise_var)]
        mean, var = latent_gaussian_conditionals(*args, ~masks)
        return mpt_estimate(normal_log_prob(args[0], mean, var), masks).double()

    est64, est32 = estimate(torch.float64), estimate(torch.float32)
    exact64 = latent_gaussian_log_marginal(x, weight, bias, noise_var)
    exact32 = latent_gaussian_log_marginal(*[t.float() for t in (x, weight, bias, noise_var)])
    # Relative error of float32 against float64, for the estimate and the exact LML.
    assert ((est32 - est64).abs() / est64.abs()).max() < 1e-4
    assert ((exact32.double() - exact64).abs() / exact64.abs()).max() < 1e-4
    assert math.isfinite(est32.sum().item())
