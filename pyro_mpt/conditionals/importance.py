"""Self-predictive conditionals by importance sampling with the guide as proposal, and the
wake-phase loss that trains the guide as a proposal. The diagnostics of the weights are in
:mod:`pyro_mpt.conditionals.importance_diagnostics`."""

import math
import numbers
import warnings

import torch
from pyro.poutine import replay

from pyro_mpt.conditionals.accuracy_warnings import warn_if_unreliable
from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.conditionals.importance_diagnostics import ImportanceDiagnostics
from pyro_mpt.conditionals.likelihood_draws import picked_draws
from pyro_mpt.errors import ImportanceAccuracyWarning, check_positive_int
from pyro_mpt.ops.bernoulli import observed_log_prob
from pyro_mpt.ops.conditional_sampling import mixture_component_sample
from pyro_mpt.ops.importance_weights import ratio_bias
from pyro_mpt.ops.jackknife_importance import (
    jackknife_importance_log_conditionals,
    jackknife_importance_log_marginal,
)
from pyro_mpt.ops.masks import (
    UniformRate,
    mask_scores,
    masked_sum,
    process_generator,
    sample_masks,
)
from pyro_mpt.ops.self_normalised_importance import (
    check_fill,
    fill_masked,
    importance_log_conditionals,
    importance_log_marginal,
)
from pyro_mpt.ops.shared_sample_importance import (
    context_log_likelihoods,
    every_mask_average,
    mixture_log_density,
    proposal_masks,
    shared_sample_log_conditionals,
)
from pyro_mpt.trace.defensive_proposal import GUIDE_FN, defensive_discrete
from pyro_mpt.trace.factors import check_factors, factor_log_prob
from pyro_mpt.trace.guide_densities import (
    observed_tensor,
    proposal_log_density,
    sites_log_density,
)
from pyro_mpt.trace.guided_model import RememberedGuided, observed_site_of_run, run_guided
from pyro_mpt.trace.trace_utils import latent_sites, unwrap_independent

__all__ = [
    "ImportanceSampling",
    "ImportanceSelfPredictive",
]

DEBIAS = (None, "jackknife")


def _draws_shared_from_unmasked(share_samples, num_proposals, unmasked_proposal):
    """Whether every mask weights the same draws, all from the guide on the unmasked input:
    the setting whose average over every mask has a closed form."""
    return bool(share_samples) and num_proposals == 0 and bool(unmasked_proposal)


