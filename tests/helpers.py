"""Shared test utilities: exact references computed the slow, obvious way."""

import itertools
import math

import torch


def dense_schur_log_conditionals(x, loc, cov, mask):
    """``log p(x_j | x_R)`` for each masked ``j`` of one observation, by explicit indexing
    and a dense inverse of the context block. Returns a dict ``j -> value``."""
    masked = torch.nonzero(mask).flatten().tolist()
    context = torch.nonzero(~mask).flatten()
    out = {}
    for j in masked:
        if len(context) == 0:
            mean, var = loc[j], cov[j, j]
        else:
            s_rr_inv = torch.linalg.inv(cov[context][:, context])
            s_jr = cov[j, context]
            mean = loc[j] + s_jr @ s_rr_inv @ (x[context] - loc[context])
            var = cov[j, j] - s_jr @ s_rr_inv @ s_jr
        out[j] = -0.5 * ((x[j] - mean) ** 2 / var + torch.log(2 * math.pi * var))
    return out


def all_masks(num_features, size):
    """Every boolean mask of the given size, stacked: shape ``(C(D, M), D)``."""
    rows = []
    for subset in itertools.combinations(range(num_features), size):
        row = torch.zeros(num_features, dtype=torch.bool)
        row[list(subset)] = True
        rows.append(row)
    return torch.stack(rows)


def ppca_max_likelihood_lml(x, latent_dim):
    """Mean log-likelihood of PPCA at its closed-form maximum-likelihood solution
    (Tipping & Bishop, 1999): sigma^2 is the mean of the discarded eigenvalues."""
    n, d = x.shape
    mean = x.mean(0)
    centered = x - mean
    cov = centered.T @ centered / n
    eigvals, eigvecs = torch.linalg.eigh(cov)
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    sigma2 = eigvals[latent_dim:].mean()
    weight = eigvecs[:, :latent_dim] * (eigvals[:latent_dim] - sigma2).sqrt()
    model_cov = weight @ weight.T + sigma2 * torch.eye(d)
    return torch.distributions.MultivariateNormal(mean, model_cov).log_prob(x).mean()


class CountedCalls:
    """A model (or any function) that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)
