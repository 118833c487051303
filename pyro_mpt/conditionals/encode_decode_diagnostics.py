"""The accuracy figures that encode-decode conditionals measure on every call from their own
``S`` draws of the codes, and the warning that states them."""

import math
import warnings
from typing import NamedTuple

import torch

from pyro_mpt.conditionals.accuracy_warnings import failure_history
from pyro_mpt.errors import UnmeasuredAccuracyWarning
from pyro_mpt.ops.masks import mask_scores

__all__ = [
    "BENCHMARK_ERRORS",
    "BENCHMARK_ERROR_PER_DRAW_BIAS",
    "MAX_DRAW_BIAS",
    "EncodeDecodeDiagnostics",
]

#: The most nats of ``log p(x)`` per observation, on average, by which encode-decode
#: conditionals' estimate may fall when half their draws are used
#: (:attr:`EncodeDecodeDiagnostics.draw_bias`) before a call warns: the same limit as the
#: bias of importance-sampled conditionals' ratios
#: (:data:`~pyro_mpt.conditionals.importance_diagnostics.MAX_RATIO_BIAS`).
MAX_DRAW_BIAS = 0.1

#: How far below the exact conditionals' estimate of ``log p(x)`` encode-decode's fell, in
#: nats per observation, least and most over the 15 linear-Gaussian configurations of
#: ``benchmarks/bench_encode_decode_accuracy.py`` (``T = 5``), by ``num_samples``: the
#: figures of ``benchmarks/results/encode_decode_accuracy.json`` that the warnings quote
#: (a test holds them to the file).
BENCHMARK_ERRORS = {1: (2.2, 3527.0), 16: (0.31, 269.0)}
#: The error against exact conditionals over the call's own
#: :attr:`EncodeDecodeDiagnostics.draw_bias`, least and most over the same configurations
#: and ``S`` from 2 to 64: the figure can understate the error many times over (a bias
#: every draw shares), rarely overstate it.
BENCHMARK_ERROR_PER_DRAW_BIAS = (0.69, 37.0)


