"""How much of a quadrature rule's posterior sits on its outermost nodes.

A Gauss–Hermite rule integrates what lies within its nodes' span. When the integrand
``p(x | z) p(z)`` (divided by the rule's Gaussian, for a rule moved to a guide) still carries
weight at the rule's outermost nodes, part of it lies beyond them, where no node sees it:
the rule misses that part whatever its number of nodes, and a finer rule, whose span is
hardly wider, misses it too. The refinement gap then understates the error, by orders of
magnitude for a rule centred at a guide that sits away from the posterior. The share of
the posterior over the nodes held by the outermost ones measures it: for an integrand well
inside the span it is below the outermost weights of the rule (``1e-14`` for 20 nodes);
where it passes a few hundredths, the mass beyond the span is of that order too.

This module is pure tensor code: no Pyro effects.
"""

import torch

__all__ = ["edge_share", "outermost_nodes"]


def outermost_nodes(nodes, continuous=None):
    """Which nodes of a tensor-product rule lie on the edge of its span: those with a
    coordinate at the largest absolute value that coordinate takes.

    :param torch.Tensor nodes: the rule's nodes in its own (unmoved) coordinates, ``(G, K)``.
    :param continuous: the columns the rule integrates (the others hold indices of discrete
        values, which have no edge); all of them by default.
    :returns: booleans ``(G,)``.
    """
    if continuous is not None:
        nodes = nodes[:, list(continuous)]
    if nodes.shape[-1] == 0:
        return torch.zeros(nodes.shape[0], dtype=torch.bool, device=nodes.device)
    size = nodes.abs()
    return (size >= size.amax(0)).any(-1)


def edge_share(node_log_joint, on_edge):
    """The posterior probability of the outermost nodes, per observation.

    :param torch.Tensor node_log_joint: ``log w_g + log p(x | z_g)``, ``(G,) + batch``.
    :param torch.Tensor on_edge: booleans ``(G,)`` (:func:`outermost_nodes`).
    :returns: a tensor of shape ``batch`` in ``[0, 1]``; 0 where no node is on the edge.
    """
    total = torch.logsumexp(node_log_joint, 0)
    return (torch.logsumexp(node_log_joint[on_edge], 0) - total).exp()
