"""Deprecated: the conditionals of a model run at quadrature nodes now live with their
strategy, in :mod:`pyro_mpt.conditionals.quadrature`. Any name looked up here warns
(``DeprecationWarning``) and is that module's very object."""

import warnings

from pyro_mpt.conditionals import quadrature as _new

__all__ = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(_new, name)
    warnings.warn(
        f"pyro_mpt.conditionals.quadrature_self_predictive.{name} moved to "
        f"pyro_mpt.conditionals.quadrature.{name}; import it from there. The old path will "
        f"be removed.",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
