"""The optional ``transformers`` dependency, imported with an install hint."""

import importlib

INSTALL_HINT = 'pip install "pyro-mpt[transformers]"'


def require(module_name):
    """Imports ``module_name`` (``"transformers"``, ``"tokenizers"``, ...) or raises an
    ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"pyro_mpt.transformers needs the optional package {module_name!r}, which is not "
            f"installed; install it with: {INSTALL_HINT}"
        ) from error
