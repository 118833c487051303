"""Draws from the conditionals ``p(x_S | x_R)`` of latent-variable models: latent
linear-Gaussian, dense multivariate normal and finite mixtures, each jointly over the hidden
features or feature by feature (:ref:`theory-sampling`).

Context weights ``c`` (True at features in ``R``) have shape ``batch + (D,)``; draws have a
leading dim of size ``num_samples`` and cover *all* features: callers keep the observed
values where ``c`` is True (:func:`~pyro_mpt.ops.masks.select_masked`).

This module is pure tensor code: no Pyro effects.
"""

import itertools

import torch

from pyro_mpt.ops.gaussian import dense_gaussian_conditionals, latent_gaussian_conditionals

__all__ = [
    "block_gibbs_covariance",
    "dense_gaussian_block_sample",
    "dense_gaussian_marginal_sample",
    "gaussian_marginal_sample",
    "latent_gaussian_block_sample",
    "latent_gaussian_marginal_sample",
    "latent_gaussian_posterior",
    "mixture_component_sample",
]


def latent_gaussian_posterior(x, weight, bias, noise_var, context):
    """The posterior ``p(u | x_R)`` of a standard normal latent given the context features.

    .. math::

        \\Lambda = I + W^\\top \\mathrm{diag}(c / \\psi) W, \\qquad
        \\mu_u = \\Lambda^{-1} W^\\top \\mathrm{diag}(c / \\psi)(x - b).

    :param torch.Tensor x: observations, ``batch + (D,)``.
    :param torch.Tensor weight: ``W``, ``batch + (D, K)`` (broadcastable).
    :param torch.Tensor bias: ``b``, ``batch + (D,)`` (broadcastable).
    :param torch.Tensor noise_var: ``psi > 0``, ``batch + (D,)`` (broadcastable).
    :param torch.Tensor context: booleans or 0/1 weights, ``batch + (D,)``.
    :returns: ``(mean, precision_tril)``: the posterior mean ``batch + (K,)`` and the lower
        Cholesky factor ``L`` of ``Lambda = L L^T``, ``batch + (K, K)``.
    """
    context = context.to(x.dtype)
    precision_weights = context / noise_var
    latent_dim = weight.shape[-1]
    eye = torch.eye(latent_dim, dtype=x.dtype, device=x.device)
    weighted = weight * precision_weights.unsqueeze(-1)  # batch + (D, K)
    precision = eye + weighted.transpose(-1, -2) @ weight
    precision_tril = torch.linalg.cholesky(precision)
    rhs = weighted.transpose(-1, -2) @ (x - bias).unsqueeze(-1)  # batch + (K, 1)
    mean = torch.cholesky_solve(rhs, precision_tril).squeeze(-1)
    return mean, precision_tril


def latent_gaussian_block_sample(x, weight, bias, noise_var, context, num_samples):
    """Joint draws of every feature from ``p(x | x_R)`` of a latent linear-Gaussian model.

    ``u = mu_u + L^{-T} e`` with ``e ~ N(0, I)`` is a draw of ``p(u | x_R)``
    (:func:`latent_gaussian_posterior`), and ``x = W u + b + sqrt(psi) eta`` a draw of
    ``p(x | u)``; the features outside ``R`` of these draws are distributed as
    ``p(x_S | x_R)``, jointly.

    :param int num_samples: draws per observation.
    :returns: a tensor ``(num_samples,) + batch + (D,)``.
    """
    mean, tril = latent_gaussian_posterior(x, weight, bias, noise_var, context)
    shape = (num_samples,) + mean.shape
    noise = torch.randn(shape + (1,), dtype=x.dtype, device=x.device)
    offset = torch.linalg.solve_triangular(tril.transpose(-1, -2), noise, upper=True)
    u = mean + offset.squeeze(-1)  # (S,) + batch + (K,)
    loc = (weight @ u.unsqueeze(-1)).squeeze(-1) + bias
    return loc + noise_var.sqrt() * torch.randn_like(loc)


def dense_gaussian_block_sample(x, loc, covariance, context, num_samples):
    """Joint draws of every feature from ``p(x | x_R)`` of ``N(loc, covariance)``.

    A draw ``y ~ N(loc, Sigma)`` corrected by ``Sigma_{.R} Sigma_{RR}^{-1} (x_R - y_R)`` is a
    draw of the conditional (the correction is solved with the context block padded by the
    identity, so that every observation has its own context in one batched solve).

    :returns: a tensor ``(num_samples,) + batch + (D,)``.
    """
    weights = context.to(x.dtype)
    batch = torch.broadcast_shapes(x.shape, loc.shape, weights.shape, covariance.shape[:-1])
    y = torch.distributions.MultivariateNormal(loc, covariance_matrix=covariance).sample(
        (num_samples,)
    )
    y = y.expand((num_samples,) + batch)
    outer = weights.unsqueeze(-1) * weights.unsqueeze(-2)
    padded = covariance * outer + torch.diag_embed(1 - weights)  # Sigma_RR, identity elsewhere
    residual = (weights * (x - y)).unsqueeze(-1)
    solved = torch.linalg.solve(padded.expand(y.shape + y.shape[-1:]), residual)
    correction = ((covariance * weights.unsqueeze(-2)) @ solved).squeeze(-1)
    return y + correction


