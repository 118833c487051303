"""Reference evaluator of the exact log-marginal likelihood."""

import math

from pyro_mpt.conditionals.exact import Exact

__all__ = ["log_marginal"]


def log_marginal(model, *args, max_plate_nesting=math.inf, **kwargs):
    """The exact ``log p(x)`` of every observation of a linear-Gaussian model.

    The latents are integrated out in closed form (Woodbury identity and matrix determinant
    lemma for latent models, a Cholesky factor for dense multivariate normals):

    .. math:: \\log p(x_n) = \\log \\mathcal{N}(x_n \\mid b, W W^\\top + \\Psi).

    :param callable model: a Pyro model to which :class:`~pyro_mpt.conditionals.Exact`
        applies (see there).
    :param args: the model's arguments.
    :param kwargs: the model's keyword arguments.
    :returns: a tensor of the data plate's batch shape (differentiable).
    :raises ValueError: if the model has no closed-form marginal likelihood.

    Example::

        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=4, latent_dim=1)
        >>> x = ppca.sample(10)
        >>> log_marginal(ppca.model, x).shape
        torch.Size([10])
    """
    return Exact().prepare(model, None, args, kwargs, max_plate_nesting).log_marginal()
