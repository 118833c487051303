"""Deprecated: the Gaussian form that exact conditionals read off a model now lives with
its strategy, in :mod:`pyro_mpt.conditionals.exact`. Any name looked up here warns once
(``DeprecationWarning``) and is that module's very object."""

import importlib
import warnings

__all__ = []

_NEW = "pyro_mpt.conditionals.exact"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    # Imported on use: this package may not import the strategies when it loads.
    value = getattr(importlib.import_module(_NEW), name)
    warnings.warn(
        f"pyro_mpt.trace.gaussian_form.{name} moved to {_NEW}.{name}; import it from there. "
        f"The old path will be removed.",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
