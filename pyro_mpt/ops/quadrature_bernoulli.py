"""Quadrature conditionals of binary data under ``Bernoulli(logits)`` shared by every
observation (image models): one product over the nodes serves both values of a pixel, and
confidently mispredicted values are computed exactly. Falls back to the two-value table of
:mod:`pyro_mpt.ops.quadrature_tabulated` where that would lose accuracy. The derivation is
in :ref:`theory-quadrature`.

This module is pure tensor code: no Pyro effects.
"""

import math
from typing import NamedTuple

import torch

from pyro_mpt.ops.bernoulli import log_sigmoid
from pyro_mpt.ops.floored_exp import exact_where, floor_margin, gemm_safe_floor, log_sum_exp
from pyro_mpt.ops.quadrature_tabulated import (
    floored_node_posterior,
    table_conditionals_backward,
    table_conditionals_forward,
)

__all__ = ["bernoulli_log_conditionals", "bernoulli_log_table"]

#: A conditional ``1 - T`` below this is computed exactly instead.
_COMPLEMENT_FLOOR = 1.0 / 64
#: The largest fraction of entries computed exactly before the two-value table takes over.
_MAX_EXACT_FRACTION = 1.0 / 64


def _bernoulli_table(logits):
    """``(table, sigmoid(eta))``: the table ``(G, 2, D)`` of :func:`bernoulli_log_table`,
    without autograd."""
    table = logits.new_empty(logits.shape[:-1] + (2,) + logits.shape[-1:])
    log_zero, log_one = table.unbind(-2)
    values, probs = log_sigmoid(logits)
    log_one.copy_(values)
    torch.sub(log_one, logits, out=log_zero)
    return table, probs


def _bernoulli_logits_grad(grad_zero, grad_one, probs):
    """The gradient of the logits from those of ``log p(0 | eta)`` and ``log p(1 | eta)``:
    ``dL1/deta = 1 - sigmoid(eta)`` and ``dL0/deta = -sigmoid(eta)``."""
    total = (grad_zero + grad_one).mul_(probs)
    return torch.sub(grad_one, total, out=total)


class _BernoulliLogTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        table, probs = _bernoulli_table(logits)
        ctx.save_for_backward(probs)
        return table

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _bernoulli_logits_grad(*grad.unbind(-2), *ctx.saved_tensors)


def bernoulli_log_table(logits):
    """The table of :func:`~pyro_mpt.ops.quadrature_tabulated.tabulated_log_conditionals`
    for ``Bernoulli(logits=eta)``:

    .. math::

        L_{g1j} = \\log \\sigma(\\eta_{gj}), \\qquad
        L_{g0j} = \\log \\sigma(\\eta_{gj}) - \\eta_{gj}.

    :param torch.Tensor logits: ``eta``, shape ``(G, D)``.
    :returns: a tensor of shape ``(G, 2, D)``, differentiable in ``logits``.
    """
    return _BernoulliLogTable.apply(logits)


def _may_read(tensor):
    """Whether a path may be chosen by reading ``tensor``'s values: on the CPU only, where
    the read waits for no device."""
    return tensor.device.type == "cpu"


class _Orientation(NamedTuple):
    """The value ``o_j`` most rows observe at each feature, and the likelihood of it."""

    signs: torch.Tensor  # 2 o_j - 1, (D,)
    likelihood: torch.Tensor  # F = p(x_j = o_j | z_g) = sigmoid((2 o_j - 1) eta_gj), (G, D)
    agreement: torch.Tensor  # +1 where x_rj = o_j, else -1, (R, D)
    disagreement: torch.Tensor  # [x_rj != o_j], (R, D)


