"""A Gaussian-process decoder (GP-LVM) whose covariance comes from a GPyTorch kernel."""

import math
import numbers

import gpytorch
import pyro
import torch
from linear_operator.operators import DenseLinearOperator
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam, pyro_method

from pyro_mpt.errors import check_positive_int
from pyro_mpt.models._param_store import check_stored_shapes

__all__ = ["GPDecoder"]


class GPDecoder(PyroModule):
    """A GP-LVM: each output dimension is a Gaussian process over learned latent codes.

    .. math::

        \\mathbf{y}_{:,d} \\sim \\mathcal{N}\\big(\\mu_d \\mathbf{1},\\;
            K_\\theta(Z, Z) + \\sigma^2 I_N\\big), \\qquad d = 1, \\dots, D,

    with codes :math:`Z \\in \\mathbb{R}^{N \\times Q}` either point estimates (one learnable
    row per data point, Lawrence 2005) or the output of an amortized ``encoder`` applied to
    the data, and any GPyTorch kernel :math:`K_\\theta` (a scaled RBF with one lengthscale per
    latent dimension by default).

    **How** :class:`~pyro_mpt.MPTLoss` **sees it.** The observed site ``"y"`` is a
    (GPyTorch) ``MultivariateNormal`` over the ``N`` *data points*, inside
    ``pyro.plate("outputs", D)``. Its tokens, the features that masks hide, are therefore
    the data points of each output dimension, and the exact conditionals are the GP
    posterior predictives of held-out points given an active set ``R`` of the others: one
    ``|R| x |R|`` Cholesky factor per mask, predictive variances of the held-out points only,
    never an ``N x N`` factor (:mod:`pyro_mpt.ops.active_set`). The kernel matrix itself is
    evaluated densely, ``O(N^2 Q)``. Pass ``share_masks=True`` to ``MPTLoss`` to use one
    active set for every output dimension (one factorisation per step, as in Moreno-Muñoz
    et al., 2022); otherwise each output dimension draws its own. ``Trace_ELBO`` with the
    no-op :meth:`guide` trains the same model by its exact marginal likelihood, at
    ``O(N^3)`` per step.

    The kernel's (and encoder's) parameters are registered with ``pyro.module`` in
    :meth:`model`, so ``SVI`` trains them with the codes and the noise.

    :param int num_data: ``N``, the number of data points (rows of ``y``).
    :param int num_outputs: ``D``, the number of output dimensions (columns of ``y``).
    :param int latent_dim: ``Q``, the dimension of the codes.
    :param kernel: a ``gpytorch.kernels.Kernel`` on ``Q``-dimensional inputs; default
        ``ScaleKernel(RBFKernel(ard_num_dims=Q))``.
    :param encoder: optional ``torch.nn.Module`` mapping ``y`` of shape ``(N, D)`` to codes of
        shape ``(N, Q)``; without one the codes are free parameters. With one, the model's
        covariance is computed from the data it observes, so a masked point's own values
        reach its code: ``impute``, ``gibbs``, ``mpt_curve`` and ``MPTLoss`` at a fixed rate
        refuse it, while ``MPTLoss(rate="uniform")`` and :meth:`log_marginal` stay exact.
    :param torch.Tensor init_codes: initial codes ``(N, Q)`` (e.g. from PCA); default small
        random values. Ignored with an encoder.
    :param float noise_scale: initial noise standard deviation ``sigma``.
    :param float jitter: added to the diagonal of the covariance for numerical stability.

    .. note:: Parameters live in Pyro's global param store (the kernel under
        ``"kernel$$$..."``), so two instances share them; see the note on
        :class:`~pyro_mpt.models.PPCA`. Centre the data or keep the learnable per-output
        mean ``loc``. Under ``pyro.settings.set(module_local_params=True)`` ``SVI`` cannot
        hand the GPyTorch kernel's parameters to a ``pyro.optim`` optimiser; train with a
        ``torch.optim`` optimiser over ``decoder.parameters()`` and
        ``MPTLoss().differentiable_loss(decoder.model, decoder.guide, y)`` instead.

    Example::

        >>> import pyro, torch
        >>> from pyro.infer import SVI
        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.models import GPDecoder
        >>> y = torch.randn(64, 5)
        >>> decoder = GPDecoder(num_data=64, num_outputs=5, latent_dim=2)
        >>> svi = SVI(decoder.model, decoder.guide, pyro.optim.Adam({"lr": 0.01}),
        ...           loss=MPTLoss(rate=0.5, share_masks=True))
        >>> loss = svi.step(y)

    **References**

    N. Lawrence. *Probabilistic non-linear principal component analysis with Gaussian
    process latent variable models.* JMLR 2005.
    P. Moreno-Muñoz, C. Feldager, S. Hauberg. *Revisiting active sets for Gaussian process
    decoders.* NeurIPS 2022.
    """

    def __init__(
        self,
        num_data,
        num_outputs,
        latent_dim=2,
        kernel=None,
        encoder=None,
        init_codes=None,
        noise_scale=1.0,
        jitter=1e-6,
    ):
        super().__init__()
        self.num_data = check_positive_int("num_data", num_data)
        self.num_outputs = check_positive_int("num_outputs", num_outputs)
        self.latent_dim = check_positive_int("latent_dim", latent_dim)
        if kernel is None:
            kernel = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=self.latent_dim)
            )
        if not isinstance(kernel, gpytorch.kernels.Kernel):
            raise TypeError(
                f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}; "
                f"e.g. gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())."
            )
        if kernel.batch_shape:
            # One covariance serves every output: a kernel per output (batch_shape) would
            # broadcast in the likelihood but not in log_marginal or predict.
            raise ValueError(
                f"kernel has batch_shape {tuple(kernel.batch_shape)}; GPDecoder shares one "
                f"kernel across its {self.num_outputs} outputs, so it takes a kernel without "
                f"batch dims. Build it without batch_shape, e.g. "
                f"gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())."
            )
        if encoder is not None and not isinstance(encoder, torch.nn.Module):
            raise TypeError(
                f"encoder must be a torch.nn.Module mapping y (N, D) to codes (N, Q), got "
                f"{type(encoder).__name__}."
            )
        if not (isinstance(noise_scale, numbers.Real) and noise_scale > 0):
            raise ValueError(f"noise_scale must be a positive number, got {noise_scale!r}.")
        self.kernel = kernel
        self.encoder = encoder
        self.jitter = float(jitter)
        if encoder is None:
            if init_codes is None:
                init_codes = 0.1 * torch.randn(self.num_data, self.latent_dim)
            expected = (self.num_data, self.latent_dim)
            if tuple(init_codes.shape) != expected:
                raise ValueError(
                    f"init_codes has shape {tuple(init_codes.shape)} but the decoder has "
                    f"num_data={expected[0]} codes of latent_dim={expected[1]}; pass a tensor "
                    f"of shape {expected}."
                )
            self.codes = PyroParam(init_codes.detach().clone())
        self.loc = PyroParam(torch.zeros(self.num_outputs))
        self.noise_scale = PyroParam(
            torch.tensor(float(noise_scale)), constraint=constraints.positive
        )
        registered = [("kernel", kernel)] + ([("encoder", encoder)] if encoder is not None else [])
        check_stored_shapes(self, registered)

    def _check_data(self, y):
        if not torch.is_tensor(y) or y.dim() != 2:
            raise ValueError(
                f"y must be a tensor of shape (num_data, num_outputs) = "
                f"({self.num_data}, {self.num_outputs}), got "
                f"{tuple(y.shape) if torch.is_tensor(y) else type(y).__name__}."
            )
        num_data, num_outputs = y.shape
        if num_outputs != self.num_outputs:
            raise ValueError(
                f"y has {num_outputs} columns but the decoder has num_outputs="
                f"{self.num_outputs}; pass y of shape (N, {self.num_outputs})."
            )
        if self.encoder is None and num_data != self.num_data:
            raise ValueError(
                f"y has {num_data} rows but the decoder holds codes for num_data="
                f"{self.num_data} points; pass all {self.num_data} data points (codes are "
                f"per data point), or build the decoder with an encoder."
            )

    def codes_for(self, y):
        """The latent codes of the rows of ``y``: ``(N, Q)``.

        Registers the kernel (and encoder) with ``pyro.module``, so every objective built on
        :meth:`model`, :meth:`log_marginal` or :meth:`predict` trains their parameters. Where
        Pyro's param store already holds them (a decoder built before, or
        ``pyro.get_param_store().load(...)``), the decoder computes with the stored ones, as
        with its ``PyroParam`` s: computing with its own would leave them untrained, since
        ``SVI``'s optimiser updates the stored ones.
        """
        self._check_data(y)
        # Module-local parameters are trained by an optimiser that holds the module's own.
        shared = not pyro.settings.get("module_local_params")
        pyro.module("kernel", self.kernel, update_module_params=shared)
        if self.encoder is None:
            return self.codes
        pyro.module("encoder", self.encoder, update_module_params=shared)
        codes = self.encoder(y)
        if codes.shape != (y.shape[0], self.latent_dim):
            raise ValueError(
                f"the encoder returned codes of shape {tuple(codes.shape)}; expected "
                f"({y.shape[0]}, {self.latent_dim}) for y of shape {tuple(y.shape)}."
            )
        return codes

    def covariance(self, codes):
        """``K(Z, Z) + (sigma^2 + jitter) I``, dense ``(N, N)``: evaluated, not factorised."""
        kernel_matrix = self.kernel(codes).to_dense()
        eye = torch.eye(codes.shape[-2], dtype=codes.dtype, device=codes.device)
        return kernel_matrix + (self.noise_scale**2 + self.jitter) * eye

    @pyro_method
    def model(self, y):
        """The generative model for ``y`` of shape ``(N, D)``."""
        codes = self.codes_for(y)
        covariance = DenseLinearOperator(self.covariance(codes))
        # GPyTorch's MultivariateNormal is lazy: building it does not factorise the N x N
        # covariance, so MPTLoss reads the blocks it needs and nothing else.
        loc = self.loc.unsqueeze(-1).expand(self.num_outputs, y.shape[0])
        likelihood = gpytorch.distributions.MultivariateNormal(loc, covariance)
        with pyro.plate("outputs", self.num_outputs, dim=-1):
            pyro.sample("y", likelihood, obs=y.transpose(-1, -2))

    @pyro_method
    def guide(self, y):
        """No latent sample sites: the codes are parameters (or an encoder's output)."""

    @pyro_method
    def log_marginal(self, y):
        """The exact ``log p(y) = sum_d log N(y_d | mu_d, K + sigma^2 I)``: one ``N x N``
        Cholesky factor shared by the ``D`` output dimensions.

        :returns: a scalar tensor (differentiable).
        """
        codes = self.codes_for(y)
        chol = torch.linalg.cholesky(self.covariance(codes))
        residual = y - self.loc
        whitened = torch.linalg.solve_triangular(chol, residual, upper=False)
        num_data, num_outputs = y.shape
        log_det = 2 * chol.diagonal().log().sum()
        return -0.5 * (
            whitened.pow(2).sum() + num_outputs * (log_det + num_data * math.log(2 * math.pi))
        )

    @pyro_method
    def predict(self, y, new_codes):
        """The GP posterior predictive of ``y`` at new codes, given the training data.

        :param torch.Tensor y: training data ``(N, D)``.
        :param torch.Tensor new_codes: ``(T, Q)``.
        :returns: ``(mean, var)``: means ``(T, D)`` and variances ``(T, 1)`` (shared by the
            output dimensions), noise included.
        """
        codes = self.codes_for(y)
        chol = torch.linalg.cholesky(self.covariance(codes))
        cross = self.kernel(new_codes, codes).to_dense()  # (T, N)
        whitened = torch.linalg.solve_triangular(chol, cross.T, upper=False)  # (N, T)
        whitened_y = torch.linalg.solve_triangular(chol, y - self.loc, upper=False)
        mean = self.loc + whitened.T @ whitened_y
        prior_var = self.kernel(new_codes, diag=True)
        var = prior_var - whitened.pow(2).sum(0) + self.noise_scale**2
        return mean, var.unsqueeze(-1)
