"""Self-predictive conditionals by importance sampling with the guide as proposal.

Also the Pyro glue shared with :mod:`pyro_mpt.conditionals.encode_decode`: both strategies
feed the guide a filled copy of the data (masked features replaced) and replay the model
against the guide's latents, inside two extra plates, one over samples and one over masks.
"""

import math
import numbers
from typing import NamedTuple

import pyro
import pyro.poutine as poutine
import torch

from pyro_mpt.conditionals.base import Conditionals, SelfPredictive
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.latent_probe import LocalModel, flatten_tail, trace_local_model
from pyro_mpt.infer.trace_utils import latent_sites, unwrap_independent
from pyro_mpt.ops.importance import (
    check_fill,
    fill_masked,
    importance_log_conditionals,
    importance_log_marginal,
)

__all__ = [
    "GuidedModel",
    "Importance",
    "ImportanceSelfPredictive",
    "check_count",
    "describe_guide",
    "observed_tensor",
    "prepare_guided",
    "run_guided",
    "sites_log_density",
]

_SAMPLE_PLATE = "_mpt_samples"
_MASK_PLATE = "_mpt_masks"

_CONVENTION = (
    "the model and the guide must take the data tensor as their first positional argument, "
    "the guide must compute q(z | x) from the tensor it is given, and both must broadcast "
    "over extra leading dims of it (size plates with x.shape[-2], not x.shape[0])"
)


class GuidedModel(NamedTuple):
    """A model, its guide and their arguments, checked for running the guide on filled data.

    :ivar LocalModel local: what one model trace says about the model.
    :ivar torch.Size data_shape: the shape of the data argument ``args[0]``.
    :ivar int num_pad: size-1 dims between the extra plates and the data's batch dims.
    """

    model: object
    guide: object
    args: tuple
    kwargs: dict
    local: LocalModel
    data_shape: torch.Size
    num_pad: int


def describe_guide(guide):
    """A readable name for a guide: a function's qualified name or an object's class."""
    name = getattr(guide, "__qualname__", None)
    return name if isinstance(name, str) else type(guide).__name__


