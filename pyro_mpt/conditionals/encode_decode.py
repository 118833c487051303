"""Approximate self-predictive conditionals by recursive encoding and decoding."""

import math
import numbers
import warnings

import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.conditionals.encode_decode_diagnostics import (
    BENCHMARK_ERRORS,
    EncodeDecodeDiagnostics,
)
from pyro_mpt.conditionals.likelihood_draws import observation_draws
from pyro_mpt.conditionals.reference_check import NUM_REFERENCE_SAMPLES, mpt_gap_to_reference
from pyro_mpt.errors import (
    NotApplicableError,
    UnmeasuredAccuracyWarning,
    check_positive_int,
    user_stacklevel,
)
from pyro_mpt.ops.bernoulli import observed_log_prob
from pyro_mpt.ops.masks import select_masked
from pyro_mpt.ops.self_normalised_importance import check_fill, fill_masked, importance_log_marginal
from pyro_mpt.trace.factors import factor_log_prob
from pyro_mpt.trace.guide_densities import observed_tensor
from pyro_mpt.trace.guided_model import (
    RememberedGuided,
    describe_guide,
    observed_site_of_run,
    run_guided,
)
from pyro_mpt.trace.trace_utils import latent_sites, same_random_state, unwrap_independent

__all__ = ["NUM_BOUND_SAMPLES", "NUM_CHECK_MASKS", "EncodeDecode", "EncodeDecodeSelfPredictive"]

#: Draws of the guide on the whole observation for the importance-sampling lower bound of
#: ``log p(x)`` that ``MPTLoss`` holds the conditionals' estimate to.
NUM_BOUND_SAMPLES = NUM_REFERENCE_SAMPLES
#: Uniform-size masks per observation of the estimate held to that bound. The check's
#: standard error comes from each observation's own noise (the spread of its masks'
#: estimates), so more masks sharpen it: with 16, a bias of more than 1.5 nats per
#: observation, which the approximation leaves on a linear-Gaussian model of 6 features
#: with the exact posterior as the guide, passes four standard errors on a batch of 20
#: (``tests/test_encode_decode_reference_check.py``).
NUM_CHECK_MASKS = 16


class EncodeDecodeSelfPredictive(SelfPredictive):
    """Conditionals of one batch by recursive encoding and decoding."""

    def __init__(self, guided, num_iterations, num_samples, fill, refill="mean"):
        super().__init__(guided.local.observed, guided.local.scale, factor_log_prob(guided.local))
        self.guided = guided
        self.num_iterations = num_iterations
        self.num_samples = num_samples
        self.fill = fill
        self.refill = refill

    @property
    def log_prob_width(self):
        """``S``, the draws per mask that each conditional averages."""
        return self.num_samples

    def _decode(self, filled, hidden):
        """The observed site's base distribution and value at ``z ~ q(z | filled)``, the
        guide told which entries are ``hidden``."""
        # The codes are used as q's own draws, with no weights to correct a defensive mixture.
        _, model_trace = run_guided(
            self.guided, filled, self.num_samples, hidden=hidden, defensive=False
        )
        site, self.scale = observed_site_of_run(self.guided, model_trace)
        return unwrap_independent(site["fn"]), site["value"]

    def log_prob(self, masks):
        x = self.observed.value
        lead = (self.num_samples, masks.shape[0])
        hidden = ~self.context(masks)  # masked or missing
        filled = fill_masked(x, hidden, self.fill)  # (P,) + batch + (D,)
        for _ in range(self.num_iterations):
            fn = self._decode(filled, hidden)[0]
            refill = fn.mean if self.refill == "mean" else fn.sample()
            refill = observed_tensor(refill, self.guided, lead)
            filled = select_masked(hidden, refill, x)  # (S, P) + batch + (D,): one chain per sample
        fn, value = self._decode(filled, hidden)
        log_likelihood = observed_tensor(observed_log_prob(fn, value), self.guided, lead)
        estimate = importance_log_marginal(log_likelihood)
        entries = self.observed.entries
        scored = hidden if entries is None else hidden & entries
        counts = x.shape[-1] if entries is None else entries.sum(-1)
        self.diagnostics = EncodeDecodeDiagnostics.of(log_likelihood, estimate, scored, counts)
        return estimate

    def sample(self, hidden, num_samples, joint=True):
        """The Markov chain of Rezende et al. (2014, appendix F): encode the filled data,
        *draw* the hidden features from the decoder, refill, ``max(T, 1)`` times; one chain
        per draw (per draw and feature when not ``joint``). An approximation of
        ``p(x_S | x_R)``. See :meth:`SelfPredictive.sample`."""
        x, observed = self.observed.value, self.observed
        num_chains = num_samples if joint else num_samples * observed.num_features
        unseen = ~self.context(hidden)  # hidden or missing: drawn by the chain
        unseen = unseen.expand((num_chains,) + unseen.shape)
        filled = fill_masked(x, unseen, self.fill)
        for _ in range(max(self.num_iterations, 1)):
            _, model_trace = run_guided(self.guided, filled, 1, hidden=unseen, defensive=False)
            fn = observed_site_of_run(self.guided, model_trace)[0]["fn"]
            filled = select_masked(unseen, observation_draws(fn, observed, (1, num_chains))[0], x)
        if not joint:
            # Feature j of draw s comes from chain (j, s): the chains are independent.
            filled = filled.reshape((observed.num_features, num_samples) + filled.shape[1:])
            filled = filled.diagonal(dim1=0, dim2=-1)  # (S,) + batch + (D,)
        return self.keep_given(hidden, filled)


