"""The check, as a model is built, that Pyro's global param store holds none of its
parameters' names with another shape.

A ``PyroModule`` takes its parameters from the store by name (unless
``pyro.settings.set(module_local_params=True)``), so a model built after another of the
same names shares the stored values: the documented behaviour where the shapes agree. Where
they differ (a ``VAE`` with 30 features after one with 20) the model cannot run, and the
error it would give deep inside its first call names the data instead (a shape that does
not broadcast); this check names the parameter and the fix before anything runs.
"""

import pyro
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name

__all__ = ["check_stored_shapes"]


def _own_parameters(model, registered):
    """``{store name: unconstrained tensor}`` of ``model``'s ``PyroParam`` s (its own and
    those of the ``PyroModule`` s inside it) and of the modules it registers with
    ``pyro.module`` (``registered``: ``(name, module)`` pairs)."""
    own = {}
    for prefix, module in model.named_modules():
        if isinstance(module, PyroModule):
            for name in module._pyro_params:
                store_name = f"{prefix}.{name}" if prefix else name
                own[store_name] = getattr(module, name + "_unconstrained")
    for module_name, module in registered:
        for name, value in module.named_parameters():
            own[param_with_module_name(module_name, name)] = value
    return own


def check_stored_shapes(model, registered=()):
    """Raises ``ValueError`` when Pyro's param store holds a parameter under the name of one
    of ``model``'s with another shape (see the module's notes); nothing to check with
    module-local parameters.

    :param registered: ``(name, module)`` pairs of the modules that ``model`` registers with
        ``pyro.module`` (a GPyTorch kernel).
    """
    if pyro.settings.get("module_local_params"):
        return
    store = pyro.get_param_store()
    for name, value in _own_parameters(model, registered).items():
        if name not in store:
            continue
        stored = store.get_param(name).unconstrained()
        if stored.shape != value.shape:
            raise ValueError(
                f"Pyro's param store already holds a parameter {name!r} of shape "
                f"{tuple(stored.shape)}, from a model built before; this "
                f"{type(model).__name__}'s is {tuple(value.shape)}. A PyroModule takes its "
                f"parameters from the store by name, so it could not run. Call "
                f"pyro.clear_param_store() before building it, or "
                f"pyro.settings.set(module_local_params=True) to keep each model's parameters "
                f"in the model."
            )
