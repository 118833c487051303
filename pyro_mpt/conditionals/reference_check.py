"""The check that approximate conditionals drawn from the guide (importance sampling,
encode-decode) make of themselves on a call's data: how far their uniform-rate MPT estimate
of ``log p(x)`` lies from an importance-sampling estimate of it with the guide on the whole
observation, the *reference*.

The reference is a lower bound of ``log p(x)`` in expectation, so an estimate below it is
off by at least the shortfall, whatever the reference's weights. Where those weights are
reliable (:meth:`~pyro_mpt.conditionals.importance_diagnostics.ImportanceDiagnostics.reliable`)
the reference is close to ``log p(x)``, lower by about ``(1/ESS - 1/S) / 2`` (the first-order
bias of a log-mean of weights), and an estimate above it by more than that is too high by
about the excess: a proposal fitted to the whole observation is too narrow for the broader
posteriors of masked contexts, misses part of their mass, and the conditionals then come
out too high, which their own weights may not show. A few observations whose posteriors
the guide misses altogether are counted apart (:func:`_single_draw_shortfall`), and those
whose reference rests wholly on one draw, which nothing measures, are named
(:func:`_warn_if_unmeasured`)."""

import math
import warnings

import torch

from pyro_mpt.conditionals.base import RuleGap
from pyro_mpt.conditionals.importance import ImportanceSampling
from pyro_mpt.errors import NotApplicableError, UnmeasuredAccuracyWarning, user_stacklevel
from pyro_mpt.ops.masks import UniformRate, mask_scores, sample_masks
from pyro_mpt.trace.trace_utils import same_random_state

__all__ = [
    "NUM_CHECK_MASKS",
    "NUM_REFERENCE_SAMPLES",
    "SINGLE_DRAW_MARGIN",
    "UNMEASURED_WEIGHT_GAP",
    "mpt_gap_to_reference",
]

#: Draws of the guide on the whole observation for the reference.
NUM_REFERENCE_SAMPLES = 64
#: Uniform-size masks per observation of the MPT estimate compared with it.
NUM_CHECK_MASKS = 4
#: Nats by which the estimate may lie below a reference that rests on one draw, at one
#: observation, before the excess counts (:func:`_single_draw_shortfall`): both rest on a
#: few draws there and move by nats from one set of draws to the next (1 to 10 nats on a
#: Poisson observation whose average error was 0.8), while a guide that misses a posterior
#: leaves tens or thousands of nats.
SINGLE_DRAW_MARGIN = 10.0
#: Nats by which every other draw's weight must lie below the largest for an observation's
#: reference to rest wholly on one draw (:func:`_warn_if_unmeasured`): from a guide that
#: covers the posterior, 64 draws essentially never leave such a gap.
UNMEASURED_WEIGHT_GAP = 10.0


