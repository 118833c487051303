"""The diagnostics of importance weights (Pareto k-hat of PSIS, effective sample size) per
(mask, observation) row, the thresholds past which an estimate cannot be trusted, and the
warning that states the figures."""

import math
import warnings
from typing import NamedTuple

import torch

from pyro_mpt.conditionals.accuracy_warnings import failure_history
from pyro_mpt.errors import ImportanceAccuracyWarning
from pyro_mpt.ops.importance_weights import effective_sample_size, pareto_shape

__all__ = [
    "ImportanceDiagnostics",
    "MAX_EMPTY_CONTEXT_ERROR",
    "MAX_PARETO_K",
    "MAX_RATIO_BIAS",
    "MAX_ROW_PARETO_K",
    "MAX_ROW_STDERR",
    "MAX_UNRELIABLE_SHARE",
    "MIN_EFFECTIVE_SAMPLES",
    "MIN_ROW_ESS_SHARE",
    "MIN_SAMPLES_FOR_ROW_K",
    "SINGLE_DRAW_ESS",
]

#: Above this Pareto k-hat the importance estimate cannot be trusted: its variance is
#: infinite or its pre-asymptotic error is large (Vehtari et al., PSIS, 2024).
MAX_PARETO_K = 0.7
#: The most (observation, mask) rows whose k-hat may pass :data:`MAX_PARETO_K` before the
#: whole batch is flagged: k-hat from a 13-point tail (S=64) is noisy, so a few rows pass
#: it by chance, but when one row in five does, single observations are off by nats.
MAX_UNRELIABLE_SHARE = 0.2
#: Below this many effective samples the self-normalised estimate rests on a handful of
#: draws, and the ``-(1/ESS - 1/S)/2`` bias of each log-mean-exp term passes a tenth of a nat.
MIN_EFFECTIVE_SAMPLES = 5.0
#: A row whose ESS is below this rests on one draw: the proposal found its posterior once,
#: by chance, and rows like it that found it not at all look healthy (equal weights, all in
#: the wrong place). More than :data:`MAX_UNRELIABLE_SHARE` of such rows flag the batch,
#: which matters most where ``S`` is too small for k-hat.
SINGLE_DRAW_ESS = 2.0
#: Above this k-hat one row's weights have no finite mean: its estimate fails whatever the
#: other rows do. Counted from :data:`MIN_SAMPLES_FOR_ROW_K` draws, where the tail fit has
#: about a hundred weights: below 1 row in 4000 of a proposal whose true k is 0.5 passes
#: it there, against 1 in 400 at 256 draws and 1 in 40 at 64.
MAX_ROW_PARETO_K = 1.0
#: The fewest draws from which one row's k-hat above :data:`MAX_ROW_PARETO_K` fails it.
MIN_SAMPLES_FOR_ROW_K = 1000
#: A row whose k-hat passes :data:`MAX_PARETO_K` fails on its own, from any number of draws,
#: when its effective sample size is also below this share of them: its weights rest on a
#: few draws of a heavy tail. A proposal narrower than its target (a guide fitted to the
#: whole observation, asked for the posterior of a few of its entries) gives such rows,
#: whose estimates were seen several nats off; from a proposal whose true k is 0.5, about 1
#: row in 400 fails by chance at 64 to 1000 draws, and none at k = 0.3.
MIN_ROW_ESS_SHARE = 0.05
#: The most nats per observation, on average, by which the empty context's term of an
#: average over every mask may miss its exact value 0 (see
#: :attr:`ImportanceDiagnostics.empty_context`): the estimate carries that error whole, so
#: the objective overstates the importance-weighted bound by that much. The same limit as a
#: quadrature rule's worst observation (:data:`~pyro_mpt.conditionals.auto.WORST_TOL`): at
#: 0.5, trained VAEs' objectives stood 0.3 to 0.45 nats per observation above their
#: log p(x) with no warning.
MAX_EMPTY_CONTEXT_ERROR = 0.1
#: The most nats per observation, on average, by which the ratios of importance estimates
#: that make up the conditionals may be biased, to first order
#: (:func:`~pyro_mpt.ops.importance_weights.ratio_bias`,
#: :attr:`ImportanceDiagnostics.ratio_bias`): weights that pass every other test leave it
#: unsaid when the likelihood of a hidden feature is sharp next to ``p(z | x_R)``. The same
#: limit as :data:`MAX_EMPTY_CONTEXT_ERROR`, though this figure is estimated: from the same
#: draws, the first-order bias understates the true one where they are few (by 1.5 to 3
#: times at 16 to 64 samples on a 12-dimensional linear-Gaussian model with a perfect
#: proposal, whose estimate at 32 samples was a quarter of a nat low while the figure said
#: under 0.2, the limit before).
MAX_RATIO_BIAS = 0.1
#: The largest standard error of one observation's importance estimate of ``log p(x)``
#: (:meth:`ImportanceDiagnostics.row_stderr`) that passes unwarned where values are read
#: one by one (``log_marginal``): past it an observation is off by more than half a nat,
#: the limit at any one observation, about one time in twenty, and more often where the
#: weights' tail is heavy, where the figure itself understates. Within the other
#: thresholds, observations of a linear-Gaussian model come out more than half a nat off
#: from 64 draws of a guide three times as wide as the posterior
#: (``tests/test_importance_accuracy.py``).
MAX_ROW_STDERR = 0.25


