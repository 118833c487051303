"""``MaskedPredictiveLogLikelihood``: the MPT objective as a GPyTorch marginal log likelihood."""

import warnings

import torch
from gpytorch import settings
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.kernels import GridKernel, InducingPointKernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.likelihoods import Likelihood
from gpytorch.mlls import ExactMarginalLogLikelihood
from gpytorch.models import GP
from linear_operator.operators import DiagLinearOperator, SumLinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning

from pyro_mpt.ops.active_set import active_set_predictive, split_masks
from pyro_mpt.ops.gaussian import normal_log_prob
from pyro_mpt.ops.masks import as_rate_schedule, check_num_masks, sample_masks

__all__ = ["MAX_VARIANCE_ROUNDING", "MaskedPredictiveLogLikelihood"]

#: The largest rounding error of a held-out output's predictive variance, relative to it,
#: that passes without a ``NumericalWarning``: machine epsilon times how far the variance
#: fell below its prior variance. Measured on 60 smooth points in float32, 30 held out:
#: noise ``1e-6`` gives about 0.1 and 139 nats off in all (54 at one output), ``1e-5``
#: about 0.008 and 0.4 nats off (0.75 at one output), ``1e-4`` about 0.001 and 0.0005 off.
MAX_VARIANCE_ROUNDING = 0.005


#: Kernels whose value at a pair of inputs depends on the other inputs they are given
#: (KISS-GP's grid is fitted to its inputs; SGPR's kernel refuses unequal inputs while
#: training): a covariance that holds one is evaluated whole and then indexed.
_WHOLE_INPUT_KERNELS = (GridKernel, InducingPointKernel)


def _covariance_blocks(covariance, context, target):
    """``Sigma_RR``, ``Sigma_TR`` and ``diag(Sigma_TT)`` of a (lazy) covariance.

    Each summand is indexed lazily, so a kernel matrix is evaluated on the ``R x R`` and
    ``T x R`` blocks only; a diagonal summand (the likelihood's noise) adds to the context
    block's diagonal and to the target variances without any matrix. A kernel that must see
    every input (:data:`_WHOLE_INPUT_KERNELS`) is evaluated whole, as
    ``ExactMarginalLogLikelihood`` evaluates it, and then indexed. With no context (every
    output hidden), the blocks are empty and no operator is indexed.
    """
    summands = covariance.linear_ops if isinstance(covariance, SumLinearOperator) else (covariance,)
    context_cov = cross_cov = target_var = 0
    empty = context.shape[-1] == 0
    for summand in summands:
        if _sees_every_input(summand):
            summand = summand.to_dense()
        diagonal = summand.diagonal(dim1=-2, dim2=-1)
        target_var = target_var + diagonal[..., target]
        if empty:
            continue
        if isinstance(summand, DiagLinearOperator):
            context_cov = context_cov + torch.diag_embed(diagonal[..., context])
            continue
        context_cov = context_cov + _block(summand, context, context)
        cross_cov = cross_cov + _block(summand, target, context)
    if not torch.is_tensor(context_cov):
        context_cov = target_var.new_zeros(target_var.shape[:-1] + context.shape * 2)
    if not torch.is_tensor(cross_cov):
        cross_cov = target_var.new_zeros(target_var.shape + context.shape)
    return context_cov, cross_cov, target_var


def _sees_every_input(summand):
    """Whether ``summand`` is a lazily evaluated kernel matrix of a kernel that holds one of
    :data:`_WHOLE_INPUT_KERNELS` (as itself or inside a ``ScaleKernel``, a sum, ...)."""
    if not isinstance(summand, LazyEvaluatedKernelTensor):
        return False
    return any(isinstance(module, _WHOLE_INPUT_KERNELS) for module in summand.kernel.modules())


