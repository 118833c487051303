"""The share of a quadrature rule's posterior on its outermost nodes, against closed forms.

The integrand is a Gaussian bump ``exp(-(z - m)^2 / (2 sigma^2))`` under the prior
``N(0, 1)``, whose integral is ``sigma / sqrt(1 + sigma^2) exp(-m^2 / (2 (1 + sigma^2)))``,
integrated by a 20-node rule moved to ``N(c, s^2)`` (a rule centred at a guide) and compared
with a 30-node one, as the package's rule check compares them.
"""

import itertools
import math
import warnings

import pyro
import pyro.distributions as dist
import torch

from pyro_mpt import log_marginal
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.errors import QuadratureAccuracyWarning
from pyro_mpt.ops.quadrature_edge import edge_share, outermost_nodes
from pyro_mpt.ops.quadrature_nodes import adapted_nodes, gauss_hermite_grid


def _rule(num_points, center, scale, bump_loc, bump_scale):
    """``(log integral, edge share)`` of the bump by a rule moved to ``N(center, scale^2)``."""
    nodes, log_weights = gauss_hermite_grid(num_points, 1, dtype=torch.float64)
    on_edge = outermost_nodes(nodes)
    center, scale = torch.tensor([[center]]), torch.tensor([[scale]])
    moved, moved_log_weights = adapted_nodes(nodes, log_weights, center, scale)
    z = moved[..., 0]
    log_joint = moved_log_weights - (z - bump_loc) ** 2 / (2 * bump_scale**2)
    return float(torch.logsumexp(log_joint, 0)[0]), float(edge_share(log_joint, on_edge)[0])


def _exact(bump_loc, bump_scale):
    variance = 1 + bump_scale**2
    return math.log(bump_scale / math.sqrt(variance)) - bump_loc**2 / (2 * variance)


def test_outermost_nodes_of_a_tensor_product_rule():
    nodes, _ = gauss_hermite_grid(3, 2, dtype=torch.float64)  # 0 and +-sqrt(3) per dim
    on_edge = outermost_nodes(nodes)
    assert on_edge.tolist() == [bool((row.abs() > 1).any()) for row in nodes]
    assert int(on_edge.sum()) == 8  # all but the centre
    # A column of discrete indices has no edge.
    assert int(outermost_nodes(nodes, continuous=[0]).sum()) == 6
    assert not outermost_nodes(nodes, continuous=[]).any()


def test_edge_share_is_the_posterior_mass_of_the_edge_nodes():
    log_joint = torch.log(torch.tensor([[0.1, 0.5], [0.2, 0.2], [0.7, 0.3]]))
    on_edge = torch.tensor([True, False, True])
    share = edge_share(log_joint, on_edge)
    assert torch.allclose(share, torch.tensor([0.8, 0.8]))
    assert torch.equal(edge_share(log_joint, torch.zeros(3, dtype=torch.bool)), torch.zeros(2))


def test_a_rule_that_misses_the_integrand_shows_mass_at_its_edge():
    # The guide sits at 3 with scale 0.1, the bump at -1: every node is past the bump.
    value, share = _rule(20, 3.0, 0.1, -1.0, 0.5)
    finer_value, finer_share = _rule(30, 3.0, 0.1, -1.0, 0.5)
    error = abs(value - _exact(-1.0, 0.5))
    assert error > 20  # nats
    assert abs(finer_value - value) < error / 5  # the refinement gap understates it
    assert share > 0.3 and finer_share > 0.3  # the edge does not