class ImportanceSelfPredictive(SelfPredictive):
    """Conditionals of one batch by self-normalised importance sampling.

    :ivar diagnostics: the
        :class:`~pyro_mpt.conditionals.importance_diagnostics.ImportanceDiagnostics` of the last
        call of :meth:`log_prob` or :meth:`log_marginal`, or None before the first.
    """

    def __init__(
        self,
        guided,
        num_samples,
        fill,
        debias=None,
        share_samples=False,
        num_proposals=None,
        unmasked_proposal=False,
        wake_contexts=None,
    ):
        super().__init__(guided.local.observed, guided.local.scale, factor_log_prob(guided.local))
        self.guided = guided
        self.num_samples = num_samples
        self.fill = fill
        self.debias = debias
        self.share_samples = share_samples
        self.num_proposals = num_proposals
        self.unmasked_proposal = unmasked_proposal
        self.wake_contexts = 1 if wake_contexts is None else wake_contexts
        self.diagnostics = None
        self._proposal_terms = None

    @property
    def log_prob_width(self):
        """``S``, the draws per mask that each conditional weights."""
        return self.num_samples

    def _sample(self, filled, hidden):
        """``(log p(z) - log q(z), l)`` at ``S`` guide samples on ``filled`` data, with
        ``hidden`` the masked or missing entries: shapes ``(S, P) + batch`` and
        ``(S, P) + batch + (D,)``. Keeps the guide trace for :meth:`proposal_loss`."""
        guided, num_samples = self.guided, self.num_samples
        guide_trace, model_trace = run_guided(guided, filled, num_samples, hidden=hidden)
        site, self.scale = observed_site_of_run(guided, model_trace)
        check_factors(guided.local, model_trace, "importance sampling")
        lead = (num_samples, filled.shape[0])
        log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
        log_q = proposal_log_density(guide_trace, guided, lead)
        ll = observed_log_prob(unwrap_independent(site["fn"]), site["value"])
        self._proposal_terms = (guide_trace, lead)
        return log_p - log_q, observed_tensor(ll, guided, lead)

    def _sample_shared(self, filled, hidden):
        """Guide samples for the ``P`` masks of each observation, pooled: ``S`` draws from
        each mask's proposal, all ``S * P`` used by every mask against the equal mixture
        of the ``P`` proposals (multiple importance sampling with the balance heuristic;
        Veach & Guibas, 1995). Every mask gets ``P`` times the samples, and the model runs
        once per pooled draw instead of once per draw and mask.

        :returns: ``(log p(z) - log q_mix(z), l)`` of shapes ``(S * P,) + batch`` and
            ``(S * P,) + batch + (D,)``, or None when a latent is not drawn per mask and
            observation (nothing to pool).
        """
        guided, num_samples = self.guided, self.num_samples
        num_masks = filled.shape[0]
        pooled_size = num_samples * num_masks
        lead = (pooled_size, num_masks)
        drawn = None
        if len(guided.local.latent_names) == 1:
            # One latent site: its q depends on no other draw, so one guide run with S * P
            # draws per mask gives every mask's q at every pooled draw. Pooled draw k is
            # draw k of mask k mod P: S from each mask.
            drawn, _ = run_guided(guided, filled, pooled_size, replay_model=False, hidden=hidden)
            if len(latent_sites(drawn)) != 1:  # e.g. an auxiliary site of an autoguide
                drawn = None
        if drawn is not None:
            (name,) = latent_sites(drawn)
            value = drawn.nodes[name]["value"]
            if value.shape[:2] != lead:
                return None
            index = torch.arange(pooled_size, device=value.device)
            merged = value[index, index % num_masks].unsqueeze(1)
            pooled, scored = drawn.copy(), drawn.copy()
            pooled.nodes[name] = dict(drawn.nodes[name], value=merged)
            expanded = merged.expand(lead + value.shape[2:])
            scored.nodes[name] = dict(drawn.nodes[name], value=expanded)
        else:
            drawn, _ = run_guided(guided, filled, num_samples, replay_model=False, hidden=hidden)
            names = latent_sites(drawn)
            shapes = [drawn.nodes[n]["value"].shape[:2] for n in names]
            if any(shape != (num_samples, num_masks) for shape in shapes):
                return None
            pooled, every = drawn.copy(), drawn.copy()
            for name in names:
                value = drawn.nodes[name]["value"]
                merged = value.reshape((pooled_size, 1) + value.shape[2:])
                pooled.nodes[name] = dict(drawn.nodes[name], value=merged)
                expanded = merged.expand(lead + value.shape[2:])
                every.nodes[name] = dict(drawn.nodes[name], value=expanded)
            # A site's q may depend on other draws: the guide is replayed at every pooled
            # draw under every mask, with the defensive mixtures the draws came from.
            replaying = replay(defensive_discrete(guided.guide), trace=every)
            proposals = guided._replace(guide=replaying)
            scored, _ = run_guided(
                proposals, filled, pooled_size, replay_model=False, hidden=hidden
            )
        # log q_p(z_k) of every pooled draw under every mask's proposal.
        log_q_mix = mixture_log_density(proposal_log_density(scored, guided, lead))
        # The model at each pooled draw once (any mask's filled data: the model reads none),
        # replayed against the pooled draws without running the guide again.
        _, model_trace = run_guided(
            guided, filled[:1], pooled_size, hidden=hidden[:1], guide_trace=pooled
        )
        site, self.scale = observed_site_of_run(guided, model_trace)
        check_factors(guided.local, model_trace, "importance sampling")
        lead = (pooled_size, 1)
        log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
        fn = unwrap_independent(site["fn"])
        ll = observed_tensor(observed_log_prob(fn, site["value"]), guided, lead)
        self._proposal_terms = (scored, (pooled_size, num_masks))
        return log_p[:, 0] - log_q_mix, ll[:, 0]

    def log_prob(self, masks):
        context = self.context(masks)
        value = self.observed.value
        shape = torch.broadcast_shapes(context.shape, context.shape[:1] + value.shape)
        if self.share_samples and (shape[0] > 1 or self.unmasked_proposal):
            drawing = proposal_masks(shape[0], self.num_proposals, value.device)
            # Only the masks that draw need filled inputs.
            contexts = context.expand(shape)[drawing]
            if self.unmasked_proposal:  # the guide on the input with nothing hidden
                unmasked = self.context(torch.zeros_like(masks[:1])).expand((1,) + shape[1:])
                contexts = torch.cat([contexts, unmasked])
            filled = fill_masked(value, ~contexts, self.fill)
            shared = self._sample_shared(filled, ~contexts)
            if shared is not None:
                log_w, ll = shared
                context = context.expand(shape)
                log_joint = log_w.unsqueeze(1) + context_log_likelihoods(ll, context)
                targets = log_joint[:, drawing]
                if self.unmasked_proposal:
                    full = log_w.unsqueeze(1) + context_log_likelihoods(ll, contexts[-1:])
                    targets = torch.cat([targets, full], 1)
                bias = ratio_bias(log_joint, ll.unsqueeze(1))
                bias = self._row_bias(bias, context)
                self._record(log_joint.detach(), targets.detach(), bias, context)
                return shared_sample_log_conditionals(log_joint, ll)
        filled, hidden = fill_masked(value, ~context, self.fill), ~context
        log_w, ll = self._sample(filled, hidden)
        # log p(z, x_R) - log q(z): the weights toward p(z | x_R).
        log_joint = log_w.detach() + masked_sum(ll.detach(), context)
        if self.debias == "jackknife":
            bias = self._row_bias(ratio_bias(log_joint, ll), context)
            self._record(log_joint, None, bias, context)
            return jackknife_importance_log_conditionals(log_w, ll, context)
        out, bias = importance_log_conditionals(log_w, ll, context, with_bias=True)
        self._record(log_joint, None, self._row_bias(bias, context), context)
        return out

    def _wake_targets(self, full, log_w, ll):
        """The log weights that :meth:`proposal_loss` trains the guide toward after
        :meth:`mask_average`: the full context's, ``full`` ``(S, 1) + batch``, and those of
        :attr:`wake_contexts` contexts per observation drawn at the uniform rate, the
        contexts the average runs over, ``(S, C) + batch``. The posteriors of partial
        contexts are broader than ``p(z | x)``, and their weights rest on more draws."""
        if not self.wake_contexts:
            return full
        value = self.observed.value
        masks, _ = sample_masks(
            UniformRate(),
            self.wake_contexts,
            self.observed.batch_shape,
            value.shape[-1],
            device=value.device,
            entries=self.observed.entries,
            generator=process_generator(value.device),
        )
        contexts = log_w.unsqueeze(1) + context_log_likelihoods(ll, self.context(masks))
        return torch.cat([full, contexts.detach()], 1)

    def _record(self, log_joint, targets=None, bias=None, context=None):
        """Keeps the weights' diagnostics of every mask (with ``bias``, the first-order bias
        of each row's score), and the log weights toward the posteriors that the proposals
        approximate, the targets of :meth:`proposal_loss`: ``targets`` (one column per
        proposal), or every mask's own."""
        entries = self.observed.entries
        counted = None if entries is None else entries.any(-1).expand(log_joint.shape[1:])
        diagnostics = ImportanceDiagnostics.of(log_joint, counted, context)
        self.diagnostics = diagnostics._replace(ratio_bias=bias)
        self._log_joint = log_joint if targets is None else targets

    def _row_bias(self, bias, context):
        """The first-order bias of each (mask, observation) row's score
        ``D / M sum_{j in mask} log p(x_j | x_R)``, from that of each feature's conditional
        (:func:`~pyro_mpt.ops.importance_weights.ratio_bias`): NaN where nothing is scored."""
        entries = self.observed.entries
        scored = ~context if entries is None else ~context & entries
        counts = scored.shape[-1] if entries is None else entries.sum(-1)
        sizes = scored.expand(bias.shape).sum(-1)
        rows = counts * mask_scores(bias, scored, sizes)
        return torch.where(sizes > 0, rows, math.nan)

    def proposal_loss(self):
        """The wake-phase loss of the guide for the samples of the last :meth:`log_prob`:
        ``-sum_s wbar_s log q(z_s | x_R)`` with the self-normalised weights ``wbar`` toward
        ``p(z | x_R)`` and the samples ``z_s`` detached (reweighted wake-sleep; Bornschein &
        Bengio, 2015). Its gradient moves ``q`` toward ``p(z | x_R)`` (it is the gradient
        of ``KL(p(z | x_R) || q)`` up to the estimator's error) and never rewards a larger
        estimate of ``log p(x_j | x_R)``. Averaged over the targets (every mask's own
        context, or the proposals' contexts with pooled draws; after :meth:`mask_average`,
        the full context and :attr:`wake_contexts` drawn ones), summed over observations
        (scaled like the loss); shape ``()``.
        """
        guide_trace, lead = self._proposal_terms
        detached = guide_trace.copy()
        for name, site in list(detached.nodes.items()):
            if site["type"] == "sample" and not site["is_observed"]:
                # The guide's own q, not the defensive mixture the samples were drawn from.
                fn = site["infer"].get(GUIDE_FN, site["fn"])
                detached.nodes[name] = dict(site, fn=fn, value=site["value"].detach())
        log_q = proposal_log_density(detached, self.guided, lead)
        weights = torch.softmax(self._log_joint.detach(), 0)
        per_row = -(weights * log_q).sum(0)  # (P,) + batch
        entries = self.observed.entries
        if entries is not None:
            per_row = torch.where(entries.any(-1), per_row, 0.0)
        return (self.scale * per_row.mean(0)).sum()

    def sample(self, hidden, num_samples, joint=True):
        """Sampling-importance-resampling: ``S`` proposals from the guide on the filled data,
        weighted toward ``p(z | x_R)``, one resampled per draw (per draw and feature when not
        ``joint``), and the hidden features drawn from the likelihood at it; consistent as
        ``S`` grows. Warns as :meth:`log_prob` does when the weights fail. See
        :meth:`SelfPredictive.sample`."""
        guided, num_proposals = self.guided, self.num_samples
        x, observed = self.observed.value, self.observed
        context = self.context(hidden)
        unseen = (~context).unsqueeze(0)  # hidden or missing: what the guide must not read
        filled = fill_masked(x, unseen, self.fill)  # (1,) + batch + (D,)
        guide_trace, model_trace = run_guided(guided, filled, num_proposals, hidden=unseen)
        check_factors(guided.local, model_trace, "importance resampling")
        lead = (num_proposals, 1)
        log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
        log_q = proposal_log_density(guide_trace, guided, lead)
        site, _ = observed_site_of_run(guided, model_trace)
        fn = unwrap_independent(site["fn"])
        ll = observed_tensor(observed_log_prob(fn, site["value"]), guided, lead)
        log_w = (log_p - log_q + masked_sum(ll, context))[:, 0]  # (S',) + batch
        # Resampling is only as good as the weights: the same figures as the conditionals'.
        what = "Draws of hidden features"
        diagnostics = ImportanceDiagnostics.of(log_w, None, context)
        model, args, guide = guided.model, guided.args, guided.guide
        warn_if_unreliable(diagnostics, what, model, args, guide=guide, each_row=True)
        if not joint:
            log_w = log_w.unsqueeze(-1).expand(log_w.shape + (observed.num_features,))
        index = mixture_component_sample(log_w, (num_samples,))
        if joint:
            index = index.unsqueeze(-1).expand(index.shape + (observed.num_features,))
        draws = picked_draws(site["fn"], observed, num_proposals, index)
        return self.keep_given(hidden, draws)

    def log_marginal(self):
        """The importance estimate of ``log p(x)`` of each observation, with the guide on
        the full data: ``LSE_s(log p(x, z_s) - log q(z_s | x)) - log S`` (a stochastic
        lower bound in expectation, the IWAE bound; jackknife-corrected with
        ``debias="jackknife"``), shape ``batch_shape``. Its weights' diagnostics are in
        :attr:`diagnostics`."""
        entries = self.observed.entries
        value = self.observed.value
        hidden = torch.zeros_like(value, dtype=torch.bool) if entries is None else ~entries
        filled = fill_masked(value, hidden.unsqueeze(0), self.fill)
        log_w, ll = self._sample(filled, hidden.unsqueeze(0))
        if entries is not None:
            ll = ll * entries.to(ll.dtype)
        log_joint = log_w + ll.sum(-1)
        self._record(log_joint)
        log_joint = log_joint[:, 0]
        if self.debias == "jackknife":
            result = jackknife_importance_log_marginal(log_joint)
        else:
            result = importance_log_marginal(log_joint)
        if entries is None:
            return result
        # An observation with no observed entry has log p = 0 exactly, not its estimate.
        return torch.where(entries.any(-1), result, 0.0)

    def mask_average(self):
        """The average over every mask, exactly, of conditionals whose masks all weight the
        same ``S`` draws from the guide on the unmasked input (``share_samples=True,
        num_proposals=0, unmasked_proposal=True``): ``LSE_s(log r_s + log p(x | z_s)) -
        LSE_s(log r_s)`` with ``r_s = p(z_s) / q(z_s | x)``
        (:func:`~pyro_mpt.ops.shared_sample_importance.every_mask_average`). Its weights'
        diagnostics cover both ends of the chain of contexts, the full one and the empty
        one, whose term is exactly 0 and whose error the estimate carries
        (:attr:`ImportanceDiagnostics.empty_context`). The wake loss that follows targets the
        full context and ``wake_contexts`` contexts drawn at the uniform rate.

        :raises ValueError: for other settings, whose masks draw samples of their own.
        """
        if not _draws_shared_from_unmasked(
            self.share_samples, self.num_proposals, self.unmasked_proposal
        ):
            raise ValueError(
                f"The average over every mask has a closed form only when all masks weight "
                f"the same draws, from the guide on the unmasked input; these conditionals "
                f"draw per mask (share_samples={self.share_samples}, "
                f"num_proposals={self.num_proposals}, "
                f"unmasked_proposal={self.unmasked_proposal}). Use "
                f"ImportanceSampling({self.num_samples}, share_samples=True, num_proposals=0, "
                f"unmasked_proposal=True), or draw masks (num_masks=P)."
            )
        entries = self.observed.entries
        visible = self.context(torch.zeros_like(self.observed.value, dtype=torch.bool))
        hidden = ~visible.unsqueeze(0)
        filled = fill_masked(self.observed.value, hidden, self.fill)
        shared = self._sample_shared(filled, hidden)
        if shared is None:
            log_w, ll = self._sample(filled, hidden)
            log_w, ll = log_w[:, 0], ll[:, 0]
        else:
            log_w, ll = shared
        total = masked_sum(ll, visible)
        ends = torch.stack([log_w + total, log_w], 1).detach()  # (S, 2) + batch
        self._record(ends, self._wake_targets(ends[:, :1], log_w, ll))
        self.diagnostics = self.diagnostics._replace(
            empty_context=torch.logsumexp(ends[:, 1], 0) - math.log(ends.shape[0])
        )
        result = every_mask_average(log_w, total)
        if entries is None:
            return result
        # An observation with no observed entry has log p = 0 exactly.
        return torch.where(entries.any(-1), result, 0.0)