def _orient(logits, ones):
    """The :class:`_Orientation` of the rows, the signed logits ``s = (2 o - 1) eta`` and
    the log-likelihoods ``log p(o_j | z_g) = log sigmoid(s)`` at the nodes, ``(G, D)`` each,
    and whether some ``F`` may be below the floor of :mod:`pyro_mpt.ops.floored_exp`.

    On the CPU the smallest ``s`` is read (no device to wait for): ``log(sigmoid)`` is used
    where ``sigmoid`` stays a normal number (see :func:`pyro_mpt.ops.bernoulli.log_sigmoid`)
    and the floor only where some ``F`` may be below it. Elsewhere nothing is read back:
    ``logsigmoid``, and the floor always applies (it leaves larger values as they are)."""
    signs = (ones.sum(0) * 2 >= ones.shape[0]).to(logits.dtype).mul_(2).sub_(1)  # (D,)
    signed_logits = logits * signs
    likelihood = torch.sigmoid(signed_logits)
    if _may_read(logits):
        lowest = float(signed_logits.min()) if signed_logits.numel() else 0.0
        if lowest > math.log(torch.finfo(logits.dtype).tiny) + 8:
            log_agree = likelihood.log()
        else:
            log_agree = torch.nn.functional.logsigmoid(signed_logits)
        # sigmoid(l) >= exp(l) / 2: below the floor only where l < log(floor) + log(2).
        needs_floor = lowest < math.log(gemm_safe_floor(logits.dtype)) + 1
    else:
        log_agree, needs_floor = torch.nn.functional.logsigmoid(signed_logits), True
    # Arithmetic rather than boolean selections, which are slow on CPUs.
    agreement = torch.mul(ones, 2 * signs).sub_(signs)
    disagreement = torch.sub(1, agreement).mul_(0.5)
    orientation = _Orientation(signs, likelihood, agreement, disagreement)
    return orientation, signed_logits, log_agree, needs_floor


class _OrientedSaved(NamedTuple):
    """What the backward pass of the one-product path needs (``k`` exact entries)."""

    slope: torch.Tensor  # sigmoid(eta) sigmoid(-eta), (G, D)
    numerator: torch.Tensor  # p(x_rj | x_R), (R, D)
    index: torch.Tensor  # flat indices of the exact entries, (k,)
    node_share: torch.Tensor  # p(z_g | x_R, x_rj) at the exact entries, (k, G)
    other: torch.Tensor  # p(1 - x_rj | z_g) at the exact entries, (k, G)


def _oriented_forward(logits, posterior, orientation, needs_floor=True):
    """The forward pass with one product over the nodes (see the module notes), or ``None``
    when the two-value table must take over.

    :param logits: ``eta``, shape ``(G, D)``.
    :param posterior: the node posterior ``(R, G)``, floored.
    :param _Orientation orientation: its likelihood is floored in place.
    :param bool needs_floor: whether some of that likelihood may be below the floor.
    :returns: ``(log p(x_rj | x_R), _OrientedSaved)``.
    """
    signs, likelihood, agreement, disagreement = orientation
    num_features = likelihood.shape[-1]
    floor = gemm_safe_floor(logits.dtype)
    # sigmoid(eta) sigmoid(-eta) = F (1 - F): exact to F's rounding error in absolute
    # terms, which is all the gradient it scales needs.
    slope = torch.addcmul(likelihood, likelihood, likelihood, value=-1)
    if needs_floor:
        torch.nn.functional.threshold_(likelihood, floor, 0.0)
    total = posterior @ likelihood  # T, (R, D)
    numerator = torch.addcmul(disagreement, total, agreement)  # T or 1 - T
    # Entries below 1/64: exact where x_rj != o_j; with x_rj = o_j, fine above the floors.
    index = (numerator < _COMPLEMENT_FLOOR).flatten().nonzero().squeeze(-1)
    if index.numel() > _MAX_EXACT_FRACTION * numerator.numel():
        return None
    unmatched = disagreement.flatten()[index] > 0
    if bool((numerator.flatten()[index[~unmatched]] < math.sqrt(floor)).any()):
        return None  # a conditional near the floors
    index = index[unmatched]
    # The exact entries: p(x_rj | z_g) and p(1 - x_rj | z_g), (k, G) each.
    rows, cols = index // num_features, index % num_features
    signed_logits = logits.index_select(1, cols).mul_(signs[cols]).T
    observed, other = torch.sigmoid(-signed_logits), torch.sigmoid(signed_logits)
    node_share = observed.mul_(posterior[rows])
    conditional = node_share.sum(-1)
    if bool((conditional < math.sqrt(floor)).any()):
        return None
    node_share.div_(conditional.unsqueeze(-1))  # p(z_g | x_R, x_rj)
    numerator.view(-1)[index] = conditional
    return numerator.log(), _OrientedSaved(slope, numerator, index, node_share, other)


