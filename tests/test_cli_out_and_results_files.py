"""Files the ``pyro-mpt`` commands cannot use are refused before any work, with status 2, one
line naming the option or file and the fix, and nothing created or written: an ``--out``
folder that cannot be made (checked before ``reproduce`` runs, whose results would otherwise
be lost at its end) and a result JSON that ``render-results`` cannot decode or cannot find."""

import os
import shutil
from pathlib import Path

import pytest

from experiments import render
from pyro_mpt.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIX = "choose a folder that can be created and written, e.g. --out results"


def _tree(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert info.value.code == 2
    assert captured.out == ""  # the experiment did not start
    return captured.err.strip().splitlines()[-1]


def test_out_below_a_file_is_refused_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny.py").write_text("")
    error = _refused(["reproduce", "ppca-curve", "--smoke", "--out", "tiny.py/sub"], capsys)
    assert error == (
        f"pyro-mpt reproduce: error: --out 'tiny.py/sub': 'tiny.py' is a file, not a folder; {FIX}"
    )
    assert _tree(tmp_path) == ["tiny.py"]


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "results"
    out.write_text("not a folder")
    error = _refused(["reproduce", "ppca-curve", "--smoke", "--out", str(out)], capsys)
    assert f"--out {str(out)!r}: {str(out)!r} is a file, not a folder; {FIX}" in error
    assert out.read_text() == "not a folder"


@pytest.mark.parametrize("out", ["", " "])
def test_out_that_names_no_folder_is_refused(tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    error = _refused(["reproduce", "ppca-curve", "--smoke", "--out", out], capsys)
    assert error == f"pyro-mpt reproduce: error: --out {out!r} names no folder; {FIX}"
    assert _tree(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_out_that_cannot_be_created_is_refused(capsys):
    out = "/proc/pyro-mpt-nope/x"
    error = _refused(["reproduce", "ppca-curve", "--smoke", "--out", out], capsys)
    assert error == (
        f"pyro-mpt reproduce: error: --out {out!r} cannot be created or written: No such file "
        f"or directory (/proc/pyro-mpt-nope); {FIX}"
    )
    assert not os.path.exists("/proc/pyro-mpt-nope")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_out_in_a_read_only_folder_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        error = _refused(
            ["reproduce", "ppca-curve", "--smoke", "--out", str(locked / "a" / "b")], capsys
        )
        assert "cannot be created or written: Permission denied" in error
        assert _tree(locked) == []
    finally:
        locked.chmod(0o700)


def test_new_nested_out_is_checked_without_leaving_folders(tmp_path, monkeypatch, capsys):
    """A good ``--out`` passes the check, which removes the folders it made: the experiment
    (here one that fails at once) is what creates them."""
    import experiments

    calls = []

    class Experiment:
        @staticmethod
        def run(out_dir, **kwargs):
            calls.append(out_dir)
            assert not os.path.exists(out_dir)
            raise RuntimeError("stop")

    monkeypatch.setattr(experiments, "get_experiment", lambda name: Experiment)
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError, match="stop"):
        main(["reproduce", "ppca-curve", "--smoke", "--no-progress", "--out", str(out)])
    assert calls == [str(out)]
    assert _tree(tmp_path) == []


@pytest.fixture
def checkout(tmp_path):
    """A copy of the documents and the result files the tables are rendered from."""
    shutil.copy(ROOT / "README.md", tmp_path)
    (tmp_path / "docs").mkdir()
    for page in (ROOT / "docs").glob("*.rst"):
        shutil.copy(page, tmp_path / "docs")
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def _snapshot(root):
    return {p: p.read_bytes() for p in [root / "README.md", *sorted(root.glob("docs/*.rst"))]}


def test_render_results_names_a_corrupt_result_file_and_writes_nothing(checkout, capsys):
    # mlm-generation.json is rendered into docs/cli.rst only, after the README, whose table
    # is made stale here: nothing may be written before the corrupt file is found.
    readme = checkout / "README.md"
    text = readme.read_text()
    start = text.index("<!-- results:ppca-table1 -->\n") + len("<!-- results:ppca-table1 -->\n")
    readme.write_text(text[:start] + "a stale table\n" + text[start:])
    corrupt = checkout / "docs" / "results" / "mlm-generation.json"
    corrupt.write_text('{"config": {"seed": 0,')
    before = _snapshot(checkout)
    assert main(["render-results", "--root", str(checkout)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: {corrupt} is not valid JSON (Expecting ")
    assert captured.err.endswith(
        "; write it again with `pyro-mpt render-results --rerun mlm-generation`.\n"
    )
    assert _snapshot(checkout) == before


def test_render_results_names_a_corrupt_manifest(checkout, capsys):
    manifest = checkout / "docs" / "results" / "manifest.json"
    manifest.write_text("")
    before = _snapshot(checkout)
    for argv in (["--check"], ["--rerun", "ppca-table1"]):  # --rerun stops before running
        assert main(["render-results", "--root", str(checkout), *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (
            f"error: {manifest} is not valid JSON (Expecting value: line 1 column 1 (char 0)); "
            "write it again with `pyro-mpt render-results --rerun` (each source records its "
            "entry), or restore the committed copy.\n"
        )
    assert manifest.read_text() == ""
    assert _snapshot(checkout) == before


def test_render_results_refuses_an_unknown_source_before_rerunning_any(checkout, capsys):
    before = _snapshot(checkout)
    argv = ["render-results", "--root", str(checkout), "--rerun", "ppca-table1", "nosuch"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("--rerun nosuch: no such result source; choose from ")
    assert "ppca-table1" in captured.err
    assert _snapshot(checkout) == before


@pytest.mark.parametrize(
    "run",
    [
        lambda argv: main(["render-results", *argv]),
        render.main,  # python -m experiments.render
    ],
    ids=["pyro-mpt", "experiments.render"],
)
@pytest.mark.parametrize("check", [False, True], ids=["render", "check"])
def test_a_missing_result_file_is_named_with_the_command_that_writes_it(
    checkout, capsys, run, check
):
    # mlm-generation.json is rendered into docs/cli.rst only, after the README, whose table
    # is made stale here: nothing may be written before the missing file is found.
    readme = checkout / "README.md"
    text = readme.read_text()
    start = text.index("<!-- results:ppca-table1 -->\n") + len("<!-- results:ppca-table1 -->\n")
    readme.write_text(text[:start] + "a stale table\n" + text[start:])
    missing = checkout / "docs" / "results" / "mlm-generation.json"
    missing.unlink()
    before = _snapshot(checkout)
    assert run(["--root", str(checkout)] + (["--check"] if check else [])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: {missing} is missing; write it with "
        "`pyro-mpt render-results --rerun mlm-generation`.\n"
    )
    assert _snapshot(checkout) == before
    assert not missing.exists()