def _latent_parameters(trace, names):
    """The tensor parameters of the named sites' distributions, in a fixed order."""
    params = []
    for name in names:
        fn = unwrap_independent(trace.nodes[name]["fn"])
        for key in sorted(fn.arg_constraints):
            value = getattr(fn, key, None)
            if torch.is_tensor(value):
                params.append(value)
    return params


def _ignores_data(guided):
    """Whether the guide's ``q(z)`` ignores the data it is given: run from the same random
    state, it gives the same distributions at every latent site for two different fillings
    of the data, and (for floating-point data) no gradient path leads from the data to
    them. A linear encoder that starts at zero weights passes."""
    x = guided.local.observed.value
    second = torch.zeros_like(x)
    fillings = [x, x + 1 if torch.equal(x, second) else second]
    params = []
    with torch.enable_grad():
        for i, filled in enumerate(fillings):
            filled = filled.detach().unsqueeze(0)
            if filled.is_floating_point():
                filled.requires_grad_(True)
            # Common random numbers: each run starts from the caller's random state.
            with same_random_state():
                trace = run_guided(guided, filled, 1, False)[0]
            params.append(_latent_parameters(trace, latent_sites(trace)))
            fillings[i] = filled
    if not params[0] or len(params[0]) != len(params[1]):
        return False  # nothing to compare: no verdict
    for a, b in zip(*params):
        try:
            if not torch.equal(*torch.broadcast_tensors(a, b)):
                return False
        except RuntimeError:
            return False
    outputs = [p for p in params[0] if p.requires_grad]
    if fillings[0].requires_grad and outputs:
        with torch.enable_grad():
            grads = torch.autograd.grad([p.sum() for p in outputs], fillings[0], allow_unused=True)
        return grads[0] is None
    return True


def _ignores_hidden_entries(guided):
    """Whether a guide told which entries are ``hidden`` ignores their values, so that
    refilling them changes nothing it computes: run from the same random state, it gives
    the same distributions at every latent site when the hidden entries of the data are
    changed (every other feature hidden, then the others), and (for floating-point data)
    no gradient reaches them. ``LinearVAE.guide`` and ``VAE.guide``, which zero the hidden
    entries, pass; then every refill of :class:`EncodeDecode` is a no-op."""
    if not guided.takes_hidden:
        return False
    x = guided.local.observed.value.detach().unsqueeze(0)
    features = torch.arange(x.shape[-1], device=x.device)
    for parity in (0, 1):
        hidden = (features % 2 == parity).expand(x.shape)
        if not hidden.any():
            continue
        if x.is_floating_point():
            changed = torch.where(hidden, x + 1, x)
        else:
            changed = torch.where(hidden, 1 - x.long(), x.long()).to(x.dtype)
        params = []
        with torch.enable_grad():
            for data in (x.clone(), changed):
                if data.is_floating_point():
                    data.requires_grad_(True)
                with same_random_state():
                    trace = run_guided(guided, data, 1, False, hidden=hidden)[0]
                params.append((data, _latent_parameters(trace, latent_sites(trace))))
        (first, ours), (_, theirs) = params
        if not ours or len(ours) != len(theirs):
            return False
        for a, b in zip(ours, theirs):
            try:
                if not torch.equal(*torch.broadcast_tensors(a, b)):
                    return False
            except RuntimeError:
                return False
        outputs = [p for p in ours if p.requires_grad]
        if first.requires_grad and outputs:
            with torch.enable_grad():
                grads = torch.autograd.grad([p.sum() for p in outputs], first, allow_unused=True)
            if grads[0] is not None and bool(grads[0][hidden].ne(0).any()):
                return False
    return True


