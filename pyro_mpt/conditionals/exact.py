"""Exact self-predictive conditionals of linear-Gaussian models."""

import math

import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.ops.conditional_sampling import (
    dense_gaussian_block_sample,
    dense_gaussian_marginal_sample,
    latent_gaussian_block_sample,
    latent_gaussian_marginal_sample,
)
from pyro_mpt.ops.gaussian import (
    dense_gaussian_conditionals,
    latent_gaussian_conditionals,
    latent_gaussian_log_marginal,
    normal_log_prob,
)
from pyro_mpt.trace.factors import factor_log_prob
from pyro_mpt.trace.gaussian_form import extract_gaussian_form, no_latent_form
from pyro_mpt.trace.model_structure import read_structure
from pyro_mpt.trace.remembered_structure import RememberedStructure

__all__ = ["Exact", "GaussianSelfPredictive"]


class GaussianSelfPredictive(SelfPredictive):
    """Closed-form conditionals of a :class:`~pyro_mpt.trace.gaussian_form.GaussianForm`."""

    def __init__(self, form, extra_log_prob=0.0):
        super().__init__(form.observed, form.scale, extra_log_prob)
        self.form = form

    def log_prob(self, masks):
        form = self.form
        x = self.observed.value
        context = self.context(masks)
        if form.covariance is None:
            mean, var = latent_gaussian_conditionals(
                x, form.weight, form.loc, form.noise_var, context
            )
        else:
            mean, var = dense_gaussian_conditionals(x, form.loc, form.covariance, context)
        return normal_log_prob(x, mean, var)

    @property
    def log_prob_width(self):
        """``K`` through a ``K``-dimensional latent, ``D`` for a dense covariance."""
        form = self.form
        if form.weight is not None:
            return form.weight.shape[-1]
        return form.covariance.shape[-1]

    def sample(self, hidden, num_samples, joint=True):
        """Exact draws: through the latent posterior, ``z ~ p(z | x_R)`` then
        ``x_S ~ p(x_S | z)``, ``O(D K^2 + K^3)`` per observation; or from the dense Gaussian
        block conditional of a ``MultivariateNormal`` observation. See
        :meth:`SelfPredictive.sample`."""
        form, x = self.form, self.observed.value
        context = self.context(hidden)
        if form.covariance is not None:
            draw = dense_gaussian_block_sample if joint else dense_gaussian_marginal_sample
            draws = draw(x, form.loc, form.covariance, context, num_samples)
        else:
            draw = latent_gaussian_block_sample if joint else latent_gaussian_marginal_sample
            draws = draw(x, form.weight, form.loc, form.noise_var, context, num_samples)
        return self.keep_given(hidden, draws)

    def log_marginal(self):
        """The exact ``log p(x)`` of each observation, shape ``batch_shape``."""
        form = self.form
        x = self.observed.value
        entries = self.observed.entries
        if form.covariance is None:
            return latent_gaussian_log_marginal(x, form.weight, form.loc, form.noise_var, entries)
        if entries is not None:
            raise NotImplementedError(
                "log_marginal of a dense multivariate normal observation with missing entries"
            )
        return torch.distributions.MultivariateNormal(
            form.loc, covariance_matrix=form.covariance
        ).log_prob(x)


class Exact(Conditionals):
    """Closed-form conditionals of linear-Gaussian models.

    Applies to models whose local latents are Gaussian (``Normal`` or
    ``MultivariateNormal``), sit inside the data plate, and enter the ``loc`` of an observed
    ``Normal`` site affinely (PPCA, factor analysis), and to models whose observed site is a
    ``MultivariateNormal`` or ``LowRankMultivariateNormal``. Conditioning goes through the
    ``K``-dimensional latent posterior (Woodbury): ``O(D K^2 + K^3)`` per mask, never a
    ``D x D`` inverse. A dense ``MultivariateNormal`` observation (a GP decoder's, whose
    features are data points) is conditioned through each mask's active set: one
    ``|R| x |R|`` Cholesky of the context block and the predictive variances of the masked
    features only.

    The guide is not used: the latents are integrated out exactly. Each call runs the model
    once at ``K + 6`` points of the latents' whitened space, which give the affine map and
    verify it far from the origin; the first call with a model (and argument shapes) also
    traces it once to read its structure.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Exact
        >>> loss = MPTLoss(rate="uniform", conditionals=Exact())
    """

    name = "exact"

    def __init__(self):
        self._structure = RememberedStructure()

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """See :meth:`Conditionals.prepare`.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        call = (model, guide, args, kwargs, max_plate_nesting, signature)
        return self._structure.prepared(self, *call)

    def structure_for(self, signature):
        """The structure :meth:`prepare` read for calls of ``signature`` (the very object it
        was passed), or None: a caller that holds it calls :meth:`prepare_with`."""
        return self._structure.held(signature)

    def prepare_with(self, structure, model, guide, args, kwargs):
        """:meth:`prepare` for a call like the one ``structure`` was read from (the same
        model and argument shapes): the model runs once, at the probe points."""
        if not structure.latents:
            # The model's one run is the structure trace itself.
            structure = read_structure(model, args, kwargs, structure.max_plate_nesting)
            return GaussianSelfPredictive(no_latent_form(structure), factor_log_prob(structure))
        form, extra_log_prob = extract_gaussian_form(model, args, kwargs, structure)
        return GaussianSelfPredictive(form, extra_log_prob)
