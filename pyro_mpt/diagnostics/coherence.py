"""The chain-rule coherence of self-predictive conditionals: ``log p(x)`` summed along random
orderings of the features. Exact conditionals give the same sum for every ordering; the spread
of approximate ones measures their error without a reference (:doc:`/coherence`)."""

import math
from typing import NamedTuple

import torch

from pyro_mpt.conditionals.accuracy_warnings import counted_per_call, warn_if_unreliable
from pyro_mpt.conditionals.base import joined_diagnostics
from pyro_mpt.conditionals.per_model import conditionals_for, package_function
from pyro_mpt.conditionals.rule_check import prepare_checked
from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.orderings import (
    observed_steps,
    prefix_masks,
    random_orderings,
    select_steps,
    summarize_orderings,
)
from pyro_mpt.progress import progress_bar
from pyro_mpt.trace.trace_utils import param_store_rollback

__all__ = ["OrderingLogLikelihoods", "ordering_log_likelihoods"]

# Elements of the largest intermediate tensor per chunk of masks (about 160 MB in float64).
_CHUNK_ELEMENTS = 2 * 10**7
# A spread below this many machine epsilons of |log p(x)| (at least 1 nat) is rounding, not
# incoherence: about 2e-13 in float64 and 1e-4 in float32.
_ROUNDING_EPSILONS = 1000


class OrderingLogLikelihoods(NamedTuple):
    """Chain-rule sums ``sum_i log p(x_s(i) | x_s(1..i-1))`` along random orderings ``s`` of
    each observation's features, and their summary per observation.

    :ivar torch.Tensor values: the sum of each ordering, ``(num_orderings,) + batch``.
    :ivar torch.Tensor mean: the mean over orderings, ``batch``: an estimate of ``log p(x)``.
    :ivar torch.Tensor spread: the standard deviation across orderings (``n - 1`` in the
        denominator), ``batch``; 0 up to rounding for coherent conditionals, NaN with one
        ordering.
    :ivar torch.Tensor spread_se: the standard error of ``spread`` (see
        :func:`~pyro_mpt.ops.orderings.summarize_orderings`), ``batch``.
    :ivar log_marginal: the strategy's own ``log p(x)``, ``batch``, or None.
    :ivar gap: ``mean - log_marginal``, ``batch``, or None.
    """

    values: torch.Tensor
    mean: torch.Tensor
    spread: torch.Tensor
    spread_se: torch.Tensor
    log_marginal: torch.Tensor | None = None
    gap: torch.Tensor | None = None

    @classmethod
    def from_values(cls, values, log_marginal=None):
        """Summarises the chain-rule sums of every ordering.

        :param torch.Tensor values: ``(num_orderings,) + batch``.
        :param torch.Tensor log_marginal: a reference ``log p(x)`` of shape ``batch``, or None.
        :returns: an :class:`OrderingLogLikelihoods`.
        """
        if values.dim() < 1:
            raise ValueError(
                f"values must have a leading dim of orderings, (num_orderings,) + batch; got a "
                f"tensor of shape {tuple(values.shape)}."
            )
        mean, spread, spread_se = summarize_orderings(values)
        gap = None
        if log_marginal is not None:
            log_marginal = torch.as_tensor(log_marginal, dtype=values.dtype, device=values.device)
            if log_marginal.shape != mean.shape:
                raise ValueError(
                    f"log_marginal must have the batch shape {tuple(mean.shape)} of values, got "
                    f"{tuple(log_marginal.shape)}."
                )
            gap = mean - log_marginal
        return cls(values, mean, spread, spread_se, log_marginal, gap)

    @property
    def num_orderings(self):
        """How many orderings each observation had."""
        return self.values.shape[0]

    def summary(self):
        """Plain floats over the batch, for tables and logs.

        :returns: a dict with ``num_orderings``, ``num_observations``, ``mean`` (the mean
            per observation of the chain-rule sums), ``mean_se`` (its Monte Carlo standard
            error over orderings), ``spread`` (the mean per observation of the spread),
            ``spread_se`` (its standard error, the observations' errors being independent),
            ``max_spread``, and ``log_marginal`` and ``gap`` (means per observation; None
            without a reference).
        """
        num = max(1, self.mean.numel())
        spread = self.spread.reshape(-1)
        log_marginal = gap = None
        if self.log_marginal is not None:
            log_marginal = float(self.log_marginal.mean())
            gap = float(self.gap.mean())
        return {
            "num_orderings": self.num_orderings,
            "num_observations": self.mean.numel(),
            "mean": float(self.mean.mean()),
            "mean_se": float(spread.pow(2).sum().sqrt() / (num * math.sqrt(self.num_orderings))),
            "spread": float(spread.mean()),
            "spread_se": float(self.spread_se.reshape(-1).pow(2).sum().sqrt() / num),
            "max_spread": float(spread.max()) if spread.numel() else math.nan,
            "log_marginal": log_marginal,
            "gap": gap,
        }

    def _rounding(self, mean):
        """The largest spread that rounding explains, in nats."""
        eps = torch.finfo(self.values.dtype).eps if self.values.is_floating_point() else 0.0
        return _ROUNDING_EPSILONS * eps * max(1.0, abs(mean))

    def describe(self):
        """One sentence saying what the orderings found, in nats per observation."""
        s = self.summary()
        head = (
            f"Over {s['num_orderings']} ordering(s) of {s['num_observations']} observation(s), "
            f"the chain rule gives {s['mean']:.4f} nats per observation"
        )
        if s["num_orderings"] < 2:
            text = f"{head}; one ordering shows no spread (use num_orderings >= 2)"
        elif s["max_spread"] <= self._rounding(s["mean"]):
            text = f"{head}, the same for every ordering up to rounding: coherent conditionals"
        else:
            spread = (
                f"{s['spread']:.4g} +/- {s['spread_se']:.2g} nats ("
                if math.isfinite(s["spread_se"])
                else f"{s['spread']:.4g} nats (no standard error from two orderings; "
            )
            text = (
                f"{head}; its spread across orderings is {spread}"
                f"standard deviation per observation, averaged; at "
                f"most {s['max_spread']:.4g}): the conditionals are not coherent (no one joint "
                f"distribution has them)"
            )
        if s["log_marginal"] is not None:
            text += (
                f"; the strategy's log_marginal is {s['log_marginal']:.4f}, a gap of "
                f"{s['gap']:+.4g} +/- {s['mean_se']:.2g}"
            )
        return text + "."