def mpt_gap_to_reference(
    prepared, model, guide, args, kwargs, above=True, num_masks=NUM_CHECK_MASKS, own_noise=False
):
    """How far the uniform-rate MPT estimate of ``prepared``'s conditionals lies from the
    reference, per observation on the batch's mean, less four standard errors (0 when not
    past them): ``(gap, compared_with)`` with ``compared_with`` ``"importance"`` for an
    estimate below the reference (the figure is a lower bound of its error),
    ``"importance, one draw"`` where the shortfall on the few observations whose reference
    rests on one draw says more (:func:`_single_draw_shortfall`; not where the conditionals'
    own weights fail their share-based tests, which warn of it), and
    ``"importance above"`` for one above a reference whose weights are reliable, less that
    reference's own first-order bias (only with ``above``). ``(None, None)`` where importance
    sampling does not apply to the model and guide, or for fewer than two observations.
    ``num_masks``: uniform-size masks per observation of the estimate (the caller's, for
    conditionals whose masks pool their draws). Leaves the random state as it found it.

    The standard error of the batch's mean difference comes from the spread of the
    differences between observations, or with ``own_noise`` (and ``num_masks >= 2``) from
    each observation's own noise: the spread of its masks' estimates over ``num_masks`` and
    the reference's first-order variance
    (:meth:`~pyro_mpt.conditionals.importance_diagnostics.ImportanceDiagnostics.row_stderr`).
    The first also counts how far the error varies between observations, which is no noise
    in a statement about this batch, and can hide a bias of several nats on every
    observation of a small batch; the second needs masks whose draws are their own (not
    pooled)."""
    observed = prepared.observed
    with same_random_state(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference's own weights are judged below
        try:
            reference = ImportanceSampling(NUM_REFERENCE_SAMPLES).prepare(
                model, guide, args, kwargs
            )
        except NotApplicableError:
            return None, None
        log_p = reference.log_marginal()
        masks, sizes = sample_masks(
            UniformRate(),
            num_masks,
            observed.batch_shape,
            observed.value.shape[-1],
            device=observed.value.device,
            entries=observed.entries,
        )
        counts = None if observed.entries is None else observed.feature_counts()
        # Each mask's estimate D / M sum_{j in mask} log p(x_j | x_R); mpt_estimate averages them.
        scores = mask_scores(prepared.log_prob(masks), masks, sizes)
        per_mask = scores * (observed.value.shape[-1] if counts is None else counts)
        estimate = per_mask.mean(0)
    difference = (estimate - log_p).double().flatten()
    if difference.numel() < 2:
        return None, None
    weights = reference.diagnostics
    row_noise = None  # each observation's estimate's own standard error, with own_noise
    if own_noise and num_masks >= 2:
        estimate_variance = (per_mask.double().var(0) / num_masks).flatten()
        row_noise = estimate_variance.sqrt()
        variance = estimate_variance + weights.row_stderr().flatten() ** 2
        stderr = math.sqrt(float(variance.nansum())) / difference.numel()
    else:
        stderr = float(difference.std()) / math.sqrt(difference.numel())
    below = max(0.0, -float(difference.mean()) - 4 * stderr)
    found = [(below, "importance")]
    own = getattr(prepared, "diagnostics", None)  # of the masks drawn above
    if own is None or own.reliable():
        # Where the conditionals' own weights fail their share-based tests, they say so.
        shortfall = _single_draw_shortfall(difference, weights, row_noise)
        found.append((shortfall, "importance, one draw"))
        _warn_if_unmeasured(estimate.double().flatten(), weights)
    if below == 0 and above and weights.reliable():
        # The reference lies below log p(x) by about its first-order bias: an estimate that
        # high is not counted against the conditionals.
        allowance = 0.5 * (1 / weights.ess.double() - 1 / weights.num_samples)
        excess = float(difference.mean() - allowance.nanmean()) - 4 * stderr
        found.append((max(0.0, excess), "importance above"))
    # The largest finding (on a tie, the first: "importance" with 0 where none is past 0).
    figure, compared_with = max(found, key=lambda finding: finding[0])
    return RuleGap(figure, figure), compared_with


def _single_draw_shortfall(difference, weights, row_noise=None):
    """The estimate's shortfall below the reference on the observations whose reference fails
    on its own (``weights.failing_rows()``: it rests on one draw of the guide), beyond
    :data:`SINGLE_DRAW_MARGIN` nats at each (and beyond four of the estimate's own standard
    errors there, ``row_noise``, where given), summed and divided by the batch size: nats
    per observation of the batch; 0 where none is that far below.

    A few such observations, too few for the share-based tests of the weights, can carry the
    batch's whole error: a guide that misses their posteriors puts their conditionals tens
    or thousands of nats low, and the spread of the differences that they make hides the
    shortfall from the batch's mean and its standard error. Their references are low too
    (one that rests on one draw mostly underestimates), so the figure tends to understate
    their error."""
    failing = weights.failing_rows().flatten()
    if not bool(failing.any()):
        return 0.0
    margin = SINGLE_DRAW_MARGIN
    if row_noise is not None:
        margin = margin + 4 * row_noise[failing].nan_to_num(nan=0.0)
    beyond = (-difference[failing] - margin).clamp(min=0)
    return float(beyond.sum()) / difference.numel()


def _warn_if_unmeasured(estimate, weights):
    """Warns (:class:`~pyro_mpt.errors.UnmeasuredAccuracyWarning`) of observations whose
    reference rests wholly on one draw: every other draw's weight below
    :data:`UNMEASURED_WEIGHT_GAP` nats under the largest, so the guide's draws miss a
    posterior far narrower than their spread. The conditionals draw from the same guide and
    may be off by nats there, thousands where the posterior is sharpest, in either
    direction, where the reference is off as far: nothing on the call's draws measures them.
    Not where the conditionals' own weights fail their share-based tests, which warn."""
    ess = weights.ess.double().flatten()
    # ESS = (1 + r)^2 / (1 + r2) ~ 1 + 2r, with r the other weights' sum over the largest.
    alone = ess < 1 + 2 * math.exp(-UNMEASURED_WEIGHT_GAP)
    if not bool(alone.any()):
        return
    count, total = int(alone.sum()), alone.numel()
    median = float(estimate.median())
    values = ", ".join(f"{v:.4g}" for v in estimate[alone][:3].tolist())
    warnings.warn(
        f"The check of the conditionals against an importance-sampling estimate of log p(x) "
        f"with the guide on the whole observation cannot measure {count} of the {total} "
        f"observations: that estimate rests wholly on one draw of the guide there (every "
        f"other draw's weight at least {UNMEASURED_WEIGHT_GAP:g} nats below it), so the "
        f"guide's draws miss a posterior far narrower than their spread. The conditionals "
        f"draw from the same guide and may be off there by nats, thousands where the "
        f"posterior is sharpest, in either direction, with no other word; their estimates "
        f"of log p(x) are {values}"
        f"{' ...' if count > 3 else ''} against a median of {median:.4g} over the batch. "
        f"Fix: a guide that proposes near each observation's posterior (an amortized one "
        f"trained by Trace_ELBO, or MPTLoss(guide_loss='wake')), more samples, or exact or "
        f"quadrature conditionals where the model allows.",
        UnmeasuredAccuracyWarning,
        stacklevel=user_stacklevel(),
    )
