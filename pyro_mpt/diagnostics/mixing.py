"""Mixing of Markov chains (block Gibbs, MLM samplers): effective sample size and R-hat of
chain statistics over several chains, computed by ArviZ, with the ESS per step and per model
evaluation, so that samplers of different costs per step can be compared."""

import math
import numbers
import warnings
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Mixing", "mixing_diagnostics"]

_METHODS = ("bulk", "tail", "mean")


class Mixing(NamedTuple):
    """Mixing diagnostics of ``S`` chain statistics, each over ``C`` chains of ``N`` draws.

    :ivar torch.Tensor ess: effective sample size of each statistic over all chains, ``(S,)``
        (``()`` for a 2-D input).
    :ivar torch.Tensor rhat: rank-normalised split R-hat of each statistic; near 1 when the
        chains agree, above about 1.01 when they have not mixed. Same shape as ``ess``.
    :ivar torch.Tensor ess_per_step: ``ess / (C N)``, the effective draws per step; for
        independent draws about 1.
    :ivar torch.Tensor ess_per_evaluation: ``ess / (C N E)`` with ``E`` the model evaluations
        (e.g. forward passes) per step.
    :ivar int num_chains: ``C``.
    :ivar int num_draws: ``N``.
    :ivar tuple names: the statistics' names for a dict input, else ``None``.
    """

    ess: torch.Tensor
    rhat: torch.Tensor
    ess_per_step: torch.Tensor
    ess_per_evaluation: torch.Tensor
    num_chains: int
    num_draws: int
    names: tuple = None


def _as_chains(samples):
    """``(array (C, N, S), names or None, squeeze)`` from the accepted input forms."""
    names = None
    if isinstance(samples, dict):
        if not samples:
            raise ValueError("samples is an empty dict; give name -> (chains, draws) arrays.")
        names = tuple(samples)
        arrays = [_to_numpy(v, f"samples[{k!r}]") for k, v in samples.items()]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1 or arrays[0].ndim != 2:
            raise ValueError(
                "every statistic in samples must be a (chains, draws) array of the same shape, "
                f"got shapes {[a.shape for a in arrays]}."
            )
        return np.stack(arrays, axis=-1), names, False
    array = _to_numpy(samples, "samples")
    if array.ndim not in (2, 3):
        raise ValueError(
            f"samples must have shape (chains, draws) or (chains, draws, statistics), got "
            f"{array.shape}; stack chains along the first dimension."
        )
    return (array[..., None], None, True) if array.ndim == 2 else (array, None, False)


def _to_numpy(value, name):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name} must be an array of numbers, got {type(value).__name__}."
        ) from error


def _arviz():
    with warnings.catch_warnings():
        # ArviZ announces an upcoming refactor on import; it concerns no call made here.
        warnings.filterwarnings(
            "ignore", message=r"(?s).*ArviZ is undergoing", category=FutureWarning
        )
        import arviz
    return arviz


