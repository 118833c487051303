"""``MPTLoss``: masked pre-training as a Pyro objective, beside ``Trace_ELBO``."""

import contextlib
import logging
import math
import numbers
import warnings

import pyro.poutine as poutine
import torch
from pyro.infer import ELBO, Trace_ELBO
from pyro.infer.util import is_validation_enabled
from pyro.util import warn_if_nan

from pyro_mpt.conditionals.accuracy_warnings import warn_if_floored, warn_if_unreliable
from pyro_mpt.conditionals.auto import (
    ACCURACY_TOL,
    STRUCTURE_AWARE,
    WORST_TOL,
    as_conditionals,
    prepare_call,
    too_coarse,
)
from pyro_mpt.conditionals.base import gap_sentence
from pyro_mpt.conditionals.exact import verify_every_call
from pyro_mpt.errors import (
    NotApplicableError,
    StaleStructureError,
    check_positive_int,
    user_stacklevel,
)
from pyro_mpt.ops import floored_exp
from pyro_mpt.ops.autograd_graph import gradients, reaches, with_zero_gradients
from pyro_mpt.ops.masks import (
    UniformRate,
    as_rate_schedule,
    mpt_estimate,
    process_generator,
    sample_masks,
)
from pyro_mpt.trace.data_reads import check_data_not_read
from pyro_mpt.trace.guide_site_check import check_guide_sites
from pyro_mpt.trace.model_structure import read_structure, shared_reads
from pyro_mpt.trace.parameter_lists import ParameterLists
from pyro_mpt.trace.plate_nesting import (
    copied_trace,
    guessed_plate_nesting,
    guide_and_model_traces,
)
from pyro_mpt.trace.remembered_structure import call_signature
from pyro_mpt.trace.remembered_structure import described as described_argument
from pyro_mpt.trace.trace_utils import RandomState, param_store_rollback, same_random_state

__all__ = ["GUIDE_LOSSES", "MPTLoss"]

#: The values of ``MPTLoss(guide_loss=...)``.
GUIDE_LOSSES = ("auto", "wake", "elbo", None)


