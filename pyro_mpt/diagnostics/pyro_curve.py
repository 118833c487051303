"""The MPT curve of a Pyro model: the score ``S(x; M)`` of each mask size, from the model's
conditionals, whose sum over ``M = 1 ... D`` is log p(x)."""

import math

import torch

from pyro_mpt.conditionals.accuracy_warnings import counted_per_call, warn_if_unreliable
from pyro_mpt.conditionals.base import joined_diagnostics
from pyro_mpt.conditionals.per_model import conditionals_for, package_function
from pyro_mpt.conditionals.rule_check import prepare_checked
from pyro_mpt.diagnostics.curve import MPTCurve, check_rates, rate_sizes
from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.masks import mask_scores, masks_of_sizes
from pyro_mpt.progress import progress_bar
from pyro_mpt.trace.data_reads import check_data_not_read
from pyro_mpt.trace.subsampled_plates import refusing_subsampled_plates
from pyro_mpt.trace.trace_utils import param_store_rollback

__all__ = ["mpt_curve"]

# Elements of the largest intermediate tensor per chunk of masks (about 160 MB in float64).
_CHUNK_ELEMENTS = 2 * 10**7


def _sizes_from(rates, sizes, num_features):
    if sizes is not None and rates is not None:
        raise ValueError(
            f"mpt_curve got sizes={sizes!r} and rates={rates!r}; pass one of them, not both."
        )
    if sizes is None and rates is None:
        return torch.arange(1, num_features + 1)
    if sizes is None:
        return rate_sizes(check_rates(rates), num_features)
    given = torch.as_tensor(sizes)
    if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
        raise TypeError(
            f"sizes must be whole numbers of masked features in 1..{num_features}, got "
            f"{sizes!r}; round them first, or pass rates=... to have them rounded as the "
            f"masking rates round."
        )
    sizes = given.to(torch.long).reshape(-1)
    if sizes.numel() == 0 or (sizes < 1).any() or (sizes > num_features).any():
        raise ValueError(
            f"sizes must be a non-empty list of mask sizes in 1..{num_features}, got {sizes}."
        )
    return sizes


