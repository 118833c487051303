"""Block Gibbs chains on the self-predictive conditionals."""

import math

import torch

from pyro_mpt.conditionals.accuracy_warnings import counted_per_call
from pyro_mpt.conditionals.per_model import conditionals_for, package_function
from pyro_mpt.conditionals.rule_check import prepare_checked
from pyro_mpt.generation._arguments import check_count
from pyro_mpt.generation.draws import draw_hidden
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.progress import progress_bar
from pyro_mpt.trace.data_reads import check_data_not_read
from pyro_mpt.trace.subsampled_plates import refusing_subsampled_plates
from pyro_mpt.trace.trace_utils import flatten_tail, param_store_rollback

__all__ = ["gibbs"]


@package_function
def gibbs(
    model,
    *args,
    block_size,
    num_steps,
    joint=True,
    conditionals="auto",
    guide=None,
    progress=True,
    max_plate_nesting=math.inf,
    check_rule=True,
    **kwargs,
):
    """Runs a block Gibbs chain from each observation of the data.

    Each step picks, for every observation, a uniformly random block ``S`` of
    ``block_size`` features and draws them again given the others ``R``:

    * ``joint=True``: :math:`x_S \\sim p(x_S \\mid x_R)` jointly, an exact block-Gibbs step
      that leaves :math:`p(x)` invariant (with ``block_size = D`` each step is an
      independent draw of the model);
    * ``joint=False``: each :math:`x_j \\sim p(x_j \\mid x_R)`, :math:`j \\in S`,
      independently, what one parallel pass of a masked language model does. Its
      stationary distribution is not :math:`p(x)` when the features of a block depend on
      one another: with ``block_size = D`` it draws every feature from its marginal, with
      no dependence left.

    Entries that the model masks (``.mask``, ``poutine.mask``, ``obs_mask``) are in no
    block: they are never context, keep their state, and the chain leaves the joint of the
    entries the model counts invariant (fill missing entries with
    :func:`~pyro_mpt.impute` first to run a chain over all of them).

    The draws are those of :func:`~pyro_mpt.impute`; each step prepares the conditionals
    once (one model run for ``"exact"``, two for ``"quadrature"``).

    :param callable model: the Pyro model. Its first positional argument must be the data
        tensor observed at its likelihood site: each step calls it with the chain's state.
    :param args: the model's arguments, the data first.
    :param int block_size: ``k``, features drawn per step, ``1 <= k <= D``.
    :param int num_steps: steps of the chain (0 or more).
    :param bool joint: joint block draws (True) or a product of per-feature draws.
    :param conditionals: a strategy name or :class:`~pyro_mpt.conditionals.Conditionals`.
    :param callable guide: the guide, for ``"importance"`` and ``"encode-decode"``.
    :param bool progress: show a progress bar over steps.
    :param bool check_rule: whether a quadrature rule given here measures its own error on
        the data before drawing, as in :func:`~pyro_mpt.log_marginal` (one more run of the
        model; a :class:`~pyro_mpt.errors.QuadratureAccuracyWarning` states the figure when
        it is large). Checked once, on the data the chain starts from. Encode-decode
        conditionals are held to an importance-sampling lower bound of ``log p(x)`` instead,
        as in :func:`~pyro_mpt.mpt_curve`.
    :param kwargs: the model's keyword arguments.
    :returns: the chain, ``(num_steps + 1,) + x.shape``; its first entry is the data.

    Pyro's param store is left as it was found, as :func:`~pyro_mpt.log_marginal` leaves
    it: parameters first created here (a guide's sized by this ``x``) are removed.

    Example::

        >>> from pyro_mpt import gibbs
        >>> from pyro_mpt.models import PPCA
        >>> ppca = PPCA(num_features=5, latent_dim=2)
        >>> x = ppca.sample(4)
        >>> gibbs(ppca.model, x, block_size=2, num_steps=10, progress=False).shape
        torch.Size([11, 4, 5])
    """
    data = args[0] if args else None
    if not torch.is_tensor(data):
        got = "no positional argument" if not args else f"{type(data).__name__} {data!r}"
        raise TypeError(
            f"gibbs calls the model with the chain's state as its first positional argument, "
            f"which must be the data tensor observed at its likelihood site; got {got}. "
            f"Write the model as model(x, ...) and call gibbs(model, x, ...)."
        )
    num_steps = check_count("num_steps", num_steps, 0, hint="Pass num_steps=0 or more.")
    if not isinstance(joint, bool):
        raise TypeError(f"joint must be True or False, got {joint!r}.")
    strategy = conditionals_for(conditionals, model)
    rest = tuple(args[1:])
    # The param store is left as it was found (a guide sized by this x creates parameters).
    # One call counts its failing importance weights afresh (warns at its first).
    subsampled = refusing_subsampled_plates("gibbs draws every observation")
    with param_store_rollback(always=True), counted_per_call(), subsampled as plates:
        # Prepared with gradients on: some strategies check their guide by differentiating it.
        call = (model, guide, args, kwargs, max_plate_nesting)
        prepared = prepare_checked(
            strategy, *call, check_rule, "gibbs", lambda prepared: prepared.check_draws()
        )
        plates.refuse()
        observed = prepared.observed
        _check_state(data, observed)
        check_data_not_read(model, args, kwargs, "gibbs")
        num_features = observed.num_features
        block_size = check_count(
            "block_size",
            block_size,
            1,
            num_features,
            f"It counts the features drawn per step, of the D={num_features} of one observation.",
        )
        sizes = torch.full(observed.batch_shape, block_size, device=data.device)
        chain = [data]
        steps = progress_bar(range(num_steps), desc="Gibbs", disable=not progress, leave=False)
        for step in steps:
            step_args = (chain[-1],) + rest
            if step > 0:
                prepared = strategy.prepare(model, guide, step_args, kwargs, max_plate_nesting)
            blocks = _blocks(sizes, prepared.observed)
            with torch.no_grad():
                draws = draw_hidden(prepared, blocks, 1, joint=joint)[0]
            chain.append(draws.reshape(data.shape).to(data.dtype))
    return torch.stack(chain)


