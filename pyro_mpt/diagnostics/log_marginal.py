"""Reference evaluators of the log-marginal likelihood."""

import math

from pyro_mpt.conditionals.accuracy_warnings import counted_per_call, warn_if_unreliable
from pyro_mpt.conditionals.per_model import conditionals_for, package_function
from pyro_mpt.conditionals.rule_check import prepare_checked
from pyro_mpt.trace.subsampled_plates import refusing_subsampled_plates
from pyro_mpt.trace.trace_utils import param_store_rollback

__all__ = ["log_marginal"]


@package_function
def log_marginal(
    model,
    *args,
    conditionals="exact",
    guide=None,
    max_plate_nesting=math.inf,
    check_rule=True,
    **kwargs,
):
    """The ``log p(x)`` of every observation, with the local latents integrated out.

    ``conditionals`` chooses how: ``"exact"`` (the default) for linear-Gaussian models, in
    closed form (Woodbury identity and matrix determinant lemma, or a Cholesky factor for
    dense multivariate normals); a :class:`~pyro_mpt.conditionals.Quadrature` rule for
    latents of dimension up to 3 (use many nodes, or ``center="guide"``, for a reference
    value); or any strategy whose prepared conditionals offer ``log_marginal()``.

    .. math:: \\log p(x_n) = \\log \\int p(x_n \\mid z)\\, p(z)\\, dz.

    ``pyro.factor`` terms of the model are not part of ``p(x)`` and are left out here;
    :class:`~pyro_mpt.MPTLoss` adds them to its loss, as ``Trace_ELBO`` does.

    .. note:: Pyro's param store is left as it was found, whether the call returns or
        raises: parameters first created here (a guide's or model's, sized by this ``x``)
        are removed afterwards, and existing parameters keep their tensors, so training
        with ``Trace_ELBO`` on other data goes on as before.

    :param callable model: the Pyro model.
    :param args: the model's arguments.
    :param conditionals: a strategy name or :class:`~pyro_mpt.conditionals.Conditionals`.
    :param callable guide: the guide, for strategies that use one.
    :param bool check_rule: whether a quadrature rule given here measures its own error on
        the data: the model runs once more at 1.5 times the nodes per dimension (2.25 times
        the nodes of a 2-dimensional rule), or, for a rule at the limit of
        :data:`~pyro_mpt.conditionals.quadrature.MAX_POINTS`, at two thirds of them. Pass
        False where the rule is known to be accurate on such data and the cost matters.
        (Encode-decode conditionals, which give no ``log p(x)``, are refused first.)
        (``conditionals="auto"`` checks the rule it chooses either way.)
    :param kwargs: the model's keyword arguments.
    :returns: a tensor of the data plate's batch shape (differentiable). An importance
        estimate whose weights fail the thresholds of
        :class:`~pyro_mpt.conditionals.importance.ImportanceDiagnostics` comes with an
        :class:`~pyro_mpt.errors.ImportanceAccuracyWarning` stating them; a quadrature
        rule that the check finds moving by more than
        :data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL` nats per observation, with a
        :class:`~pyro_mpt.errors.QuadratureAccuracyWarning` stating the figure.
    :raises ValueError: if the strategy does not apply to the model or gives no
        log-marginal likelihood.

    Example::

        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=4, latent_dim=1)
        >>> x = ppca.sample(10)
        >>> log_marginal(ppca.model, x).shape
        torch.Size([10])
    """
    strategy = conditionals_for(conditionals, model)
    call = (model, guide, args, kwargs)
    # Each call is an evaluation of its own: it warns of its failing weights whatever
    # earlier calls found, and of any one observation whose value rests on a single draw.
    with param_store_rollback(always=True), counted_per_call():
        values = []

        def whole(prepared):
            # Refuses a strategy that gives no log p(x) before its check spends a run.
            try:
                values.append(prepared.log_marginal())
            except NotImplementedError as error:
                raise ValueError(f"conditionals={strategy!r}: {error}") from None

        with refusing_subsampled_plates("log_marginal returns one value per observation"):
            # A check of the conditionals' MPT estimate says nothing of log p(x) alone.
            check_rule = check_rule and not strategy.gap_of_mpt_estimate
            prepared = prepare_checked(
                strategy, *call, max_plate_nesting, check_rule, "log_marginal", whole
            )
        result = values[0]
        diagnostics, what = prepared.diagnostics, "log_marginal"
        warn_if_unreliable(
            diagnostics,
            what,
            model,
            args,
            guide=guide,
            strategy=strategy.in_use,
            each_row=True,
            whole=True,
        )
    return result
