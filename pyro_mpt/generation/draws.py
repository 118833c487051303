"""Draws of hidden features from a prepared :class:`~pyro_mpt.conditionals.SelfPredictive`.

One function per strategy, chosen by the type of the prepared conditionals. Each takes the
hidden features (booleans ``batch + (D,)``) and returns ``(num_samples,) + batch + (D,)``
draws, jointly from ``p(x_S | x_R)`` (``joint=True``) or each hidden feature from its own
``p(x_j | x_R)`` (``joint=False``); visible features keep their values. ``R`` is the
visible features that count (not hidden, not missing in the model).
"""

import torch

from pyro_mpt.conditionals.encode_decode import EncodeDecodeSelfPredictive
from pyro_mpt.conditionals.exact import GaussianSelfPredictive
from pyro_mpt.conditionals.importance import (
    ImportanceDiagnostics,
    ImportanceSelfPredictive,
    warn_if_unreliable,
)
from pyro_mpt.conditionals.quadrature_self_predictive import QuadratureRuleSelfPredictive
from pyro_mpt.infer.factors import check_factors
from pyro_mpt.infer.guided_model import observed_tensor, run_guided, sites_log_density
from pyro_mpt.infer.trace_utils import flatten_tail, latent_sites, unwrap_independent
from pyro_mpt.infer.whitened_latents import run_at_points
from pyro_mpt.ops.bernoulli import log_prob
from pyro_mpt.ops.conditional_sampling import (
    dense_gaussian_block_sample,
    dense_gaussian_marginal_sample,
    latent_gaussian_block_sample,
    latent_gaussian_marginal_sample,
    mixture_component_sample,
)
from pyro_mpt.ops.masks import masked_sum, select_masked
from pyro_mpt.ops.self_normalised_importance import fill_masked

__all__ = ["draw_hidden"]

#: The most entries of one batch of likelihood draws (samples x components x data).
_CHUNK_ELEMENTS = 2**24


def draw_hidden(prepared, call, hidden, num_samples, joint=True):
    """Draws the hidden features of every observation.

    :param prepared: the :class:`~pyro_mpt.conditionals.SelfPredictive` of the batch.
    :param tuple call: ``(model, args, kwargs, max_plate_nesting, structure)``: the call that
        prepared it and a :class:`~pyro_mpt.infer.model_structure.RememberedStructure` (the
        quadrature draws run the model again at the chosen nodes).
    :param torch.Tensor hidden: booleans ``batch + (D,)``, ``True`` at features to draw.
    :param int num_samples: draws per observation.
    :param bool joint: draw the hidden features jointly, or each from its own conditional.
    :returns: a tensor ``(num_samples,) + batch + (D,)`` in the dtype of the data the model
        observed.
    :raises NotImplementedError: for conditionals that offer no draws.
    """
    for cls, sampler in _SAMPLERS.items():
        if isinstance(prepared, cls):
            observed = prepared.observed
            draws = sampler(prepared, call, hidden, num_samples, joint)
            # The entries `hidden` leaves alone come back as the model had them: in the data's
            # dtype, and where the model masks them, not as the stand-ins scoring fills in.
            given = observed.value if observed.unfilled is None else observed.unfilled
            return torch.where(hidden, draws.to(given.dtype), given)
    raise NotImplementedError(
        f"Drawing from {type(prepared).__name__} is not implemented; use conditionals='exact', "
        f"'quadrature', 'importance' or 'encode-decode'."
    )


def _exact(prepared, call, hidden, num_samples, joint):
    form, x = prepared.form, prepared.observed.value
    context = prepared.context(hidden)
    if form.covariance is not None:
        sample = dense_gaussian_block_sample if joint else dense_gaussian_marginal_sample
        return sample(x, form.loc, form.covariance, context, num_samples)
    sample = latent_gaussian_block_sample if joint else latent_gaussian_marginal_sample
    return sample(x, form.weight, form.loc, form.noise_var, context, num_samples)


def _observation_draws(fn, observed, lead, sample_shape=()):
    """Draws of the observed site's distribution ``fn`` (whose batch shape starts with
    ``lead``), as ``sample_shape + lead + batch + (D,)``."""
    value = fn.sample(torch.Size(sample_shape))
    value = flatten_tail(value, observed.num_feature_dims)
    shape = tuple(sample_shape) + tuple(lead) + tuple(observed.batch_shape) + (-1,)
    return value.reshape(shape)