def check_count(name, value):
    """Returns ``value`` as an int after checking that it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    return int(value)


def prepare_guided(model, guide, args, kwargs, max_plate_nesting, what):
    """Checks that ``what`` (a strategy name) applies and returns a :class:`GuidedModel`.

    :raises NotApplicableError: with no guide, no local latents, a likelihood that does
        not factorise over features, a first argument that is not the observed data, or a
        guide that does not sample every local latent or does not broadcast.
    :raises ValueError: for a latent site outside the data plate.
    """
    if guide is None:
        raise NotApplicableError(
            f"{what} draws the local latents from the guide and no guide was given. Pass an "
            f"amortized guide that encodes its data argument (e.g. LinearVAE.guide), or use "
            f"conditionals='exact' or 'quadrature'."
        )
    local = trace_local_model(model, args, kwargs, max_plate_nesting)
    if not local.latent_names:
        raise NotApplicableError(f"{what} integrates over local latents and the model has none.")
    obs_site = local.trace.nodes[local.observed.name]
    obs_fn = obs_site["fn"]
    base = unwrap_independent(obs_fn)
    if base.event_shape:
        raise NotApplicableError(
            f"Observed site {local.observed.name!r} has a {type(base).__name__} likelihood "
            f"that does not factorise over features; {what} needs one distribution per "
            f"feature (e.g. Bernoulli(...).to_event(1))."
        )
    data = args[0] if args else None
    full_shape = obs_fn.batch_shape + obs_fn.event_shape
    if not torch.is_tensor(data) or data.shape != full_shape:
        got = f"shape {tuple(data.shape)}" if torch.is_tensor(data) else repr(type(data).__name__)
        raise NotApplicableError(
            f"{what} passes filled copies of the data to the guide, so {_CONVENTION}. The "
            f"first argument must be the tensor observed at site {local.observed.name!r} "
            f"(shape {tuple(full_shape)}), got {got}; subsampled data plates are not supported."
        )
    num_pad = max(0, local.max_plate_nesting - len(obs_fn.batch_shape))
    guided = GuidedModel(model, guide, tuple(args), dict(kwargs), local, data.shape, num_pad)
    with torch.no_grad():
        value = local.observed.value
        guide_trace, _ = run_guided(guided, value.expand((2,) + value.shape), 1, False)
    sampled = set(latent_sites(guide_trace))
    missing = [name for name in local.latent_names if name not in sampled]
    if missing:
        raise NotApplicableError(
            f"{what} draws every local latent from the guide, but the guide "
            f"{describe_guide(guide)} samples no site {missing}. Sample them in the guide "
            f"(an amortized q(z | x)), or use conditionals='exact' or 'quadrature'."
        )
    return guided


def run_guided(guided, filled, num_samples, replay_model=True):
    """Runs the guide on filled data and replays the model against its latents.

    :param GuidedModel guided: the checked model and guide.
    :param torch.Tensor filled: data with features flattened, ``lead + batch + (D,)``, with
        ``lead = (P,)`` or ``(S, P)``.
    :param int num_samples: ``S``, the size of the plate over samples.
    :returns: ``(guide_trace, model_trace)``; every site has the batch dims
        ``(S, P) + batch``; ``model_trace`` is None unless ``replay_model``.
    """
    local = guided.local
    num_lead = filled.dim() - len(local.observed.batch_shape) - 1
    lead = filled.shape[:num_lead]
    data = filled.reshape(lead + (1,) * guided.num_pad + guided.data_shape)
    nesting = local.max_plate_nesting
    with (
        pyro.plate(_SAMPLE_PLATE, num_samples, dim=-(nesting + 2)),
        pyro.plate(_MASK_PLATE, lead[-1], dim=-(nesting + 1)),
    ):
        try:
            guide_trace = poutine.trace(guided.guide).get_trace(
                data, *guided.args[1:], **guided.kwargs
            )
        except (ValueError, RuntimeError, IndexError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise NotApplicableError(
                f"The guide {describe_guide(guided.guide)} failed on a batch of filled copies "
                f"of the data, of shape {tuple(data.shape)}: {reason}. To run the guide on "
                f"masked inputs, {_CONVENTION}."
            ) from error
        model_trace = None
        if replay_model:
            model_trace = poutine.trace(poutine.replay(guided.model, trace=guide_trace)).get_trace(
                *guided.args, **guided.kwargs
            )
    return guide_trace, model_trace


def _per_observation(tensor, lead, tail, site_name):
    """Drops size-1 pad dims after ``lead`` and broadcasts to ``lead + tail``."""
    while tensor.dim() > len(lead) + len(tail) and tensor.shape[len(lead)] == 1:
        tensor = tensor.squeeze(len(lead))
    try:
        return tensor.expand(lead + tail)
    except RuntimeError:
        raise ValueError(
            f"Site {site_name!r} has shape {tuple(tensor.shape)} inside the plates over "
            f"samples and masks, which does not broadcast to {tuple(lead + tail)}; latent "
            f"sites must sit in the data plate of the observed site."
        ) from None


def sites_log_density(trace, names, guided, lead):
    """``sum_i log f_i(z_i)`` over the named sites of a trace, shape ``lead + batch``: each
    ``fn.log_prob(value)``, with the dims of plates inside the data plate summed."""
    local = guided.local
    num_inner = -max(local.data_dims) - 1 if local.data_dims else 0
    total = 0.0
    for name in names:
        site = trace.nodes[name]
        log_prob = site["fn"].log_prob(site["value"])
        if num_inner:
            log_prob = log_prob.sum(tuple(range(-num_inner, 0)))
        total = total + _per_observation(log_prob, lead, local.observed.batch_shape, name)
    return total


def observed_tensor(tensor, guided, lead):
    """A tensor of the observed site's base shape as ``lead + batch + (D,)``."""
    observed = guided.local.observed
    flat = flatten_tail(tensor, observed.num_feature_dims)
    tail = observed.batch_shape + observed.value.shape[-1:]
    return _per_observation(flat, lead, tail, observed.name)


