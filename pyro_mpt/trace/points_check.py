"""Checks, once per model structure, that a model may be run at many latent values at once
(an extra batch dim left of its plates), and which layout of the points it allows: the
first run at points of :mod:`pyro_mpt.trace.whitened_latents` calls
:func:`check_model_at_points`."""

import torch
from pyro.poutine.util import site_is_subsample

from pyro_mpt.errors import NotApplicableError
from pyro_mpt.trace.model_structure import points_dtype
from pyro_mpt.trace.trace_utils import (
    RandomState,
    check_points,
    same_random_state,
    unwrap_independent,
)
from pyro_mpt.trace.vectorized_run_check import (
    batch_norm_hint,
    check_run_at_points,
    kept_patterns,
    mixing_message,
)

__all__ = ["check_model_at_points"]

#: Random points of the checks of :func:`check_model_at_points`; the first two are compared.
_NUM_CHECK_POINTS = 5
#: The distance from the origin of the second check point, in prior standard deviations.
_FAR_RADIUS = 5.0


def check_model_at_points(model, args, kwargs, structure, run):
    """Checks, once per structure, that the model can be run at many latent values at once,
    and returns whether points shared by every observation may keep the observations' dims
    of size one (so a decoder runs once per point, not once per point and observation).

    The model runs at five random points, the second far out, with an extra batch dim left
    of its plates, and its likelihood and prior densities at the first point must be those
    of a plain run of the model at the same latent values
    (:func:`~pyro_mpt.trace.vectorized_run_check.check_run_at_points`). The two runs draw
    from different random states (unless a plate subsamples: both then see one subsample),
    so a model that is random at fixed latents (dropout in training mode), mixes values
    across its batch (batch normalization in training mode) or reduces over a fixed
    positive dim disagrees; when it does, :func:`_explain_disagreement` runs the model
    again to say which (a :class:`ValueError` says what to change).
    The compact layout is used when the model runs so, with latents of size one along the
    observations' dims (every prior taken from its first observation), and gives the
    likelihood of the full layout at those priors: a model that indexes, reshapes or
    concatenates its latents per observation runs at full size. When no prior differs
    between observations the run at the check points serves as that reference, so a model
    passing every check runs three times here.
    Nothing here touches the caller's random state.

    :param run: how the model is run at points:
        ``run(model, args, kwargs, structure, points, compact=..., first_rows=...,
        watch=...)`` returns a :class:`~pyro_mpt.trace.whitened_latents.PointsRun`
        (:func:`~pyro_mpt.trace.whitened_latents.run_at_points`, passed in so that this
        module does not import the one that calls it).
    """
    dtype, device = points_dtype(structure)
    points = check_points(_NUM_CHECK_POINTS, structure.latent_dim)
    points[1] *= _FAR_RADIUS / points[1].norm()
    points = points.to(dtype=dtype, device=device)
    # With a subsampled plate, another random state would draw another subsample.
    subsamples = _subsamples(structure)
    with torch.no_grad(), same_random_state():
        start = RandomState()

        def run_at(points, compact, same_state=True, first_rows=False, watch_rows=False):
            # From one random state a subsampled plate draws the same subsample.
            start.restore()
            if not same_state:
                _advance_random_state(device)
            return run(
                model,
                args,
                kwargs,
                structure,
                points,
                compact=compact,
                first_rows=first_rows,
                watch=watch_rows,
            )

        def log_prob_at(points, compact, same_state=True, first_rows=False):
            return _observed_log_prob(run_at(points, compact, same_state, first_rows))

        try:
            # The check points shared by every observation, then slices in which some
            # observations keep the first point and the others hold the third (_check_local).
            spread = torch.cat([_shared(points, structure), _kept_or_moved(points, structure)])
            wide_run = run_at(spread, False, same_state=subsamples, watch_rows=True)
        except (ValueError, RuntimeError, IndexError) as error:
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
            hint = batch_norm_hint(model, args, kwargs)
            in_words = isinstance(error, ValueError) and not hint
            if in_words or isinstance(error, NotApplicableError):
                raise  # in Pyro's or the model's own words (a BatchNorm's is a ValueError)
            raise ValueError(
                f"The model failed when run at several latent values at once ({cause}). "
                + (
                    hint
                    or "MPTLoss integrates the latents out by running the model with an extra "
                    "batch dim left of its plates, as Pyro's vectorized particles do, so the "
                    "model must broadcast over leading dims: expand covariates to the latent's "
                    "batch shape before concatenating "
                    "(torch.cat([z, c.expand(z.shape[:-1] + c.shape[-1:])], -1)), and reshape "
                    "with z.shape[:-1] rather than the data size."
                )
            ) from error
    try:
        check_run_at_points(model, args, kwargs, structure, wide_run.trace, [0])
    except ValueError:
        _explain_disagreement(structure, log_prob_at, points, subsamples)
        raise
    _check_local(structure, _observed_log_prob(wide_run), len(points))
    with torch.no_grad(), same_random_state():
        # Every prior narrowed to its first row, so the compact run's latents have the
        # observations' dims of size one, as later runs give them wherever the prior's rows
        # are equal (on this call or a later one); the full run at the same priors is the
        # reference: the run above where every prior's rows were equal already.
        if wide_run.rows_differ:
            at_first_rows = log_prob_at(points[:2], False, first_rows=True)
        else:
            at_first_rows = _observed_log_prob(wide_run)[:2]
        try:
            compact = log_prob_at(points[:2], True, first_rows=True)
        except (RuntimeError, IndexError):  # shape errors of per-observation indexing
            compact = None
    return compact is not None and _same(compact.expand_as(at_first_rows), at_first_rows)


