"""Deprecated name of :mod:`pyro_mpt.trace`, kept so that old imports keep working.

Importing it warns once (``DeprecationWarning``) and registers every submodule of
:mod:`pyro_mpt.trace` under this name too, so ``pyro_mpt.infer.guided_model`` *is*
``pyro_mpt.trace.guided_model`` and the names imported from either are the same objects.
"""

import importlib
import pkgutil
import sys
import warnings

import pyro_mpt.trace as _new

__all__ = []

_OLD, _NEW = __name__, _new.__name__

# The submodules are registered before any `import pyro_mpt.infer.<name>` looks them up, so
# Python finds them in sys.modules and never loads a second copy of the same file.
for _info in pkgutil.iter_modules(_new.__path__):
    _module = importlib.import_module(f"{_NEW}.{_info.name}")
    sys.modules[f"{_OLD}.{_info.name}"] = _module
    globals()[_info.name] = _module

warnings.warn(
    f"{_OLD} was renamed {_NEW}; import from {_NEW} instead "
    f"(e.g. `from {_NEW}.trace_utils import latent_sites`). The old name will be removed.",
    DeprecationWarning,
    # Python skips its import machinery's frames, so this names the importing line.
    stacklevel=2,
)


def __getattr__(name):
    """Any other name of :mod:`pyro_mpt.trace`, looked up there."""
    return getattr(_new, name)
