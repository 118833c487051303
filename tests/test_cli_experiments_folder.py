"""``pyro-mpt reproduce`` and ``render-results`` run the ``experiments/`` folder of a clone:
a copy of the package alone (as a wheel installs it) keeps ``--help`` and stops the two
commands with status 2 and the commands that get a clone; from inside a clone they run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A folder holding only a copy of ``pyro_mpt`` (no experiments beside it)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(
        ROOT / "pyro_mpt", site / "pyro_mpt", ignore=shutil.ignore_patterns("__pycache__")
    )
    return site


def _cli(site, cwd, *argv):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run(
        [sys.executable, "-m", "pyro_mpt.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_copy_imports_its_own_package(installed, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(installed))
    where = subprocess.run(
        [sys.executable, "-c", "import pyro_mpt; print(pyro_mpt.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where) == installed / "pyro_mpt" / "__init__.py"


def test_help_works_without_a_clone(installed, tmp_path):
    done = _cli(installed, tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert "reproduce" in done.stdout and "render-results" in done.stdout
    assert "clone" in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["reproduce", "--list"],
        ["reproduce", "ppca-table1", "--smoke"],
        ["render-results"],
        ["render-results", "--check", "--rerun", "ppca-table1"],
    ],
)
def test_without_a_clone_the_commands_say_how_to_get_one(installed, tmp_path, argv):
    done = _cli(installed, tmp_path, *argv)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: pyro-mpt {argv[0]}: ")
    assert "run from a clone of the repository (the folder that holds experiments/" in lines[0]
    assert "cd into it, pip install -e . there" in lines[0]
    assert not (tmp_path / "results").exists()


def test_unknown_options_are_still_refused_without_a_clone(installed, tmp_path):
    done = _cli(installed, tmp_path, "reproduce", "--bogus")
    assert done.returncode == 2
    assert "unrecognized arguments: --bogus" in done.stderr


def test_a_clone_is_found_from_a_folder_inside_it(installed):
    """The package copy lives elsewhere; the working directory is inside the clone."""
    done = _cli(installed, ROOT / "docs", "reproduce", "--list")
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names[0] == "ppca-table1"
    assert {"ppca-table1", "vae-deep", "gp-decoder", "bert-rates"} <= set(names)


def test_python_m_experiments_is_reproduce(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "experiments", "ppca-table1", "--smoke", "--no-progress"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pyro-mpt reproduce ppca-table1: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppca-table1.json", "ppca-table1.png"]
