"""A model's structure remembered between calls, so that strategies which run the model at
points run it once per step."""

import math

import torch

from pyro_mpt.errors import NotApplicableError, StaleStructureError
from pyro_mpt.trace.model_structure import read_structure
from pyro_mpt.trace.trace_utils import same_random_state

__all__ = ["RememberedStructure", "call_signature", "described", "same"]


class _Same:
    """An object compared by identity, and kept alive, so that a signature holding it is
    never equal to one of a later object that reuses its ``id``."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self):
        return id(self.value)


#: ``same(value)``: ``value`` wrapped to compare by identity (and kept alive) in a call
#: signature (the class itself, so that wrapping is one call).
same = _Same


def described(value):
    """How a call signature holds an argument: a tensor by its shape, dtype and device; a
    dict, list or tuple by what it holds, so that a fresh container per mini-batch (a batch
    as a dict of tensors) is the same call; anything else by identity."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if type(value) is dict:
        return ("dict", tuple((key, described(item)) for key, item in value.items()))
    if type(value) in (list, tuple):
        return (type(value).__name__, tuple(described(item) for item in value))
    return ("object", _Same(value))


def call_signature(model, args, kwargs, max_plate_nesting):
    """What must not change for a model's structure to stand: the model (a function, or a
    method and its object) and its arguments as :func:`described` holds them."""

    # Plain loops, tensors inline: this runs on every step.
    signature = []
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            signature.append(("tensor", tuple(value.shape), value.dtype, value.device))
        else:
            signature.append(described(value))
    named = sorted(zip(kwargs, signature[len(args) :]))
    return (
        _Same(getattr(model, "__func__", model)),
        _Same(getattr(model, "__self__", None)),
        tuple(signature[: len(args)]),
        tuple(named),
        max_plate_nesting,
    )


class RememberedStructure:
    """The :class:`ModelStructure` of the last model a strategy read, so that later calls
    with the same model and argument shapes run the model once (at the points) instead of
    twice. The structure is read without touching the random state, so seeded calls draw
    the same numbers on the first call and on later ones."""

    def __init__(self):
        self._signature = None
        self._structure = None

    def get(self, model, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """The structure of ``model`` on these arguments, read again only when the call's
        signature changed.

        :param signature: ``call_signature(model, args, kwargs, max_plate_nesting)`` when the
            caller has it already (it is worked out here otherwise).
        """
        if signature is None:
            signature = call_signature(model, args, kwargs, max_plate_nesting)
        if signature != self._signature:
            # No graph: the remembered trace must not keep the first call's tensors alive.
            with same_random_state(), torch.no_grad():
                structure = read_structure(model, args, kwargs, max_plate_nesting)
            self._structure = structure
        # The caller's signature from now on: a caller that passes the same object again
        # finds the structure by identity, with no comparison of its parts.
        self._signature = signature
        return self._structure

    def prepared(self, strategy, model, guide, args, kwargs, max_plate_nesting, signature=None):
        """``strategy.prepare_with(structure, ...)`` with the structure of this call (see
        :meth:`get`). A structure kept from an earlier call that the model no longer matches
        (:class:`~pyro_mpt.errors.StaleStructureError`, or a ``ValueError`` such as a site
        that ``obs_mask`` added) is read again once, and a genuine error repeats on the fresh
        read; a structure the strategy refuses is forgotten (the model may be changed before
        the next call)."""
        if signature is None:
            signature = call_signature(model, args, kwargs, max_plate_nesting)
        kept = signature == self._signature
        structure = self.get(model, args, kwargs, max_plate_nesting, signature)
        try:
            return strategy.prepare_with(structure, model, guide, args, kwargs)
        except NotApplicableError:
            self.forget()
            raise
        except (StaleStructureError, ValueError):
            if not kept:
                raise
        self.forget()
        structure = self.get(model, args, kwargs, max_plate_nesting, signature)
        return strategy.prepare_with(structure, model, guide, args, kwargs)

    def __getstate__(self):
        # A copy (pickled for a spawned process) reads its model afresh: a trace holds
        # the model's own objects, which need not pickle.
        return {"_signature": None, "_structure": None}

    def forget(self):
        """Drops the remembered structure (one a strategy could not use: the model may be
        changed before the next call, under the same argument shapes)."""
        self._signature = self._structure = None

    def held(self, signature):
        """The structure read for ``signature``, the very object last passed to :meth:`get`
        (found by identity, with no comparison); None for any other."""
        return self._structure if signature is self._signature else None
