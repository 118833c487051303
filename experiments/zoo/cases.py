"""What the model-zoo tests (``tests/test_model_zoo.py``, ``tests/test_held_out_models.py``)
and ``benchmarks/model_zoo_table.py`` share: the case record, seeded draws, grid references
under a standard-normal latent, and the statistical checks on MPT's estimates."""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch

from experiments.zoo.references import (
    grid_log_marginal_1d,
    grid_log_marginal_2d,
    standard_normal_log_prob,
)
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Exact


@dataclass
class ModelCase:
    """One hand-written model and its exact reference.

    :ivar name: a short name (the test id).
    :ivar model: the Pyro model.
    :ivar args: its positional arguments (the data first).
    :ivar reference: computes the exact ``log p(x_i)`` per observation (the shape of the data
        plate; masked observations 0, missing entries marginalised), or ``None``.
    :ivar strategy: the class ``conditionals="auto"`` must pick, or ``None``.
    :ivar conditionals: builds the reference-quality strategy for ``log_marginal``.
    :ivar tol: accepted |log_marginal - reference| per observation under ``conditionals``.
    :ivar guide: the guide, or what builds it (see the subclass), or ``None``.
    :ivar auto_tol: accepted error per observation under auto's own choice.
    :ivar kwargs: keyword arguments of the model.
    """

    name: str
    model: Callable
    args: tuple
    reference: Callable | None = None
    strategy: type | None = None
    conditionals: Callable = Exact
    tol: float = 1e-8
    guide: Callable | None = None
    auto_tol: float = 1e-8
    kwargs: dict = field(default_factory=dict)


@contextlib.contextmanager
def seeded(seed):
    """Draws under a fixed seed without touching the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def factory_ids(factories):
    """Test ids: the factories' names."""
    return [f.__name__ for f in factories]


def grid_1d(log_lik, **grid):
    """``log ∫ N(t; 0, 1) exp(log_lik(t)) dt`` per observation, on the fine trapezoid grid of
    :func:`grid_log_marginal_1d` (``grid``: its ``lo``, ``hi``, ``num_points``); ``log_lik``
    maps nodes ``(G, 1)`` to ``(G, N)``."""
    return grid_log_marginal_1d(lambda t: log_lik(t) + standard_normal_log_prob(t), **grid)


def grid_2d(log_lik):
    """``log ∫ N(t; 0, I_2) exp(log_lik(t)) dt`` per observation, on the product grid of
    :func:`grid_log_marginal_2d`; ``log_lik`` maps nodes ``(G, 2)`` to ``(G, N)``."""
    return grid_log_marginal_2d(
        lambda t: log_lik(t) + standard_normal_log_prob(t).sum(-1, keepdim=True)
    )


def log_marginal_and_reference(case, conditionals, guide):
    """``log_marginal`` of the case under ``conditionals`` and its reference, without
    gradients."""
    with torch.no_grad():
        value = log_marginal(
            case.model, *case.args, conditionals=conditionals, guide=guide, **case.kwargs
        )
        return value, case.reference()


def estimate_draws(loss, case, guide, num_draws):
    """``num_draws`` seeded estimates of every observation, ``(num_draws,) + batch``."""
    with torch.no_grad():
        return torch.stack(
            [loss.estimate(case.model, guide, *case.args, **case.kwargs) for _ in range(num_draws)]
        )


def assert_unbiased(draws, reference, bias_tol=0.0, num_se=4.5):
    """The mean of the draws matches the reference, in total and per observation, within
    ``num_se`` standard errors plus ``bias_tol`` nats per observation."""
    draws = draws.reshape(draws.shape[0], -1)
    reference = reference.reshape(-1)
    assert draws.shape[1] == reference.shape[0]
    total = draws.sum(1)
    total_se = total.std() / math.sqrt(total.numel())
    gap = (total.mean() - reference.sum()).abs()
    assert gap <= num_se * total_se + bias_tol * reference.numel(), (
        f"total: mean {total.mean():.4f}, reference {reference.sum():.4f}, "
        f"standard error {total_se:.4f}"
    )
    se = draws.std(0) / math.sqrt(draws.shape[0])
    gaps = (draws.mean(0) - reference).abs()
    worst = int((gaps - (num_se + 0.5) * se).argmax())
    assert bool((gaps <= (num_se + 0.5) * se + bias_tol).all()), (
        f"observation {worst}: mean {draws.mean(0)[worst]:.4f}, reference "
        f"{reference[worst]:.4f}, standard error {se[worst]:.4f}"
    )


def assert_uniform_estimate_unbiased(case, guide, seed=None, num_draws=150):
    """``MPTLoss(rate="uniform", num_masks=4)`` under the case's reference-quality
    conditionals, averaged over ``num_draws`` draws (after ``pyro.set_rng_seed(seed)`` where
    given), is unbiased for the reference: exactly for exact conditionals, within the case's
    ``tol`` per observation otherwise."""
    loss = MPTLoss(rate="uniform", num_masks=4, conditionals=case.conditionals())
    if seed is not None:
        pyro.set_rng_seed(seed)
    draws = estimate_draws(loss, case, guide, num_draws)
    with torch.no_grad():
        reference = case.reference()
    assert_unbiased(draws, reference, 0.0 if case.strategy is Exact else case.tol)


def assert_mean_loss_matches(losses, target, slack=0.0, num_se=4.5):
    """The mean of seeded losses is within ``num_se`` standard errors (plus ``slack``) of
    the target."""
    losses = torch.as_tensor(losses)
    assert abs(losses.mean() - target) < num_se * losses.std() / math.sqrt(losses.numel()) + slack
