"""Ground-truth PPCA data and models, the training set-up, and fast exact MPT estimates for
the paper's PPCA studies.

The studies score hundreds of thousands of masks on one fixed model, so the generic path
(:func:`~pyro_mpt.ops.gaussian.latent_gaussian_conditionals` on every mask and observation)
is too slow: about 6 s per ``P = 1`` on the Table 1 problem, where ``P = 100`` must take
seconds. Two exact rearrangements make it cheap.

**Masks shared by all observations** (the paper's convention). For one mask with context
weights ``c``, the latent posterior precision ``Λ = I + Wᵀ diag(c/ψ) W`` and the conditional
variances ``v_j = ψ_j + w_jᵀ Λ⁻¹ w_j`` are the same for every observation, and the conditional
mean is ``b + W B r`` with ``B = Λ⁻¹ Wᵀ diag(c/ψ)`` and ``r = x − b``. The mean over the
observations of ``log p(x_j | x_R)`` therefore needs the data only through the second moment
``S = mean_n r_n r_nᵀ``:

.. math::

    \\frac1N \\sum_n (r_{nj} - w_j^\\top B r_n)^2
        = \\big[(I - W B)\\, S\\, (I - W B)^\\top\\big]_{jj},

which costs ``O(K D²)`` per mask, whatever ``N``.

**Masks drawn per observation.** Each (observation, mask) pair has its own posterior. The
mask is drawn as the first ``M`` entries of a partial Fisher–Yates shuffle, vectorised over
the pairs and run for ``min(M, D − M)`` steps (sorting random keys costs far more), and
``Λ`` is built from whichever side of the mask is smaller (a downdate of the full
precision when fewer features are masked than observed), so a pair costs
``O(min(M, D − M) K² + M K²)``.

Both agree with ``latent_gaussian_conditionals`` followed by
:func:`~pyro_mpt.ops.estimators.mask_scores` to rounding error (see ``tests/test_cli.py``).
"""

import math
from typing import NamedTuple

import pyro
import pyro.optim
import torch
from pyro.infer import SVI

from experiments import _common as common
from pyro_mpt import log_marginal
from pyro_mpt.models import PPCA
from pyro_mpt.ops.estimators import mask_scores
from pyro_mpt.ops.gaussian import latent_gaussian_log_marginal, normal_log_prob
from pyro_mpt.ops.masks import masks_of_sizes

__all__ = [
    "NOISE_CHOICES",
    "PPCAData",
    "check_noise",
    "exact_log_marginal",
    "ground_truth",
    "maximum_log_marginal",
    "mean_log_marginal",
    "no_guide",
    "per_observation_estimate",
    "per_observation_scores",
    "ppca_data",
    "random_subsets",
    "shared_mask_estimate",
    "shared_mask_scores",
    "trainee",
]

NOISE_CHOICES = ("paper", "model")

# Elements of the largest float64 intermediate per chunk (64 MB), which bounds the memory
# of a chunk to a few hundred MB.
_CHUNK_ELEMENTS = 8 * 10**6