def _block(covariance, rows, cols):
    """``covariance[..., rows, :][..., :, cols]`` as a dense tensor.

    A lazily evaluated kernel matrix with one output per input is evaluated on the indexed
    inputs directly, which skips the generic index bookkeeping of ``LinearOperator`` (it
    dominates small blocks); a multitask kernel's rows are (input, task) pairs, not inputs.
    Another operator is read entry by entry (a Kronecker product from its factors).
    """
    if isinstance(covariance, LazyEvaluatedKernelTensor) and _one_output_per_input(covariance):
        x1 = covariance.x1[..., rows, :]
        x2 = covariance.x2[..., cols, :]
        # The stored inputs have the kernel's active_dims taken already: the kernel must
        # not take them again (a permutation of them would swap the inputs' dims silently),
        # as GPyTorch's own evaluation of the lazy tensor does not.
        kernel, active_dims = covariance.kernel, covariance.kernel.active_dims
        kernel.active_dims = None
        try:
            with settings.lazily_evaluate_kernels(False):
                block = kernel(x1, x2, **covariance.params)
        finally:
            kernel.active_dims = active_dims
        return block.to_dense()
    return torch.as_tensor(covariance[..., rows.unsqueeze(-1), cols.unsqueeze(-2)])


def _one_output_per_input(covariance):
    kernel = covariance.kernel
    return kernel.num_outputs_per_input(covariance.x1, covariance.x2) == 1


def _stacked_positions(output):
    """Where each target of ``output`` sits in its covariance matrix, targets flattened in
    row-major order: the identity, except for a multitask output stored task by task
    (``interleaved=False``), whose row-major entry ``(i, k)`` is at ``k n + i``."""
    num_data = output.event_shape.numel()
    positions = torch.arange(num_data, device=output.loc.device)
    if isinstance(output, MultitaskMultivariateNormal) and not output._interleaved:
        num_inputs, num_tasks = output.event_shape
        positions = positions.reshape(num_tasks, num_inputs).T.reshape(-1)
    return positions