class EncodeDecodeDiagnostics(NamedTuple):
    """The accuracy figures of one call of encode-decode conditionals, measured from its own
    draws on every call with ``S >= 2``, detached.

    Each conditional is ``log mean_s p(x_j | z_s)`` over ``S`` codes ``z_s``, one per
    chain: a log-mean-exp, which lies below its value at infinitely many draws by an
    amount that falls with ``S``. Two figures per (mask, observation) row, each summed
    over the row's masked entries and scaled like its score (``D / M sum_{j in mask}``),
    so that their mean over a batch's rows is in nats of ``log p(x)`` per observation:

    * :attr:`draw_bias`: the estimate from all ``S`` draws less the mean of the estimates
      from each half of them. Where the bias falls like ``1 / S`` this is the bias left at
      ``S`` (a jackknife); the estimate lies about that far below what more draws would
      give, and so at least that far below ``log p(x)`` wherever more draws would not rise
      above it (on the linear-Gaussian models measured, they never did). ``MPTLoss`` and
      the package's functions warn where its mean passes :data:`MAX_DRAW_BIAS` (at the
      1st, 10th, 100th, ... such call).
    * :attr:`spread`: the estimate less ``mean_s log p(x_j | z_s)``, how far the draws
      disagree: what an estimate from one draw would lose against them, in expectation.

    Neither sees a bias that every draw shares (a guide that encodes partly filled data
    badly, chains that have not mixed), which measured up to several times the figures
    (``benchmarks/bench_encode_decode_accuracy.py``, ``docs/accuracy.rst``): they measure
    the Monte Carlo part of the error, not the whole. ``MPTLoss`` also holds the estimate
    to an importance-sampling lower bound of ``log p(x)`` on some steps
    (:attr:`~pyro_mpt.MPTLoss.rule_check`).

    :ivar spread: the spread of each (mask, observation) row's score, in nats, NaN where
        nothing is scored; None when ``S = 1`` (one draw cannot disagree with itself: the
        call is unmeasured).
    :ivar int num_samples: ``S``.
    :ivar draw_bias: the fall of each row's score when half the draws are used, in nats
        (NaN where nothing is scored; None when ``S = 1``).
    """

    spread: torch.Tensor | None
    num_samples: int
    draw_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, log_likelihoods, estimate, scored, num_features):
        """The figures of ``log p(x_j | z_s)`` ``(S,) + rows + (D,)`` and the estimates
        ``LSE_s - log S`` of them, ``rows + (D,)``; ``scored``: the entries each row scores
        (masked and not missing), ``num_features``: ``D`` or the observations' counts of
        observed entries."""
        num_samples = log_likelihoods.shape[0]
        if num_samples < 2:
            return cls(None, num_samples)
        with torch.no_grad():
            log_likelihoods, estimate = log_likelihoods.detach(), estimate.detach()
            half = num_samples // 2
            halves = log_likelihoods[: 2 * half].reshape((2, half) + log_likelihoods.shape[1:])
            halves = torch.logsumexp(halves, 1).mean(0) - math.log(half)
            scored = scored.expand(estimate.shape)
            sizes = scored.sum(-1)

            def rows(per_entry):
                per_entry = torch.where(scored, per_entry, 0.0)
                score = num_features * mask_scores(per_entry, scored, sizes)
                return torch.where(sizes > 0, score, math.nan)

            spread = rows(estimate - log_likelihoods.mean(0))
            draw_bias = rows(estimate - halves)
        return cls(spread, num_samples, draw_bias)

    @classmethod
    def joined(cls, parts):
        """Several batches' figures, with the same ``S`` and observations, as one: rows
        side by side along the leading (mask) dim. None when no part has any."""
        parts = [part for part in parts if part is not None]
        if not parts:
            return None
        if any(part.spread is None for part in parts):
            return cls(None, parts[0].num_samples)
        spread = torch.cat([part.spread for part in parts])
        draw_bias = torch.cat([part.draw_bias for part in parts])
        return cls(spread, parts[0].num_samples, draw_bias)

    def measured(self):
        """Whether the call has a figure (``S >= 2``)."""
        return self.spread is not None

    def per_observation(self, name="draw_bias"):
        """The mean of a figure (``"draw_bias"`` or ``"spread"``) over each observation's
        rows, shape ``batch`` (NaN where no row scores anything), or None when unmeasured."""
        rows = getattr(self, name)
        if rows is None:
            return None
        return rows.double().nanmean(0)

    def summary(self):
        """Plain numbers for messages and logs, in nats of ``log p(x)`` per observation: the
        mean over the observations of their rows' :attr:`draw_bias` (``draw_bias``) and of
        their :attr:`spread` (``mean_spread``), and the largest of each over the
        observations (``worst_draw_bias``, ``worst_spread``). NaN when unmeasured or
        nothing is scored."""
        figures = dict(num_samples=self.num_samples)
        for name, key in (("draw_bias", "draw_bias"), ("spread", "mean_spread")):
            worst = "worst_" + name
            per_observation = self.per_observation(name)
            if per_observation is not None:
                per_observation = per_observation[~per_observation.isnan()]
            if per_observation is None or not per_observation.numel():
                figures.update({key: math.nan, worst: math.nan})
            else:
                figures.update(
                    {key: float(per_observation.mean()), worst: float(per_observation.max())}
                )
        return figures

    def reliable(self, each_row=False):
        """Whether the draws' bias (:attr:`draw_bias`) is within :data:`MAX_DRAW_BIAS` nats
        per observation on average (with ``each_row``, at every observation too). An
        unmeasured call (``S = 1``) passes: it has no figure, which :meth:`warn` says."""
        figures = self.summary()
        worst = figures["worst_draw_bias"] if each_row else figures["draw_bias"]
        return not (figures["draw_bias"] > MAX_DRAW_BIAS or worst > MAX_DRAW_BIAS)

    def failing(self):
        """``not reliable()`` as a boolean scalar tensor on the figures' device, computed
        without reading anything back (``MPTLoss`` reads it with its loss); None when
        unmeasured."""
        if self.draw_bias is None:
            return None
        # NaN (nothing scored anywhere) fails no comparison.
        return self.draw_bias.double().nanmean(0).nanmean() > MAX_DRAW_BIAS

    def describe(self):
        """The figures in one sentence."""
        f = self.summary()
        low, high = BENCHMARK_ERROR_PER_DRAW_BIAS
        return (
            f"halving its {self.num_samples} draws of the codes lowers the estimate of log "
            f"p(x) by {f['draw_bias']:.3g} nats per observation on average "
            f"({f['worst_draw_bias']:.3g} at the worst observation), so it lies about that "
            f"far below what more draws would give, and at least that far below log p(x) "
            f"wherever more draws would not rise above it; its draws disagree by "
            f"{f['mean_spread']:.3g} nats per observation (what one draw would lose against "
            f"them). A bias that every draw shares (the guide's, or chains that have not "
            f"mixed) comes on top, unseen: against exact conditionals the error was {low:g} "
            f"to {high:g} times this figure on linear-Gaussian models "
            f"(benchmarks/bench_encode_decode_accuracy.py)"
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
        """Counts this call in ``counts`` and warns
        (:class:`~pyro_mpt.errors.UnmeasuredAccuracyWarning`) on a warned failure (the 1st,
        10th, 100th, ...: :func:`~pyro_mpt.conditionals.accuracy_warnings.failure_history`):
        a call whose draws' bias passes :data:`MAX_DRAW_BIAS` on average, with its figures,
        and every call with one draw (``num_samples=1``), which has no figure: its error is
        unmeasured. The arguments are those of
        :func:`~pyro_mpt.conditionals.accuracy_warnings.warn_if_unreliable`; the figure is
        judged on average whatever ``each_row``, and ``whole`` and ``every_mask_possible``
        (importance sampling's) change nothing here."""
        measured = self.measured()
        if not measured:
            failed = True
        elif failed is None:
            failed = not self.reliable()
        history = failure_history(counts, failed)
        if history is None:
            return
        fix = (
            "conditionals='importance' (whose error is measured at every step) or, where the "
            "model allows, 'exact' or 'quadrature'"
        )
        if not measured:
            one, many = BENCHMARK_ERRORS[1], BENCHMARK_ERRORS[16]
            message = (
                f"{what} by encode-decode ({strategy!r}) have an unmeasured error{history}: "
                f"one draw of the codes per mask (num_samples=1) cannot measure how far off "
                f"it is, and one draw put the estimate of log p(x) {one[0]:g} to {one[1]:g} "
                f"nats per observation below exact conditionals on linear-Gaussian models "
                f"({many[0]:g} to {many[1]:g} with 16 draws; "
                f"benchmarks/bench_encode_decode_accuracy.py). Fix: raise num_samples (16 by "
                f"default; from 2 up every call measures the bias of its draws and warns with "
                f"it when it is large), or use {fix}."
            )
        else:
            message = (
                f"{what} by encode-decode ({strategy!r}) are off here{history}: "
                f"{self.describe()}. Fix: raise num_samples (the figures fall with it), or "
                f"use {fix}."
            )
        warnings.warn(message, UnmeasuredAccuracyWarning, stacklevel=stacklevel)
