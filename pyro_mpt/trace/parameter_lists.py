"""The parameters a loss step differentiates: the model's, and those of the guide alone,
found by tracing the two once per call and kept while the tensors they rest on stay the
same."""

import pyro
import pyro.poutine as poutine
import torch

from pyro_mpt.trace.trace_utils import same_random_state

__all__ = ["ParameterLists"]


class ParameterLists:
    """The unconstrained parameters of a model and of its guide, for the calls of one loss.

    A loss that gives the model and the guide different gradients (``MPTLoss`` with
    ``guide_loss="elbo"`` or ``"wake"``) needs the two lists at every step. Tracing both
    every step would run them twice more; the lists of a call are kept instead, and found
    again when the call differs (another model, guide or argument shapes: its key) or the
    tensors they rest on are no longer the same (:func:`_parameter_snapshot`: a parameter
    added, deleted or replaced, or a module swapped under ``module_local_params``).
    """

    def __init__(self):
        self._found = None
        self._offered = None

    def offer(self, key, traces):
        """``(guide_trace, model_trace)`` that the call ``key`` has traced already: the next
        :meth:`split` of that call reads their param sites instead of tracing again."""
        self._offered = (key, traces)

    def split(self, model, guide, args, kwargs, key):
        """The model's parameters, and the guide's that are not the model's, each of them
        that needs a gradient.

        :param key: what identifies the call (``MPTLoss``'s call key: the model, the guide
            and the argument shapes).
        :returns: ``(model_params, guide_params)``, two lists of tensors.
        """
        store = _parameter_snapshot(model, guide)
        found = self._found
        offered, self._offered = self._offered, None
        if found is None or found[0] != key or store is None or not _same_store(found[1], store):
            if offered is not None and offered[0] == key and guide is not None:
                guide_trace, model_trace = offered[1]
            else:
                with poutine.block(), torch.no_grad(), same_random_state():
                    guide_trace = poutine.trace(guide, param_only=True).get_trace(*args, **kwargs)
                    model_trace = poutine.trace(model, param_only=True).get_trace(*args, **kwargs)
            model_params = _unconstrained(model_trace)
            seen = {id(p) for p in model_params}
            guide_params = [p for p in _unconstrained(guide_trace) if id(p) not in seen]
            # The model and guide stay alive with the lists, so the ids in the key stay theirs.
            kept = (model, guide, tuple(v for v in args if not torch.is_tensor(v)))
            found = self._found = (key, store, model_params, guide_params, kept)
        return [p for p in found[2] if p.requires_grad], [p for p in found[3] if p.requires_grad]


def _parameter_snapshot(model, guide):
    """The ``(name, tensor)`` pairs that the parameter lists of a call rest on: Pyro's param
    store's and, under ``pyro.settings.set(module_local_params=True)``, where parameters live
    in their modules rather than the store, those of the modules that the model and the guide
    are (or are methods of): a module replaced between steps is found. ``None`` when in that
    mode the model or the guide is not such a module (its parameters cannot be seen): the
    lists are found again on every call."""
    store = tuple(pyro.get_param_store().named_parameters())
    if not pyro.settings.get("module_local_params"):
        return store
    modules = []
    for fn in (model, guide):
        owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        if not isinstance(owner, torch.nn.Module):
            return None
        if all(owner is not module for module in modules):
            modules.append(owner)
    return store + tuple(pair for module in modules for pair in module.named_parameters())


def _same_store(before, now):
    """Whether two snapshots of the param store's ``(name, tensor)`` pairs hold the same
    names and the very same tensors."""
    return len(before) == len(now) and all(
        a[0] == b[0] and a[1] is b[1] for a, b in zip(before, now)
    )


def _unconstrained(trace):
    """The unconstrained tensors behind a trace's param sites, each once, in order."""
    params = []
    for site in trace.nodes.values():
        if site["type"] == "param":
            value = site["value"]
            value = value.unconstrained() if hasattr(value, "unconstrained") else value
            if all(value is not p for p in params):
                params.append(value)
    return params
