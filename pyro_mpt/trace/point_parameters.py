"""The parameters of the observed distribution of a run at points, read as
``(Q,) + batch + (D,)`` with size-one dims where they are shared: a decoder's output at the
nodes stays one copy for every observation."""

import torch

from pyro_mpt.trace.trace_utils import flatten_tail, narrow_broadcast_dims

__all__ = ["point_parameter"]


def _unexpanded(tensor, num_dims):
    """The tensor that ``tensor`` was broadcast from, when it is a plain ``expand`` view (as
    plates make), left-padded to ``num_dims`` dims; else ``tensor``, padded.

    Narrowing a broadcast view would make autograd allocate the full broadcast shape in the
    backward pass; taking the view's base keeps the graph small.
    """
    base = tensor._base
    if base is not None and base.dim() <= tensor.dim():
        padded = base.reshape((1,) * (tensor.dim() - base.dim()) + base.shape)
        try:
            same = padded.expand(tensor.shape)
        except RuntimeError:
            same = None
        if (
            same is not None
            and same.stride() == tensor.stride()
            and same.data_ptr() == tensor.data_ptr()
        ):
            tensor = padded
    return tensor.reshape((1,) * (num_dims - tensor.dim()) + tensor.shape)


def point_parameter(param, fn, observed):
    """A parameter of the observed distribution of a :func:`run_at_points` run as
    ``(Q,) + batch + (D,)``, with dims of size 1 where it is the same for every point or
    every observation.

    :raises RuntimeError: if its shape does not broadcast to the observations.
    """
    full = fn.batch_shape + fn.event_shape
    num_lead = len(full) - observed.num_feature_dims
    param = _unexpanded(param, len(full))
    param = param.expand(param.shape[:num_lead] + full[num_lead:])
    param = narrow_broadcast_dims(param, num_lead)
    param = flatten_tail(param, observed.num_feature_dims)
    param = param.reshape(param.shape[:1] + param.shape[-1 - len(observed.batch_shape) :])
    target = (param.shape[0],) + observed.batch_shape + observed.value.shape[-1:]
    torch.broadcast_shapes(param.shape, target)
    return param