class MPTLoss(ELBO):
    """The masked pre-training (MPT) objective: a stochastic estimate of the log-marginal
    likelihood built from the model's self-predictive conditionals.

    For each observation ``x`` with ``D`` features, a mask of ``M`` features is drawn and
    scored under the conditionals of the masked features given the rest, with the latents
    integrated out:

    .. math::

        \\widehat{\\log p}(x) = \\frac{D}{M} \\sum_{j \\in \\mathcal{M}}
            \\log p_\\theta(x_j \\mid x_{\\mathcal{R}}),
        \\qquad \\log p_\\theta(x) = \\sum_{M=1}^{D} \\mathcal{S}_\\theta(x; M),

    where :math:`\\mathcal{S}_\\theta(x; M)` is the mean of
    :math:`\\frac{1}{M}\\sum_{j\\in\\mathcal{M}} \\log p_\\theta(x_j \\mid x_\\mathcal{R})` over
    masks of size ``M`` (Moreno-Muñoz et al., 2023, Proposition 1). With ``rate="uniform"``
    (``M ~ Uniform{1..D}``) the estimate is unbiased for ``log p(x)`` when the conditionals
    are exact (quadrature: up to its rule's error); with importance-sampled conditionals it
    is consistent but biased, with encode-decode ones biased (see "How accurate are
    approximate conditionals" in the docs, and ``diagnostics`` after a step); with a fixed rate
    (BERT's 0.15) it is biased by a constant that does not stop it from rising with
    ``log p(x)``. The loss is minus the sum of the estimates over the data plate, scaled like
    ``Trace_ELBO`` under subsampling, so both are in nats and directly comparable.

    :param rate: the mask-size schedule: ``"uniform"``, a float in ``(0, 1]`` (fixed rate),
        or a pair ``(lo, hi)`` (a random rate per mask, as in R2MAE). See
        :func:`pyro_mpt.ops.masks.as_rate_schedule`.
    :param num_masks: masks per observation and step, all scored in one vectorized
        pass. Their sizes are stratified, so ``num_masks=D`` with ``rate="uniform"`` sums
        over every mask size exactly once. ``"all"``, with ``rate="uniform"``: the average
        over every mask, computed exactly where the conditionals allow it, so that drawing
        masks adds no variance: exact and quadrature conditionals give their ``log p(x)``
        (the identity above), and importance conditionals that share one proposal's draws
        across masks (``ImportanceSampling(S, share_samples=True, num_proposals=0,
        unmasked_proposal=True)``, what ``conditionals="importance"`` and ``"auto"`` then
        use) a closed form (:meth:`~pyro_mpt.conditionals.SelfPredictive.mask_average`);
        other conditionals raise an error that says so.
    :param conditionals: how the conditionals are computed: ``"auto"`` (the first strategy
        that applies), ``"exact"``, or a :class:`pyro_mpt.conditionals.Conditionals`.
    :param bool share_masks: draw one mask per step for the whole batch instead of one per
        observation (the convention of the paper's scripts; higher variance).
    :param int max_plate_nesting: bound on the number of nested plates in the model;
        guessed from a trace of the model and guide on the first call when left at infinity,
        and stored, as ``Trace_ELBO`` does (and guessed again for another model or guide).
    :param str guide_loss: what trains the guide's parameters (the model's always follow
        the MPT gradient). ``"wake"``: the wake-phase update of reweighted wake-sleep, which
        moves the guide toward ``p(z | x_R)`` with the importance samples already drawn and
        their weights detached (for strategies that propose from the guide, importance
        sampling); ``"elbo"``: ``Trace_ELBO``'s gradient (the guide then serves as a
        proposal or for ``Predictive``); ``None``: whatever gradient the MPT estimate gives
        it (through reparameterised importance samples, a gradient that can raise the
        ratio estimate without raising ``log p(x)``). ``"auto"`` (default): the one that
        suits the strategy: ``"wake"`` for importance sampling, ``"elbo"`` for quadrature
        nodes centred at the guide, else ``None`` (exact and prior-centred quadrature
        conditionals do not reach the guide; a one-time warning says so when the guide has
        parameters, and ``"elbo"`` trains it). Under ``"wake"`` and ``"elbo"`` the
        parameters of the model and of the guide are told apart once per call shape, and
        again when Pyro's param store changes; with ``module_local_params``, when a module
        that the model or guide is (or is a method of) changes, and on every call if the
        model or guide is a plain function.
    :param bool retain_graph: as for ``Trace_ELBO``.

    Example::

        >>> import torch, pyro
        >>> from pyro.infer import SVI
        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=6, latent_dim=2)
        >>> svi = SVI(ppca.model, ppca.guide, pyro.optim.Adam({"lr": 0.01}),
        ...           loss=MPTLoss(rate="uniform"))
        >>> loss = svi.step(torch.randn(100, 6))

    .. note:: The guide is run only by strategies that need one; with ``"exact"``
        conditionals the latents are integrated out and any guide (a no-op included) works.
        See "Your own model" in the docs for what a model may contain.

    :ivar diagnostics: the accuracy figures of the last step's importance-sampled
        conditionals, or of its encode-decode ones
        (:class:`~pyro_mpt.conditionals.encode_decode_diagnostics.EncodeDecodeDiagnostics`:
        measured from their own draws on every step where ``num_samples >= 2``, and warned
        of on every step past
        :data:`~pyro_mpt.conditionals.encode_decode_diagnostics.MAX_DRAW_BIAS`); None for
        other strategies.
    :ivar rule_check: the last check of a quadrature rule against a finer one, made on the
        1st call (for a rule given by the user: ``auto`` measures its choice while it
        chooses), the 2nd, the 16th, then every 64th call (the next call, when one falls
        between), whatever the argument shapes for a rule given by the user, and on calls
        like the last for ``auto``'s choice (its search measures the rule it chooses):
        ``dict(step, strategy, mean_gap, compared_with)``, the gap in nats of ``log p(x)``
        per observation against the ``"finer"`` rule (1.5 times the nodes per dimension).
        Where no finer rule fits (more than 200 nodes per dimension, or more memory than is
        allowed), the rule is compared with a ``"coarser"`` one (two thirds of the nodes)
        instead. Past
        :data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL`, ``conditionals="auto"`` searches
        again, and a rule given by the user warns
        (:class:`~pyro_mpt.errors.QuadratureAccuracyWarning`). For
        :class:`~pyro_mpt.conditionals.EncodeDecode`, the same steps hold the estimate to an
        importance-sampling lower bound of ``log p(x)`` (``compared_with="importance"``,
        the gap a lower bound of the shortfall) and warn past the same limit
        (:class:`~pyro_mpt.errors.UnmeasuredAccuracyWarning`).

    **References**

    P. Moreno-Muñoz, P. G. Recasens, S. Hauberg. *On Masked Pre-training and the Marginal
    Likelihood.* NeurIPS 2023.
    """

    def __init__(
        self,
        rate="uniform",
        num_masks=1,
        conditionals="auto",
        share_masks=False,
        max_plate_nesting=math.inf,
        guide_loss="auto",
        retain_graph=None,
    ):
        if max_plate_nesting != math.inf and (
            isinstance(max_plate_nesting, bool)
            or not isinstance(max_plate_nesting, numbers.Integral)
            or max_plate_nesting < 0
        ):
            raise ValueError(
                f"max_plate_nesting must be a non-negative integer (a bound on the nested "
                f"plates of the model), got {max_plate_nesting!r}; leave it unset to have it "
                f"guessed."
            )
        super().__init__(
            num_particles=1, max_plate_nesting=max_plate_nesting, retain_graph=retain_graph
        )
        self.schedule = as_rate_schedule(rate)
        if num_masks == ALL_MASKS:
            if not isinstance(self.schedule, UniformRate):
                raise ValueError(
                    f"num_masks='all' averages over every mask under the uniform rate, whose "
                    f"average is log p(x); rate={rate!r} has no such average. Use "
                    f"rate='uniform', or draw masks (num_masks=P)."
                )
            if share_masks:
                raise ValueError(
                    "share_masks=True draws one mask for the whole batch, but "
                    "num_masks='all' draws none. Leave share_masks=False."
                )
            self.num_masks = ALL_MASKS
        elif isinstance(num_masks, str):
            raise ValueError(
                f"num_masks must be a positive integer or 'all' (the average over every mask), "
                f"got {num_masks!r}."
            )
        else:
            hint = "It is the number of masks drawn per observation and step, or 'all'."
            self.num_masks = check_positive_int("num_masks", num_masks, hint)
        self.conditionals = as_conditionals(conditionals, every_mask=num_masks == ALL_MASKS)
        if not isinstance(share_masks, bool):
            raise TypeError(
                f"share_masks must be True or False, got {share_masks!r}: True draws one mask "
                f"per step for the whole batch, False one per observation."
            )
        self.share_masks = share_masks
        if guide_loss not in GUIDE_LOSSES:
            raise ValueError(
                f"guide_loss must be one of {', '.join(map(repr, GUIDE_LOSSES))}, got "
                f"{guide_loss!r}. 'wake' trains the guide as an importance proposal, 'elbo' by "
                f"Trace_ELBO, while the model's parameters follow the MPT gradient."
            )
        self.guide_loss = guide_loss
        self._elbo = Trace_ELBO(max_plate_nesting=max_plate_nesting)
        self._warned_untrained_guide = False
        self._last_call = None
        self._signature = None
        self._steady = None
        self._kept = None
        # The (model, guide) whose traces gave the guessed max_plate_nesting, if guessed.
        self._nesting_guessed_for = None
        # The model's and the guide's parameters, found once per call like the last.
        self._parameters = ParameterLists()
        # Calls so far, and the next at which the strategy checks its accuracy (see
        # _first_due_call and _schedule_next_check).
        self._num_calls, self._next_check = 0, self._first_due_call()
        # [checks, failures] of the importance diagnostics of this loss's calls like the last.
        self._accuracy_counts = [0, 0]
        self.diagnostics = None
        self._pending_check = None
        self._pending_weights = None
        # The count of conditionals the floors kept off the CPU, on the device, and
        # [checks, failures] of those counts (see _estimate).
        self._pending_floored = None
        self._floored_counts = [0, 0]
        self._checking = False
        self.rule_check = None

    def __getstate__(self):
        """The loss's settings, for a copy (pickled for a process that ``ddp_spawn`` starts,
        or deep-copied): what it read of the models it was called on (traces that hold the
        models' own objects, weak references) is left behind, and the copy reads its model
        afresh on its first call."""
        state = dict(self.__dict__)
        state.update(
            _last_call=None,
            _signature=None,
            _steady=None,
            _kept=None,
            _parameters=ParameterLists(),
            diagnostics=None,
            _pending_check=None,
            _pending_weights=None,
            _pending_floored=None,
        )
        if self._nesting_guessed_for is not None:  # guessed, not given: guessed again
            state.update(_nesting_guessed_for=None, max_plate_nesting=math.inf)
        return state

    def __repr__(self):
        return (
            f"MPTLoss(rate={self.schedule!r}, num_masks={self.num_masks!r}, "
            f"conditionals={self.conditionals!r}, guide_loss={self.guide_loss!r})"
        )

    def _get_trace(self, model, guide, args, kwargs):
        # ELBO's particle machinery is not used: MPT scores no (model, guide) trace pair.
        raise NotImplementedError("MPTLoss does not score (model, guide) trace pairs.")

    def estimate(self, model, guide, *args, **kwargs):
        """The per-observation MPT estimates of ``log p(x)``, before scaling and summing.

        For an observation with missing entries (a mask on the observed site, or
        ``obs_mask``) it estimates ``log p(x_observed)``; for one masked out entirely it is 0.
        With importance conditionals the estimates carry their errors (see
        :attr:`diagnostics`); over every mask (``num_masks="all"``) each one is the
        importance-weighted bound of its draws less the empty context's term, which is a
        bias of its own: ``diagnostics.empty_context`` gives it, and the warning fires past
        0.1 nats per observation on average.

        :returns: a tensor of the data plate's batch shape (differentiable). The accuracy
            figures of approximate conditionals are in :attr:`diagnostics` afterwards.
        """
        return self._mpt_loss(model, guide, args, kwargs)[2]

    def _mpt_loss(self, model, guide, args, kwargs):
        """The call's loss, its prepared conditionals and the per-observation estimates: a
        call like the last successful one (the next mini-batch) takes the steady route."""
        verify = contextlib.nullcontext()
        if not (
            self._pending_check is None
            and self._pending_weights is None
            and self._pending_floored is None
        ):
            # Left unread by a differentiable_loss call of its own (the module form of the
            # loss): read now, before they are replaced.
            if self._read_left_over():
                verify = verify_every_call()
        key = (self._call_key(model, guide, args, kwargs), is_validation_enabled())
        self._num_calls += 1
        steady = key == self._last_call
        if steady:
            # A later call like the last one that succeeded (the next mini-batch): the
            # plate nesting is known, the guide's sites were compared, parameters exist, and
            # the strategy that prepared it (auto's choice) prepares this one, from the
            # structure it read then where it has one (see _steady_route).
            try:
                prepared, estimates = self._steady_prepare_and_estimate(model, guide, args, kwargs)
            except StaleStructureError:
                steady = False  # the model changed under the same shapes: read it afresh
            except ValueError:
                if self._steady[1] is None:
                    self._last_call = None
                    raise
                # A kept structure that the model outgrew (e.g. a site that obs_mask added):
                # read afresh below, where a genuine error repeats (a linear-Gaussian form
                # that no longer holds is verified again there, validation on or off).
                steady, verify = False, verify_every_call()
            except BaseException:
                self._last_call = None
                raise
        if not steady:
            self._last_call = None
            self._accuracy_counts = [0, 0]
            with verify:
                try:
                    prepared, estimates = self._first_prepare_and_estimate(
                        model, guide, args, kwargs
                    )
                except StaleStructureError:
                    # A strategy shared with another loss kept a read that the model outgrew;
                    # it forgot it on the way out, so this reads the model afresh.
                    prepared, estimates = self._first_prepare_and_estimate(
                        model, guide, args, kwargs
                    )
            # The key holds ids: the objects behind them stay alive while it is kept.
            others = tuple(v for v in (*args, *kwargs.values()) if not torch.is_tensor(v))
            self._kept = (model, guide, others)
            self._last_call = (self._call_key(model, guide, args, kwargs), key[1])
        self.diagnostics = prepared.diagnostics
        self._pending_check = prepared.pending_check
        self._pending_weights = None
        if prepared.diagnostics is not None:
            failing = None
            if steady and not self._checking and not is_validation_enabled():
                # Whether the weights (or encode-decode's draws) fail stays on the device:
                # loss_and_grads and loss read it with the loss (_read), and warn then.
                failing = prepared.diagnostics.failing()
            if failing is not None:
                self._pending_weights = (failing, prepared.diagnostics, model, args)
            else:
                self._warn_if_unreliable(prepared.diagnostics, model, args)
        loss = -(prepared.scale * estimates).sum() - prepared.extra_log_prob
        if is_validation_enabled():
            # Reads the loss back from the device, so only under validation.
            warn_if_nan(loss, "loss")
        return loss, prepared, estimates

    def _first_due_call(self):
        """The first call on which the strategy measures its own error: the 1st for a
        strategy given by the user (a one-off ``loss`` or ``estimate`` is then never left
        unmeasured), the 2nd for ``auto``, which measured its choice on the 1st call's batch
        while choosing it."""
        return 2 if self.conditionals.name == "auto" else 1

    def _schedule_next_check(self):
        """Called on a call on which the strategy measures its own error on the call's data
        (``_num_calls >= _next_check``): the 1st (a strategy given by the user) and the 2nd,
        the 16th, then every 64th (64, 128, ...; the first call from each on, should it have
        other argument shapes). Every batch is new data and training moves the parameters,
        so a rule that was accurate can stop being so at any step."""
        calls = self._num_calls
        if calls < 2:
            self._next_check = 2
        elif calls < _FIRST_CHECK:
            self._next_check = _FIRST_CHECK
        else:
            self._next_check = (calls // 64 + 1) * 64

    def _steady_prepare_and_estimate(self, model, guide, args, kwargs):
        strategy, structure, _ = self._steady
        check = self._checking = self._num_calls >= self._next_check
        if check:
            self._schedule_next_check()
        before = RandomState() if check else None
        # On those calls a linear-Gaussian form is verified again, validation on or off (and
        # by auto's search, if it searches again): parameters trained since the first call
        # may have made the model nonlinear.
        with verify_every_call() if check else contextlib.nullcontext():
            try:
                nesting = self.max_plate_nesting
                if structure is not None:
                    prepared = strategy.prepare_with(structure, model, guide, args, kwargs)
                else:
                    call = (model, guide, args, kwargs, nesting, self._signature)
                    prepared = prepare_call(strategy, *call)
                if check:
                    call = (model, guide, args, kwargs)
                    prepared = self._check_accuracy(strategy, structure, prepared, call, before)
            except NotApplicableError:
                if strategy is self.conditionals:
                    raise
                # Auto's choice no longer applies (the model changed): auto searches again.
                prepared = self._search_again(model, guide, args, kwargs)
        return prepared, self._estimate(prepared)

    def _search_again(self, model, guide, args, kwargs):
        """``auto``'s search for a call like the last, whose choice then prepares the later
        ones (see :meth:`_steady_route`)."""
        signature, nesting = self._signature, self.max_plate_nesting
        prepared = self.conditionals.search(model, guide, args, kwargs, nesting, signature)
        self._steady = self._steady_route(signature)
        return prepared

    def _check_accuracy(self, strategy, structure, prepared, call, before):
        """The strategy's own measure of its error on this step's data
        (:meth:`~pyro_mpt.conditionals.Conditionals.refinement_gap`), kept in
        :attr:`rule_check`. Past ``auto``'s threshold, ``auto`` searches again (the rule it
        chose at the first step may be too coarse for the trained model) and its new choice
        prepares the step; a strategy given by the user warns with the figure.

        :param before: the random state ``prepared`` was made from: the finer rule sees the
            same subsample. The random state after the check is the one it found.
        """
        if strategy.gap_of_mpt_estimate and self.num_masks == ALL_MASKS:
            # The check measures drawn masks' estimate; the average over every mask departs
            # from the importance-weighted bound by a term known exactly (diagnostics).
            return prepared
        after = RandomState()
        # A rule that cannot be refined (at MAX_POINTS) is compared with a coarser one, as
        # the package's functions compare it: a rule auto chose at that limit is checked too.
        gap, compared_with = strategy.checked_gap(
            prepared, *call, structure=structure, restore=before.restore, num_masks=self.num_masks
        )
        after.restore()
        if gap is None:  # a strategy with no such measure
            return prepared
        step = self._num_calls
        measured = gap.measured()
        self.rule_check = dict(
            step=step,
            strategy=repr(strategy),
            mean_gap=gap.mean if measured else None,
            worst_gap=gap.worst if measured else None,
            compared_with=compared_with,
        )
        if not measured or not too_coarse(gap, strategy.gap_tolerance):
            return prepared
        tolerance = ACCURACY_TOL if strategy.gap_tolerance is None else strategy.gap_tolerance
        figure = (
            f"{gap_sentence(strategy, gap, compared_with)} (step {step}; the limits are "
            f"{tolerance:g} on average and {WORST_TOL:g} at any observation)"
        )
        # A finer rule may fix a rule's gap; a reference's gap is the strategy's own.
        if strategy is not self.conditionals and compared_with in ("finer", "coarser"):
            _logger.info("conditionals='auto' searches again: %s.", figure)
            before.restore()
            return self._search_again(*call)
        warnings.warn(
            f"MPTLoss's {figure}: its conditionals are about that far off. Fix: "
            f"{strategy.accuracy_fix}",
            strategy.accuracy_warning,
            stacklevel=user_stacklevel(),
        )
        return prepared

    def _steady_route(self, signature):
        """How later calls like a successful one of ``signature`` are prepared: the strategy
        that prepared it (auto's choice), the structure that strategy read for it, or None
        for a strategy that finds its own (it is then passed the signature where it takes
        one), and what ``guide_loss="auto"`` trains the guide by under that strategy."""
        strategy = self.conditionals.in_use
        if type(strategy).prepare in STRUCTURE_AWARE:
            return strategy, strategy.structure_for(signature), strategy.guide_loss
        return strategy, None, strategy.guide_loss

    def _call_key(self, model, guide, args, kwargs):
        """What identifies a call: the model and the guide (functions, or methods and their
        objects) and the arguments that are not tensors by ``id``, the shapes, dtypes and
        devices of the tensor arguments, dicts, lists and tuples by what they hold
        (:func:`~pyro_mpt.trace.remembered_structure.described`), the keywords and the
        plate nesting. Compared
        without calling any ``__eq__`` of the user's objects; the objects behind the ids
        of the last successful call are kept alive (``_kept``), so no other object can
        take one of its ids."""
        described = [
            id(getattr(model, "__func__", model)),
            id(getattr(model, "__self__", None)),
            id(getattr(guide, "__func__", guide)),
            id(getattr(guide, "__self__", None)),
            self.max_plate_nesting,
            tuple(kwargs),
        ]
        for value in (*args, *kwargs.values()):
            if torch.is_tensor(value):
                described.append((value.shape, value.dtype, value.device))
            elif type(value) in (dict, list, tuple):
                described.append(described_argument(value))  # a batch as a dict of tensors
            else:
                described.append(id(value))
        return tuple(described)

    def _first_prepare_and_estimate(self, model, guide, args, kwargs):
        # A failing call leaves no half-initialised parameters behind; the model is traced
        # once for all the places that read its structure.
        with param_store_rollback(), shared_reads():
            traces = None
            if self._nesting_guessed_for is not None and not _same_callables(
                self._nesting_guessed_for, (model, guide)
            ):
                # The nesting was guessed for another model or guide: guessed again here,
                # as a loss given no bound takes any model.
                self.max_plate_nesting = math.inf
            if self.max_plate_nesting == math.inf:
                # Once, as Trace_ELBO does, leaving the random state as it was: a seeded
                # first call draws the same masks as any later one. The model is read first
                # so that its errors come in MPTLoss's words.
                with same_random_state():
                    structure = read_structure(model, args, kwargs)
                    if guide is None:
                        # The model's own run serves the guess: no guide to replay it against.
                        traces = (poutine.Trace(), copied_trace(structure.trace))
                    else:
                        traces = guide_and_model_traces(model, guide, args, kwargs, structure)
                self.max_plate_nesting = guessed_plate_nesting(*traces)
                self._nesting_guessed_for = (model, guide)
                # Their param sites serve the parameter lists on this call.
                self._parameters.offer(self._call_key(model, guide, args, kwargs), traces)
            # The traces of the guess serve the comparison of the guide's sites too.
            check_guide_sites(model, guide, args, kwargs, self.max_plate_nesting, traces)
            conditionals, nesting = self.conditionals, self.max_plate_nesting
            signature = self._signature = call_signature(model, args, kwargs, nesting)
            # A rule given by the user measures itself when due on such calls too (auto
            # measures its choice while it searches): with argument shapes that change from
            # call to call (ragged batches), every call is one.
            check = conditionals.name != "auto" and self._num_calls >= self._next_check
            if check:
                self._schedule_next_check()
            before = RandomState() if check else None
            with verify_every_call() if check else contextlib.nullcontext():
                prepared = prepare_call(
                    conditionals, model, guide, args, kwargs, nesting, signature
                )
                # Refused before the check would spend a run on conditionals not used.
                if self.num_masks != ALL_MASKS:
                    prepared.check_masked_contexts("MPTLoss with drawn masks")
                if check:
                    strategy, structure, _ = self._steady_route(signature)
                    call = (model, guide, args, kwargs)
                    prepared = self._check_accuracy(strategy, structure, prepared, call, before)
            if not self.schedule.unbiased:
                check_data_not_read(model, args, kwargs, f"MPTLoss with {self.schedule!r}")
            estimates = self._estimate(prepared)
        self._steady = self._steady_route(signature)
        return prepared, estimates

    def _estimate(self, prepared):
        """The per-observation estimates of ``prepared``'s conditionals, counting on the
        device the conditionals that the floors kept off the CPU
        (:func:`~pyro_mpt.ops.floored_exp.floored_ledger`; none on the CPU, where every one
        is computed again). The count is read with the loss (:meth:`_read`)."""
        observed = prepared.observed
        every_mask = self.num_masks == ALL_MASKS
        if not every_mask:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            batch_shape = observed.batch_shape
            if self.share_masks and observed.entries is not None:
                raise ValueError(
                    f"share_masks=True draws one mask for the whole batch, but observed site "
                    f"{observed.name!r} has missing entries, so each observation needs masks "
                    f"of its own. Use share_masks=False."
                )
            masks, sizes = sample_masks(
                self.schedule,
                self.num_masks,
                torch.Size() if self.share_masks else batch_shape,
                observed.value.shape[-1],
                device=observed.value.device,
                entries=observed.entries,
                # The global generator in one process; each data-parallel process a seed of
                # its own (looked for only once torch.distributed is initialised).
                generator=process_generator(observed.value.device) if distributed else None,
            )
            if self.share_masks:
                shape = (self.num_masks,) + (1,) * len(batch_shape) + masks.shape[-1:]
                masks, sizes = masks.reshape(shape), sizes.reshape(shape[:-1])
        counted = observed.value.device.type != _READ_BACK_ON
        with floored_exp.floored_ledger() if counted else contextlib.nullcontext() as ledger:
            if every_mask:
                try:
                    estimates = prepared.mask_average()
                except NotImplementedError as error:
                    raise ValueError(f"MPTLoss(num_masks='all'): {error}") from None
            else:
                counts = None if observed.entries is None else observed.feature_counts()
                estimates = mpt_estimate(prepared.log_prob(masks), masks, counts, sizes)
        self._pending_floored = None if ledger is None else ledger.total()
        return estimates

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """Minus the summed MPT estimate, as a differentiable scalar tensor.

        With ``guide_loss`` ``"wake"`` or ``"elbo"`` the result's value is the MPT loss and
        its gradient is the MPT gradient for the model's parameters and the guide loss's for
        the guide's.
        """
        # A call refused for its guide loss leaves no parameter it created behind.
        wake = self.guide_loss == "wake"
        with param_store_rollback() if wake else contextlib.nullcontext():
            loss, prepared, _ = self._mpt_loss(model, guide, args, kwargs)
            mode = self.guide_loss
            if mode == "auto":
                mode = self._steady[2]  # that of the strategy that prepared the call
            proposal_loss = prepared.proposal_loss() if mode == "wake" else None
            if mode == "wake" and proposal_loss is None:
                self._last_call = None
                raise ValueError(
                    f"guide_loss='wake' trains the guide on importance samples, but "
                    f"{self.conditionals.in_use!r} draws none from the guide. Use "
                    f"conditionals='importance', or guide_loss='elbo'."
                )
        if mode is None:
            if not self._warned_untrained_guide:
                self._warn_if_guide_untrained(model, guide, args, kwargs, loss)
            if isinstance(guide, torch.nn.Module):
                return with_zero_gradients(loss, guide)
            return loss
        # The call's key, as the successful preparation above left it.
        key = self._last_call[0]
        model_params, guide_params = self._parameters.split(model, guide, args, kwargs, key)
        if mode == "elbo":
            guide_objective = self._elbo.differentiable_loss(model, guide, *args, **kwargs)
        else:
            guide_objective = proposal_loss
        grads = gradients(loss, model_params, retain_graph=True)
        grads += gradients(guide_objective, guide_params)
        params = model_params + guide_params
        # A surrogate whose value is the loss and whose gradient is the one computed above.
        surrogate = sum(((p * g).sum() for p, g in zip(params, grads) if g is not None), 0.0)
        return loss.detach() + surrogate - torch.as_tensor(surrogate).detach()

    def loss(self, model, guide, *args, **kwargs):
        """Minus the summed MPT estimate, as a float (no gradients are computed)."""
        with torch.no_grad():
            loss = self._mpt_loss(model, guide, args, kwargs)[0]
            value = self._read(loss)
            if value is None:
                with verify_every_call():
                    value = self._mpt_loss(model, guide, args, kwargs)[0].item()
        return value

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Computes the loss and back-propagates it into every parameter it depends on
        (with ``guide_loss`` ``"wake"`` or ``"elbo"``, the guide's parameters get that
        loss's gradient).

        :returns: the loss as a float.
        """
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        value = self._read(loss)
        if value is None:
            with verify_every_call():
                loss = self.differentiable_loss(model, guide, *args, **kwargs)
            value = loss.item()
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        else:
            warnings.warn(
                "MPTLoss does not depend on any trainable parameter; no gradients were computed.",
                stacklevel=user_stacklevel(),
            )
        return value

    def _read(self, loss):
        """The loss as a float, read from the device in one synchronisation with the checks
        that the call left unread with validation off: whether a linear-Gaussian form still
        holds (:attr:`SelfPredictive.pending_check`) and whether importance weights fail
        (:meth:`ImportanceDiagnostics.failing`, warned of here), and how many conditionals
        the floors kept off the CPU (:meth:`_estimate`, warned of here). ``None``
        when the form failed, after which the call is made afresh and verified (the loss's
        value is then not used, and nothing has been back-propagated)."""
        form, weights, floored = self._pending_check, self._pending_weights, self._pending_floored
        self._pending_check = self._pending_weights = self._pending_floored = None
        pending = [loss.detach().double()]
        for check in (form, weights and weights[0], floored):
            if check is not None:
                pending.append(check.double())
        if len(pending) == 1:
            return loss.item()
        value, *failed = torch.stack(pending).tolist()
        left_floored = int(failed.pop()) if floored is not None else 0
        if form is not None and failed.pop(0):
            self._last_call = None
            return None
        if weights is not None:
            self._warn_if_unreliable(*weights[1:], failed=bool(failed[0]))
        if floored is not None:
            warn_if_floored(left_floored, "MPTLoss", counts=self._floored_counts)
        return value

    def _read_left_over(self):
        """Reads the checks that the last call left on the device when nothing read them
        with its loss (:meth:`differentiable_loss` called on its own, as by
        ``MPTLoss()(model, guide)``): warns of failing importance weights, of conditionals
        that the floors kept off the CPU, and of a linear-Gaussian form that no longer held,
        whose call's loss and gradient were then those of a form that does not hold. Returns
        whether the form failed: this call then reads the model afresh, verified. The checks
        are read in one synchronisation."""
        form, weights, floored = self._pending_check, self._pending_weights, self._pending_floored
        self._pending_check = self._pending_weights = self._pending_floored = None
        checks = [check for check in (form, weights and weights[0], floored) if check is not None]
        if not checks:
            return False
        read = torch.stack([check.double() for check in checks]).tolist()
        form_failed = form is not None and bool(read.pop(0))
        if weights is not None:
            _, diagnostics, model, args = weights
            self._warn_if_unreliable(diagnostics, model, args, failed=bool(read.pop(0)))
        if floored is not None:
            warn_if_floored(int(read.pop(0)), "MPTLoss", counts=self._floored_counts)
        if not form_failed:
            return False
        self._last_call = None
        warnings.warn(
            "MPTLoss's last call used the linear-Gaussian form it read before, but the model "
            "no longer has it (checked with validation off, and read only now, as "
            "differentiable_loss was called on its own): that call's loss and gradient were "
            "those of a form that does not hold. This call reads the model afresh, verified. "
            "Call loss_and_grads (SVI.step) to have the check read with each loss, or enable "
            "Pyro's validation to verify the form on every call.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return True

    def _warn_if_unreliable(self, diagnostics, model, args, failed=None):
        """Warns when the conditionals' figures fail (:func:`warn_if_unreliable`), counting
        this loss's calls, at the line of the user's code that made the call."""
        warn_if_unreliable(
            diagnostics,
            "MPTLoss's conditionals",
            model,
            args,
            counts=self._accuracy_counts,
            strategy=self.conditionals.in_use,
            failed=failed,
            every_mask_possible=self.num_masks != ALL_MASKS,
        )

    def _warn_if_guide_untrained(self, model, guide, args, kwargs, loss):
        """Warns once when the guide has parameters that the loss does not reach."""
        if self._warned_untrained_guide or guide is None or not loss.requires_grad:
            return
        self._warned_untrained_guide = True
        key = self._call_key(model, guide, args, kwargs)
        model_params, guide_params = self._parameters.split(model, guide, args, kwargs, key)
        guide_params = [p for p in guide_params if p.requires_grad]
        if not guide_params:
            return
        if not reaches(loss, guide_params):
            strategy = self.conditionals.in_use
            warnings.warn(
                f"MPTLoss with {strategy!r} integrates the latents out without the "
                f"guide, so the guide's {len(guide_params)} parameter tensors get no gradient "
                f"and stay untrained (Predictive would return the untrained posterior). Pass "
                f"guide_loss='elbo' to train the guide by the ELBO while the model follows "
                f"the MPT gradient.",
                stacklevel=user_stacklevel(),
            )


_logger = logging.getLogger("pyro_mpt")


def _same_callables(first, second):
    """Whether two sequences of callables are the same functions (or methods of the same
    objects), compared by identity: a bound method is a new object at every access."""
    return all(
        getattr(a, "__func__", a) is getattr(b, "__func__", b)
        and getattr(a, "__self__", None) is getattr(b, "__self__", None)
        for a, b in zip(first, second)
    )


#: ``num_masks`` for the exact average over every mask.
ALL_MASKS = "all"

#: The device on which :func:`~pyro_mpt.ops.floored_exp.exact_where` reads back the
#: sums near the floors, so that none is left to count (see ``MPTLoss._estimate``).
_READ_BACK_ON = "cpu"

#: The call on which ``MPTLoss`` checks a strategy's accuracy next after the 2nd (then
#: every 64th).
_FIRST_CHECK = 16
