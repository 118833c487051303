"""The dtype check of the data the ready models are given: in a model whose prior is built
like its data (``x.new_zeros``), integer data or data of another floating dtype than the
parameters fail deep inside torch, with no word of the fix."""

import torch

__all__ = ["check_data_dtype"]


def check_data_dtype(x, module):
    """Raises ``TypeError`` unless ``x`` is floating with the dtype of ``module``'s
    parameters, naming both and the conversion that fixes it."""
    parameter = next(module.parameters(), None)
    if not torch.is_tensor(x) or parameter is None:
        return
    name = type(module).__name__
    if not x.is_floating_point():
        raise TypeError(
            f"{name} takes floating data, got x of dtype {x.dtype}; convert it first, e.g. "
            f"x = x.to({parameter.dtype})."
        )
    if x.dtype != parameter.dtype:
        raise TypeError(
            f"x is {x.dtype} but the parameters of {name} are {parameter.dtype}: convert one "
            f"to the other, x = x.to({parameter.dtype}) or model.to({x.dtype})."
        )