def _check_amortized(guided):
    """:raises ValueError: naming the guide and the fix, if the guide ignores its data."""
    if _ignores_data(guided):
        latents = ", ".join(guided.local.latent_names)
        raise ValueError(
            f"conditionals='encode-decode' encodes filled copies of the data with the guide, "
            f"but the guide {describe_guide(guided.guide)} gives the same q({latents}) for "
            f"different data: it ignores its data argument (e.g. AutoNormal, or free "
            f"per-observation parameters). Amortize the guide on x (compute the parameters of "
            f"q(z | x) from its first argument, as LinearVAE.guide does), or use "
            f"conditionals='importance' or 'quadrature'."
        )


class EncodeDecode(Conditionals):
    """Approximate conditionals by recursive encoding–decoding (Rezende et al., 2014,
    appendix F).

    For every mask: fill the masked features (zeros or feature means), then ``T`` times
    encode the data with the guide, ``z ~ q(z | x_fill)``, decode, and refill the masked
    features with the decoder's mean ``E[x_j | z]`` (Bernoulli ``probs``, Normal ``loc``;
    ``refill="mean"``) or with a draw of ``p(x_j | z)`` (``refill="sample"``); each of the
    ``S`` samples runs its own chain. Finally encode once more and score the
    masked features under the decoder at these codes,

    .. math::

        \\log p(x_j \\mid x_R) \\approx \\operatorname{LSE}_s \\log p(x_j \\mid z^{(s)})
            - \\log S, \\qquad z^{(s)} \\sim q(z \\mid x^{(T)}_s).

    ``num_iterations=0`` encodes the filled data once and scores it.

    **This is an approximation**, not a consistent estimate of ``p(x_j | x_R)``: it is as
    good as the guide is at encoding partially imputed data, and refilling with the decoder
    *mean* (not a sample) underestimates the spread of the masked features. For PPCA with the
    exact posterior as guide the chain's mean converges to the exact conditional mean
    ``W_j E[z | x_R] + mu_j`` as ``T`` grows, but the codes' covariance converges to
    ``sigma^2 (M - H M^{-1} H)^{-1}`` (``M = W^T W + sigma^2 I``,
    ``H = W_m^T W_m`` over the masked features ``m``) instead of the exact posterior
    covariance ``sigma^2 (M - H)^{-1}``, so the predictive variance is too small. Use
    ``conditionals="importance"`` for a consistent estimate.

    **Refilling with the mean or a draw.** ``refill="mean"`` (the default) is a deterministic
    fixed-point iteration: the chain's fill settles near ``E[x_S | x_R]`` and its codes are
    too confident, as above. ``refill="sample"`` makes each iteration a step of the Markov
    chain of Rezende et al. (2014, appendix F): encode, decode, *draw* the masked features.
    Its fills wander as draws of ``p(x_S | x_R)`` would (exactly so when the guide is the
    exact posterior), so the final codes keep the spread of ``p(z | x_R)``, at the price of
    more Monte Carlo noise per mask; :func:`~pyro_mpt.impute` always runs this chain.

    **Data conventions.** The strategy relies on the guide being an amortized encoder:

    * the model and the guide take the data tensor as their first positional argument (the
      tensor observed at the likelihood site);
    * the guide computes ``q(z | x)`` from the tensor it is given; a guide that ignores it
      (``AutoNormal``, free per-observation parameters) raises a ``ValueError``;
    * both broadcast over extra leading dims: the guide is called with data of shape
      ``(P,) + x.shape`` or ``(S, P) + x.shape`` inside plates over samples and masks (size
      the data plate with ``x.shape[-2]``), and the model runs with latents of shape
      ``(S, P) + z.shape``;
    * the likelihood factorises over features and its distribution has a ``mean``.

    :class:`~pyro_mpt.models.LinearVAE` and :class:`~pyro_mpt.models.VAE` follow them.

    **Its error, measured on every call.** With ``S >= 2`` each call measures how far its
    own draws bias it
    (:class:`~pyro_mpt.conditionals.encode_decode_diagnostics.EncodeDecodeDiagnostics`, in
    ``.diagnostics`` of the prepared conditionals and in ``MPTLoss.diagnostics``): the
    fall of the estimate when half the draws are used, which was 0.03 to 1.44 times the
    error against exact conditionals (see 'How accurate are approximate conditionals').
    ``MPTLoss`` (and ``mpt_curve``, ``ordering_log_likelihoods``) warn with the figure
    where it passes :data:`~pyro_mpt.conditionals.encode_decode_diagnostics.MAX_DRAW_BIAS`
    nats per observation, at the 1st, 10th, 100th, ... such call, as importance
    sampling's failing weights warn. A bias that every draw shares (the guide's, chains
    that have not mixed) is not seen by it; ``MPTLoss`` holds the estimate to an
    importance-sampling lower bound of ``log p(x)`` on its 1st, 2nd, 16th and every 64th step
    for that.

    :param int num_iterations: ``T``, refills of the masked features (0 or more). A
        guide that takes ``hidden`` and ignores the values of the hidden entries (as
        ``LinearVAE.guide`` and ``VAE.guide`` do: they zero them) never sees a refill, so
        every iteration would cost a guide and a model run and change nothing: such a
        guide, recognised on the first call with each model (the same ``q`` and no
        gradient when the hidden entries change), is run with ``T = 0``, which gives the
        same conditionals in distribution.
    :param int num_samples: ``S``, chains per mask and observation (16 by default; 1
        before, whose estimates were 1.2 to 24 times further below ``log p(x)`` on the
        linear-Gaussian models of ``benchmarks/bench_encode_decode_accuracy.py``, at
        1/12 to 1/3.5 of the cost). With 1 no call measures its error, and ``MPTLoss``
        (and ``mpt_curve``, ``ordering_log_likelihoods``) warn that it is unmeasured,
        naming the fix, at the 1st, 10th, 100th, ... call.

    :param str fill: the initial value of masked features: ``"zeros"`` or ``"mean"``.
    :param str refill: what replaces the masked features at each iteration: ``"mean"``, the
        decoder's mean, or ``"sample"``, a draw from the decoder.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> loss = MPTLoss(rate="uniform", conditionals="encode-decode")
    """

    name = "encode-decode"
    accuracy_warning = UnmeasuredAccuracyWarning
    accuracy_fix = (
        "raise num_samples and num_iterations, or use conditionals='importance' (whose "
        "error is measured at every step) or, where the model allows, 'exact' or "
        "'quadrature'."
    )

    def __init__(self, num_iterations=5, num_samples=16, fill="zeros", refill="mean"):
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, numbers.Integral):
            raise TypeError(f"num_iterations must be an integer, got {num_iterations!r}.")
        if num_iterations < 0:
            raise ValueError(f"num_iterations must be 0 or more, got {num_iterations}.")
        self.num_iterations = int(num_iterations)
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.fill = check_fill(fill)
        if refill not in ("mean", "sample"):
            raise ValueError(
                f"refill must be 'mean' or 'sample', got {refill!r}: 'mean' refills the masked "
                f"features with the decoder's mean, 'sample' with a draw from the decoder."
            )
        self.refill = refill

    def __getstate__(self):
        # A copy (pickled for a process that ddp_spawn starts, or deep-copied) warns again of
        # its unmeasured accuracy: that process has not shown the warning.
        state = dict(self.__dict__)
        state.pop("_warned", None)
        return state

    def __repr__(self):
        refill = "" if self.refill == "mean" else f", refill={self.refill!r}"
        return (
            f"EncodeDecode(num_iterations={self.num_iterations}, "
            f"num_samples={self.num_samples}, fill={self.fill!r}{refill})"
        )

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
        """How far below ``log p(x)`` the conditionals' MPT estimate lies at least, on the
        call's data (below an importance-sampling lower bound of it,
        :func:`~pyro_mpt.conditionals.reference_check.mpt_gap_to_reference`):
        ``(gap, "importance")`` (or ``"importance, one draw"``, counting only the
        observations whose reference rests on one draw), or ``(None, None)`` where it
        cannot be measured. ``MPTLoss`` measures it on the 1st and 2nd step, the
        16th and every 64th, and warns past a hundredth of a nat per observation; ``context`` (the
        check of given entries) is not measured."""
        if context is not None:
            return None, None
        if restore is not None:
            restore()
        # Each mask's draws are its own: the masks per observation do not change the estimate,
        # and their spread measures each observation's noise.
        return mpt_gap_to_reference(
            prepared,
            model,
            guide,
            args,
            kwargs,
            above=False,
            num_masks=NUM_CHECK_MASKS,
            own_noise=True,
        )

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        # The model is read, and the guide checked, once per model, guide and argument shapes.
        remembered = vars(self).setdefault("_remembered", RememberedGuided())
        call = (model, guide, args, kwargs, max_plate_nesting, "encode-decode")
        guided, fresh = remembered.get(*call)
        if fresh:
            try:
                _check_decoder_and_encoder(guided)
                # Refills that the guide never reads are skipped (see num_iterations).
                self._refills_unread = self.num_iterations > 0 and _ignores_hidden_entries(guided)
            except BaseException:
                remembered.forget()
                raise
        if not vars(self).get("_warned"):
            self._warned = True
            if self.num_samples < 2:
                measured = (
                    "with num_samples=1 no call measures its error, which MPTLoss and the "
                    "package's functions say again on the 10th, 100th, ... call "
                    "(num_samples >= 2 has every call measure the bias of its draws, in "
                    ".diagnostics, and warn when it is large)"
                )
            else:
                measured = (
                    "every call measures the bias of its own draws (in .diagnostics) and "
                    "warns when it is large, but not a bias that every draw shares"
                )
            one, many = BENCHMARK_ERRORS[1], BENCHMARK_ERRORS[16]
            warnings.warn(
                f"{self!r} approximates the conditionals by a rule that is not exact and is "
                f"mostly below them: on linear-Gaussian models its estimate of log p(x) was "
                f"{many[0]:g} to {many[1]:g} nats per observation below exact conditionals' "
                f"with num_samples=16 and {one[0]:g} to {one[1]:g} with 1 (more for sharp "
                f"likelihoods, more latent dimensions and untrained guides; "
                f"benchmarks/bench_encode_decode_accuracy.py, and 'How accurate are "
                f"approximate conditionals' in the docs): {measured}; MPTLoss "
                f"also holds it to an importance-sampling lower bound of log p(x) on its "
                f"1st and 2nd step, 16th and every 64th. Before relying on its figures, "
                f"compare them with conditionals='importance' (whose error is measured) or, "
                f"where the "
                f"model allows, 'exact' or 'quadrature'.",
                UnmeasuredAccuracyWarning,
                stacklevel=user_stacklevel(),
            )
        num_iterations = 0 if vars(self).get("_refills_unread") else self.num_iterations
        return EncodeDecodeSelfPredictive(
            guided, num_iterations, self.num_samples, self.fill, self.refill
        )


def _check_decoder_and_encoder(guided):
    """The likelihood has a mean to refill with, and the guide encodes its data.

    :raises NotApplicableError: for a likelihood with no mean.
    :raises ValueError: for a guide that ignores its data.
    """
    obs_fn = unwrap_independent(guided.local.trace.nodes[guided.local.observed.name]["fn"])
    try:
        has_mean = not torch.isnan(obs_fn.mean).any()
    except NotImplementedError:
        has_mean = False
    if not has_mean:
        raise NotApplicableError(
            f"encode-decode refills masked features with the decoder mean, and the "
            f"{type(obs_fn).__name__} likelihood of site {guided.local.observed.name!r} "
            f"has none; use conditionals='importance'."
        )
    _check_amortized(guided)
