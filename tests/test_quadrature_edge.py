"""The share of a quadrature rule's posterior on its outermost nodes, against closed forms.

The integrand is a Gaussian bump ``exp(-(z - m)^2 / (2 sigma^2))`` under the prior
``N(0, 1)``, whose integral is ``sigma / sqrt(1 + sigma^2) exp(-m^2 / (2 (1 + sigma^2)))``,
integrated by a 20-node rule moved to ``N(c, s^2)`` (a rule centred at a guide) and compared
with a 30-node one, as the package's rule check compares them.
"""

import itertools
import math

import torch

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
