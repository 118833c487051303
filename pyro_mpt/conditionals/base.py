"""The interface every self-predictive conditional strategy implements."""

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

__all__ = [
    "MAX_EDGE_SHARE",
    "Conditionals",
    "RuleGap",
    "SelfPredictive",
    "edge_clause",
    "gap_sentence",
    "joined_diagnostics",
]

#: The largest share of an observation's posterior over a quadrature rule's nodes that its
#: outermost nodes may hold (:mod:`~pyro_mpt.ops.quadrature_edge`): past it, part of the
#: integrand lies beyond the rule's span, and the change under refinement may understate
#: the rule's error by orders of magnitude.
MAX_EDGE_SHARE = 0.01


class RuleGap(NamedTuple):
    """How far a rule's ``log p(x)`` moves when it is refined (or coarsened), in nats: the
    mean over the observations, and the largest, that of the observation the rule fits
    worst. A mean alone hides one sharp observation among many easy ones. ``edge``: the
    largest share of an observation's posterior on the finer rule's outermost nodes, where
    it was measured (0 otherwise)."""

    mean: float
    worst: float
    edge: float = 0.0

    @classmethod
    def of(cls, change, edge=None):
        """The gap of a tensor of per-observation changes (and, if given, of the finer
        rule's edge shares)."""
        change = change.abs()
        edge = 0.0 if edge is None or not edge.numel() else float(edge.max())
        return cls(float(change.mean()), float(change.max()), edge)

    @classmethod
    def unmeasured(cls):
        """No rule to compare with (NaN)."""
        return cls(math.nan, math.nan)

    def measured(self):
        """Whether a rule was compared with."""
        return not math.isnan(self.mean)


