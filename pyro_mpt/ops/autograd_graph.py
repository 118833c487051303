"""Walks of a loss's autograd graph, and gradients of a loss for some parameters only.

A walk computes nothing: it follows ``grad_fn.next_functions`` from the loss to the leaf
tensors it was built from. This module is pure tensor code: no Pyro effects.
"""

import torch

__all__ = ["gradients", "leaf_tensors", "leaves", "reaches", "with_zero_gradients"]


def leaf_tensors(loss):
    """The leaf tensors that ``loss``'s autograd graph was built from (those that require a
    gradient), each once."""
    found, stack, seen = {}, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def leaves(loss):
    """The ``id`` s of the leaf tensors that ``loss``'s autograd graph was built from."""
    return {id(leaf) for leaf in leaf_tensors(loss)}


def reaches(loss, params):
    """Whether the autograd graph of ``loss`` leads to any of ``params``."""
    return not leaves(loss).isdisjoint(id(p) for p in params)


def gradients(loss, params, retain_graph=None):
    """The gradient of ``loss`` for each of ``params``: None for a parameter it does not
    reach (all None when it needs no gradient)."""
    if not params:
        return []
    if not loss.requires_grad:
        return [None] * len(params)
    return list(torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain_graph))


def with_zero_gradients(loss, module):
    """``loss``, plus 0 with a zero gradient for each parameter of ``module`` that it does
    not reach, under :mod:`torch.distributed`: ``DistributedDataParallel`` stops at the next
    step when a parameter of the module it wraps got no gradient (conditionals that integrate
    the latents out never use the guide). One process gets ``loss`` itself."""
    if not (
        loss.requires_grad
        and isinstance(module, torch.nn.Module)
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        return loss
    reached = leaves(loss)
    unreached = [p for p in module.parameters() if p.requires_grad and id(p) not in reached]
    # An empty slice sums to exactly 0 whatever the values, and its gradient is zeros.
    return sum((p.reshape(-1)[:0].sum() for p in unreached), loss)