def _oriented_backward(grad, posterior, orientation, saved):
    """``(node_grad, logits_grad)``: the gradient of the log joint ``a`` ``(R, G)``, and that
    of the logits through ``p(x | z)`` ``(G, D)`` divided by the signs ``2 o - 1``, from
    :func:`_oriented_forward`'s tensors."""
    signs, likelihood, agreement, disagreement = orientation
    slope, numerator, index, node_share, other = saved
    num_features = grad.shape[-1]
    ratio = grad / numerator  # h = g / p(x_rj | x_R)
    ratio.view(-1)[index] = 0  # exact entries are added below
    # sum_j h_rj p(x_rj | z_g) = sum_j (+-h_rj) F_gj + sum over unmatched j of h_rj.
    offset = (ratio * disagreement).sum(-1, keepdim=True).sub_(grad.sum(-1, keepdim=True))
    signed = ratio.mul_(agreement)
    node_grad = torch.addmm(offset, signed, likelihood.T).mul_(posterior)
    rows, cols = index // num_features, index % num_features
    exact_grad = grad.flatten()[index].unsqueeze(-1)  # (k, 1)
    node_grad.index_add_(0, rows, exact_grad * node_share)
    # d p(x | eta) / d eta = (2x - 1) sigmoid(eta) sigmoid(-eta), 2x - 1 = +-(2 o - 1).
    logits_grad = (posterior.T @ signed).mul_(slope)
    # The exact entries have x_rj = 1 - o_j: 2x - 1 = -(2 o_j - 1).
    exact_slope = (exact_grad * node_share).mul_(other).neg_()
    logits_grad.index_add_(1, cols, exact_slope.T)
    return node_grad, logits_grad


def _signed_table_grad(grad_agree, grad_disagree, orientation):
    """The gradient of the signed logits ``s = (2 o - 1) eta`` from those of
    ``log p(o_j | z) = log sigmoid(s)`` and ``log p(1 - o_j | z) = log sigmoid(s) - s``
    ``(G, D)``: ``1 - F`` and ``-F``; ``grad_agree`` is overwritten."""
    total = grad_agree + grad_disagree
    return grad_agree.addcmul_(total, orientation.likelihood, value=-1)


