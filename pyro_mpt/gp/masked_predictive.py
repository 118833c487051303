"""``MaskedPredictiveLogLikelihood``: the MPT objective as a GPyTorch marginal log likelihood."""

import torch
from gpytorch import settings
from gpytorch.distributions import MultivariateNormal
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.mlls import ExactMarginalLogLikelihood
from linear_operator.operators import DiagLinearOperator, SumLinearOperator

from pyro_mpt.ops.active_set import active_set_predictive, split_masks
from pyro_mpt.ops.gaussian import normal_log_prob
from pyro_mpt.ops.masks import as_rate_schedule, check_num_masks, sample_masks

__all__ = ["MaskedPredictiveLogLikelihood"]


def _covariance_blocks(covariance, context, target):
    """``Sigma_RR``, ``Sigma_TR`` and ``diag(Sigma_TT)`` of a (lazy) covariance.

    Each summand is indexed lazily, so a kernel matrix is evaluated on the ``R x R`` and
    ``T x R`` blocks only; a diagonal summand (the likelihood's noise) adds to the context
    block's diagonal and to the target variances without any matrix.
    """
    summands = covariance.linear_ops if isinstance(covariance, SumLinearOperator) else (covariance,)
    context_cov = cross_cov = target_var = 0
    for summand in summands:
        diagonal = summand.diagonal(dim1=-2, dim2=-1)
        target_var = target_var + diagonal[..., target]
        if isinstance(summand, DiagLinearOperator):
            context_cov = context_cov + torch.diag_embed(diagonal[..., context])
            continue
        context_cov = context_cov + _block(summand, context, context)
        cross_cov = cross_cov + _block(summand, target, context)
    if not torch.is_tensor(cross_cov):
        cross_cov = target_var.new_zeros(target_var.shape + context.shape)
    return context_cov, cross_cov, target_var


def _block(covariance, rows, cols):
    """``covariance[..., rows, :][..., :, cols]`` as a dense tensor.

    A lazily evaluated kernel matrix is evaluated on the indexed inputs directly, which
    skips the generic index bookkeeping of ``LinearOperator`` (it dominates small blocks).
    """
    if isinstance(covariance, LazyEvaluatedKernelTensor):
        x1 = covariance.x1[..., rows, :]
        x2 = covariance.x2[..., cols, :]
        with settings.lazily_evaluate_kernels(False):
            block = covariance.kernel(x1, x2, **covariance.params)
        return block.to_dense()
    return covariance[..., rows, :][..., :, cols].to_dense()