class ImportanceDiagnostics(NamedTuple):
    """The diagnostics of one batch of importance weights, detached.

    One entry per (mask, observation) row: the weights are those of the proposal as an
    approximation of ``p(z | x_R)`` for that row's context ``R``.

    :ivar torch.Tensor pareto_k: Pareto k-hat of each row's weights (PSIS); above
        :data:`MAX_PARETO_K` the estimate is unreliable.
    :ivar torch.Tensor ess: Kish's effective sample size of each row, out of ``num_samples``.
    :ivar int num_samples: ``S``.
    :ivar empty_context: for an average over every mask
        (:meth:`~pyro_mpt.conditionals.ImportanceSelfPredictive.mask_average`), the
        estimate of ``log p(x_empty)`` of each observation, whose exact value is 0: the
        average over every mask is the importance estimate of ``log p(x)`` minus it, so its
        value is that term's error, known exactly. None otherwise.
    :ivar ratio_bias: for conditionals of drawn masks, the first-order bias of each (mask,
        observation) row's score ``D / M sum_{j in mask} log p(x_j | x_R)``, in nats
        (:func:`~pyro_mpt.ops.importance_weights.ratio_bias`): the average over rows is
        about how far the estimate of ``log p(x)`` is off. None otherwise.
    :ivar empty_rows: for rows whose context is empty (every entry hidden), the estimate of
        ``log p(x_empty)`` from their weights, whose exact value is 0, and NaN at the other
        rows: its value is that row's error, known exactly. A proposal narrower than the
        prior (a guide fitted to the whole observation) misses part of the prior's mass
        there with weights that look healthy. None where not recorded.
    """

    pareto_k: torch.Tensor
    ess: torch.Tensor
    num_samples: int
    empty_context: torch.Tensor | None = None
    ratio_bias: torch.Tensor | None = None
    empty_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, log_weights, entries=None, context=None):
        """The diagnostics of log-weights ``(S,) + rows`` toward ``p(z | x_R)``; rows where
        ``entries`` is False (nothing to estimate) are NaN. With ``context`` (booleans
        ``rows + (D,)``, the entries each row sees), the rows that see none estimate
        ``log p(x_empty) = 0`` (:attr:`empty_rows`)."""
        log_weights = log_weights.detach()
        k, ess = pareto_shape(log_weights), effective_sample_size(log_weights)
        empty = None
        if context is not None:
            sees_none = ~context.any(-1).expand(log_weights.shape[1:])
            mean = torch.logsumexp(log_weights, 0) - math.log(log_weights.shape[0])
            empty = torch.where(sees_none, mean, math.nan)
        if entries is not None:
            k = torch.where(entries, k, math.nan)
            ess = torch.where(entries, ess, math.nan)
            empty = None if empty is None else torch.where(entries, empty, math.nan)
        return cls(k, ess, log_weights.shape[0], empty_rows=empty)

    @classmethod
    def joined(cls, parts):
        """The diagnostics of several batches of drawn masks' weights, with the same number of
        samples and observations (e.g. one batch per mask size), as one: their rows side by
        side along the leading (mask) dim. None when no part has any."""
        parts = [part for part in parts if part is not None]
        if not parts:
            return None

        def cat(name):
            values = [getattr(part, name) for part in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        k, ess, bias, empty = (cat(n) for n in ("pareto_k", "ess", "ratio_bias", "empty_rows"))
        return cls(k, ess, parts[0].num_samples, None, bias, empty)

    def summary(self):
        """Plain numbers for messages and logs: the share of rows with k-hat above
        :data:`MAX_PARETO_K`, the median and largest k-hat (NaN where ``S`` is too small
        to fit a tail), the median ESS, the share of rows whose ESS is below
        :data:`SINGLE_DRAW_ESS`, the mean of :attr:`empty_context` and the mean per
        observation of :attr:`ratio_bias` (NaN without one)."""

        def finite(values):
            return values[~values.isnan()].double()

        k, ess = finite(self.pareto_k), finite(self.ess)
        nan = math.nan
        empty = None if self.empty_context is None else finite(self.empty_context)
        bias = nan
        if self.ratio_bias is not None:
            bias = float(self.ratio_bias.double().nanmean(0).nanmean())
        rows_empty = None if self.empty_rows is None else finite(self.empty_rows)
        if rows_empty is not None and rows_empty.numel():
            empty_rows, worst_empty = float(rows_empty.mean()), float(rows_empty.min())
        else:
            empty_rows = worst_empty = nan
        return dict(
            empty_rows=empty_rows,
            worst_empty_row=worst_empty,
            empty_context=float(empty.mean()) if empty is not None and empty.numel() else nan,
            ratio_bias=bias,
            unreliable=float((k > MAX_PARETO_K).double().mean()) if k.numel() else nan,
            median_k=float(k.median()) if k.numel() else nan,
            max_k=float(k.max()) if k.numel() else nan,
            median_ess=float(ess.median()) if ess.numel() else nan,
            single_draw=float((ess < SINGLE_DRAW_ESS).double().mean()) if ess.numel() else nan,
            failing_rows=int(self.failing_rows().sum()),
            rows=ess.numel(),
        )

    def row_stderr(self):
        """Each row's standard error of its estimate ``log mean_s w_s``, to first order (delta
        method): ``sqrt(1 / ESS - 1 / S)`` (NaN rows stay NaN). From the same draws it
        understates where the weights' tail is heavy (k-hat above 0.5)."""
        return (1.0 / self.ess.double() - 1.0 / self.num_samples).clamp(min=0.0).sqrt()

    def _noisy_rows(self):
        """``(count, largest, ess)``: how many rows' :meth:`row_stderr` passes
        :data:`MAX_ROW_STDERR`, the largest, and that row's ESS; None where none does."""
        stderr = self.row_stderr()
        noisy = stderr > MAX_ROW_STDERR
        count = int(noisy.sum())
        if not count:
            return None
        worst = int(torch.where(noisy, stderr, -1.0).reshape(-1).argmax())
        return count, float(stderr.reshape(-1)[worst]), float(self.ess.reshape(-1)[worst])

    def failing_rows(self):
        """Which rows fail on their own: resting on one draw (ESS below
        :data:`SINGLE_DRAW_ESS`), with k-hat above :data:`MAX_PARETO_K` and ESS below
        :data:`MIN_ROW_ESS_SHARE` of the draws, or, from :data:`MIN_SAMPLES_FOR_ROW_K`
        draws, with k-hat above :data:`MAX_ROW_PARETO_K` (NaN rows pass): booleans of the
        rows' shape, on their device."""
        failing = self.ess < SINGLE_DRAW_ESS
        heavy = self.pareto_k > MAX_PARETO_K
        failing = failing | (heavy & (self.ess < MIN_ROW_ESS_SHARE * self.num_samples))
        if self.empty_rows is not None:
            failing = failing | (self.empty_rows.abs() > MAX_EMPTY_CONTEXT_ERROR)
        if self.num_samples >= MIN_SAMPLES_FOR_ROW_K:
            failing = failing | (self.pareto_k > MAX_ROW_PARETO_K)
        return failing

    def reliable(self, each_row=False):
        """Whether the weights pass the thresholds: at most :data:`MAX_UNRELIABLE_SHARE` of
        the rows with k-hat above :data:`MAX_PARETO_K`, as many at most resting on one draw
        (ESS below :data:`SINGLE_DRAW_ESS`), a median ESS of at least
        :data:`MIN_EFFECTIVE_SAMPLES`, and the empty context's term of an average over
        every mask within :data:`MAX_EMPTY_CONTEXT_ERROR` of 0 on average, and the
        first-order bias of the conditionals' ratios within :data:`MAX_RATIO_BIAS` nats per
        observation on average.

        :param bool each_row: whether every row must pass on its own too. For results read
            row by row (``log_marginal`` of each observation, imputed draws), where one
            observation off by tens of nats matters whatever the others do: none may rest
            on one draw, and from :data:`MIN_SAMPLES_FOR_ROW_K`
            draws none may have k-hat above :data:`MAX_ROW_PARETO_K`. A training step sums
            its rows, where the shares above decide."""
        figures = self.summary()
        return not (
            figures["unreliable"] > MAX_UNRELIABLE_SHARE
            or figures["single_draw"] > MAX_UNRELIABLE_SHARE
            or (each_row and figures["failing_rows"] > 0)
            or figures["median_ess"] < MIN_EFFECTIVE_SAMPLES
            or abs(figures["empty_context"]) > MAX_EMPTY_CONTEXT_ERROR
            or abs(figures["empty_rows"]) > MAX_EMPTY_CONTEXT_ERROR
            or abs(figures["ratio_bias"]) > MAX_RATIO_BIAS
        )

    def failing(self):
        """``not reliable()`` as a boolean scalar tensor on the weights' device, computed
        without reading anything back: a caller that reads the device anyway (``MPTLoss``
        reads its loss) reads this with it. NaN rows (nothing to estimate) do not count,
        and a figure with no finite row fails nothing, as in :meth:`summary`."""
        k, ess = self.pareto_k.double(), self.ess.double()

        def share(passed, values):
            # Of the finite rows; 0 / 0 is NaN, which fails no comparison.
            return passed.sum() / (~values.isnan()).sum()

        failing = (share(k > MAX_PARETO_K, k) > MAX_UNRELIABLE_SHARE) | (
            share(ess < SINGLE_DRAW_ESS, ess) > MAX_UNRELIABLE_SHARE
        )
        failing = failing | (ess.nanmedian() < MIN_EFFECTIVE_SAMPLES)
        if self.empty_context is not None:
            empty = self.empty_context.double().nanmean().abs()
            failing = failing | (empty > MAX_EMPTY_CONTEXT_ERROR)
        if self.ratio_bias is not None:
            bias = self.ratio_bias.double().nanmean(0).nanmean().abs()
            failing = failing | (bias > MAX_RATIO_BIAS)
        if self.empty_rows is not None:
            # NaN (no row sees nothing) fails no comparison.
            failing = failing | (self.empty_rows.double().nanmean().abs() > MAX_EMPTY_CONTEXT_ERROR)
        return failing

    def describe(self, rows="(observation, mask) pairs"):
        """The figures in one sentence; ``rows`` names what the rows of the weights are
        (``"observations"`` for ``log p(x)`` of whole observations)."""
        f = self.summary()
        ess = f"median effective sample size {f['median_ess']:.1f} of {self.num_samples}"
        if f["single_draw"] > MAX_UNRELIABLE_SHARE:
            ess += (
                f", and {100 * f['single_draw']:.0f}% of the {rows} rest on a single draw "
                f"(effective sample size below {SINGLE_DRAW_ESS:g})"
            )
        elif f["failing_rows"]:
            share = MIN_ROW_ESS_SHARE * self.num_samples
            reasons = [f"rest on a single draw (effective sample size below {SINGLE_DRAW_ESS:g})"]
            # Only where a row can fail that way: k-hat fitted, and an ESS bound above 1.
            if share > SINGLE_DRAW_ESS and not math.isnan(f["median_k"]):
                reasons.append(
                    f"on a few draws of a heavy tail (k-hat above {MAX_PARETO_K} with an "
                    f"effective sample size below {share:g})"
                )
            if self.num_samples >= MIN_SAMPLES_FOR_ROW_K:
                reasons.append(f"have k-hat above {MAX_ROW_PARETO_K:g} (weights of no finite mean)")
            if self.empty_rows is not None and abs(f["worst_empty_row"]) > MAX_EMPTY_CONTEXT_ERROR:
                reasons.append("see no entry and miss part of the prior's mass (below)")
            ess += (
                f", and {f['failing_rows']} of the {f['rows']} {rows} fail "
                f"on their own: they {', or '.join(reasons)}; theirs may be off by nats, tens "
                f"of them where one draw decides"
            )
        if not math.isnan(f["empty_context"]):
            ess += (
                f"; the average over every mask carries the error of its empty context's "
                f"term, exactly 0, which came out at {f['empty_context']:.2f} nats per "
                f"observation on average, so the estimate is {-f['empty_context']:+.2f} nats "
                f"from the importance-weighted bound of the same draws (a bound below "
                f"log p(x) by an amount these draws do not measure)"
            )
        if abs(f["empty_rows"]) > MAX_EMPTY_CONTEXT_ERROR or (
            f["failing_rows"] and abs(f["worst_empty_row"]) > MAX_EMPTY_CONTEXT_ERROR
        ):
            ess += (
                f"; the rows that see no entry (every one hidden) estimate log p(nothing), "
                f"exactly 0, which came out at {f['empty_rows']:.2f} nats on average (worst "
                f"{f['worst_empty_row']:.2f}): the proposal misses part of the prior's mass, "
                f"which the weights alone do not show, and the rows that see few entries "
                f"lean the same way"
            )
        # A first-order figure means nothing where the weights themselves fail: there the
        # estimate was seen 17 to 80 nats off while the figure said 0.3 to 0.8.
        weights_pass = self._replace(ratio_bias=None, empty_context=None).reliable()
        if abs(f["ratio_bias"]) > MAX_RATIO_BIAS and weights_pass:
            ess += (
                f"; each log p(x_j | x_R) is the log of a ratio of two importance estimates, "
                f"and the numerator's weights w_s p(x_j | z_s) rest on fewer draws than the "
                f"weights w_s: to first order (delta method) the ratios bias the estimate by "
                f"{f['ratio_bias']:+.2f} nats per observation on average (a likelihood "
                f"p(x_j | z) sharp next to p(z | x_R) needs more draws than the weights "
                f"alone show)"
            )
        if math.isnan(f["median_k"]):
            return f"{ess} (too few samples to fit the Pareto tail)"
        return (
            f"Pareto k-hat above {MAX_PARETO_K} for {100 * f['unreliable']:.0f}% of "
            f"{rows} (median {f['median_k']:.2f}, max {f['max_k']:.2f}); "
            f"{ess}"
        )

    def warn(
        self,
        what,
        stacklevel,
        counts,
        strategy=None,
        failed=None,
        each_row=False,
        whole=False,
        every_mask_possible=False,
    ):
        """Counts this call in ``counts`` and, when the weights fail on a warned failure
        (:func:`~pyro_mpt.conditionals.accuracy_warnings.failure_history`), warns with the
        figures and the fix (:class:`~pyro_mpt.errors.ImportanceAccuracyWarning`). The
        arguments are those of
        :func:`~pyro_mpt.conditionals.accuracy_warnings.warn_if_unreliable`; ``strategy``
        is named by the counts only."""
        if failed is None:
            failed = not self.reliable(each_row)
        # Values read one by one: one observation's noise matters too.
        noisy = self._noisy_rows() if whole and each_row and not failed else None
        history = failure_history(counts, failed or noisy is not None)
        if history is None:
            return
        if noisy is not None:
            count, largest, ess = noisy
            warnings.warn(
                f"{what} by importance sampling{history}: {count} of the {self.ess.numel()} "
                f"observations' estimates of log p(x) have standard errors above "
                f"{MAX_ROW_STDERR:g} nats (the largest {largest:.2f}, at an effective sample "
                f"size of {ess:.1f} of {self.num_samples}; .diagnostics.row_stderr() gives "
                f"each), so each may be off by twice that or more, mostly low; the batch's "
                f"figures pass otherwise ({self.describe(rows='observations')}). Fix: raise "
                f"ImportanceSampling(num_samples=...), or fit the guide closer to p(z | x) on "
                f"these data.",
                ImportanceAccuracyWarning,
                stacklevel=stacklevel,
            )
            return
        if whole:
            described = self.describe(rows="observations")
            reading = (
                "Each log p(x) is such an estimate and may be off by nats, mostly low (an "
                "importance-weighted bound in expectation)."
            )
            fix = (
                "fit the guide (or a fresh encoder) to the posterior p(z | x) on these data, "
                "longer or with more particles, raise ImportanceSampling(num_samples=...), or "
                "use exact or quadrature conditionals where the model allows (Quadrature("
                "center='guide') up to 3 latent dimensions)."
            )
        else:
            described = self.describe()
            reading = (
                "Each log p(x_j | x_R) is a ratio of two such estimates and may be off by nats "
                "per observation, in either direction."
            )
            fix = _fix(self)
        advice = _EVERY_MASK_ADVICE if every_mask_possible else ""
        warnings.warn(
            f"{what} by importance sampling cannot be trusted here{history}: "
            f"{described}. {reading} Fix: {fix}{advice}",
            ImportanceAccuracyWarning,
            stacklevel=stacklevel,
        )


def _fix(diagnostics):
    """What to do about failing weights: over every mask the guide sees the unmasked input
    only, so a guide told which entries are hidden does not help there."""
    # Rows that fail on their own are the guide's doing: the fix is then the guide's.
    weights_pass = diagnostics._replace(ratio_bias=None).reliable(each_row=True)
    if weights_pass and abs(diagnostics.summary()["ratio_bias"]) > MAX_RATIO_BIAS:
        return (
            "raise ImportanceSampling(num_samples=...): the ratios' bias falls as one over "
            "the number of samples, and the weights pass, so the guide is not at fault; or use "
            "exact or quadrature conditionals where the model allows."
        )
    if diagnostics.empty_context is not None:
        return (
            "train the guide toward the posterior (MPTLoss(guide_loss='wake'), the default "
            "under importance sampling, with ImportanceSampling(wake_contexts=...)), raise "
            "ImportanceSampling(num_samples=...), or use exact or quadrature conditionals "
            "where the model allows."
        )
    return (
        "use a guide that sees which entries are hidden (a 'hidden' argument, see 'Guides "
        "for masked inputs'), train it as a proposal (MPTLoss(guide_loss='wake')), raise "
        "ImportanceSampling(num_samples=...), or use exact or quadrature conditionals where "
        "the model allows."
    )


#: What a failing ``MPTLoss`` that draws its masks is advised besides the weights' fix.
_EVERY_MASK_ADVICE = (
    " To train a deep model, average over every mask instead (MPTLoss(num_masks='all'), "
    "whose draws all come from the guide on the unmasked input; see the deep-VAE docs): "
    "every mask's conditionals rest on every draw, and the one term by which its objective "
    "departs from the importance-weighted bound is known exactly."
)