def test_edge_share_of_the_finer_rule_flags_what_the_refinement_gap_misses():
    """Over guides near and far from the bump: for bumps as wide as the prior or wider
    (which 20 nodes resolve anywhere in their span), every 20-node rule off by more than 0.1
    nats has a refinement gap past 0.1 or a 30-node rule whose edge holds over 1% of the
    posterior, and some are caught by the edge alone; for every bump, an edge over 1% is no
    false alarm: the rule is off by more than 0.01 nats, or its gap passes 0.01 anyway."""
    caught_by_edge_alone = 0
    for bump_loc, bump_scale, center, scale in itertools.product(
        [0.0, 1.0, 3.0, 6.0, 10.0, 14.0],
        [0.05, 0.3, 1.0, 3.0],
        [-3.0, 0.0, 2.0, 5.0, 9.0, 14.0],
        [0.05, 0.2, 0.5, 1.0, 2.0],
    ):
        case = (bump_loc, bump_scale, center, scale)
        value = _rule(20, center, scale, bump_loc, bump_scale)[0]
        error = abs(value - _exact(bump_loc, bump_scale))
        finer_value, finer_share = _rule(30, center, scale, bump_loc, bump_scale)
        gap = abs(finer_value - value)
        if finer_share > 0.01:
            assert error > 0.01 or gap > 0.01, case
        if bump_scale >= 1.0 and error > 0.1:
            assert gap > 0.1 or finer_share > 0.01, case
            caught_by_edge_alone += gap <= 0.1
    assert caught_by_edge_alone > 0


def _tanh_model(x):
    weight = torch.tensor([1.0, 1.5, 2.0, 0.7], dtype=x.dtype)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        pyro.sample("x", dist.Normal(torch.tanh(z.unsqueeze(-1) * weight), 0.3).to_event(1), obs=x)


_GRID = torch.linspace(-10, 10, 40001, dtype=torch.float64)


def _tanh_log_joint(x):
    """``log p(x, z)`` on :data:`_GRID`, ``(Z, N)``."""
    weight = torch.tensor([1.0, 1.5, 2.0, 0.7], dtype=torch.float64)
    log_lik = dist.Normal(torch.tanh(_GRID[:, None, None] * weight), 0.3).log_prob(x).sum(-1)
    return log_lik + dist.Normal(0.0, 1.0).log_prob(_GRID)[:, None]


def _guide_at(loc, scale):
    """A guide with ``z ~ N(loc, scale^2)``: numbers, or one per observation."""

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample(
                "z", dist.Normal(torch.as_tensor(loc, dtype=x.dtype).expand(x.shape[:1]), scale)
            )

    return guide


def test_a_rule_centred_at_a_misplaced_guide_says_its_error_is_beyond_its_figure():
    # The posteriors sit near z = -1 .. 0; a guide at 3 with scale 0.1 puts every node past
    # them. The refinement gap is about a nat; the rule is off by tens of nats.
    torch.manual_seed(0)
    x = torch.tanh(torch.tensor([-1.0, -0.5, 0.0])[:, None] * torch.tensor([1.0, 1.5, 2.0, 0.7]))
    x = (x + 0.3 * torch.randn(3, 4)).double()
    log_joint = _tanh_log_joint(x)
    reference = torch.logsumexp(log_joint, 0) + math.log(float(_GRID[1] - _GRID[0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = log_marginal(
            _tanh_model, x, guide=_guide_at(3.0, 0.1), conditionals=Quadrature(20, center="guide")
        )
    (warning,) = [w for w in caught if w.category is QuadratureAccuracyWarning]
    message = str(warning.message)
    figure = float(message.split("log p(x) by ")[1].split(" nats")[0])
    error = float((value - reference).abs().mean())
    assert error > 10 * figure  # the gap alone would mislead by an order of magnitude
    assert "outermost nodes of the finer rule hold" in message
    assert "many times that figure" in message
    # A guide at each posterior's mean and standard deviation: accurate, and silent.
    posterior = torch.softmax(log_joint, 0)
    posterior_mean = (posterior * _GRID[:, None]).sum(0)
    posterior_sd = ((posterior * _GRID[:, None] ** 2).sum(0) - posterior_mean**2).sqrt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        value = log_marginal(
            _tanh_model,
            x,
            guide=_guide_at(posterior_mean, posterior_sd),
            conditionals=Quadrature(20, center="guide"),
        )
    assert float((value - reference).abs().max()) < 0.01
