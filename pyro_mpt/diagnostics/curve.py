"""The MPT curve type shared by Pyro models, masked language models and ViT-MAE: its
summary (area and standard errors) and the masking rates it is evaluated at."""

import math
from typing import NamedTuple

import torch

from pyro_mpt.ops.masks import FixedRate

__all__ = ["MPTCurve", "check_rates", "default_rates", "rate_sizes"]


class MPTCurve(NamedTuple):
    """The MPT curve ``r -> S(x; r)`` of a model on ``N`` observations, and its area.

    Observation ``i`` has ``D_i`` maskable features (tokens, patches); at rate ``r`` it has
    ``M_ir`` of them masked, ``num_masks`` random masks per observation and rate.

    :ivar torch.Tensor rates: the masking rates, shape ``(R,)``.
    :ivar torch.Tensor scores: ``S(x; r)``, the mean log-probability of a masked feature,
        averaged over masks and then over observations, ``(R,)``.
    :ivar torch.Tensor stderr: Monte Carlo standard errors of ``scores`` over the random
        masks, for this data (NaN with one mask), ``(R,)``.
    :ivar float area: the mean over observations of ``D_i`` times the mean of its scores
        over rates: with every size ``1 ... D`` (or rates evenly covering ``(0, 1]``) an
        estimate of the mean ``log p(x)`` per observation.
    :ivar float area_stderr: the Monte Carlo standard error of ``area``.
    :ivar torch.Tensor sizes: the mask sizes ``M_ir``, long ``(N, R)``.
    :ivar torch.Tensor num_features: ``D_i``, long ``(N,)``.
    :ivar torch.Tensor masked_fraction: the mean over observations of ``M_ir / D_i``, ``(R,)``.
    :ivar torch.Tensor observation_scores: each observation's scores averaged over masks,
        ``(N, R)``.
    """

    rates: torch.Tensor
    scores: torch.Tensor
    stderr: torch.Tensor
    area: float
    area_stderr: float
    sizes: torch.Tensor
    num_features: torch.Tensor
    masked_fraction: torch.Tensor
    observation_scores: torch.Tensor

    @classmethod
    def from_scores(cls, scores, rates, sizes, num_features, share_masks=False):
        """Summarises the score of every mask.

        :param torch.Tensor scores: the mean log-probability of the masked features of each
            observation, rate and mask, ``(N, R, P)``.
        :param torch.Tensor rates: ``(R,)``.
        :param torch.Tensor sizes: ``M_ir``, ``(N, R)``.
        :param torch.Tensor num_features: ``D_i``, ``(N,)``.
        :param bool share_masks: whether each mask served every observation (then the masks,
            not the observations' masks, are the independent draws).
        :returns: an :class:`MPTCurve`.
        """
        num_obs, num_rates, num_masks = scores.shape
        per_observation = scores.mean(-1)
        d = num_features.to(scores.dtype)
        if num_masks < 2:
            stderr = scores.new_full((num_rates,), math.nan)
            area_stderr = math.nan
        elif share_masks:
            stderr = scores.mean(0).std(-1) / math.sqrt(num_masks)
            area_stderr = float(d.mean() * stderr.pow(2).sum().sqrt() / num_rates)
        else:
            # Independent masks per observation: the variances of the per-observation means add.
            variance = scores.var(-1) / num_masks
            stderr = variance.sum(0).sqrt() / num_obs
            weights = (d / (num_obs * num_rates)).unsqueeze(-1)
            area_stderr = float((weights.pow(2) * variance).sum().sqrt())
        return cls(
            rates=rates.to(scores.dtype),
            scores=per_observation.mean(0),
            stderr=stderr,
            area=float((d * per_observation.mean(1)).mean()),
            area_stderr=area_stderr,
            sizes=sizes,
            num_features=num_features,
            masked_fraction=(sizes.to(scores.dtype) / d.unsqueeze(-1)).mean(0),
            observation_scores=per_observation,
        )


def default_rates(low=0.01, high=0.99, step=0.01):
    """Evenly spaced masking rates ``low, low + step, ..., high`` (the paper's 1%...99%)."""
    count = int(round((high - low) / step)) + 1
    return torch.tensor([round(low + k * step, 10) for k in range(count)], dtype=torch.float64)


def check_rates(rates, name="rates"):
    """``rates`` as a float64 tensor of masking rates in ``(0, 1]``.

    :raises TypeError: if ``rates`` is not a sequence of numbers.
    :raises ValueError: if it is empty or a rate lies outside ``(0, 1]``.
    """
    try:
        values = torch.as_tensor(rates, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name} must be a sequence of floats in (0, 1], got {rates!r}.") from error
    if values.numel() == 0 or not bool(((values > 0) & (values <= 1)).all()):
        raise ValueError(
            f"{name} must be a non-empty sequence of masking rates in (0, 1], got "
            f"{values.tolist()}; e.g. pyro_mpt.default_rates() for 1%...99%."
        )
    return values


def rate_sizes(rates, num_features):
    """The mask sizes ``max(1, floor(r D + 1/2))`` (halves up) of each rate for
    ``D = num_features``, as :class:`~pyro_mpt.ops.masks.FixedRate` draws them, long
    ``(R,)``."""
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([FixedRate(float(r)).sizes_from_quantiles(zero, num_features) for r in rates])
