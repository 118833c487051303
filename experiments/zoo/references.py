"""Exact references for the model zoo, computed the slow, obvious way in float64.

Gaussian marginals come from ``torch.distributions.MultivariateNormal`` on the implied
covariance; everything else from trapezoid sums of the joint density over a fine, wide grid
of the latent, in log space.
"""

import math

import torch

__all__ = [
    "grid_log_marginal_1d",
    "grid_log_marginal_2d",
    "mvn_log_prob",
    "mvn_observed_log_prob",
    "standard_normal_log_prob",
    "trapezoid_log_weights",
]

#: A standard-normal latent beyond +-12 carries less than 1e-30 of the prior mass.
GRID_HALF_WIDTH = 12.0


def standard_normal_log_prob(eps):
    """``log N(eps; 0, 1)``, elementwise."""
    return -0.5 * eps**2 - 0.5 * math.log(2 * math.pi)


def trapezoid_log_weights(lo, hi, num_points):
    """Nodes and log trapezoid weights of ``[lo, hi]`` with ``num_points`` points."""
    nodes = torch.linspace(lo, hi, num_points, dtype=torch.float64)
    step = (hi - lo) / (num_points - 1)
    weights = torch.full((num_points,), step, dtype=torch.float64)
    weights[0] = weights[-1] = step / 2
    return nodes, weights.log()


def grid_log_marginal_1d(log_joint, lo=-GRID_HALF_WIDTH, hi=GRID_HALF_WIDTH, num_points=6001):
    """``log ∫ exp(log_joint(t)) dt`` per observation, by the trapezoid rule.

    :param log_joint: maps nodes of shape ``(G, 1)`` to log densities ``(G, N)`` (prior of
        the integration variable included).
    :returns: a tensor of shape ``(N,)``.
    """
    nodes, log_w = trapezoid_log_weights(lo, hi, num_points)
    values = log_joint(nodes.unsqueeze(-1))
    return torch.logsumexp(values + log_w.unsqueeze(-1), 0)


def grid_log_marginal_2d(log_joint, lo=-GRID_HALF_WIDTH, hi=GRID_HALF_WIDTH, num_points=601):
    """``log ∫∫ exp(log_joint(t)) dt`` per observation over the square ``[lo, hi]^2``, by the
    product trapezoid rule.

    :param log_joint: maps nodes of shape ``(G, 2)`` to log densities ``(G, N)``.
    :returns: a tensor of shape ``(N,)``.
    """
    nodes, log_w = trapezoid_log_weights(lo, hi, num_points)
    t1, t2 = torch.meshgrid(nodes, nodes, indexing="ij")
    points = torch.stack([t1.reshape(-1), t2.reshape(-1)], -1)
    log_weights = (log_w.unsqueeze(1) + log_w.unsqueeze(0)).reshape(-1)
    # Chunks over the nodes keep the (G, N, D) likelihood tensors small.
    parts = []
    for chunk, chunk_w in zip(points.split(40_000), log_weights.split(40_000)):
        parts.append(torch.logsumexp(log_joint(chunk) + chunk_w.unsqueeze(-1), 0))
    return torch.logsumexp(torch.stack(parts), 0)


def mvn_log_prob(x, mean, cov):
    """``log N(x; mean, cov)`` per row of ``x``."""
    return torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(x)


def mvn_observed_log_prob(x, observed, mean, cov):
    """``log N(x_O; mean_O, cov_OO)`` for each row, ``O`` the row's observed entries.

    :param x: ``(N, D)`` data.
    :param observed: ``(N, D)`` boolean, ``True`` where an entry is observed.
    :param mean: ``(D,)`` or ``(N, D)`` mean.
    :param cov: ``(D, D)`` covariance.
    :returns: ``(N,)``; exactly 0 for a row with no observed entry.
    """
    mean = mean.expand_as(x)
    out = []
    for row, keep, mu in zip(x, observed, mean):
        idx = torch.nonzero(keep).flatten()
        if idx.numel() == 0:
            out.append(torch.zeros((), dtype=x.dtype))
            continue
        out.append(mvn_log_prob(row[idx], mu[idx], cov[idx][:, idx]))
    return torch.stack(out)
