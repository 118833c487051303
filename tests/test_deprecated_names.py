"""Old import paths that still work: ``pyro_mpt.infer`` (renamed ``pyro_mpt.trace``) warns
once and hands out the very objects of the new package, never a second copy."""

import importlib
import pathlib
import sys
import warnings

import pytest

import pyro_mpt
import pyro_mpt.trace

OLD, NEW = "pyro_mpt.infer", "pyro_mpt.trace"
#: The submodules of the new package, read off its folder (not through the alias).
SUBMODULES = sorted(
    path.stem
    for path in pathlib.Path(pyro_mpt.trace.__file__).parent.glob("*.py")
    if path.stem != "__init__"
)


@pytest.fixture
def fresh_old_name():
    """Forget any earlier import of the old name, so this test's import is the first; put
    ``sys.modules`` and the ``pyro_mpt`` attribute back as they were afterwards."""

    def old_entries():
        return {k: v for k, v in sys.modules.items() if k == OLD or k.startswith(OLD + ".")}

    saved_modules, saved_attr = old_entries(), pyro_mpt.__dict__.get("infer")
    for name in saved_modules:
        del sys.modules[name]
    pyro_mpt.__dict__.pop("infer", None)
    yield
    for name in old_entries():
        del sys.modules[name]
    sys.modules.update(saved_modules)
    pyro_mpt.__dict__.pop("infer", None)
    if saved_attr is not None:
        pyro_mpt.infer = saved_attr


def test_new_package_has_the_expected_submodules():
    # Guards the tests below against an empty or misplaced folder.
    assert {"guided_model", "trace_utils", "whitened_latents", "factors"} <= set(SUBMODULES)


def test_old_path_warns_once_naming_the_new_package(fresh_old_name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pyro_mpt.infer.guided_model  # noqa: F401
        from pyro_mpt.infer.trace_utils import latent_sites  # noqa: F401

        from pyro_mpt.infer import whitened_latents  # noqa: F401

        importlib.import_module(f"{OLD}.factors")
    ours = [w for w in caught if OLD in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    (warning,) = ours
    assert warning.category is DeprecationWarning
    assert f"{OLD} was renamed {NEW}" in str(warning.message)
    # The warning points at the line that imported the old name, not at import machinery.
    assert pathlib.Path(warning.filename).resolve() == pathlib.Path(__file__).resolve()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_old_and_new_names_give_the_same_objects(fresh_old_name):
    from pyro_mpt.infer.guided_model import GuidedModel, run_guided
    from pyro_mpt.infer.trace_utils import latent_sites

    from pyro_mpt.trace.guided_model import GuidedModel as new_guided_model
    from pyro_mpt.trace.guided_model import run_guided as new_run_guided
    from pyro_mpt.trace.trace_utils import latent_sites as new_latent_sites

    assert latent_sites is new_latent_sites
    assert GuidedModel is new_guided_model
    assert run_guided is new_run_guided

    import pyro_mpt.infer.whitened_latents

    assert pyro_mpt.infer.whitened_latents is pyro_mpt.trace.whitened_latents
    for name in SUBMODULES:
        old = importlib.import_module(f"{OLD}.{name}")
        new = importlib.import_module(f"{NEW}.{name}")
        assert old is new, name
        assert getattr(pyro_mpt.infer, name) is new, name
        assert old.__name__ == f"{NEW}.{name}", name


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_old_name_loads_no_second_copy_of_any_file(fresh_old_name):
    importlib.import_module(OLD)
    for name in SUBMODULES:
        importlib.import_module(f"{OLD}.{name}")
    folder = pathlib.Path(pyro_mpt.trace.__file__).parent.resolve()
    by_file = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and pathlib.Path(path).resolve().parent == folder:
            by_file.setdefault(pathlib.Path(path).stem, set()).add(id(module))
    # One module object per source file, however many names it is registered under.
    assert {stem: len(ids) for stem, ids in by_file.items()} == {
        stem: 1 for stem in ["__init__", *SUBMODULES]
    }


def test_old_importance_name_warns_and_builds_the_renamed_strategy():
    from pyro_mpt.conditionals import Importance, ImportanceSampling

    with pytest.warns(DeprecationWarning, match=r"renamed ImportanceSampling"):
        old = Importance(16, share_samples=True, num_proposals=2)
    assert isinstance(old, ImportanceSampling)
    assert repr(old) == repr(ImportanceSampling(16, share_samples=True, num_proposals=2))


def test_gaussian_form_names_moved_to_the_exact_strategy_warn_and_are_the_same_objects():
    from pyro_mpt.conditionals import exact

    with pytest.warns(DeprecationWarning, match="moved to pyro_mpt.conditionals.exact"):
        from pyro_mpt.trace.gaussian_form import GaussianForm, extract_gaussian_form
    assert GaussianForm is exact.GaussianForm
    assert extract_gaussian_form is exact.extract_gaussian_form
    with pytest.raises(ImportError, match="no_such_name"):
        from pyro_mpt.trace.gaussian_form import no_such_name  # noqa: F401


def test_quadrature_conditionals_moved_to_the_quadrature_strategy_warn_and_are_the_same():
    from pyro_mpt.conditionals import quadrature

    with pytest.warns(DeprecationWarning, match="moved to pyro_mpt.conditionals.quadrature"):
        from pyro_mpt.conditionals.quadrature_self_predictive import (
            quadrature_self_predictive,
        )
    assert quadrature_self_predictive is quadrature.quadrature_self_predictive