class ImportanceSampling(Conditionals):
    """Conditionals by self-normalised importance sampling, with the guide on the masked
    input as proposal (formerly ``Importance``, a deprecated alias now).

    For every mask the masked features are filled (zeros or feature means), the guide
    encodes the filled data and proposes ``S`` latents ``z_s ~ q(z | x_fill)``, and the model
    scores each feature at them, ``l_sj = log p(x_j | z_s)``. With
    ``log w_s = log p(z_s) + sum_{k in R} l_sk - log q(z_s)``,

    .. math::

        \\log p(x_j \\mid x_R) \\approx \\operatorname{LSE}_s(\\log w_s + l_{sj})
            - \\operatorname{LSE}_s(\\log w_s).

    Consistent for any model with a guide as ``S`` grows, but **biased at finite** ``S``: each
    log-mean-exp term is biased down by about ``Var/(2S)`` and their difference either way,
    so with ``rate="uniform"`` the MPT estimate is *not* unbiased for ``log p(x)``, as it is
    with exact or quadrature conditionals. How far off it is depends on how well the guide
    proposes for ``p(z | x_R)``: every call records the Pareto k-hat and effective sample
    size of each (observation, mask) row in :attr:`ImportanceSelfPredictive.diagnostics`
    (and ``MPTLoss.diagnostics``), and an :class:`~pyro_mpt.errors.ImportanceAccuracyWarning`
    states the figures when the weights fail (the thresholds of
    :mod:`pyro_mpt.conditionals.importance_diagnostics`: k-hat above
    :data:`~pyro_mpt.conditionals.importance_diagnostics.MAX_PARETO_K` for more than
    :data:`~pyro_mpt.conditionals.importance_diagnostics.MAX_UNRELIABLE_SHARE` of the rows, or a
    median below :data:`~pyro_mpt.conditionals.importance_diagnostics.MIN_EFFECTIVE_SAMPLES`
    effective samples). ``MPTLoss`` and the package's functions also hold the MPT estimate
    to an importance estimate of ``log p(x)`` with the guide on the whole observation, and
    warn with the figure when it lies below, or above where that estimate is reliable
    (:meth:`checked_gap`). ``debias="jackknife"`` removes the ``1/S`` term of the bias
    (Nowozin, 2018) at the cost of ``S`` leave-one-out sums.
    Any likelihood that factorises over features and any latent prior work; gradients reach
    the model and, through reparameterised samples, the guide
    (``MPTLoss(guide_loss="wake")``, the default for such guides, trains the guide as a
    proposal instead).

    **Data conventions** (those of :class:`~pyro_mpt.conditionals.EncodeDecode`, which
    LinearVAE and VAE follow). The model and the guide take the observed data tensor as
    first positional argument; the guide computes ``q(z | x)`` from the tensor it is given
    and is called with data of shape ``(P,) + x.shape`` inside plates over samples and
    masks, so it sizes its data plate with ``x.shape[-2]``. A guide that ignores its data
    (e.g. ``AutoNormal``) is a valid, poor proposal.

    :param int num_samples: ``S``, latent samples per mask and observation.
    :param str fill: the value of masked features given to the guide: ``"zeros"`` or
        ``"mean"`` (each feature's mean over the batch, see
        :func:`~pyro_mpt.ops.self_normalised_importance.fill_masked`).
    :param str debias: ``None`` (plain ratio estimate) or ``"jackknife"`` (bias of order
        ``1/S^2`` instead of ``1/S``, see
        :func:`~pyro_mpt.ops.jackknife_importance.jackknife_importance_log_conditionals`).
    :param bool share_samples: with several masks per observation (``MPTLoss(num_masks=P)``),
        pool their draws: each mask's conditionals use all ``S * P`` samples, weighted
        against the equal mixture of the ``P`` masks' proposals, at the model cost of
        separate samples (see "What to do" in the accuracy docs). Not with ``debias``.
    :param int num_proposals: with ``share_samples``, how many of the ``P`` masks draw
        samples (``S`` each, spread over the mask sizes); the other masks only reweight the
        pooled ``S * num_proposals`` draws. More masks than proposals cut the spread of the
        MPT estimate over masks, the main noise of its gradient, at the cost of matrix
        products instead of model runs (see :ref:`deep-vae-masks`). None: every mask draws;
        0 (with ``unmasked_proposal``): none does, and the guide on the unmasked input draws
        every sample, the setting that trains a deep VAE best (:ref:`deep-vae-masks`).
    :param bool unmasked_proposal: with ``share_samples``, also draw ``S`` latents from the
        guide on the input with nothing hidden (missing entries stay hidden) and pool them
        with the masks' draws: the mixture then proposes well for the masks that hide
        little, whose posteriors are close to ``p(z | x)``, and the wake update trains the
        guide on the unmasked input too. The model runs ``S`` times more per observation.
    :param int wake_contexts: with ``share_samples=True, num_proposals=0,
        unmasked_proposal=True`` and ``MPTLoss(num_masks="all")``, how many contexts per
        observation, drawn at the uniform rate, the wake update trains the guide toward
        besides the full one (None: 1). The average over every mask conditions on every
        context, and under a sharp likelihood the weights toward ``p(z | x)`` alone rest on
        about one draw, so that the wake update learns little from them (:ref:`deep-vae-masks`
        measures both); the posteriors of partial contexts are broader and their weights
        rest on more. 0 trains toward ``p(z | x)`` only, as reweighted wake-sleep does.

    .. note:: The proposal is only as good as the guide is on *filled* data. An encoder
        fitted to complete data (e.g. PPCA's exact posterior) reads the filled values as
        observed, so its ``q`` is confident about the wrong place: the estimate converges,
        but slowly (tenths of a nat off at ``S`` in the thousands, where a broad proposal
        is hundredths off). A broad guide, or one trained on masked inputs, does better.

    .. note:: Local latents must sit inside the data plate; the data plate cannot be
        subsampled. Cost: one guide run and one model run on ``S * P * N`` latents.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import ImportanceSampling
        >>> loss = MPTLoss(rate="uniform", conditionals=ImportanceSampling(num_samples=64))
    """

    name = "importance"
    guide_loss = "wake"

    def __init__(
        self,
        num_samples=64,
        fill="zeros",
        debias=None,
        share_samples=False,
        num_proposals=None,
        unmasked_proposal=False,
        wake_contexts=None,
    ):
        self.num_samples = check_positive_int("num_samples", num_samples)
        if share_samples not in (True, False):
            raise ValueError(
                f"share_samples must be True or False, got {share_samples!r}. True pools the "
                f"samples of an observation's masks (MPTLoss(num_masks=P) with P > 1)."
            )
        if share_samples and debias is not None:
            raise ValueError(
                f"debias={debias!r} and share_samples=True cannot be combined: the jackknife "
                f"leaves out one sample of a mask's own set. Use one of them."
            )
        self.share_samples = bool(share_samples)
        if num_proposals is not None:
            if isinstance(num_proposals, bool) or num_proposals != 0 or not unmasked_proposal:
                check_positive_int(
                    "num_proposals",
                    num_proposals,
                    "num_proposals=0 is accepted only with unmasked_proposal=True, where the "
                    "guide on the unmasked input draws every sample.",
                )
            num_proposals = int(num_proposals)
            if not share_samples:
                raise ValueError(
                    f"num_proposals={num_proposals!r} needs share_samples=True: only pooled "
                    f"samples can be used by masks that draw none. Pass share_samples=True, "
                    f"or leave num_proposals=None."
                )
        self.num_proposals = num_proposals
        if unmasked_proposal not in (True, False):
            raise ValueError(
                f"unmasked_proposal must be True or False, got {unmasked_proposal!r}. True adds "
                f"S draws from the guide on the unmasked input to the pooled draws."
            )
        if unmasked_proposal and not share_samples:
            raise ValueError(
                "unmasked_proposal=True needs share_samples=True: the unmasked input's draws "
                "serve the masks only when they are pooled. Pass share_samples=True."
            )
        self.unmasked_proposal = bool(unmasked_proposal)
        if wake_contexts is not None:
            if isinstance(wake_contexts, bool) or not isinstance(wake_contexts, numbers.Integral):
                raise TypeError(
                    f"wake_contexts must be a non-negative integer, got {wake_contexts!r} of "
                    f"type {type(wake_contexts).__name__}, e.g. wake_contexts=1."
                )
            if wake_contexts < 0:
                raise ValueError(
                    f"wake_contexts must be a non-negative integer, got {wake_contexts}; 0 "
                    f"trains the guide toward p(z | x) only."
                )
            if not _draws_shared_from_unmasked(share_samples, num_proposals, unmasked_proposal):
                raise ValueError(
                    f"wake_contexts={wake_contexts} is used by the average over every mask "
                    f"(MPTLoss(num_masks='all')), whose draws all come from the guide on the "
                    f"unmasked input: pass share_samples=True, num_proposals=0, "
                    f"unmasked_proposal=True, or leave wake_contexts=None."
                )
        self.wake_contexts = None if wake_contexts is None else int(wake_contexts)
        self.fill = check_fill(fill)
        if debias not in DEBIAS:
            raise ValueError(
                f"debias must be None or 'jackknife', got {debias!r}. 'jackknife' cuts the "
                f"finite-sample bias of the ratio estimate from order 1/S to 1/S^2."
            )
        if debias == "jackknife" and self.num_samples < 2:
            raise ValueError(
                f"debias='jackknife' leaves one sample out at a time and needs num_samples of "
                f"at least 2, got num_samples={self.num_samples}."
            )
        self.debias = debias

    def __repr__(self):
        debias = "" if self.debias is None else f", debias={self.debias!r}"
        shared = ", share_samples=True" if self.share_samples else ""
        if self.num_proposals is not None:
            shared += f", num_proposals={self.num_proposals}"
        if self.unmasked_proposal:
            shared += ", unmasked_proposal=True"
        if self.wake_contexts is not None:
            shared += f", wake_contexts={self.wake_contexts}"
        options = f"num_samples={self.num_samples}, fill={self.fill!r}{debias}{shared}"
        return f"ImportanceSampling({options})"

    accuracy_warning = ImportanceAccuracyWarning
    accuracy_fix = (
        "use a guide that sees which entries are hidden (a 'hidden' argument, see 'Guides "
        "for masked inputs' in the docs), train it as a proposal (MPTLoss(guide_loss='wake')), "
        "raise num_samples, or use exact or quadrature conditionals where the model allows."
    )
    #: Conditionals from a finite ``S`` are off by design, by a few hundredths of a nat per
    #: observation where the guide proposes well: :meth:`checked_gap` warns past a tenth.
    gap_tolerance = 0.1
    gap_of_mpt_estimate = True

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
        """How far the conditionals' MPT estimate lies from an importance-sampling estimate
        of ``log p(x)`` with the guide on the whole observation
        (:func:`~pyro_mpt.conditionals.reference_check.mpt_gap_to_reference`): below it (a
        lower bound of the error), or above it where its weights are reliable (a guide
        fitted to whole observations proposing too narrowly for masked ones). ``MPTLoss``
        measures it on its checked steps and warns past :attr:`gap_tolerance`. Pooled draws
        (``share_samples``) make an estimate that depends on the masks per observation: they
        are measured with the caller's ``num_masks``, and not where it is not given. Not
        measured for ``context`` (the check of given entries): ``(None, None)``.
        """
        if context is not None or (self.share_samples and num_masks is None):
            return None, None
        # Here, not at the top: the check prepares importance conditionals of its own.
        from pyro_mpt.conditionals.reference_check import NUM_CHECK_MASKS, mpt_gap_to_reference

        if restore is not None:
            restore()
        if not self.share_samples:
            num_masks = NUM_CHECK_MASKS  # each mask's draws are its own
        return mpt_gap_to_reference(prepared, model, guide, args, kwargs, num_masks=num_masks)

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """See :meth:`Conditionals.prepare`.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        # The model is read, and the guide checked, once per model, guide and argument shapes.
        remembered = vars(self).get("_remembered")
        if remembered is None:
            remembered = self._remembered = RememberedGuided()
        call = (model, guide, args, kwargs, max_plate_nesting, "importance")
        guided = remembered.get(*call, signature=signature)[0]
        return ImportanceSelfPredictive(
            guided,
            self.num_samples,
            self.fill,
            self.debias,
            self.share_samples,
            self.num_proposals,
            self.unmasked_proposal,
            self.wake_contexts,
        )


class Importance(ImportanceSampling):
    """Deprecated alias of :class:`ImportanceSampling`, renamed so that it no longer shares
    its name with :class:`pyro.infer.Importance` (an inference algorithm, not conditionals);
    warns with ``DeprecationWarning``."""

    def __init__(self, *args, **kwargs):
        warnings.warn(
            "pyro_mpt.conditionals.Importance is renamed ImportanceSampling (it is not "
            "pyro.infer.Importance); the old name will be removed. Use "
            "pyro_mpt.conditionals.ImportanceSampling.",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