class SelfPredictive(ABC):
    """The self-predictive conditionals ``p(x_j | x_R)`` of one batch of observations.

    Built whole by :meth:`Conditionals.prepare` from one run of the model; :meth:`log_prob`
    then scores any number of masks in one vectorized call, :meth:`log_marginal` gives
    ``log p(x)`` by the same rule and :meth:`sample` draws hidden features, so that
    imputation, Gibbs chains and the diagnostics use a strategy through this interface only.

    :ivar observed: the :class:`~pyro_mpt.trace.trace_utils.ObservedSite` being scored.
    :ivar scale: the log-probability scale per observation (plate subsampling).
    :ivar extra_log_prob: the model's ``pyro.factor`` terms that do not depend on the local
        latents, summed and scaled (added to the loss as ``Trace_ELBO`` adds them).
    :ivar diagnostics: the accuracy figures of the last :meth:`log_prob` or
        :meth:`log_marginal` call of an approximate strategy (e.g.
        :class:`~pyro_mpt.conditionals.importance.ImportanceDiagnostics`); None for
        strategies whose conditionals are exact for their rule.
    :ivar pending_check: ``None``, or a boolean scalar tensor that is ``True`` when a check of
        the conditionals' assumptions made on this call failed (e.g. a linear-Gaussian form
        that no longer holds), left on the device to spare a synchronisation while Pyro's
        validation is off. :class:`~pyro_mpt.MPTLoss` reads it with the loss, in the same
        synchronisation, and makes the call afresh, verified, when it is ``True``.
    """

    diagnostics = None
    pending_check = None

    def __init__(self, observed, scale, extra_log_prob=0.0):
        self.observed = observed
        self.scale = scale
        self.extra_log_prob = extra_log_prob

    def context(self, masks):
        """The entries each mask leaves visible: not masked, and not missing."""
        entries = self.observed.entries
        return ~masks if entries is None else ~masks & entries

    @property
    def num_features(self):
        """The number of features ``D`` of one observation."""
        return self.observed.value.shape[-1]

    @property
    def batch_shape(self):
        """The shape of the batch of observations."""
        return self.observed.batch_shape

    @abstractmethod
    def log_prob(self, masks):
        """``log p(x_j | x_R)`` for every feature ``j``, with ``R`` the unmasked features.

        :param torch.Tensor masks: boolean, ``True`` at masked features; shape
            ``(P,) + batch_shape + (D,)``, or ``(P,) + (1,) * len(batch_shape) + (D,)`` to
            share masks across the batch.
        :returns: a tensor of shape ``(P,) + batch_shape + (D,)``; entries at unmasked
            features are finite and meaningless. Missing entries (a mask on the observed
            site) are never part of the context.
        """
        raise NotImplementedError

    @property
    def log_prob_width(self):
        """How many numbers :meth:`log_prob` holds per mask, observation and feature in its
        largest intermediate tensor (e.g. ``K`` for conditioning through a ``K``-dimensional
        latent): callers that score masks in chunks divide their memory budget by it."""
        return 1

    def sample(self, hidden, num_samples, joint=True):
        """Draws the hidden features of every observation given the others.

        With ``S`` the hidden features and ``R`` the visible ones that count (not hidden and
        not missing in the model), draws :math:`x_S \\sim p(x_S \\mid x_R)` jointly
        (``joint=True``), or each hidden feature from its own :math:`p(x_j \\mid x_R)`
        (``joint=False``, what one parallel pass of a masked language model does).

        :param torch.Tensor hidden: booleans ``batch_shape + (D,)``, ``True`` at the
            features to draw.
        :param int num_samples: draws per observation.
        :param bool joint: draw the hidden features jointly, or each from its own
            conditional.
        :returns: a tensor ``(num_samples,) + batch_shape + (D,)`` in the dtype of the data
            the model observed, whose other features keep their given values (see
            :meth:`keep_given`).
        :raises NotImplementedError: for strategies that offer no draws.
        """
        raise self._no_draws()

    def check_draws(self):
        """Raises what :meth:`sample` would raise for any ``hidden``, before a caller spends
        more runs of the model on these conditionals (:func:`~pyro_mpt.impute` checks a rule
        first): ``NotImplementedError`` for strategies that offer no draws; a strategy whose
        conditionals cannot serve draws for a reason of their own overrides it."""
        if type(self).sample is SelfPredictive.sample:
            raise self._no_draws()

    def check_masked_contexts(self, what):
        """Raises ``ValueError`` where the conditionals of masked inputs are not what
        :meth:`log_prob` claims though ``log p(x)`` of the whole data is (a rule placed by a
        guide that read the hidden entries): for callers that score drawn masks (``what``
        names them). Nothing to raise for most strategies."""
        return None

    def _no_draws(self):
        return NotImplementedError(
            f"{type(self).__name__} does not implement sample(hidden, num_samples, joint), so "
            f"its conditionals cannot impute or run Gibbs chains; use conditionals='exact', "
            f"'quadrature', 'importance' or 'encode-decode', or implement sample."
        )

    def keep_given(self, hidden, draws):
        """``draws`` at the ``hidden`` features and the given values elsewhere, in the dtype
        of the data the model observed: entries the model masks come back as the model had
        them, not as the stand-ins that scoring fills in.

        :param torch.Tensor hidden: booleans ``batch_shape + (D,)``.
        :param torch.Tensor draws: ``(num_samples,) + batch_shape + (D,)``.
        """
        observed = self.observed
        given = observed.value if observed.unfilled is None else observed.unfilled
        return torch.where(hidden, draws.to(given.dtype), given)

    def proposal_loss(self):
        """A loss that trains the guide as a proposal for ``p(z | x_R)`` from the samples of
        the last :meth:`log_prob` call, or None for strategies that draw nothing from the
        guide. ``MPTLoss(guide_loss="wake")`` trains the guide's parameters on it."""
        return None

    def log_marginal(self):
        """``log p(x)`` of each observation (of its observed entries), ``batch_shape``.

        :raises NotImplementedError: for strategies that give no log-marginal likelihood.
        """
        raise NotImplementedError(
            f"{type(self).__name__} gives no log-marginal likelihood; use exact conditionals, "
            f"a Quadrature rule, or ImportanceSampling."
        )

    def mask_average(self):
        """The uniform-rate MPT estimate of each observation averaged over every mask
        exactly, ``sum_M S(x; M)`` of these conditionals, shape ``batch_shape``: what
        ``MPTLoss(num_masks="all")`` trains on, with no variance from drawing masks.

        Conditionals that are those of one joint distribution (exact ones, a quadrature
        rule's mixture) sum by the chain rule to its ``log p(x)``, :meth:`log_marginal`;
        importance conditionals that share one proposal's draws across masks telescope
        (:func:`~pyro_mpt.ops.shared_sample_importance.every_mask_average`).

        :raises NotImplementedError: for conditionals whose average over the ``2^D`` masks
            has no closed form.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no closed form for the average over every mask; use "
            f"exact or quadrature conditionals, or ImportanceSampling(share_samples=True, "
            f"num_proposals=0, unmasked_proposal=True), or draw masks (num_masks=P)."
        )


class Conditionals(ABC):
    """A strategy that computes self-predictive conditionals for a Pyro model.

    Strategies are configured in their constructor; :class:`~pyro_mpt.conditionals.Auto`
    also remembers which strategy it chose for a model.
    """

    #: The name accepted by ``MPTLoss(conditionals=...)``.
    name = None
    #: What ``MPTLoss(guide_loss="auto")`` trains the guide by under this strategy: None
    #: when the strategy does not use the guide.
    guide_loss = None
    #: The warning ``MPTLoss`` gives when :meth:`checked_gap` finds the conditionals off,
    #: and the fix it names.
    accuracy_warning = UserWarning
    accuracy_fix = "use exact or quadrature conditionals where the model allows."
    #: How many nats per observation :meth:`checked_gap` may find on average before the
    #: conditionals count as off; None: :data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL`.
    gap_tolerance = None
    #: Whether :meth:`checked_gap` measures the conditionals' MPT estimate against a
    #: reference of ``log p(x)`` rather than the strategy's own ``log p(x)``: a caller that
    #: uses ``log p(x)`` alone (:func:`~pyro_mpt.log_marginal`) has no use for it.
    gap_of_mpt_estimate = False

    @property
    def in_use(self):
        """The strategy that prepares this strategy's calls: itself
        (:class:`~pyro_mpt.conditionals.Auto` gives the one it chose)."""
        return self

    def refinement_gap(self, prepared, model, guide, args, kwargs, structure=None, factor=1.5):
        """How far the conditionals of ``prepared`` may be off, as the strategy itself
        measures it on that call's data: a :class:`RuleGap` of ``log p(x)``, or None where
        it has no such measure (exact conditionals have no error; importance sampling reports
        the diagnostics of its weights instead). ``structure``: the one ``prepared`` was made
        from, where the caller holds it; ``factor``: how much finer the rule it is compared
        with (coarser below 1)."""
        return None

    def checked_gap(
        self,
        prepared,
        model,
        guide,
        args,
        kwargs,
        structure=None,
        restore=None,
        context=None,
        num_masks=None,
    ):
        """:meth:`refinement_gap` against 1.5 times the nodes, or, for a rule that cannot be
        refined, against two thirds of them (a sign that the rule is still moving, not a
        measure of its own error): ``(gap, "finer" or "coarser")``; ``(None, None)`` for a
        strategy with no such measure. ``restore``, if given, is called before each rule is
        prepared (to put back the random state ``prepared`` was made from). ``context``, if
        given, restricts the ``log p`` compared to those entries (booleans ``batch + (D,)``;
        passed on to :meth:`refinement_gap` only then). ``num_masks``: the masks per
        observation of the caller's MPT estimate, where it draws them (``MPTLoss``), for the
        strategies whose check measures that estimate (:attr:`gap_of_mpt_estimate`)."""
        call = (prepared, model, guide, args, kwargs)
        options = {"structure": structure}
        if context is not None:
            options["context"] = context
        if restore is not None:
            restore()
        gap = self.refinement_gap(*call, **options)
        if gap is None:
            return None, None
        if gap.measured():
            return gap, "finer"
        if restore is not None:
            restore()
        return self.refinement_gap(*call, **options, factor=2 / 3), "coarser"

    @abstractmethod
    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        """Runs the model (and the guide, if the strategy needs one) on a batch of data.

        :returns: a :class:`SelfPredictive` for the batch.
        :raises pyro_mpt.errors.NotApplicableError: if the strategy does not apply to this
            model.
        """
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


def gap_sentence(strategy, gap, compared_with):
    """What :meth:`Conditionals.checked_gap` found (a :class:`RuleGap`), in words, for
    warnings and logs."""
    figures = (
        f"{gap.mean:.2g} nats per observation on average and by {gap.worst:.2g} at the "
        f"observation it fits worst"
    )
    if compared_with == "importance":
        return (
            f"{strategy!r} estimates log p(x) at least {gap.mean:.2g} nats per observation "
            f"below an importance-sampling lower bound of it (the batch's mean shortfall, "
            f"less four standard errors)"
        )
    if compared_with == "importance, one draw":
        return (
            f"{strategy!r} estimates log p(x) {gap.mean:.2g} nats per observation of the batch "
            f"below an importance-sampling estimate of it with the guide on the whole "
            f"observation, counting only the observations on which that estimate rests on "
            f"one draw of the guide (a figure that tends to understate the error, that "
            f"estimate being low there too): the guide misses their posteriors, too few of "
            f"them for the weights' share-based tests, and their conditionals are off by nats"
        )
    if compared_with == "importance above":
        return (
            f"{strategy!r} estimates log p(x) {gap.mean:.2g} nats per observation or more "
            f"above an importance-sampling estimate of it with the guide on the whole "
            f"observation, whose weights are reliable (the batch's mean excess, less that "
            f"estimate's own first-order bias and four standard errors, so that the figure "
            f"tends to understate it), as when a guide "
            f"fitted to whole observations proposes too narrowly for masked ones, whose "
            f"conditionals then come out too high"
        )
    if compared_with == "finer":
        sentence = (
            f"{strategy!r} changes log p(x) by {figures} when refined to 1.5 times its nodes "
            f"per dimension"
        )
    else:
        sentence = (
            f"{strategy!r} cannot be refined, and a rule with two thirds of its nodes differs "
            f"from it by {figures}"
        )
    return sentence + edge_clause(gap)


def edge_clause(gap):
    """What ``gap.edge`` says, in words, where it passes :data:`MAX_EDGE_SHARE` (else "")."""
    if gap.edge <= MAX_EDGE_SHARE:
        return ""
    return (
        f"; and the outermost nodes of the finer rule hold {100 * gap.edge:.2g}% of the "
        f"posterior of an observation, so part of it lies beyond both rules' nodes and the "
        f"error may be many times that figure"
    )


def joined_diagnostics(parts):
    """The accuracy figures of several batches of one call's conditionals (e.g. one batch
    per mask size), as one, joined by their own kind's ``joined``; None when no part has
    any. Every part is of one kind: one strategy made them."""
    parts = [part for part in parts if part is not None]
    return type(parts[0]).joined(parts) if parts else None