class MaskedPredictiveLogLikelihood(ExactMarginalLogLikelihood):
    """The masked-predictive (active-set) estimate of an exact GP's log marginal likelihood.

    Each step hides a random subset ``T`` of ``M`` training points and scores them under the
    GP posterior predictive given the other ``R`` points (the active set):

    .. math::

        \\widehat{\\mathcal{L}} = \\frac{1}{N} \\cdot \\frac{N}{M} \\sum_{j \\in T}
            \\log p(y_j \\mid \\mathbf{y}_R, X, \\theta), \\qquad
        \\log p(\\mathbf{y} \\mid X, \\theta) = \\sum_{M=1}^{N}
            \\mathbb{E}_{|T| = M}\\Big[\\frac{1}{M}\\sum_{j\\in T}
            \\log p(y_j \\mid \\mathbf{y}_R)\\Big].

    With ``rate="uniform"`` (``M ~ Uniform{1..N}``) :math:`\\widehat{\\mathcal{L}}` is an
    unbiased estimate of ``ExactMarginalLogLikelihood``'s value (the log marginal likelihood
    divided by ``N``), because the conditionals are the exact GP predictives (Fong & Holmes,
    2020; Moreno-Muñoz et al., 2023). With masks of size one its expectation is GPyTorch's
    ``LeaveOneOutPseudoLikelihood``. With a fixed rate it is the stochastic active-set
    objective (Moreno-Muñoz et al., 2022): biased, but a step costs one ``|R| x |R|``
    Cholesky factor and ``O(M |R|)`` kernel entries instead of an ``N x N`` factor. Only the
    blocks a mask needs are read from the (lazy) kernel matrix.

    :param likelihood: a Gaussian likelihood (``gpytorch.likelihoods.GaussianLikelihood`` or
        another of GPyTorch's Gaussian likelihoods).
    :param model: the exact GP (``gpytorch.models.ExactGP``).
    :param rate: the mask-size schedule: ``"uniform"`` (unbiased), a float in ``(0, 1]`` (fixed
        rate; ``|R| = N - max(1, floor(rate N + 1/2))``) or a pair ``(lo, hi)``; see
        :func:`pyro_mpt.ops.masks.as_rate_schedule`.
    :param int num_masks: masks averaged per call, with stratified sizes; each mask is shared
        by every GP of a batch.

    Example::

        >>> import gpytorch, torch
        >>> from pyro_mpt.gp import MaskedPredictiveLogLikelihood
        >>> train_x, train_y = torch.linspace(0, 1, 50), torch.randn(50)
        >>> class GP(gpytorch.models.ExactGP):
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(
        ...             self.mean_module(x), self.covar_module(x))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = GP(train_x, train_y, likelihood)
        >>> model.mean_module = gpytorch.means.ConstantMean()
        >>> model.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        >>> mll = MaskedPredictiveLogLikelihood(likelihood, model, rate="uniform")
        >>> loss = -mll(model(train_x), train_y)
        >>> loss.backward()

    .. note:: Prior terms and added loss terms of the model are included as in
        ``ExactMarginalLogLikelihood``. Missing (NaN) targets are not supported.

    **References**

    E. Fong, C. C. Holmes. *On the marginal likelihood and cross-validation.* Biometrika 2020.
    P. Moreno-Muñoz, C. Feldager, S. Hauberg. *Revisiting active sets for Gaussian process
    decoders.* NeurIPS 2022.
    P. Moreno-Muñoz, P. G. Recasens, S. Hauberg. *On Masked Pre-training and the Marginal
    Likelihood.* NeurIPS 2023.
    """

    def __init__(self, likelihood, model, rate="uniform", num_masks=1):
        schedule = as_rate_schedule(rate)
        num_masks = check_num_masks(num_masks)
        try:  # GPyTorch's exact objective accepts only its Gaussian likelihoods
            super().__init__(likelihood, model)
        except RuntimeError as error:
            raise TypeError(
                f"likelihood must be a Gaussian likelihood (e.g. "
                f"gpytorch.likelihoods.GaussianLikelihood), got {type(likelihood).__name__}. "
                f"Exact predictive conditionals exist only for Gaussian noise; use "
                f"gpytorch.mlls.VariationalELBO for other likelihoods."
            ) from error
        self.schedule = schedule
        self.num_masks = num_masks

    def extra_repr(self):
        return f"rate={self.schedule!r}, num_masks={self.num_masks}"

    def _check_inputs(self, function_dist, target):
        if not isinstance(function_dist, MultivariateNormal):
            raise TypeError(
                f"function_dist must be a gpytorch.distributions.MultivariateNormal (the "
                f"output of an ExactGP), got {type(function_dist).__name__}."
            )
        num_data = function_dist.event_shape.numel()
        if target.shape[-1:] != function_dist.event_shape:
            raise ValueError(
                f"target has shape {tuple(target.shape)} but the GP has {num_data} data "
                f"points; pass one target per training input, shape (..., {num_data})."
            )
        return num_data

    def masked_log_prob(self, function_dist, target, mask, *params, **kwargs):
        """``log p(y_j | y_R)`` of every masked training point ``j`` given the others.

        :param ~gpytorch.distributions.MultivariateNormal function_dist: the GP prior at the
            training inputs.
        :param torch.Tensor target: training targets, shape ``batch_shape + (N,)``.
        :param torch.Tensor mask: boolean, shape ``(N,)``, ``True`` at the held-out points.
        :returns: a tensor of shape ``batch_shape + (M,)``, the masked points in index order.
        """
        num_data = self._check_inputs(function_dist, target)
        if mask.shape != (num_data,) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a boolean tensor of shape ({num_data},), got shape "
                f"{tuple(mask.shape)} and dtype {mask.dtype}."
            )
        output = self.likelihood(function_dist, *params, **kwargs)
        return self._masked_log_prob(output, target, mask)

    def _masked_log_prob(self, output, target, mask):
        mean, covariance = output.mean, output.lazy_covariance_matrix
        active = split_masks(mask)
        context, targets = active.context_index, active.target_index
        context_cov, cross_cov, target_var = _covariance_blocks(covariance, context, targets)
        residual = (target - mean)[..., context]
        mean_offset, var = active_set_predictive(
            context_cov, cross_cov, target_var, residual, active.context_valid
        )
        return normal_log_prob(target[..., targets], mean[..., targets] + mean_offset, var)

    def forward(self, function_dist, target, *params, **kwargs):
        """The estimate, shape ``batch_shape`` of the GP, divided by the number of data points.

        :param ~gpytorch.distributions.MultivariateNormal function_dist: the GP prior at the
            training inputs (the output of the ``ExactGP`` in training mode).
        :param torch.Tensor target: the training targets, shape ``batch_shape + (N,)``.
        """
        num_data = self._check_inputs(function_dist, target)
        output = self.likelihood(function_dist, *params, **kwargs)
        masks, sizes = sample_masks(self.schedule, self.num_masks, (), num_data, target.device)
        total = 0
        # One mask at a time: masks of different sizes give blocks of different sizes.
        for mask, size in zip(masks, sizes.tolist()):
            log_p = self._masked_log_prob(output, target, mask)
            total = total + log_p.sum(-1) * (num_data / size)
        res = total / self.num_masks
        res = self._add_other_terms(res, params)
        return res.div_(num_data)
