"""The masked pre-training estimator of ``log p(x)``, ``(D / M) sum_{j in mask}
log p(x_j | x_R)``, from per-feature conditionals (:ref:`theory-estimator`).

This module is pure tensor code: no Pyro effects.
"""

from pyro_mpt.ops.masks import masked_sum

__all__ = ["mask_scores", "mpt_estimate"]


def mask_scores(log_conditionals, masks):
    """The per-mask score ``(1/M) sum_{j in mask} log p(x_j | x_R)`` (0 for an empty mask).

    :param torch.Tensor log_conditionals: ``log p(x_j | x_R)`` for every feature, shape
        ``S + (D,)``; entries outside the mask are ignored.
    :param torch.Tensor masks: boolean masks, shape ``S + (D,)`` (broadcastable).
    :returns: a tensor of shape ``S``.
    """
    masks = masks.expand(log_conditionals.shape)
    sizes = masks.sum(-1).to(log_conditionals.dtype)
    return masked_sum(log_conditionals, masks) / sizes.clamp(min=1)


def mpt_estimate(log_conditionals, masks, num_features=None):
    """The MPT estimate ``D / M sum_{j in mask} log p(x_j | x_R)`` averaged over masks.

    :param torch.Tensor log_conditionals: shape ``(P,) + batch + (D,)``, one row per mask.
    :param torch.Tensor masks: boolean, shape ``(P,) + batch + (D,)`` (broadcastable).
    :param num_features: ``D``, or a ``batch`` tensor of per-observation counts of observed
        entries (missing data); by default the size of the last dim.
    :returns: a tensor of shape ``batch``: for each observation, the mean over its ``P``
        masks of ``D`` times the mask score.
    """
    if num_features is None:
        num_features = log_conditionals.shape[-1]
    return num_features * mask_scores(log_conditionals, masks).mean(0)
