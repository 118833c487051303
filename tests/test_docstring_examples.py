"""Every ``>>>`` example in the package's docstrings runs as a user would run it (float32,
a fresh param store, a fixed seed) and prints what the docstring says it prints.

Each docstring is run on its own: Pyro's param store is global, so an example that ran
before another (a ``pyro.param("loc", ...)`` of another size) would otherwise break it. No
example is skipped (``# doctest: +SKIP`` fails here): one that cannot run offline is not an
example a user can follow."""

import doctest
import importlib
import importlib.util
import pkgutil

import pyro
import pytest
import torch

import pyro_mpt

#: Modules kept only as deprecated aliases of others: their docstrings are the others'.
_ALIASES = {"pyro_mpt.infer"}
#: Modules that need an optional extra (``pyro_mpt[transformers]``).
_NEEDS = {"pyro_mpt.transformers": "transformers"}


def _modules(package=pyro_mpt):
    """The names of ``package`` and of every module below it, aliases left out (a package
    is imported to be walked, and an alias warns when imported)."""
    names = [package.__name__]
    for info in pkgutil.iter_modules(package.__path__, prefix=package.__name__ + "."):
        if info.name in _ALIASES:
            continue
        if info.ispkg:
            names += _modules(importlib.import_module(info.name))
        else:
            names.append(info.name)
    return names


def _examples():
    """``(id, module name, test name)`` of every docstring that holds an example."""
    found = []
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in _modules():
        extra = next((pkg for prefix, pkg in _NEEDS.items() if name.startswith(prefix)), None)
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue
        module = importlib.import_module(name)
        for test in finder.find(module):
            # DocTestFinder leaves out what a module imports from another: found there.
            if not test.examples:
                continue
            marks = ()
            needs_antiberty = any("load_antiberty" in ex.source for ex in test.examples)
            if needs_antiberty and importlib.util.find_spec("antiberty") is None:
                marks = pytest.mark.skip(reason="needs antiberty (pip install antiberty)")
            found.append(pytest.param(name, test.name, id=test.name, marks=marks))
    return found


def _find(module_name, test_name):
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module)
    return next(test for test in tests if test.name == test_name)


def test_some_examples_are_found():
    # A finder that found nothing would pass every test below by running none.
    assert len(_examples()) >= 25


@pytest.mark.parametrize("module_name, test_name", _examples())
def test_docstring_example_runs_as_written(module_name, test_name):
    test = _find(module_name, test_name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as a user runs it
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    report = []
    try:
        runner.run(test, out=report.append, clear_globs=True)
    finally:
        torch.set_default_dtype(dtype)
        pyro.clear_param_store()
    assert runner.failures == 0, "".join(report)
    assert runner.tries == len(test.examples)
