"""Self-predictive conditionals of Gaussian models in closed form: latent linear-Gaussian
models through the ``K``-dimensional posterior (Woodbury), dense multivariate normals
through their context blocks (:ref:`theory-gaussian`).

Masks enter as 0/1 context weights ``batch + (D,)``, so one batched computation serves
every mask. Every function returns the conditional mean and variance of *each* feature; the
entries of features inside the context are not conditionals (unspecified but finite).

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

from pyro_mpt.ops.active_set import active_set_conditionals
from pyro_mpt.ops.masks import select_masked

__all__ = [
    "latent_gaussian_conditionals",
    "latent_gaussian_log_marginal",
    "dense_gaussian_conditionals",
    "normal_log_prob",
]


def normal_log_prob(x, mean, var):
    """Elementwise ``log N(x | mean, var)``."""
    return -0.5 * ((x - mean) ** 2 / var + var.log() + math.log(2 * math.pi))


def latent_gaussian_conditionals(x, weight, bias, noise_var, context):
    """Conditionals ``p(x_j | x_R)`` of a latent linear-Gaussian model.

    With a standard normal latent ``u`` and context weights ``c`` (1 for features in ``R``):

    .. math::

        \\Lambda = I + W^\\top \\mathrm{diag}(c / \\psi) W, \\qquad
        \\mu_u = \\Lambda^{-1} W^\\top \\mathrm{diag}(c / \\psi)(x - b),

        p(x_j \\mid x_R) = \\mathcal{N}\\big(x_j \\mid w_j^\\top \\mu_u + b_j,\\;
        w_j^\\top \\Lambda^{-1} w_j + \\psi_j\\big).

    :param torch.Tensor x: observations, shape ``batch + (D,)``.
    :param torch.Tensor weight: loading matrix ``W``, shape ``batch + (D, K)`` (broadcastable).
    :param torch.Tensor bias: offset ``b``, shape ``batch + (D,)`` (broadcastable).
    :param torch.Tensor noise_var: noise variances ``psi > 0``, shape ``batch + (D,)``
        (broadcastable).
    :param torch.Tensor context: context weights, 1 where the feature is observed, 0 where
        it is masked; shape ``batch + (D,)`` (broadcastable). Extra leading dimensions (one
        per mask) broadcast against the parameters.
    :returns: ``(mean, var)``, each of the broadcast batch shape ``+ (D,)``.
    """
    context = context.to(x.dtype)
    precision_weights = context / noise_var  # (..., D)
    num_features, latent_dim = weight.shape[-2:]
    eye = torch.eye(latent_dim, dtype=x.dtype, device=x.device)
    shared = weight.shape[:-2].numel() == 1
    if shared:
        # One loading matrix for the whole batch: every D-sized contraction becomes a single
        # matrix product against the D x K^2 table of outer products w_j w_j^T.
        weight = weight.reshape(num_features, latent_dim)
        outer = (weight.unsqueeze(-1) * weight.unsqueeze(-2)).reshape(num_features, -1)
        posterior_precision = eye + (precision_weights @ outer).unflatten(-1, (latent_dim,) * 2)
    else:
        posterior_precision = eye + torch.einsum(
            "...dk,...d,...dl->...kl", weight, precision_weights, weight
        )
    # Batched K x K inverses through the Cholesky factor; triangular solves against many
    # right-hand sides are slow on CPU, so the D-sized products below are matmuls instead.
    # I + W^T diag(1/psi) W is positive definite by construction: the factorisation's error
    # check, a read back from the device, is left out.
    chol = torch.linalg.cholesky_ex(posterior_precision).L
    chol_inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    posterior_cov = chol_inv.transpose(-1, -2) @ chol_inv
    weighted_residual = precision_weights * (x - bias)
    if shared:
        rhs = weighted_residual @ weight
        posterior_mean = (posterior_cov @ rhs.unsqueeze(-1)).squeeze(-1)
        mean = bias + posterior_mean @ weight.T
        var = noise_var + posterior_cov.flatten(-2) @ outer.T
    else:
        rhs = torch.einsum("...dk,...d->...k", weight, weighted_residual)
        posterior_mean = (posterior_cov @ rhs.unsqueeze(-1)).squeeze(-1)
        mean = bias + torch.einsum("...dk,...k->...d", weight, posterior_mean)
        var = noise_var + torch.einsum("...dk,...kl,...dl->...d", weight, posterior_cov, weight)
    return mean, var


def latent_gaussian_log_marginal(x, weight, bias, noise_var, entries=None):
    """Exact ``log p(x) = log N(x | b, W W^T + diag(psi))`` by the Woodbury identity and the
    matrix determinant lemma: ``O(D K^2 + K^3)`` per observation.

    :param torch.Tensor x: observations, shape ``batch + (D,)``.
    :param torch.Tensor weight: ``W``, shape ``batch + (D, K)`` (broadcastable).
    :param torch.Tensor bias: ``b``, shape ``batch + (D,)`` (broadcastable).
    :param torch.Tensor noise_var: ``psi``, shape ``batch + (D,)`` (broadcastable).
    :param torch.Tensor entries: optional booleans ``batch + (D,)``, ``True`` at observed
        entries: the result is then the marginal ``log p(x_observed)``.
    :returns: a tensor of the broadcast batch shape.
    """
    precision = 1 / noise_var
    if entries is not None:
        precision = precision * entries.to(x.dtype)
    weight_t = weight.transpose(-1, -2)
    scaled_t = weight_t * precision.unsqueeze(-2)
    latent_dim = weight.shape[-1]
    eye = torch.eye(latent_dim, dtype=x.dtype, device=x.device)
    chol = torch.linalg.cholesky_ex(eye + scaled_t @ weight).L  # positive definite, as above
    residual = x - bias
    projected = torch.linalg.solve_triangular(chol, scaled_t @ residual.unsqueeze(-1), upper=False)
    mahalanobis = (residual.pow(2) * precision).sum(-1) - projected.pow(2).sum((-1, -2))
    log_noise = noise_var.log().expand(residual.shape)
    if entries is None:
        num_features = x.shape[-1]
    else:
        log_noise = log_noise * entries.to(x.dtype)
        num_features = entries.sum(-1).to(x.dtype)
    log_det = log_noise.sum(-1) + 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * (mahalanobis + log_det + num_features * math.log(2 * math.pi))


def dense_gaussian_conditionals(x, loc, covariance, context):
    """Conditionals ``p(x_j | x_R)`` of a dense multivariate normal ``N(loc, covariance)``.

    Each mask is conditioned through its own active set
    (:func:`pyro_mpt.ops.active_set.active_set_conditionals`): one ``|R| x |R|`` Cholesky
    factor of the context block, the cross-covariances of the masked features with the
    context, and only the diagonal of the masked block,

    .. math::

        m_j = \\mu_j + \\Sigma_{jR} \\Sigma_{RR}^{-1} (x_R - \\mu_R), \\qquad
        v_j = \\Sigma_{jj} - \\Sigma_{jR} \\Sigma_{RR}^{-1} \\Sigma_{Rj}.

    Masks of different sizes in one batch are padded to the largest context, so a batch
    costs ``O(R_max^3 + T_max R_max^2)`` per mask and never an ``N x N`` factor.

    :param torch.Tensor x: observations, shape ``batch + (D,)``.
    :param torch.Tensor loc: mean, shape ``batch + (D,)`` (broadcastable).
    :param torch.Tensor covariance: ``Sigma``, shape ``batch + (D, D)`` (broadcastable; keep
        shared covariances unexpanded so that shared masks factorise once).
    :param torch.Tensor context: context weights (1 observed, 0 masked), ``batch + (D,)``.
    :returns: ``(mean, var)`` of the broadcast batch shape ``+ (D,)`` (``var`` only of the
        batch shape of ``covariance`` and ``context``: it does not depend on ``x``); on
        context features ``mean`` is ``loc`` and ``var`` is 1 (the conditional is degenerate).
    """
    masks = context == 0
    active, target_mean, target_var = active_set_conditionals(x, loc, covariance, masks)
    num_features = covariance.shape[-1]
    mean_shape = target_mean.shape[:-1] + (num_features,)
    var_shape = target_var.shape[:-1] + (num_features,)
    # Padded target slots point at context features, which are overwritten below.
    index = active.target_index
    mean = loc.expand(mean_shape).scatter(
        -1, index.expand(mean_shape[:-1] + index.shape[-1:]), target_mean
    )
    var = target_var.new_ones(var_shape).scatter(
        -1, index.expand(var_shape[:-1] + index.shape[-1:]), target_var
    )
    mean = select_masked(masks, mean, loc)
    var = select_masked(masks, var, 1.0)
    return mean, var