def gaussian_marginal_sample(mean, var, num_samples):
    """Independent draws ``x_j ~ N(mean_j, var_j)``, ``(num_samples,) + mean.shape``: the
    product of the conditionals ``p(x_j | x_R)``."""
    shape = (num_samples,) + torch.broadcast_shapes(mean.shape, var.shape)
    return mean + var.sqrt() * torch.randn(shape, dtype=mean.dtype, device=mean.device)


def latent_gaussian_marginal_sample(x, weight, bias, noise_var, context, num_samples):
    """Draws of each feature from its own conditional ``p(x_j | x_R)`` of a latent
    linear-Gaussian model, independently: ``(num_samples,) + batch + (D,)``."""
    mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, context)
    return gaussian_marginal_sample(mean, var, num_samples)


def dense_gaussian_marginal_sample(x, loc, covariance, context, num_samples):
    """Draws of each feature from its own conditional ``p(x_j | x_R)`` of
    ``N(loc, covariance)``, independently: ``(num_samples,) + batch + (D,)``."""
    mean, var = dense_gaussian_conditionals(x, loc, covariance, context)
    return gaussian_marginal_sample(mean, var, num_samples)


def mixture_component_sample(log_probs, sample_shape=()):
    """Indices of mixture components drawn with probabilities ``softmax(log_probs)`` over
    the leading dim.

    :param torch.Tensor log_probs: unnormalised log-probabilities ``(G,) + batch``.
    :param tuple sample_shape: independent draws per batch entry.
    :returns: a long tensor ``sample_shape + batch``.
    """
    logits = log_probs.movedim(0, -1)
    return torch.distributions.Categorical(logits=logits).sample(torch.Size(sample_shape))


def block_gibbs_covariance(covariance, block_size, joint=True):
    """The stationary covariance of block Gibbs on ``N(mu, Sigma)`` with a uniformly random
    block of ``block_size`` features per step, in closed form.

    A step with block ``S`` and context ``R`` maps ``x - mu`` to ``A_S (x - mu) + e_S`` with
    ``A_S`` the regression ``Sigma_{SR} Sigma_{RR}^{-1}`` on the block's rows (identity
    rows elsewhere) and ``e_S`` Gaussian with the conditional covariance of the block:
    the Schur complement (``joint=True``) or only its diagonal (``joint=False``, each
    feature from its own conditional). The stationary ``C`` solves
    ``C = E_S[A_S C A_S^T + Cov(e_S)]``, a ``D^2 x D^2`` linear system; ``joint=True`` gives
    ``Sigma`` back.

    :param torch.Tensor covariance: ``Sigma``, ``(D, D)``; every block of ``D`` choose
        ``block_size`` is enumerated, so keep ``D`` small (a dozen).
    :returns: ``C``, ``(D, D)``.
    """
    num_features = covariance.shape[-1]
    eye = torch.eye(num_features, dtype=covariance.dtype, device=covariance.device)
    blocks = list(itertools.combinations(range(num_features), block_size))
    transition = covariance.new_zeros(num_features**2, num_features**2)
    noise = torch.zeros_like(covariance)
    for block in blocks:
        s = list(block)
        r = [j for j in range(num_features) if j not in block]
        gain = eye.clone()
        gain[s] = 0.0
        schur = covariance[s][:, s]
        if r:
            regression = covariance[s][:, r] @ torch.linalg.inv(covariance[r][:, r])
            gain[torch.tensor(s)[:, None], torch.tensor(r)] = regression
            schur = schur - regression @ covariance[r][:, s]
        if not joint:
            schur = torch.diag(schur.diagonal())
        noise[torch.tensor(s)[:, None], torch.tensor(s)] += schur
        transition += torch.kron(gain, gain)
    transition /= len(blocks)
    noise /= len(blocks)
    identity = torch.eye(num_features**2, dtype=covariance.dtype, device=covariance.device)
    stationary = torch.linalg.solve(identity - transition, noise.reshape(-1))
    return stationary.reshape(num_features, num_features)
