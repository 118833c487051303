"""Imputation: joint draws of missing entries from the self-predictive conditionals."""

import math

import torch

from pyro_mpt.conditionals.accuracy_warnings import counted_per_call
from pyro_mpt.conditionals.per_model import conditionals_for, package_function
from pyro_mpt.conditionals.rule_check import check_completed, prepare_checked
from pyro_mpt.errors import check_positive_int
from pyro_mpt.generation._arguments import check_missing, flat_missing
from pyro_mpt.generation.draws import draw_hidden
from pyro_mpt.trace.data_reads import check_data_not_read
from pyro_mpt.trace.subsampled_plates import refusing_subsampled_plates
from pyro_mpt.trace.trace_utils import param_store_rollback

__all__ = ["impute"]


@package_function
def impute(
    model,
    *args,
    missing,
    num_samples=1,
    conditionals="auto",
    guide=None,
    max_plate_nesting=math.inf,
    check_rule=True,
    **kwargs,
):
    """Draws the missing entries of each observation jointly from
    :math:`p(x_S \\mid x_R)`, with ``S`` the entries where ``missing`` is True and ``R`` the
    others, the local latents integrated out as each strategy integrates them:

    .. math::

        x_S \\sim p(x_S \\mid x_R) = \\int p(x_S \\mid z)\\, p(z \\mid x_R)\\, dz.

    * ``"exact"`` (linear-Gaussian models): ``z ~ p(z | x_R)`` in closed form, then
      ``x_S ~ p(x_S | z)``; exact, ``O(D K^2 + K^3)`` per observation.
    * ``"quadrature"``: node ``g`` with probability proportional to ``w_g p(x_R | z_g)``,
      then ``x_S`` from the model's own likelihood at that node; exact for the rule.
    * ``"importance"``: sampling-importance-resampling of the guide's proposals on the
      filled data; consistent as the strategy's ``num_samples`` grows. The draws of one call
      are resampled from the same ``S`` proposals (the strategy's ``num_samples``), so they
      are dependent: an average over them is about as precise as one over ``S`` independent
      draws at best. For more independent draws, raise ``S`` or call again.
    * ``"encode-decode"``: the chain of Rezende et al. (2014, appendix F) that encodes the
      current fill, decodes and *draws* the missing entries again, ``num_iterations`` times;
      an approximation.

    :param callable model: the Pyro model; its observed site holds the data ``x``.
    :param args: the model's arguments.
    :param torch.Tensor missing: booleans of the shape of ``x`` (or broadcasting to it),
        True at the entries to draw. Their values in ``x`` are ignored but must be valid for
        the likelihood (e.g. 0, not NaN).
    :param int num_samples: draws per observation.
    :param conditionals: a strategy name or :class:`~pyro_mpt.conditionals.Conditionals`,
        as in :class:`~pyro_mpt.MPTLoss`.
    :param callable guide: the guide, for ``"importance"`` and ``"encode-decode"``.
    :param bool check_rule: whether a quadrature rule given here measures its own error on
        the data before drawing, as in :func:`~pyro_mpt.log_marginal` (one more run of the
        model), and whether a quadrature rule (given here, or ``auto``'s choice) measures
        the error of its draws: how far ``log p(x_S | x_R)`` of its first four draws moves
        under a finer rule (eight more runs). Many hidden entries resting on few visible
        ones make a sharp integrand, which a rule that scores the visible entries well can
        still draw from too few nodes. A
        :class:`~pyro_mpt.errors.QuadratureAccuracyWarning` states the figure when either
        is large.
    :param kwargs: the model's keyword arguments.
    :returns: a tensor ``(num_samples,) + x.shape``: ``x`` with its missing entries drawn,
        where ``x`` is the value of the observed site, what the model observes: for a
        model that observes a transform of its argument (``obs=x / 10``), the transform.
    :raises TypeError: if ``missing`` is not a boolean tensor.
    :raises ValueError: if it does not broadcast to ``x`` or has no True entry.

    Pyro's param store is left as it was found, as :func:`~pyro_mpt.log_marginal` leaves
    it: parameters first created here (a guide's sized by this ``x``) are removed.

    Example::

        >>> import torch
        >>> from pyro_mpt import impute
        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=5, latent_dim=2)
        >>> x = ppca.sample(10)
        >>> missing = torch.zeros(10, 5, dtype=torch.bool)
        >>> missing[:, :2] = True
        >>> impute(ppca.model, x, missing=missing, num_samples=100).shape
        torch.Size([100, 10, 5])

    .. note:: Entries that the model itself marks missing (``obs_mask``, ``.mask``) are
        never context; they are drawn only where ``missing`` is True too.
    """
    num_samples = check_positive_int("num_samples", num_samples, "e.g. num_samples=100.")
    check_missing(missing)
    strategy = conditionals_for(conditionals, model)
    # The param store is left as it was found (a guide sized by this x creates parameters).
    # One call counts its failing importance weights afresh (warns at its first).
    subsampled = refusing_subsampled_plates("impute returns every observation")
    with param_store_rollback(always=True), counted_per_call(), subsampled as plates:
        # Prepared with gradients on: some strategies check their guide by differentiating it.
        call = (model, guide, args, kwargs, max_plate_nesting)
        scored = _visible(missing, plates)
        prepared = prepare_checked(strategy, *call, check_rule, "impute", scored)
        check_data_not_read(model, args, kwargs, "impute")
        observed = prepared.observed
        hidden = flat_missing(missing.to(observed.value.device), observed)
        with torch.no_grad():
            draws = draw_hidden(prepared, hidden, num_samples, joint=True)
        draws = draws.reshape((num_samples,) + tuple(observed.full_shape))
        if check_rule:
            check_completed(strategy, prepared, draws, hidden, call, "impute")
    return draws


def _visible(missing, plates):
    """What the rule check of :func:`impute` scores: the entries the draws rest on, after
    refusing a plate that subsamples (``plates``, a
    :class:`~pyro_mpt.trace.subsampled_plates.SubsampledPlates`) and conditionals that
    cannot serve draws (the values at the entries to draw are ignored, so they must not
    move the check)."""

    def scored(prepared):
        plates.refuse()
        prepared.check_draws()
        observed = prepared.observed
        return prepared.context(flat_missing(missing.to(observed.value.device), observed))

    return scored