def _shared(points, structure):
    """``points`` ``(Q, K)`` given to every observation: ``(Q,) + batch + (K,)``."""
    batch = structure.observed.batch_shape
    return points.reshape(points.shape[:1] + (1,) * len(batch) + points.shape[1:]).expand(
        points.shape[:1] + batch + points.shape[1:]
    )


def _kept_or_moved(points, structure):
    """One slice per row of :func:`~pyro_mpt.trace.vectorized_run_check.kept_patterns`:
    the observations the row keeps hold the first of ``points`` ``(Q, K)``, the others the
    third; ``(2 B,) + batch + (K,)``."""
    batch = structure.observed.batch_shape
    kept = kept_patterns(batch.numel()).to(points.device)[..., None]  # (2 B, N, 1)
    slices = torch.where(kept, points[0], points[2])
    return slices.reshape(slices.shape[:1] + batch + points.shape[1:])


def _check_local(structure, log_prob, num_points):
    """Raises the :class:`ValueError` for a model that mixes values across its batch when
    an observation's likelihood at a point depends on the points the other observations
    hold: ``log_prob`` ``(Q + 2 B,) + full shape`` is that of the ``Q`` shared points then of
    :func:`_kept_or_moved`'s slices, where each observation a slice keeps must score as at
    the first shared point. At shared points a batch statistic of the latents (a mean over
    the data plate, batch normalization in a decoder) is the value itself, and any two
    observations are told apart by some slice, so only these slices show it."""
    observed = structure.observed
    count = observed.batch_shape.numel()
    flat = log_prob.reshape((log_prob.shape[0], count, -1))
    first, slices = flat[:1], flat[num_points:]
    kept = kept_patterns(count).to(flat.device)[..., None].expand(slices.shape)
    if not _same(torch.where(kept, slices, first), first.expand_as(slices)):
        raise ValueError(mixing_message(observed.name))


def _advance_random_state(device):
    """Moves torch's random state (CPU, and ``device`` when it is a CUDA one) one draw on,
    so that randomness inside the model (dropout) differs from a run from the state before,
    whatever that state was."""
    torch.rand(())
    if device.type == "cuda":
        torch.rand((), device=device)


def _explain_disagreement(structure, log_prob_at, points, subsamples):
    """Raises the :class:`ValueError` that names the cause when a model that disagreed with
    its plain run is random at fixed latents, or mixes values across its batch: three more
    runs, at the first two check points from two random states, and among all five.
    Returns when neither is the cause."""
    with torch.no_grad(), same_random_state():
        full = log_prob_at(points[:2], False)
        again = full if subsamples else log_prob_at(points[:2], False, False)
        among = log_prob_at(points, False)[:2]
    observed = structure.observed.name
    if not _same(again, full):
        raise ValueError(
            f"The likelihood of observed site {observed!r} changes between two runs at the same "
            f"latent values: the model is random given its latents (dropout in training "
            f"mode?). MPTLoss integrates the latents out of p(x | z), which must be a function "
            f"of z: call .eval() on modules with dropout, or make the randomness a pyro.sample "
            f"site."
        )
    if not _same(among, full):
        raise ValueError(mixing_message(observed))


def _subsamples(structure):
    """Whether the model subsamples a plate (its observations then vary between runs)."""
    return any(
        site_is_subsample(site) and site["fn"].subsample_size not in (None, site["fn"].size)
        for site in structure.trace.nodes.values()
    )


def _same(a, b):
    """Whether two log-likelihoods agree to the rounding of a model run in their dtype."""
    tol = 10 * torch.finfo(a.dtype).eps ** 0.5
    return bool(torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True))


def _observed_log_prob(run):
    """The per-entry log-likelihood of the observation in ``run``, ``(Q,) + full shape``."""
    value = run.observed.value.reshape(run.observed.full_shape)
    return unwrap_independent(run.fn).log_prob(value)