@torch.no_grad()
@package_function
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
    check_rule=True,
    **kwargs,
):
    """The MPT curve ``M -> S(x; M)`` of a Pyro ``model`` on the data in ``args``.

    .. math::

        \\mathcal{S}(x; M) = \\mathbb{E}_{|\\mathcal{M}| = M}\\Big[\\frac{1}{M}
            \\sum_{j \\in \\mathcal{M}} \\log p(x_j \\mid x_\\mathcal{R})\\Big],
        \\qquad \\log p(x) = \\sum_{M=1}^{D} \\mathcal{S}(x; M).

    :param callable model: the Pyro model.
    :param args: the model's arguments.
    :param callable guide: the guide, for strategies that need one.
    :param sizes: mask sizes to evaluate (default: every size ``1 ... D``).
    :param rates: masking rates in ``(0, 1]`` instead of sizes (``M = max(1, floor(r D + 1/2))``).
    :param int num_masks: random masks per observation and size.
    :param conditionals: the conditional strategy, as in :class:`~pyro_mpt.MPTLoss`.
    :param bool share_masks: use each mask for every observation (the paper's convention).
    :param bool progress: show a progress bar over mask sizes.
    :param bool check_rule: whether a quadrature rule given here measures its own error on
        the data first, as :func:`~pyro_mpt.log_marginal` does (one more model run), and
        warns with the figure when it is coarse; and whether encode-decode conditionals
        given here are held to an importance-sampling lower bound of ``log p(x)`` (64 draws
        of the guide, as ``MPTLoss`` holds them on its checked steps), warning with the
        figure when their estimate falls below it.
    :returns: an :class:`~pyro_mpt.MPTCurve` whose rates are ``M / D``. Its scores are per
        observation and ignore ``poutine.scale``, as :func:`~pyro_mpt.log_marginal` does.
    :raises ValueError: for ``Quadrature(center="guide")``, whose nodes miss the
        conditionals of masked inputs.

    With importance sampling, one :class:`~pyro_mpt.errors.ImportanceAccuracyWarning` per
    call states the figures when the weights of the scored masks fail (any one row that
    fails on its own included), as :func:`~pyro_mpt.log_marginal` does.

    Pyro's param store is left as it was found, as :func:`~pyro_mpt.log_marginal` leaves
    it: parameters first created here (a guide's sized by this ``x``) are removed.

    Example::

        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=8, latent_dim=2)
        >>> curve = mpt_curve(ppca.model, ppca.sample(50), num_masks=4)
        >>> curve.scores.shape
        torch.Size([8])
    """
    check_positive_int("num_masks", num_masks, "It is the number of random masks per size.")
    strategy = conditionals_for(conditionals, model)
    # The param store is left as it was found (a guide sized by this x creates parameters).
    with (
        param_store_rollback(always=True),
        counted_per_call(),
        refusing_subsampled_plates("mpt_curve scores every observation"),
    ):
        call = (model, guide, args, kwargs)
        prepared = prepare_checked(strategy, *call, max_plate_nesting, check_rule, "mpt_curve")
        prepared.check_masked_contexts("mpt_curve")
        check_data_not_read(model, args, kwargs, "mpt_curve")
        if prepared.observed.entries is not None:
            raise ValueError(
                f"Observed site {prepared.observed.name!r} has missing entries; the MPT curve "
                f"scores masks of each size among all D features, so it needs complete "
                f"observations. Drop the incomplete ones, or use MPTLoss.estimate, which scores "
                f"each observation's observed entries."
            )
        num_features = prepared.num_features
        sizes = _sizes_from(rates, sizes, num_features)
        scores, diagnostics = _scores_by_size(prepared, sizes, num_masks, share_masks, progress)
        # Every (observation, mask) row of every size is a conditional the curve rests on:
        # one warning for the call when the weights of any of them fail.
        warn_if_unreliable(
            diagnostics,
            "mpt_curve",
            model,
            args,
            guide=guide,
            strategy=strategy.in_use,
            each_row=True,
        )
    num_obs = scores.shape[0]
    return MPTCurve.from_scores(
        scores,
        rates=sizes.double() / num_features,
        sizes=sizes.expand(num_obs, -1),
        num_features=torch.full((num_obs,), num_features),
        share_masks=share_masks,
    )


def _scores_by_size(prepared, sizes, num_masks, share_masks, progress):
    """The mask scores of ``num_masks`` random masks of each of ``sizes``, ``(N, R, P)``,
    scored in chunks that keep ``log_prob``'s largest tensor near ``_CHUNK_ELEMENTS``, and
    the importance diagnostics of every chunk joined (None for other strategies)."""
    num_features, batch_shape = prepared.num_features, prepared.batch_shape
    mask_batch = torch.Size() if share_masks else batch_shape
    value = prepared.observed.value
    per_mask = max(1, value.numel() * max(1, prepared.log_prob_width))
    chunk = max(1, _CHUNK_ELEMENTS // per_mask)
    per_size, diagnostics = [], []
    for size in progress_bar(sizes.tolist(), desc="MPT curve", disable=not progress):
        scores = []
        for start in range(0, num_masks, chunk):
            count = min(chunk, num_masks - start)
            size_tensor = torch.full((count,) + mask_batch, size, device=value.device)
            masks = masks_of_sizes(size_tensor, num_features)
            if share_masks:
                masks = masks.reshape((count,) + (1,) * len(batch_shape) + (num_features,))
            scores.append(mask_scores(prepared.log_prob(masks), masks))
            diagnostics.append(prepared.diagnostics)
        scores = torch.cat(scores).expand((num_masks,) + batch_shape)
        per_size.append(scores.reshape(num_masks, -1))
    scores = torch.stack(per_size).permute(2, 0, 1)  # (N, R, P)
    return scores, joined_diagnostics(diagnostics)