class PPCAData(NamedTuple):
    """Observations ``x (N, D)`` and the generating PPCA: ``weight (D, K)``, ``bias (D,)``,
    ``noise_var (D,)`` (the model's noise variances), and the data-noise convention."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    noise_var: torch.Tensor
    noise: str


def check_noise(noise):
    """Rejects a data-noise convention other than those of :data:`NOISE_CHOICES`."""
    if noise not in NOISE_CHOICES:
        raise ValueError(f"noise={noise!r} is not known; use one of {NOISE_CHOICES}.")


def ppca_data(num_obs, num_features, latent_dim, noise_var=0.2, noise="paper", device="cpu"):
    """Draws ``W_ij ~ N(0, 1)``, ``z_n ~ N(0, I_K)`` and ``x_n = W z_n + eps_n`` (mean 0), in
    float64, from torch's global random state.

    :param float noise_var: the model's noise variance ``σ²``.
    :param str noise: ``"paper"``: one draw ``eps_n = e_n 1`` per observation, shared by all
        features, with standard deviation ``σ²`` (the paper's scripts use ``1/beta = 0.2``
        both as this standard deviation and as the model's variance), so the data are *not*
        from the model; ``"model"``: independent ``eps_nj ~ N(0, σ²)``, as the model assumes.
    """
    check_noise(noise)
    opts = dict(dtype=torch.float64, device=device)
    weight = torch.randn(num_features, latent_dim, **opts)
    latent = torch.randn(num_obs, latent_dim, **opts)
    if noise == "paper":
        eps = noise_var * torch.randn(num_obs, 1, **opts)
    else:
        eps = math.sqrt(noise_var) * torch.randn(num_obs, num_features, **opts)
    x = latent @ weight.T + eps
    bias = torch.zeros(num_features, **opts)
    return PPCAData(x, weight, bias, torch.full((num_features,), float(noise_var), **opts), noise)


def exact_log_marginal(data):
    """The exact ``log p(x)`` under the generating parameters, averaged over observations."""
    return float(
        latent_gaussian_log_marginal(data.x, data.weight, data.bias, data.noise_var).mean()
    )


def no_guide(x):
    """:class:`~pyro_mpt.MPTLoss` integrates the latents out exactly, so no guide is needed."""


def mean_log_marginal(model, x):
    """The exact ``log p(x)`` of a :class:`~pyro_mpt.models.PPCA`, averaged over
    observations."""
    with torch.no_grad():
        return float(log_marginal(model.model, x).mean())


def ground_truth(num_obs, num_features, latent_dim, seed, device, noise_var=0.2):
    """A ground-truth ``PPCA(D, K, init_scale=1.0, noise_scale=√noise_var)`` drawn from
    ``seed``, and ``num_obs`` of its samples. Clears the parameter store first; the models
    trained on the samples (:func:`trainee`) reuse the parameter names and clear it again.

    :returns: ``(truth, x)``.
    """
    pyro.clear_param_store()
    common.seed_everything(seed)
    truth = PPCA(num_features, latent_dim, init_scale=1.0, noise_scale=math.sqrt(noise_var))
    truth = truth.to(device)
    return truth, truth.sample(num_obs)


def trainee(num_features, latent_dim, loss, lr, seed, device):
    """A ``PPCA(D, K, init_scale=1.0)`` initialised from ``seed`` (``W`` from ``N(0, 1)``; mean
    and noise scale learned too) and the full-batch :class:`~pyro.infer.SVI` that trains it on
    ``loss`` with Adam at learning rate ``lr``. Clears the parameter store first.

    :returns: ``(model, svi)``.
    """
    pyro.clear_param_store()
    common.seed_everything(seed)
    model = PPCA(num_features, latent_dim, init_scale=1.0).to(device)
    return model, SVI(model.model, no_guide, pyro.optim.Adam({"lr": lr}), loss=loss)


def maximum_log_marginal(x, latent_dim):
    """The largest per-observation ``log p(x)`` of a PPCA with ``latent_dim`` factors and
    isotropic noise on the data ``x`` (``N x D``), at its closed-form maximum-likelihood
    parameters (Tipping & Bishop, 1999): mean the sample mean, ``σ²`` the mean of the
    ``D - K`` smallest eigenvalues of the sample covariance ``S``, and ``W W^T + σ² I``
    equal to ``S`` on its top ``K`` eigenvectors. Trained runs are compared with it.
    """
    num_obs, num_features = x.shape
    if not 0 < latent_dim < num_features:
        raise ValueError(
            f"latent_dim={latent_dim} must lie in 1..{num_features - 1} (D - 1) for data with "
            f"D={num_features} features."
        )
    residual = x - x.mean(0)
    eigenvalues = torch.linalg.eigvalsh(residual.T @ residual / num_obs).flip(0)
    noise_var = eigenvalues[latent_dim:].mean()
    log_det = eigenvalues[:latent_dim].log().sum() + (num_features - latent_dim) * noise_var.log()
    # At the maximum, tr(C^-1 S) = D.
    return float(-0.5 * (num_features * math.log(2 * math.pi) + log_det + num_features))


def shared_mask_scores(second_moment, weight, noise_var, masks):
    """Mask scores ``(1/M) Σ_{j∈mask} log p(x_j | x_R)`` averaged over the observations, for
    masks shared by all of them.

    :param torch.Tensor second_moment: ``S = mean_n (x_n − b)(x_n − b)ᵀ``, shape ``(D, D)``.
    :param torch.Tensor weight: ``W``, shape ``(D, K)``.
    :param torch.Tensor noise_var: ``ψ``, shape ``(D,)``.
    :param torch.Tensor masks: boolean, ``True`` at masked features, shape ``(C, D)``.
    :returns: shape ``(C,)``.
    """
    count, latent_dim = masks.shape[0], weight.shape[-1]
    weight_t = weight.T
    scaled_t = weight_t * ((~masks).to(weight.dtype) / noise_var).unsqueeze(-2)  # (C, K, D)
    eye = torch.eye(latent_dim, dtype=weight.dtype, device=weight.device)
    chol = torch.linalg.cholesky(eye + scaled_t @ weight)
    gain = torch.cholesky_solve(scaled_t, chol)  # B = Λ⁻¹ Wᵀ diag(c/ψ), (C, K, D)
    gain_s = gain @ second_moment  # B S
    cross = (weight_t * gain_s).sum(-2)  # diag(W B S)
    quad = ((weight @ (gain_s @ gain.mT)) * weight).sum(-1)  # diag(W B S Bᵀ Wᵀ)
    sq_err = (second_moment.diagonal() - 2 * cross + quad).clamp(min=0)
    whitened = torch.linalg.solve_triangular(
        chol, weight_t.expand(count, *weight_t.shape), upper=False
    )
    var = noise_var + whitened.pow(2).sum(-2)
    log_cond = -0.5 * (sq_err / var + var.log() + math.log(2 * math.pi))
    return mask_scores(log_cond, masks)


def shared_mask_estimate(data, sizes, num_masks, bar=None):
    """``D`` times the mean over ``sizes`` of ``S(x; M)``, each ``S`` the mean score of
    ``num_masks`` random masks of size ``M`` shared by all observations; with ``sizes = 1..D``
    this is the paper's cumulative estimate ``Σ_M S(x; M)``. Averaged over observations.

    :param torch.Tensor sizes: mask sizes, shape ``(S,)``.
    :param bar: an optional progress bar, advanced by one per mask.
    """
    num_features = data.x.shape[-1]
    residual = data.x - data.bias
    second_moment = residual.T @ residual / residual.shape[0]
    all_sizes = sizes.to(data.x.device).repeat_interleave(num_masks)
    chunk = max(1, _CHUNK_ELEMENTS // (num_features * max(data.weight.shape[-1], 8)))
    total = torch.zeros((), dtype=data.x.dtype, device=data.x.device)
    for start in range(0, all_sizes.numel(), chunk):
        masks = masks_of_sizes(all_sizes[start : start + chunk], num_features)
        total = total + shared_mask_scores(second_moment, data.weight, data.noise_var, masks).sum()
        if bar is not None:
            bar.update(masks.shape[0])
    return float(num_features * total / all_sizes.numel())


def random_subsets(num_rows, num_features, size, device=None):
    """Independent uniform random subsets of ``size`` features for ``num_rows`` rows.

    :returns: a ``long`` tensor ``(num_rows, D)``, a random arrangement of ``0..D−1`` per row
        whose first ``size`` entries form the subset (and the rest its complement).
    """
    rows = torch.arange(num_rows, device=device)
    perm = torch.arange(num_features, device=device).repeat(num_rows, 1)
    # A uniform k-subset's complement is a uniform (D-k)-subset: shuffle the shorter side.
    steps = min(size, num_features - size)
    for i in range(steps):
        pick = i + (torch.rand(num_rows, device=device) * (num_features - i)).long()
        pick = pick.clamp(max=num_features - 1)
        head, other = perm[:, i].clone(), perm[rows, pick]
        perm[:, i] = other
        perm[rows, pick] = head
    if steps < size:  # the shuffled prefix is the complement: move it to the back
        perm = torch.cat([perm[:, steps:], perm[:, :steps]], dim=-1)
    return perm


def per_observation_scores(residual, weight, noise_var, perm, size):
    """Mask scores of one mask per row, the masked features being ``perm[:, :size]``.

    :param torch.Tensor residual: ``x − b`` of the observation of each row, ``(R, D)``.
    :param torch.Tensor weight: ``W``, shape ``(D, K)``.
    :param torch.Tensor noise_var: ``ψ``, shape ``(D,)``.
    :param torch.Tensor perm: from :func:`random_subsets`, ``(R, D)``.
    :param int size: the mask size ``M``.
    :returns: shape ``(R,)``.
    """
    num_rows, num_features = residual.shape
    latent_dim = weight.shape[-1]
    masked = perm[:, :size]
    context = torch.ones_like(residual).scatter_(-1, masked, 0.0)
    precision_weights = context / noise_var  # (R, D)
    # Rows of w_j w_jᵀ flattened, so Λ and the variances are plain matrix products.
    outer = (weight.unsqueeze(-1) * weight.unsqueeze(-2)).reshape(num_features, -1)
    eye = torch.eye(latent_dim, dtype=weight.dtype, device=weight.device)
    precision = eye + (precision_weights @ outer).reshape(num_rows, latent_dim, latent_dim)
    chol = torch.linalg.cholesky(precision)
    rhs = (precision_weights * residual) @ weight  # (R, K)
    post_mean = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
    post_cov = torch.cholesky_inverse(chol).reshape(num_rows, -1)
    mean = (post_mean @ weight.T).gather(-1, masked)
    var = (noise_var + post_cov @ outer.T).gather(-1, masked)
    return normal_log_prob(residual.gather(-1, masked), mean, var).mean(-1)


def per_observation_estimate(data, sizes, num_masks, bar=None):
    """Like :func:`shared_mask_estimate`, but every observation draws its own ``num_masks``
    masks of each size (the convention of :class:`~pyro_mpt.MPTLoss` with
    ``share_masks=False``)."""
    num_obs, num_features = data.x.shape
    residual = data.x - data.bias
    # Chunks of about 5e5 elements stay in cache and run faster than larger ones.
    row_width = max(num_features, data.weight.shape[-1] ** 2)
    rows_per_chunk = max(1, min(_CHUNK_ELEMENTS, 5 * 10**5) // row_width)
    total = torch.zeros((), dtype=data.x.dtype, device=data.x.device)
    for size in sizes.tolist():
        for start in range(0, num_masks * num_obs, rows_per_chunk):
            rows = torch.arange(start, min(start + rows_per_chunk, num_masks * num_obs))
            obs_residual = residual[rows.to(residual.device) % num_obs]
            perm = random_subsets(rows.numel(), num_features, size, device=residual.device)
            scores = per_observation_scores(obs_residual, data.weight, data.noise_var, perm, size)
            total = total + scores.sum()
        if bar is not None:
            bar.update(num_masks)
    return float(num_features * total / (len(sizes) * num_masks * num_obs))