def _quadrature(prepared, call, hidden, num_samples, joint):
    model, args, kwargs, max_plate_nesting, remembered = call
    structure = remembered.get(model, args, kwargs, max_plate_nesting)
    observed, nodes = prepared.observed, prepared.nodes
    log_posterior = prepared.node_log_posterior(prepared.context(hidden))  # (G,) + batch
    batch, num_features = observed.batch_shape, observed.num_features
    if joint:
        # One node per draw and observation, then the model runs once at those points.
        index = mixture_component_sample(log_posterior, (num_samples,))  # (S,) + batch
        if nodes.dim() == 2:
            points = nodes[index]
        else:
            index_k = index.unsqueeze(-1).expand(index.shape + nodes.shape[-1:])
            points = nodes.expand(nodes.shape[:1] + batch + nodes.shape[-1:]).gather(0, index_k)
        run = run_at_points(model, args, kwargs, structure, points)
        return _observation_draws(run.fn, observed, (num_samples,))
    # Each feature from its own node: the likelihood drawn at every node, then picked.
    log_posterior = log_posterior.unsqueeze(-1).expand(log_posterior.shape + (num_features,))
    index = mixture_component_sample(log_posterior, (num_samples,))  # (S,) + batch + (D,)
    run = run_at_points(model, args, kwargs, structure, nodes)
    draws = []
    for chunk in _chunks(num_samples, nodes.shape[0] * observed.value.numel()):
        values = _observation_draws(run.fn, observed, nodes.shape[:1], (len(chunk),))
        draws.append(values.gather(1, index[chunk].unsqueeze(1)).squeeze(1))
    return torch.cat(draws)


def _chunks(num_samples, per_sample):
    size = max(1, _CHUNK_ELEMENTS // max(per_sample, 1))
    return [range(start, min(start + size, num_samples)) for start in range(0, num_samples, size)]


def _importance(prepared, call, hidden, num_samples, joint):
    """Sampling-importance-resampling: proposals from the guide on the filled data, one
    resampled per draw (per feature when not ``joint``), and the hidden features drawn from
    the likelihood at it."""
    guided, num_proposals = prepared.guided, prepared.num_samples
    x, observed = prepared.observed.value, prepared.observed
    context = prepared.context(hidden)
    unseen = (~context).unsqueeze(0)  # hidden or missing: what the guide must not read
    filled = fill_masked(x, unseen, prepared.fill)  # (1,) + batch + (D,)
    guide_trace, model_trace = run_guided(guided, filled, num_proposals, hidden=unseen)
    check_factors(guided.local, model_trace, "importance resampling")
    lead = (num_proposals, 1)
    log_p = sites_log_density(model_trace, guided.local.latent_names, guided, lead)
    log_q = sites_log_density(guide_trace, latent_sites(guide_trace), guided, lead)
    site = model_trace.nodes[observed.name]
    ll = observed_tensor(log_prob(unwrap_independent(site["fn"]), site["value"]), guided, lead)
    log_w = (log_p - log_q + masked_sum(ll, context))[:, 0]  # (S',) + batch
    # Resampling is only as good as the weights: the same figures as the conditionals'.
    diagnostics = ImportanceDiagnostics.of(log_w)
    warn_if_unreliable(diagnostics, "Draws of hidden features", call[0], call[1], 6)
    if not joint:
        log_w = log_w.unsqueeze(-1).expand(log_w.shape + (observed.num_features,))
    index = mixture_component_sample(log_w, (num_samples,))
    if joint:
        index = index.unsqueeze(-1).expand(index.shape + (observed.num_features,))
    draws = []
    for chunk in _chunks(num_samples, num_proposals * x.numel()):
        values = _observation_draws(site["fn"], observed, lead, (len(chunk),))[:, :, 0]
        draws.append(values.gather(1, index[chunk].unsqueeze(1)).squeeze(1))
    return torch.cat(draws)


def _encode_decode(prepared, call, hidden, num_samples, joint):
    """The encode-decode chain: encode the filled data, draw the hidden features from the
    decoder, refill, ``max(T, 1)`` times; one chain per draw (per draw and feature when not
    ``joint``)."""
    x, observed = prepared.observed.value, prepared.observed
    num_chains = num_samples if joint else num_samples * observed.num_features
    unseen = ~prepared.context(hidden)  # hidden or missing: drawn by the chain
    unseen = unseen.expand((num_chains,) + unseen.shape)
    filled = fill_masked(x, unseen, prepared.fill)
    for _ in range(max(prepared.num_iterations, 1)):
        _, model_trace = run_guided(prepared.guided, filled, 1, hidden=unseen)
        fn = model_trace.nodes[observed.name]["fn"]
        filled = select_masked(unseen, _observation_draws(fn, observed, (1, num_chains))[0], x)
    if joint:
        return filled
    # Feature j of draw s comes from chain (j, s): the chains are independent.
    filled = filled.reshape((observed.num_features, num_samples) + filled.shape[1:])
    return filled.diagonal(dim1=0, dim2=-1)  # (S,) + batch + (D,)


_SAMPLERS = {
    GaussianSelfPredictive: _exact,
    QuadratureRuleSelfPredictive: _quadrature,
    ImportanceSelfPredictive: _importance,
    EncodeDecodeSelfPredictive: _encode_decode,
}
