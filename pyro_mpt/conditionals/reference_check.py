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
the guide misses altogether are counted apart (:func:`_single_draw_shortfall`)."""

import math
import warnings

import torch

from pyro_mpt.conditionals.base import RuleGap
from pyro_mpt.conditionals.importance import ImportanceSampling
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.ops.masks import UniformRate, mpt_estimate, sample_masks
from pyro_mpt.trace.trace_utils import same_random_state

__all__ = ["NUM_CHECK_MASKS", "NUM_REFERENCE_SAMPLES", "mpt_gap_to_reference"]

#: Draws of the guide on the whole observation for the reference.
NUM_REFERENCE_SAMPLES = 64
#: Uniform-size masks per observation of the MPT estimate compared with it.
NUM_CHECK_MASKS = 4


def mpt_gap_to_reference(
    prepared, model, guide, args, kwargs, above=True, num_masks=NUM_CHECK_MASKS
):
    """How far the uniform-rate MPT estimate of ``prepared``'s conditionals lies from the
    reference, per observation on the batch's mean, less four standard errors (0 when not
    past them): ``(gap, compared_with)`` with ``compared_with`` ``"importance"`` for an
    estimate below the reference (the figure is a lower bound of its error),
    ``"importance, one draw"`` where the shortfall on the few observations whose reference
    rests on one draw, in a batch whose reference weights pass the share-based tests, says
    more (:func:`_single_draw_shortfall`), and
    ``"importance above"`` for one above a reference whose weights are reliable, less that
    reference's own first-order bias (only with ``above``). ``(None, None)`` where importance
    sampling does not apply to the model and guide, or for fewer than two observations.
    ``num_masks``: uniform-size masks per observation of the estimate (the caller's, for
    conditionals whose masks pool their draws). Leaves the random state as it found it."""
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
        estimate = mpt_estimate(prepared.log_prob(masks), masks, counts, sizes)
    difference = (estimate - log_p).double().flatten()
    if difference.numel() < 2:
        return None, None
    stderr = float(difference.std()) / math.sqrt(difference.numel())
    below = max(0.0, -float(difference.mean()) - 4 * stderr)
    weights = reference.diagnostics
    found = [(below, "importance")]
    reliable = weights.reliable()
    if reliable:
        # Where the shares fail, the conditionals' own weights fail them too, and say so.
        found.append((_single_draw_shortfall(difference, weights), "importance, one draw"))
    if below == 0 and above and reliable:
        # The reference lies below log p(x) by about its first-order bias: an estimate that
        # high is not counted against the conditionals.
        allowance = 0.5 * (1 / weights.ess.double() - 1 / weights.num_samples)
        excess = float(difference.mean() - allowance.nanmean()) - 4 * stderr
        found.append((max(0.0, excess), "importance above"))
    # The largest finding (on a tie, the first: "importance" with 0 where none is past 0).
    figure, compared_with = max(found, key=lambda finding: finding[0])
    return RuleGap(figure, figure), compared_with


def _single_draw_shortfall(difference, weights):
    """The estimate's shortfall below the reference on the observations whose reference fails
    on its own (``weights.failing_rows()``: it rests on one draw of the guide), summed with
    its sign and divided by the batch size: nats per observation of the batch; 0 where no
    observation's reference fails.

    A few such observations, too few for the share-based tests of the weights, can carry the
    batch's whole error: a guide that misses their posteriors puts their conditionals tens
    of nats low, and the spread of the differences that they make hides the shortfall from
    the batch's mean and its standard error. Their references are low too (one that rests on
    one draw underestimates), so the sum with its sign tends to understate their error, and
    the noise of the estimate's masks, of either sign, cancels in it."""
    failing = weights.failing_rows().flatten()
    if not bool(failing.any()):
        return 0.0
    return max(0.0, -float(difference[failing].sum()) / difference.numel())