def _check_state(data, observed):
    """Checks that the model observes its first argument as it is: the chain feeds the
    observed site's draws back as that argument, so a covariate passed first, or data the
    model transforms before observing it (``x / 10``), would make each step's state another
    quantity than the last one's."""
    if tuple(data.shape) != tuple(observed.full_shape):
        raise ValueError(
            f"gibbs calls the model with the chain's state as its first positional argument, "
            f"but that argument has shape {tuple(data.shape)} and the observed site "
            f"{observed.name!r} has shape {tuple(observed.full_shape)}. Pass the observed data "
            f"tensor first."
        )
    value = observed.value if observed.unfilled is None else observed.unfilled
    state = flatten_tail(data, observed.num_feature_dims).to(value.device)
    same = value == state.to(value.dtype)
    if observed.entries is not None:
        same = same | ~observed.entries  # missing entries: any value
    if not bool(same.all()):
        raise ValueError(
            f"gibbs calls the model with the chain's state as its first positional argument, "
            f"but the observed site {observed.name!r} does not hold that argument's values: "
            f"the model observes a transform of it (e.g. obs=x / 10) or another tensor of "
            f"its shape is passed first. Pass the observed data first, and observe it as it "
            f"is (move a transform into the likelihood, e.g. a loc and scale times 10)."
        )


def _blocks(sizes, observed):
    """A uniformly random block of each observation's entries that the model counts:
    entries it masks (``.mask``, ``poutine.mask``, ``obs_mask``) are in no ``p(x)`` it
    defines, are never context, and keep their state, so the chain leaves the joint of the
    counted entries invariant. A row with fewer counted entries than the block size draws
    them all."""
    entries = observed.entries
    if entries is None:
        return masks_of_sizes(sizes, observed.num_features)
    return masks_of_sizes(torch.minimum(sizes, entries.sum(-1)), observed.num_features, entries)