def _noise_text(likelihood):
    """The likelihood's noise for an error message: its smallest value, or ``''``."""
    for name in ("noise", "task_noises"):
        try:
            noise = getattr(likelihood, name)
        except (AttributeError, RuntimeError):  # a multitask likelihood without global noise
            continue
        if torch.is_tensor(noise) and noise.numel():
            return f"noise={noise.detach().min().item():.1e}, "
    return ""


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
    blocks a mask needs are read from the (lazy) kernel matrix, except from a kernel whose
    entries depend on all the inputs it is given (KISS-GP's ``GridInterpolationKernel``,
    SGPR's ``InducingPointKernel``, alone or inside another kernel): that one is evaluated
    whole, as ``ExactMarginalLogLikelihood`` evaluates it, and then indexed.

    **Multitask GPs.** With a ``MultitaskMultivariateNormal`` output (``n`` inputs, ``t``
    tasks, targets of shape ``(..., n, t)`` as for ``ExactMarginalLogLikelihood``) the tokens
    are the ``N = n t`` scalar outputs: a mask hides single (input, task) entries, each
    scored given every output left visible, under the Gaussian over the stacked outputs in
    GPyTorch's layout (interleaved or not). The estimate is again unbiased for the log
    marginal likelihood over the ``n t`` outputs, which ``ExactMarginalLogLikelihood``
    divides by ``n t``. For an output stored task by task (``interleaved=False``), GPyTorch
    1.15's ``MultitaskMultivariateNormal.log_prob``, and so ``ExactMarginalLogLikelihood``,
    differs from the density of the same normal stored interleaved; this estimate follows
    the latter, the dense normal's (``tests/test_gp_multitask.py``). The likelihood
    (``MultitaskGaussianLikelihood``) evaluates the ``n x n`` input kernel, so only the
    Cholesky factor shrinks to ``|R| x |R|``.

    **Numerics.** The context block is factorised as GPyTorch factorises its kernel matrix
    (``psd_safe_cholesky``): where rounding makes it indefinite, e.g. a noise of ``1e-6`` in
    float32, jitter is added to its diagonal with a ``NumericalWarning``
    (``gpytorch.settings.cholesky_jitter``, ``cholesky_max_tries``); if that is not enough,
    ``NotPSDError`` names the noise, the dtype and the fixes (float64, a noise constraint).
    So does a held-out output whose predictive variance rounds to zero or below. One whose
    variance is positive but so far below its prior variance that rounding decides it (its
    rounding error past :data:`MAX_VARIANCE_ROUNDING` of it: a noise of ``1e-5`` or less in
    float32) gets a ``NumericalWarning`` with the same fixes: its log density may be nats off
    with no factorisation failing.

    :param likelihood: a Gaussian likelihood (``gpytorch.likelihoods.GaussianLikelihood`` or
        another of GPyTorch's Gaussian likelihoods, ``MultitaskGaussianLikelihood`` included).
    :param model: the exact GP (``gpytorch.models.ExactGP``), single- or multitask.
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
            if isinstance(likelihood, GP) and isinstance(model, Likelihood):
                raise TypeError(
                    f"The likelihood ({type(model).__name__}) and the model "
                    f"({type(likelihood).__name__}) are swapped: pass "
                    f"MaskedPredictiveLogLikelihood(likelihood, model), in the order of "
                    f"gpytorch's ExactMarginalLogLikelihood."
                ) from error
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
        """Checks ``target`` against the GP's event shape, and, while GPyTorch's debug setting
        is on (its default), that it holds no NaN; returns the number of outputs."""
        if not torch.is_tensor(target):
            raise TypeError(
                f"target must be a torch.Tensor, got {type(target).__name__}; convert it, "
                f"e.g. torch.as_tensor(y, dtype=torch.float64)."
            )
        if settings.debug.on() and target.is_floating_point():
            missing = int(torch.isnan(target).sum())
            if missing:
                raise ValueError(
                    f"target holds {missing} NaN values; MaskedPredictiveLogLikelihood scores "
                    f"every target and conditions on every other, so the objective would be "
                    f"NaN. Drop those points from the training data (model.set_train_data)."
                )
        if not isinstance(function_dist, MultivariateNormal):
            raise TypeError(
                f"function_dist must be a gpytorch.distributions.MultivariateNormal (the "
                f"output of an ExactGP), got {type(function_dist).__name__}."
            )
        event_shape = function_dist.event_shape
        num_data = event_shape.numel()
        if target.shape[target.dim() - len(event_shape) :] == event_shape:
            return num_data
        if isinstance(function_dist, MultitaskMultivariateNormal):
            num_inputs, num_tasks = event_shape
            raise ValueError(
                f"target has shape {tuple(target.shape)} but the multitask GP has "
                f"{num_inputs} inputs and {num_tasks} tasks; pass one row of task targets per "
                f"training input, shape (..., {num_inputs}, {num_tasks}), as for "
                f"ExactMarginalLogLikelihood."
            )
        raise ValueError(
            f"target has shape {tuple(target.shape)} but the GP has {num_data} data "
            f"points; pass one target per training input, shape (..., {num_data})."
        )

    def masked_log_prob(self, function_dist, target, mask, *params, **kwargs):
        """``log p(y_j | y_R)`` of every masked training output ``j`` given the others.

        :param ~gpytorch.distributions.MultivariateNormal function_dist: the GP prior at the
            training inputs.
        :param torch.Tensor target: training targets, shape ``batch_shape + (N,)``, or
            ``batch_shape + (n, t)`` for a multitask GP.
        :param torch.Tensor mask: boolean, of the GP's event shape (``(N,)`` or ``(n, t)``),
            ``True`` at the held-out outputs.
        :returns: a tensor of shape ``batch_shape + (M,)``, the masked outputs in row-major
            order of ``mask`` (the order of ``mask.nonzero()``).
        """
        num_data = self._check_inputs(function_dist, target)
        event_shape = function_dist.event_shape
        if mask.shape != event_shape or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a boolean tensor of shape {tuple(event_shape)} (the GP's event "
                f"shape), got shape {tuple(mask.shape)} and dtype {mask.dtype}."
            )
        output = self.likelihood(function_dist, *params, **kwargs)
        if not bool(mask.any()):  # nothing held out: no conditional to score
            return output.mean.new_zeros(output.batch_shape + (0,))
        return self._masked_log_prob(output, target, mask.reshape(num_data))

    def _masked_log_prob(self, output, target, mask):
        """``mask`` is over the ``N`` outputs flattened in row-major order, as is the result."""
        num_data = mask.shape[-1]
        batch_shape = output.batch_shape
        # A multitask output's (n, t) mean and targets are flattened row by row, and its
        # covariance read at the matching (interleaved or task-major) positions.
        mean = output.mean.reshape(batch_shape + (num_data,))
        target = target.reshape(target.shape[: target.dim() - len(output.event_shape)] + (-1,))
        positions = _stacked_positions(output)
        active = split_masks(mask)
        context, targets = active.context_index, active.target_index
        context_cov, cross_cov, target_var = _covariance_blocks(
            output.lazy_covariance_matrix, positions[context], positions[targets]
        )
        residual = (target - mean)[..., context]
        try:
            # psd_safe_cholesky factorises the context block as ExactMarginalLogLikelihood
            # factorises its kernel matrix: where rounding makes it indefinite (a tiny noise
            # in float32) it adds jitter to the diagonal (gpytorch.settings.cholesky_jitter,
            # at most cholesky_max_tries times) and warns with a NumericalWarning.
            mean_offset, var = active_set_predictive(
                context_cov,
                cross_cov,
                target_var,
                residual,
                active.context_valid,
                cholesky=psd_safe_cholesky,
            )
        except NotPSDError as error:
            subject = f"The covariance of the {context.shape[-1]} context outputs"
            raise self._not_positive_definite(str(error), subject, context_cov.dtype) from error
        # Rounding can leave a held-out output's predictive variance at or below zero where
        # the context block needed jitter (a tiny noise in float32): its log density is NaN.
        # Read in one synchronisation with how far below its prior variance it fell: the
        # variance is a difference, whose rounding error is eps times the prior's.
        smallest, shrink = torch.stack(
            [var.detach().min(), (target_var.detach() / var.detach()).max()]
        ).tolist()
        if not smallest > 0:
            found = f"A held-out output's predictive variance came out at {smallest:.1e}."
            subject = (
                f"The covariance of the held-out outputs given the {context.shape[-1]} "
                f"context outputs"
            )
            raise self._not_positive_definite(found, subject, var.dtype)
        rounding = torch.finfo(var.dtype).eps * shrink
        if rounding > MAX_VARIANCE_ROUNDING:
            warnings.warn(
                f"A held-out output's predictive variance is {shrink:.1e} times below its "
                f"prior variance, so in {var.dtype} its rounding error may be {rounding:.0%} "
                f"of it or more, and its log density off by nats (the noise is "
                f"{_noise_text(self.likelihood) or 'small, '}the context determines it "
                f"almost exactly). Train in float64 (model.double(), likelihood.double() and "
                f"float64 inputs and targets), or bound the noise away from zero, e.g. "
                f"GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-4)).",
                NumericalWarning,
                stacklevel=3,
            )
        return normal_log_prob(target[..., targets], mean[..., targets] + mean_offset, var)

    def _not_positive_definite(self, found, subject, dtype):
        """The error for a covariance (``subject``, in words) that is not positive definite
        in ``dtype``, with the fixes."""
        return NotPSDError(
            f"{found} {subject} (the kernel matrix plus the likelihood's noise; "
            f"{_noise_text(self.likelihood)}dtype {dtype}) is not positive definite in this "
            f"precision. Train in float64 (model.double(), likelihood.double() and float64 "
            f"inputs and targets), or bound the noise away from zero, e.g. "
            f"GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-4))."
        )

    def forward(self, function_dist, target, *params, **kwargs):
        """The estimate, shape ``batch_shape`` of the GP, divided by the number of outputs.

        :param ~gpytorch.distributions.MultivariateNormal function_dist: the GP prior at the
            training inputs (the output of the ``ExactGP`` in training mode).
        :param torch.Tensor target: the training targets, shape ``batch_shape + (N,)``, or
            ``batch_shape + (n, t)`` for a multitask GP (``N = n t`` outputs).
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
