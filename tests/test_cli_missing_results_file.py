"""A result file missing from ``docs/results/`` is refused by ``pyro-mpt render-results`` and
``python -m experiments.render`` as a corrupt one is: status 2, one line naming the file and
the command that writes it, and no document written."""

import shutil
from pathlib import Path

import pytest

from experiments import render
from pyro_mpt.cli import main

ROOT = Path(__file__).resolve().parents[1]


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