@torch.no_grad()
@package_function
def ordering_log_likelihoods(
    model,
    *args,
    guide=None,
    num_orderings=8,
    conditionals="auto",
    progress=False,
    max_plate_nesting=math.inf,
    check_rule=True,
    **kwargs,
):
    """``log p(x)`` of every observation by the chain rule along random orderings of its
    features, each term a self-predictive conditional given the features before it.

    .. math::

        \\log p(x) = \\sum_{i=1}^{D} \\log p\\big(x_{\\sigma(i)} \\mid
            x_{\\sigma(1)}, \\dots, x_{\\sigma(i-1)}\\big)
        \\quad \\text{for every ordering } \\sigma.

    With exact conditionals (or those of one quadrature rule, exact for the rule) every
    ordering gives the same sum, the strategy's ``log_marginal``. Approximate ones
    (importance sampling, encode-decode) disagree: the spread across orderings measures how
    far they are from the conditionals of any one joint distribution, with no reference
    needed. Each observation gets its own random orderings; an observation with missing
    entries (a mask on the observed site) is ordered over its observed entries, which
    estimates ``log p(x_observed)``.

    The model runs once (the strategy's ``prepare``); the ``num_orderings * D`` prefix masks
    are then scored by the strategy's ``log_prob`` in vectorised chunks, so one ordering costs
    about ``D`` masks' conditionals. Importance-sampled conditionals draw new samples for
    each chunk.

    .. note:: Values are per observation and unscaled: ``poutine.scale``, subsampling and
        ``pyro.factor`` terms that do not involve the local latents are not included, as in
        :func:`~pyro_mpt.log_marginal`. Pyro's param store is left as it was found.

    :param callable model: the Pyro model.
    :param args: the model's arguments.
    :param callable guide: the guide, for strategies that use one.
    :param int num_orderings: random orderings per observation (at least 2 for a spread).
    :param conditionals: a strategy name or :class:`~pyro_mpt.conditionals.Conditionals`,
        as in :class:`~pyro_mpt.MPTLoss`.
    :param bool progress: show a progress bar over the masks.
    :param max_plate_nesting: as in :class:`~pyro_mpt.MPTLoss`.
    :param bool check_rule: whether a quadrature rule given here measures its own error on
        the data first, and encode-decode conditionals are held to an importance-sampling
        lower bound of ``log p(x)``, as in :func:`~pyro_mpt.mpt_curve`, warning with the
        figure: the spread across orderings does not see a bias they all share.
    :param kwargs: the model's keyword arguments.
    :returns: an :class:`OrderingLogLikelihoods`, on the device and in the dtype of the
        conditionals; its ``log_marginal`` is the strategy's own (an estimate for
        importance sampling), or None for strategies that give none.
    :raises ValueError: if ``num_orderings`` is below 1.

    Example::

        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=5, latent_dim=2)
        >>> x = ppca.sample(20)
        >>> result = ordering_log_likelihoods(ppca.model, x, num_orderings=4)
        >>> result.values.shape
        torch.Size([4, 20])
        >>> bool((result.gap.abs() < 1e-3).all())
        True
    """
    num_orderings = check_positive_int(
        "num_orderings",
        num_orderings,
        "It is the number of random orderings of each observation's features, e.g. "
        "num_orderings=8.",
    )
    strategy = conditionals_for(conditionals, model)
    with param_store_rollback(always=True), counted_per_call():
        call = (model, guide, args, kwargs, max_plate_nesting)
        prepared = prepare_checked(strategy, *call, check_rule, "ordering_log_likelihoods")
        prepared.check_masked_contexts("ordering_log_likelihoods")
        values, diagnostics = _chain_rule_sums(prepared, num_orderings, progress)
        # Failing importance weights make the sums disagree for a reason of their own: the
        # spread would read as incoherence, and the mean as log p(x).
        what = "ordering_log_likelihoods"
        warn_if_unreliable(
            diagnostics, what, model, args, guide=guide, strategy=strategy.in_use, each_row=True
        )
        try:
            reference = prepared.log_marginal()
        except NotImplementedError:
            reference = None
    return OrderingLogLikelihoods.from_values(values, reference)


