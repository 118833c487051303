"""The MPT curve type shared by Pyro models, masked language models and ViT-MAE: its
summary (area and standard errors) and the masking rates it is evaluated at."""

import math
from typing import NamedTuple

import torch

from pyro_mpt.ops.masks import FixedRate

__all__ = ["MPTCurve", "area_weights", "check_rates", "default_rates", "rate_sizes"]


class MPTCurve(NamedTuple):
    """The MPT curve ``r -> S(x; r)`` of a model on ``N`` observations, and its area.

    Observation ``i`` has ``D_i`` maskable features (tokens, patches); at rate ``r`` it has
    ``M_ir`` of them masked, ``num_masks`` random masks per observation and rate.

    :ivar torch.Tensor rates: the masking rates, shape ``(R,)``.
    :ivar torch.Tensor scores: ``S(x; r)``, the mean log-probability of a masked feature,
        averaged over masks and then over observations, ``(R,)``.
    :ivar torch.Tensor stderr: Monte Carlo standard errors of ``scores`` over the random
        masks, for this data (NaN with one mask), ``(R,)``.
    :ivar float area: the mean over observations of ``sum_{M=1}^{D_i} S_i(M)``, with
        ``S_i(M)`` the mean score of the rates whose mask size is ``M`` and, for a size no
        rate gives, interpolated linearly between the nearest sizes given (the end ones
        held constant; :func:`area_weights`): with every size ``1 ... D`` an unbiased
        estimate of the mean ``log p(x)`` per observation, however unevenly the rates
        fall on the sizes.
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

    def observation_areas(self):
        """Each observation's area ``sum_{M=1}^{D_i} S_i(M)`` (see :attr:`area`), ``(N,)``."""
        weights = _observation_area_weights(self.sizes, self.num_features)
        return (weights.to(self.observation_scores) * self.observation_scores).sum(1)

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
        # The area of observation i is sum_r weights[i, r] * its mean score at rate r.
        weights = _observation_area_weights(sizes, num_features).to(scores)
        if num_masks < 2:
            stderr = scores.new_full((num_rates,), math.nan)
            area_stderr = math.nan
        elif share_masks:
            # The masks are the independent draws: each mask's area over the observations.
            stderr = scores.mean(0).std(-1) / math.sqrt(num_masks)
            area_of_mask = (weights.unsqueeze(-1) * scores).sum(1).mean(0)  # (P,)
            area_stderr = float(area_of_mask.std() / math.sqrt(num_masks))
        else:
            # Independent masks per observation: the variances of the per-observation means add.
            variance = scores.var(-1) / num_masks
            stderr = variance.sum(0).sqrt() / num_obs
            area_stderr = float(((weights / num_obs).pow(2) * variance).sum().sqrt())
        return cls(
            rates=rates.to(scores.dtype),
            scores=per_observation.mean(0),
            stderr=stderr,
            area=float((weights * per_observation).sum(1).mean()),
            area_stderr=area_stderr,
            sizes=sizes,
            num_features=num_features,
            masked_fraction=(sizes.to(scores.dtype) / d.unsqueeze(-1)).mean(0),
            observation_scores=per_observation,
        )


def area_weights(sizes, num_features):
    """The weight of each rate's score in the area ``sum_{M=1}^{D} S(M)`` of one
    observation with ``D = num_features`` features whose rates give the mask ``sizes``
    (long, any order, repeats allowed): ``S(M)`` of a size that some rates give is the
    mean of their scores; of one that none gives, the linear interpolation between the
    nearest sizes given below and above it, or the nearest one past the ends. The
    weights sum to ``D``, and with every size given once each is 1.

    Averaging ``D`` times the scores over the rates instead weighs each size by how many
    rates round to it: the 99 rates of :func:`default_rates` give the 8 sizes of ``D = 8``
    18, 13, 12, 13, 12, 13, 12 and 6 times, and the area overstates ``log p(x)``.

    :returns: a float64 tensor of the shape of ``sizes``.
    """
    sizes = torch.as_tensor(sizes).reshape(-1)
    given, index, counts = torch.unique(sizes, sorted=True, return_inverse=True, return_counts=True)
    every = torch.arange(1, num_features + 1, dtype=torch.float64)
    given64 = given.to(torch.float64)
    # The given size above each size (or the last), and the one below it (or the first).
    upper = torch.searchsorted(given64, every).clamp(max=len(given) - 1)
    lower = (upper - 1).clamp(min=0)
    below, above = given64[lower], given64[upper]
    span = (above - below).clamp(min=1)
    to_upper = ((every - below) / span).clamp(0, 1)
    to_upper = torch.where(every >= above, torch.ones_like(to_upper), to_upper)
    totals = torch.zeros(len(given), dtype=torch.float64)
    totals.index_add_(0, upper, to_upper)
    totals.index_add_(0, lower, 1 - to_upper)
    return (totals / counts)[index]


def _observation_area_weights(sizes, num_features):
    """:func:`area_weights` of every observation, ``(N, R)``: computed once per distinct
    ``(D_i, sizes of row i)``, as most rows share them."""
    rows, found = [], {}
    for row, count in zip(sizes.tolist(), num_features.tolist()):
        key = (count, tuple(row))
        if key not in found:
            found[key] = area_weights(torch.tensor(row), count)
        rows.append(found[key])
    return torch.stack(rows) if rows else torch.zeros(sizes.shape, dtype=torch.float64)


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
