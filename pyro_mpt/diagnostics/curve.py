"""The MPT curve: the score ``S(x; M)`` of each mask size, whose area is log p(x)."""

import math
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from pyro_mpt.conditionals.auto import as_conditionals
from pyro_mpt.ops.estimators import mask_scores
from pyro_mpt.ops.masks import masks_of_sizes

__all__ = ["MPTCurve", "mpt_curve"]

# Elements of the largest intermediate tensor per chunk of masks (about 160 MB in float64).
_CHUNK_ELEMENTS = 2 * 10**7


class MPTCurve(NamedTuple):
    """The MPT curve of a model on a batch of data.

    :ivar torch.Tensor sizes: mask sizes ``M``, shape ``(S,)``.
    :ivar torch.Tensor rates: ``M / D``.
    :ivar torch.Tensor scores: ``S(x; M)`` averaged over observations, shape ``(S,)``.
    :ivar torch.Tensor stderr: Monte Carlo standard errors of ``scores`` over the random
        masks, for this data (NaN when ``num_masks`` is 1).
    :ivar float area: ``D`` times the mean score: equals the sum over all mask sizes when
        ``sizes`` is ``1 ... D``, an estimate of the mean ``log p(x)`` per observation.
    :ivar int num_features: ``D``.
    """

    sizes: torch.Tensor
    rates: torch.Tensor
    scores: torch.Tensor
    stderr: torch.Tensor
    area: float
    num_features: int


def _sizes_from(rates, sizes, num_features):
    if sizes is not None and rates is not None:
        raise ValueError("Pass either sizes or rates to mpt_curve, not both.")
    if sizes is None and rates is None:
        return torch.arange(1, num_features + 1)
    if sizes is None:
        rates = torch.as_tensor(rates, dtype=torch.float64)
        if rates.numel() == 0 or (rates <= 0).any() or (rates > 1).any():
            raise ValueError(f"rates must be a non-empty list of values in (0, 1], got {rates}.")
        sizes = (rates * num_features).round().long().clamp(1, num_features)
    sizes = torch.as_tensor(sizes, dtype=torch.long).reshape(-1)
    if sizes.numel() == 0 or (sizes < 1).any() or (sizes > num_features).any():
        raise ValueError(
            f"sizes must be a non-empty list of mask sizes in 1..{num_features}, got {sizes}."
        )
    return sizes


@torch.no_grad()
def mpt_curve(
    model,
    *args,
    guide=None,
    sizes=None,
    rates=None,
    num_masks=10,
    conditionals="auto",
    share_masks=False,
    progress=False,
    max_plate_nesting=math.inf,
    **kwargs,
):
    """Computes the MPT curve ``M -> S(x; M)`` of ``model`` on the data in ``args``.

    .. math::

        \\mathcal{S}(x; M) = \\mathbb{E}_{|\\mathcal{M}| = M}\\Big[\\frac{1}{M}
            \\sum_{j \\in \\mathcal{M}} \\log p(x_j \\mid x_\\mathcal{R})\\Big],
        \\qquad \\log p(x) = \\sum_{M=1}^{D} \\mathcal{S}(x; M).

    :param callable model: the Pyro model.
    :param args: the model's arguments.
    :param callable guide: the guide, for strategies that need one.
    :param sizes: mask sizes to evaluate (default: every size ``1 ... D``).
    :param rates: masking rates in ``(0, 1]`` instead of sizes (rounded to sizes).
    :param int num_masks: random masks per observation and size.
    :param conditionals: the conditional strategy, as in :class:`~pyro_mpt.MPTLoss`.
    :param bool share_masks: use each mask for every observation (the paper's convention).
    :param bool progress: show a progress bar over mask sizes.
    :returns: an :class:`MPTCurve`.

    Example::

        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=8, latent_dim=2)
        >>> curve = mpt_curve(ppca.model, ppca.sample(50), num_masks=4)
        >>> curve.scores.shape
        torch.Size([8])
    """
    strategy = as_conditionals(conditionals)
    prepared = strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
    if prepared.observed.entries is not None:
        raise ValueError(
            f"Observed site {prepared.observed.name!r} has missing entries; the MPT curve "
            f"scores masks of each size among all D features, so it needs complete "
            f"observations. Drop the incomplete ones, or use MPTLoss.estimate, which scores "
            f"each observation's observed entries."
        )
    num_features = prepared.num_features
    sizes = _sizes_from(rates, sizes, num_features)
    batch_shape = prepared.batch_shape
    mask_batch = torch.Size() if share_masks else batch_shape
    value = prepared.observed.value
    per_mask = max(1, value.numel() * max(1, _latent_width(prepared)))
    chunk = max(1, _CHUNK_ELEMENTS // per_mask)

    means, stderrs = [], []
    for size in tqdm(sizes.tolist(), desc="MPT curve", disable=not progress):
        scores = []
        for start in range(0, num_masks, chunk):
            count = min(chunk, num_masks - start)
            size_tensor = torch.full((count,) + mask_batch, size, device=value.device)
            masks = masks_of_sizes(size_tensor, num_features)
            if share_masks:
                masks = masks.reshape((count,) + (1,) * len(batch_shape) + (num_features,))
            scores.append(mask_scores(prepared.log_prob(masks), masks))
        scores = torch.cat(scores).expand((num_masks,) + batch_shape).reshape(num_masks, -1)
        means.append(scores.mean())
        stderrs.append(_monte_carlo_stderr(scores, share_masks))
    scores = torch.stack(means)
    return MPTCurve(
        sizes=sizes,
        rates=sizes.double() / num_features,
        scores=scores,
        stderr=torch.stack(stderrs),
        area=float(num_features * scores.mean()),
        num_features=num_features,
    )


def _monte_carlo_stderr(scores, share_masks):
    """Standard error of the mean of ``scores`` (masks x observations) over random masks,
    for the data at hand."""
    num_masks, num_obs = scores.shape
    if num_masks < 2:
        return scores.new_tensor(math.nan)
    if share_masks:
        # Each mask serves every observation: masks are the independent draws.
        return scores.mean(1).std() / math.sqrt(num_masks)
    # Independent masks per observation: the variances of the per-observation means add.
    return (scores.var(0).sum() / num_masks).sqrt() / num_obs


def _latent_width(prepared):
    form = getattr(prepared, "form", None)
    if form is None:
        return 1
    if form.weight is not None:
        return form.weight.shape[-1]
    return form.covariance.shape[-1]