def _chain_rule_sums(prepared, num_orderings, progress):
    """The sums along ``num_orderings`` random orderings, ``(num_orderings,) + batch``, and
    the importance diagnostics of every conditional scored, joined (None for strategies
    without them)."""
    observed = prepared.observed
    value, entries, batch_shape = observed.value, observed.entries, prepared.batch_shape
    num_features = prepared.num_features
    orderings = random_orderings(
        num_orderings, batch_shape, num_features, entries=entries, device=value.device
    )
    # Missing entries come last in every ordering: steps past the most observed entries of
    # any observation score nothing and are skipped.
    num_steps = num_features if entries is None else int(entries.sum(-1).max().item())
    counts = observed_steps(orderings, entries)
    per_mask = max(1, value.numel() * prepared.log_prob_width)
    chunk = max(1, _CHUNK_ELEMENTS // per_mask)
    values, diagnostics = None, []
    with progress_bar(
        total=num_orderings * num_steps, desc="orderings", disable=not progress, leave=False
    ) as bar:
        if chunk >= num_steps:
            # Several whole orderings per call.
            per_call = chunk // max(1, num_steps)
            blocks = [
                (slice(start, start + per_call), range(num_steps))
                for start in range(0, num_orderings, per_call)
            ]
        else:
            blocks = [
                (slice(o, o + 1), range(start, min(start + chunk, num_steps)))
                for o in range(num_orderings)
                for start in range(0, num_steps, chunk)
            ]
        for which, steps in blocks:
            terms = _score_steps(prepared, orderings[which], steps, counts[which])
            diagnostics.append(prepared.diagnostics)
            if values is None:
                values = terms.new_zeros((num_orderings,) + tuple(batch_shape))
            values[which] += terms.sum(1)
            bar.update(terms.shape[0] * terms.shape[1])
    if values is None:  # no observed entry anywhere
        values = value.new_zeros((num_orderings,) + tuple(batch_shape))
    return values, joined_diagnostics(diagnostics)


def _score_steps(prepared, orderings, steps, counts):
    """``log p(x_s(i) | x_s(<i))`` at the given steps, ``(O, len(steps)) + batch``."""
    masks = prefix_masks(orderings, steps)
    num_orderings, num_steps = masks.shape[:2]
    log_probs = prepared.log_prob(masks.flatten(0, 1))
    log_probs = log_probs.reshape((num_orderings, num_steps) + log_probs.shape[1:])
    terms = select_steps(log_probs, orderings, steps)
    keep = counts.index_select(-1, torch.as_tensor(steps, device=counts.device)).movedim(-1, 1)
    return torch.where(keep, terms, terms.new_zeros(()))
