"""Random feature orderings for the chain rule ``log p(x) = sum_i log p(x_s(i) | x_s(<i))``:
the permutations, the prefix masks of each step, the term each step scores, and the spread of
the sums across orderings (:doc:`/coherence`).

This module is pure tensor code: no Pyro effects.
"""

import math

import torch

from pyro_mpt.errors import check_positive_int

__all__ = [
    "observed_steps",
    "prefix_masks",
    "random_orderings",
    "select_steps",
    "summarize_orderings",
]


def random_orderings(num_orderings, batch_shape, num_features, entries=None, device=None):
    """Independent uniformly random orderings of the features of every observation.

    :param int num_orderings: how many orderings per observation.
    :param batch_shape: the shape of the batch of observations.
    :param int num_features: features ``D``.
    :param torch.Tensor entries: optional booleans broadcastable to ``batch_shape + (D,)``,
        ``True`` at observed entries: each ordering is then uniform over the observed entries,
        which come first, and the missing entries follow them (in random order). Which steps
        score an observed entry is :func:`observed_steps`.
    :param torch.device device: where to put the result; by default ``entries``'s device, or
        the CPU.
    :returns: a long tensor of shape ``(num_orderings,) + batch_shape + (D,)`` whose last dim
        is a permutation of ``0 .. D-1``: ``orderings[..., i]`` is the feature scored at step
        ``i``.
    """
    num_orderings = check_positive_int("num_orderings", num_orderings)
    num_features = check_positive_int("num_features", num_features)
    if device is None and entries is not None:
        device = entries.device
    shape = (num_orderings,) + tuple(batch_shape) + (num_features,)
    # float64 keys tie with negligible probability; a missing entry's key is moved above
    # every observed one's, so the argsort puts it last.
    keys = torch.rand(shape, dtype=torch.float64, device=device)
    if entries is not None:
        keys = keys + (~entries.to(device=keys.device, dtype=torch.bool)).to(keys.dtype) * 2
    return keys.argsort(-1)


def observed_steps(orderings, entries=None):
    """Which steps of each ordering score an observed entry.

    :param torch.Tensor orderings: permutations, shape ``(O,) + batch + (D,)``.
    :param torch.Tensor entries: booleans broadcastable to ``batch + (D,)``, ``True`` at
        observed entries, or ``None`` when every entry is observed.
    :returns: booleans of the shape of ``orderings``, ``True`` at step ``i`` when the feature
        ``orderings[..., i]`` is observed. For orderings from :func:`random_orderings` these
        are the first ``entries.sum(-1)`` steps.
    """
    if entries is None:
        return torch.ones(orderings.shape, dtype=torch.bool, device=orderings.device)
    return entries.to(orderings.device).expand(orderings.shape).gather(-1, orderings)


def _as_steps(steps, num_features, device):
    if steps is None:
        return torch.arange(num_features, device=device)
    if isinstance(steps, slice):
        return torch.arange(num_features, device=device)[steps]
    return torch.as_tensor(steps, dtype=torch.long, device=device).reshape(-1)


def prefix_masks(orderings, steps=None):
    """The masks of the chain rule's steps: at step ``i`` the features ``s(i), .., s(D)`` are
    masked, so the context is the prefix ``s(1), .., s(i-1)`` and the feature scored is
    ``s(i)`` (steps count from 0 here: step 0 has an empty context).

    :param torch.Tensor orderings: permutations, shape ``(O,) + batch + (D,)``.
    :param steps: which steps, a sequence, ``range``, ``slice`` or 1-D long tensor of step
        indices in ``0 .. D-1``; all ``D`` by default. Chunks of steps bound the memory.
    :returns: booleans of shape ``(O, len(steps)) + batch + (D,)``, ``True`` at masked
        features.
    """
    num_features = orderings.shape[-1]
    steps = _as_steps(steps, num_features, orderings.device)
    # rank[j] is the step at which feature j is scored (the inverse permutation).
    positions = torch.arange(num_features, device=orderings.device).expand(orderings.shape)
    rank = torch.empty_like(orderings).scatter_(-1, orderings, positions)
    steps = steps.reshape((1, -1) + (1,) * (orderings.dim() - 1))
    return rank.unsqueeze(1) >= steps


def select_steps(log_probs, orderings, steps=None):
    """The term each step scores: ``log p(x_s(i) | x_s(<i))`` from the conditionals of every
    feature under that step's mask.

    :param torch.Tensor log_probs: conditionals under the masks of
        :func:`prefix_masks` ``(orderings, steps)``, shape ``(O, len(steps)) + batch + (D,)``.
    :param torch.Tensor orderings: permutations, shape ``(O,) + batch + (D,)``.
    :param steps: the steps ``log_probs`` belongs to, as for :func:`prefix_masks`.
    :returns: a tensor of shape ``(O, len(steps)) + batch``.
    """
    steps = _as_steps(steps, orderings.shape[-1], orderings.device)
    targets = orderings.index_select(-1, steps).movedim(-1, 1)  # (O, S) + batch
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def summarize_orderings(values):
    """The mean, the spread and the spread's standard error of chain-rule sums across
    orderings, per observation.

    The spread is the sample standard deviation ``s`` (``n - 1`` in the denominator) of the
    ``n`` orderings' sums. Its standard error is the jackknife's, from the ``n`` spreads
    with one ordering left out: it assumes no shape for the distribution of the sums, and
    its square errs high rather than low on average (Efron and Stein, 1981), where a
    fourth-moment formula with the sample's moments falls well short with a few orderings.
    With one ordering both are NaN, and the standard error with two; where ``s = 0`` the
    standard error is 0.

    :param torch.Tensor values: sums, shape ``(num_orderings,) + batch``.
    :returns: a tuple ``(mean, spread, spread_se)`` of tensors of shape ``batch``.
    """
    n = values.shape[0]
    mean = values.mean(0)
    if n < 2:
        nan = torch.full_like(mean, math.nan)
        return mean, nan, nan.clone()
    centred = values - mean
    squares = centred.pow(2)
    total = squares.sum(0)
    spread = (total / (n - 1)).sqrt()
    if n < 3:
        return mean, spread, torch.full_like(mean, math.nan)
    # Leaving ordering i out takes n / (n - 1) * centred_i^2 off the sum of squares.
    left_out = ((total - squares * n / (n - 1)) / (n - 2)).clamp(min=0).sqrt()
    deviations = left_out - left_out.mean(0)
    spread_se = (deviations.pow(2).sum(0) * (n - 1) / n).sqrt()
    return mean, spread, spread_se
