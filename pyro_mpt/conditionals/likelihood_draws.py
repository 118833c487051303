"""Draws of a model's observed site at latent values a strategy chose: the last step of
every strategy's :meth:`~pyro_mpt.conditionals.SelfPredictive.sample` that goes through the
latents (quadrature nodes, resampled importance proposals, encode-decode codes)."""

import torch

from pyro_mpt.trace.trace_utils import flatten_tail

__all__ = ["observation_draws", "picked_draws"]

#: The most entries of one batch of likelihood draws (samples x components x data).
_CHUNK_ELEMENTS = 2**24


def observation_draws(fn, observed, lead, sample_shape=()):
    """Draws of the observed site's distribution ``fn``, whose batch shape starts with
    ``lead``, as ``sample_shape + lead + batch + (D,)``.

    :param fn: the observed site's distribution at a run of the model.
    :param observed: its :class:`~pyro_mpt.trace.model_structure.ObservedSite`.
    :param tuple lead: the dims left of the data's batch dims (points, samples, masks).
    :param tuple sample_shape: independent draws of ``fn``.
    """
    value = fn.sample(torch.Size(sample_shape))
    value = flatten_tail(value, observed.num_feature_dims)
    shape = tuple(sample_shape) + tuple(lead) + tuple(observed.batch_shape) + (-1,)
    return value.reshape(shape)


def picked_draws(fn, observed, num_components, index):
    """One draw of ``fn`` per entry of ``index``, each at the component it picks.

    ``fn`` holds ``num_components`` components along its leading dim (quadrature nodes,
    importance proposals); every component is drawn and the picked one kept, in chunks of
    draws that bound the memory.

    :param int num_components: ``G``, the size of ``fn``'s leading dim.
    :param torch.Tensor index: long ``(S,) + batch + (D,)``, the component of each feature
        of each draw.
    :returns: ``(S,) + batch + (D,)``.
    """
    num_samples = index.shape[0]
    per_sample = max(num_components * observed.value.numel(), 1)
    size = max(1, _CHUNK_ELEMENTS // per_sample)
    draws = []
    for start in range(0, num_samples, size):
        chunk = slice(start, min(start + size, num_samples))
        count = chunk.stop - chunk.start
        values = observation_draws(fn, observed, (num_components,), (count,))
        draws.append(values.gather(1, index[chunk].unsqueeze(1)).squeeze(1))
    return torch.cat(draws)