class _BernoulliConditionals(torch.autograd.Function):
    """:func:`bernoulli_log_conditionals` on rows, with hand-written backward passes.

    Everything runs in the layout of the :class:`_Orientation`: the table's two values are
    ``o_j`` and ``1 - o_j``. The log joint is ``a = log w + c L_o^T - (c [x != o]) s^T``
    (as ``log p(1 - o | z) = log p(o | z) - s``).

    On the CPU the second product runs only over the features where some row disagrees with
    ``o`` (image borders are blank in every row), and the one-product path is taken unless
    it would lose accuracy, both decided by reading the data (no device to wait for).
    Elsewhere nothing is read back: the second product runs over every feature and the
    two-value table always serves, the same conditionals to rounding."""

    @staticmethod
    def forward(ctx, log_weights, logits, ones, context):
        orientation, signed_logits, log_agree, needs_floor = _orient(logits, ones)
        weight_disagree = context * orientation.disagreement
        on_cpu = _may_read(logits)
        log_joint = torch.addmm(log_weights, context, log_agree.T)
        if on_cpu:
            active = weight_disagree.any(0).nonzero().squeeze(-1)  # features some row disagrees
            weight_disagree = weight_disagree.index_select(1, active)
            log_joint.addmm_(weight_disagree, signed_logits.index_select(1, active).T, alpha=-1)
        else:
            active = None
            log_joint.addmm_(weight_disagree, signed_logits.T, alpha=-1)
        posterior = floored_node_posterior(log_joint)
        result = _oriented_forward(logits, posterior, orientation, needs_floor) if on_cpu else None
        ctx.oriented = result is not None
        if not ctx.oriented:
            table = torch.cat([log_agree, log_agree - signed_logits], -1)  # (G, 2D)
            disagreement = orientation.disagreement
            oriented_onehot = torch.stack([1 - disagreement, disagreement], 1)
            result = table_conditionals_forward(posterior, table, oriented_onehot, overwrite=True)
        out, saved = result
        ctx.save_for_backward(context, weight_disagree, active, posterior, *orientation, *saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        context, weight_disagree, active, posterior, *saved = ctx.saved_tensors
        orientation, saved = _Orientation(*saved[:4]), saved[4:]
        if not ctx.oriented:
            disagree = context * orientation.disagreement
            weighted = torch.cat([context - disagree, disagree], -1)
            table_grad = table_conditionals_backward(grad, weighted, posterior, *saved)
            grad_agree, grad_disagree = table_grad.unflatten(-1, (2, -1)).unbind(-2)
            signed_grad = _signed_table_grad(grad_agree, grad_disagree, orientation)
        else:
            saved = _OrientedSaved(*saved)
            node_grad, signed_grad = _oriented_backward(grad, posterior, orientation, saved)
            # The context sums: d a / d s = c (1 - F) - c [x != o].
            context_grad = node_grad.T @ context
            signed_grad.add_(context_grad).addcmul_(context_grad, orientation.likelihood, value=-1)
            signed_grad.index_add_(1, active, node_grad.T @ weight_disagree, alpha=-1)
        return None, signed_grad.mul_(orientation.signs), None, None


def bernoulli_log_conditionals(log_weights, logits, data, context):
    """:func:`~pyro_mpt.ops.quadrature_tabulated.tabulated_log_conditionals` with the
    table :func:`bernoulli_log_table` ``(logits)``, for binary data under
    ``Bernoulli(logits=eta)`` shared by every observation. The table is built inside, the
    gradient goes to the logits directly, and the sums over nodes take three matrix
    products of size ``(R, D) x (D, G)`` fewer than the table's (see the module notes).

    :param torch.Tensor log_weights: ``log w_g``, shape ``(G,)``; no gradient flows to it.
    :param torch.Tensor logits: ``eta``, shape ``(G, D)``.
    :param torch.Tensor data: the observations, zeros and ones, shape ``batch + (D,)``.
    :param torch.Tensor context: 1/True at observed features, ``(P,) + batch + (D,)``.
    :returns: ``log p(x_j | x_R)``, shape ``(P,) + batch + (D,)``.
    """
    dtype, num_features = logits.dtype, context.shape[-1]
    shape = torch.broadcast_shapes(context.shape[:-1], (1,) + data.shape[:-1])
    rows = shape + (num_features,)
    context = context.to(dtype).expand(rows).reshape(-1, num_features)
    ones = data.to(dtype).expand(rows).reshape(-1, num_features)
    log_weights = log_weights.detach()
    out = _BernoulliConditionals.apply(log_weights, logits, ones, context)
    # The posterior sums to one: the floors move a conditional by less than the margin
    # (see floor_margin) unless it is that close to them, and those are computed exactly.
    # The best node's log p(x_j | z_g), from the largest and smallest logits (log sigmoid
    # is increasing): no pass over the (G, D) table unless some entry is near the floors.
    logsigmoid = torch.nn.functional.logsigmoid
    best_one, best_zero = logsigmoid(logits.amax(0)), logsigmoid(-logits.amin(0))
    shift = torch.lerp(best_zero, best_one, ones)  # (R, D)
    margin = out - shift - math.log(floor_margin(dtype, logits.shape[0]))

    def exact(index):
        rows, features = index
        log_one, log_zero = logsigmoid(logits), logsigmoid(-logits)  # (G, D)
        observed_ones, seen = ones[rows], context[rows]
        log_joint = torch.addmm(log_weights, seen * observed_ones, log_one.T)
        log_joint = log_joint.addmm(seen * (1 - observed_ones), log_zero.T)
        value = ones[rows, features].unsqueeze(-1)
        observed = torch.lerp(log_zero[:, features].T, log_one[:, features].T, value)
        return log_sum_exp(log_joint + observed) - log_sum_exp(log_joint)

    return exact_where(margin, out, exact).reshape(rows)