class ImportanceSelfPredictive(SelfPredictive):
    """Conditionals of one batch by self-normalised importance sampling."""

    def __init__(self, guided, num_samples, fill):
        super().__init__(guided.local.observed, guided.local.scale)
        self.guided = guided
        self.num_samples = num_samples
        self.fill = fill

    def _sample(self, filled):
        """``(log p(z) - log q(z), l)`` at ``S`` guide samples on ``filled`` data:
        shapes ``(S, P) + batch`` and ``(S, P) + batch + (D,)``."""
        guided, num_samples = self.guided, self.num_samples
        guide_trace, model_trace = run_guided(guided, filled, num_samples)
        lead = (num_samples, filled.shape[0])
        log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
        log_q = sites_log_density(guide_trace, latent_sites(guide_trace), guided, lead)
        site = model_trace.nodes[self.observed.name]
        ll = unwrap_independent(site["fn"]).log_prob(site["value"])
        return log_p - log_q, observed_tensor(ll, guided, lead)

    def log_prob(self, masks):
        log_w, ll = self._sample(fill_masked(self.observed.value, masks, self.fill))
        return importance_log_conditionals(log_w, ll, ~masks)

    def log_marginal(self):
        """The importance estimate of ``log p(x)`` of each observation, with the guide on
        the full data: ``LSE_s(log p(x, z_s) - log q(z_s | x)) - log S`` (a stochastic
        lower bound in expectation, the IWAE bound), shape ``batch_shape``."""
        log_w, ll = self._sample(self.observed.value.unsqueeze(0))
        return importance_log_marginal((log_w + ll.sum(-1))[:, 0])


class Importance(Conditionals):
    """Conditionals by self-normalised importance sampling, with the guide on the masked
    input as proposal.

    For every mask the masked features are filled (zeros or feature means), the guide
    encodes the filled data and proposes ``S`` latents ``z_s ~ q(z | x_fill)``, and the model
    scores each feature at them, ``l_sj = log p(x_j | z_s)``. With
    ``log w_s = log p(z_s) + sum_{k in R} l_sk - log q(z_s)``,

    .. math::

        \\log p(x_j \\mid x_R) \\approx \\operatorname{LSE}_s(\\log w_s + l_{sj})
            - \\operatorname{LSE}_s(\\log w_s).

    Consistent for any model with a guide as ``S`` grows, biased at finite ``S`` like every
    ratio estimate. Any likelihood that factorises over features and any latent prior work;
    gradients reach the model and, through reparameterised samples, the guide.

    **Data conventions** (those of :class:`~pyro_mpt.conditionals.EncodeDecode`, which
    LinearVAE and VAE follow). The model and the guide take the observed data tensor as
    first positional argument; the guide computes ``q(z | x)`` from the tensor it is given
    and is called with data of shape ``(P,) + x.shape`` inside plates over samples and
    masks, so it sizes its data plate with ``x.shape[-2]``. A guide that ignores its data
    (e.g. ``AutoNormal``) is a valid, poor proposal.

    :param int num_samples: ``S``, latent samples per mask and observation.
    :param str fill: the value of masked features given to the guide: ``"zeros"`` or
        ``"mean"`` (each feature's mean over the batch, see
        :func:`~pyro_mpt.ops.importance.fill_masked`).

    .. note:: The proposal is only as good as the guide is on *filled* data. An encoder
        fitted to complete data (e.g. PPCA's exact posterior) reads the filled values as
        observed, so its ``q`` is confident about the wrong place: the estimate converges,
        but slowly (tenths of a nat off at ``S`` in the thousands, where a broad proposal
        is hundredths off). A broad guide, or one trained on masked inputs, does better.

    .. note:: Local latents must sit inside the data plate; the data plate cannot be
        subsampled. Cost: one guide run and one model run on ``S * P * N`` latents.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Importance
        >>> loss = MPTLoss(rate="uniform", conditionals=Importance(num_samples=64))
    """

    name = "importance"
    #: ``conditionals="auto"`` tries it (it applies whenever a guide is given).
    auto = True

    def __init__(self, num_samples=64, fill="zeros"):
        self.num_samples = check_count("num_samples", num_samples)
        self.fill = check_fill(fill)

    def __repr__(self):
        return f"Importance(num_samples={self.num_samples}, fill={self.fill!r})"

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        guided = prepare_guided(model, guide, args, kwargs, max_plate_nesting, "importance")
        return ImportanceSelfPredictive(guided, self.num_samples, self.fill)