def mixing_diagnostics(samples, evaluations_per_step=1, method="bulk"):
    """Effective sample size and R-hat of chain statistics, by :func:`arviz.ess` and
    :func:`arviz.rhat`, per step and per model evaluation.

    For a stationary chain whose statistic has autocorrelations :math:`\\rho_t`,

    .. math::

        \\mathrm{ESS} = \\frac{C N}{1 + 2 \\sum_{t \\ge 1} \\rho_t},

    e.g. :math:`C N (1 - \\rho) / (1 + \\rho)` for an AR(1) process of coefficient
    :math:`\\rho`. A sampler that needs ``E`` forward passes per step is worth
    ``ess_per_evaluation`` effective draws per pass.

    :param samples: one statistic as a ``(chains, draws)`` array or tensor, several as
        ``(chains, draws, statistics)``, or a dict of name -> ``(chains, draws)``. Chains
        come first: a :func:`~pyro_mpt.gibbs` chain, ``(steps, observations, D)``, is
        steps first, so pass ``chain.movedim(0, 1)`` (each observation's chain, a row).
        A statistic that never changes within a chain gets NaN figures and a warning.
    :param evaluations_per_step: model evaluations per step of the chain, e.g. ``k`` for
        a sequential ``k``-block Gibbs step of a masked language model, 1 for a parallel one.
    :param str method: ArviZ's ESS method: ``"bulk"`` (rank-normalised, the default),
        ``"tail"`` or ``"mean"`` (of the statistic itself).
    :returns: :class:`Mixing`, float64 tensors.
    :raises ValueError: for fewer than 2 chains or 4 draws, a NaN or infinite draw, or an
        unknown ``method``. Ten times as many chains as draws or more, the sign of a
        draws-first array, warns.

    Example::

        >>> chains = torch.randn(4, 200, generator=torch.Generator().manual_seed(0))
        >>> d = mixing_diagnostics(chains, evaluations_per_step=3)
        >>> bool(abs(d.rhat - 1) < 0.05)
        True
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
    if isinstance(evaluations_per_step, bool) or not isinstance(evaluations_per_step, numbers.Real):
        raise TypeError(
            f"evaluations_per_step must be a positive number, got {evaluations_per_step!r}."
        )
    evaluations = float(evaluations_per_step)
    if not (evaluations > 0 and math.isfinite(evaluations)):
        raise ValueError(
            f"evaluations_per_step must be a positive number, got {evaluations_per_step!r}; "
            "give the forward passes per step of the sampler."
        )
    array, names, squeeze = _as_chains(samples)
    num_chains, num_draws, num_stats = array.shape
    if num_chains < 2 or num_draws < 4:
        raise ValueError(
            f"samples has {num_chains} chain(s) of {num_draws} draws; R-hat needs at least 2 "
            "chains of at least 4 draws. Run several chains from different starts."
        )
    if not np.isfinite(array).all():
        count = int((~np.isfinite(array)).sum())
        raise ValueError(
            f"samples holds {count} NaN or infinite draws, which leave the effective sample "
            f"size and R-hat NaN or meaningless; drop the statistic or the steps that hold "
            f"them."
        )
    if num_chains >= 10 * num_draws:
        warnings.warn(
            f"samples has {num_chains} chains of {num_draws} draws each, ten times as many "
            f"chains as draws or more. Chains come first; a draws-first array (a gibbs chain "
            f"is steps first) gives an effective sample size and R-hat of nothing. If so, "
            f"pass samples.movedim(0, 1) (or .T).",
            RuntimeWarning,
            stacklevel=2,
        )
    az = _arviz()
    # A chain whose statistic never moves is stuck (or the statistic is constant): ArviZ
    # would count every draw of such chains as independent, so its figures are NaN here.
    stuck = (array == array[:, :1]).all(axis=1)  # (C, S)
    ess, rhat = [], []
    with np.errstate(invalid="ignore", divide="ignore"):
        for s in range(num_stats):
            if stuck[:, s].any():
                ess.append(math.nan)
                rhat.append(math.nan)
                continue
            ess.append(float(az.ess(array[..., s], method=method)))
            rhat.append(float(az.rhat(array[..., s])))
    if stuck.any():
        which = [names[s] if names else s for s in range(num_stats) if stuck[:, s].any()]
        chains = sorted({int(c) for c in np.nonzero(stuck.any(axis=1))[0]})
        warnings.warn(
            f"statistic(s) {which} never change within chain(s) {chains}: a stuck chain, or a "
            f"statistic that takes one value, has no effective sample size; their ess and "
            f"rhat are NaN. Check that the sampler moves, or pick a statistic that varies.",
            RuntimeWarning,
            stacklevel=2,
        )
    ess = torch.tensor(ess, dtype=torch.float64)
    rhat = torch.tensor(rhat, dtype=torch.float64)
    if squeeze:
        ess, rhat = ess[0], rhat[0]
    steps = num_chains * num_draws
    return Mixing(
        ess=ess,
        rhat=rhat,
        ess_per_step=ess / steps,
        ess_per_evaluation=ess / (steps * evaluations),
        num_chains=num_chains,
        num_draws=num_draws,
        names=names,
    )
