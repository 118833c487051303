"""Counting the host reads made from ``pyro_mpt`` code: the calls that copy a tensor's values
to the host and so make the host wait for the device. Shared by the steady-step test and
``benchmarks/step_footprint.py``.

Counted: the tensor methods of :data:`READ_METHODS`, ``torch.equal``, ``torch.allclose``, the
factorisations of :data:`CHECKED_LINALG` (they read their error flag back) and indexing with
a boolean tensor, when the nearest caller outside torch is ``pyro_mpt`` (its
example models aside). Reads in the functions of :data:`CPU_ONLY` are not counted for CPU
tensors: they are branches taken for CPU tensors only, with no device to wait for.
"""

import collections
import contextlib
import os
import sys

import torch

import pyro_mpt

__all__ = ["CHECKED_LINALG", "CPU_ONLY", "PACKAGE_DIR", "READ_METHODS", "host_reads"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(pyro_mpt.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

#: Tensor methods that copy values to the host.
READ_METHODS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
)

#: ``torch.linalg`` functions that check their result on the host (their ``_ex`` forms and
#: the triangular solves do not).
CHECKED_LINALG = ("cholesky", "inv", "solve")

#: ``(file, function name)`` whose reads happen for CPU tensors only (NumPy's sort of CPU
#: keys, and the CPU fast paths of masks, masked sums, log sigmoid and Bernoulli quadrature,
#: the test for binary data that chooses it, and the search for sums near the floors).
CPU_ONLY = {
    ("conditionals/quadrature.py", "_is_binary"),
    ("ops/floored_exp.py", "exact_where"),
    ("ops/bernoulli.py", "log_sigmoid"),
    ("ops/quadrature_bernoulli.py", "_orient"),
    ("ops/quadrature_bernoulli.py", "forward"),
    ("ops/quadrature_bernoulli.py", "_oriented_forward"),
    ("ops/masks.py", "sort_rows"),
    ("ops/masks.py", "_masks_below_threshold"),
    ("ops/masks.py", "masks_of_sizes"),
    ("ops/masks.py", "masked_sum"),
}


def _caller(frame):
    """The nearest ``pyro_mpt`` frame (not its example models) that called into torch, or
    None when the call came from elsewhere."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE_DIR):
            if filename.startswith(os.path.join(PACKAGE_DIR, "models")):
                return None
            return frame
        if not filename.startswith(_TORCH_DIR):
            return None
        frame = frame.f_back
    return None


@contextlib.contextmanager
def host_reads():
    """Counts the host reads made from ``pyro_mpt`` in the block: yields a
    :class:`collections.Counter` of ``(file, function qualname, what, line)``."""
    reads = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}
    getitem, equal, allclose = torch.Tensor.__getitem__, torch.equal, torch.allclose

    def note(what, tensor):
        frame = _caller(sys._getframe(2))
        if frame is None:
            return
        code = frame.f_code
        name = code.co_filename[len(PACKAGE_DIR) :]
        if (name, code.co_name) in CPU_ONLY and tensor.device.type == "cpu":
            return
        reads[(name, code.co_qualname, what, frame.f_lineno)] += 1

    def patched(name):
        def method(self, *args, **kwargs):
            note(name, self)
            return originals[name](self, *args, **kwargs)

        return method

    def patched_getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(torch.is_tensor(i) and i.dtype == torch.bool for i in parts):
            note("boolean index", self)
        return getitem(self, index)

    def patched_equal(a, *args, **kwargs):
        note("torch.equal", a)
        return equal(a, *args, **kwargs)

    def patched_allclose(a, *args, **kwargs):
        note("torch.allclose", a)
        return allclose(a, *args, **kwargs)

    linalg = {name: getattr(torch.linalg, name) for name in CHECKED_LINALG}

    def patched_linalg(name):
        def function(a, *args, **kwargs):
            note(f"torch.linalg.{name}", a)
            return linalg[name](a, *args, **kwargs)

        return function

    for name in READ_METHODS:
        setattr(torch.Tensor, name, patched(name))
    for name in CHECKED_LINALG:
        setattr(torch.linalg, name, patched_linalg(name))
    torch.Tensor.__getitem__ = patched_getitem
    torch.equal, torch.allclose = patched_equal, patched_allclose
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in linalg.items():
            setattr(torch.linalg, name, original)
        torch.Tensor.__getitem__ = getitem
        torch.equal, torch.allclose = equal, allclose
