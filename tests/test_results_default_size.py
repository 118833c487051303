"""Every experiment that ``pyro-mpt reproduce --list`` names has a result file committed under
``docs/results/`` from a run at its default (or full) size, so that no figure of the README or
the docs comes from a smoke run, which only shows that an experiment runs end to end.

An experiment that cannot have one yet is named in :data:`SHORT_OF_DEFAULT` with the reason.
"""

import json

import pytest

from experiments import EXPERIMENTS, results_sources

ROOT = results_sources.repository_root()
RESULTS = ROOT / results_sources.RESULTS_DIR

pytestmark = pytest.mark.skipif(
    not (RESULTS / results_sources.MANIFEST).exists(),
    reason="needs a checkout of the repository with docs/results/manifest.json",
)

#: Sizes whose figures may be quoted.
QUOTABLE_SIZES = ("default", "full")

#: Experiment name -> why its committed result is not (yet) of the default size. Keep it short
#: and empty where possible: an entry here is a figure of the docs that says nothing about the
#: method.
SHORT_OF_DEFAULT = {}


def source_of(experiment, sources):
    """The result source writing ``<experiment>.json`` (``vae-linear``'s file is written by
    ``vae-compare``), or ``None``."""
    return next((n for n, s in sources.items() if f"{experiment}.json" in s["files"]), None)


def short_of_default(experiments, sources, manifest, results_dir):
    """``{experiment: what is missing}`` for each experiment without a committed result file
    of a quotable size."""
    out = {}
    for name in experiments:
        source = source_of(name, sources)
        entry = manifest.get(source) if source is not None else None
        if source is None:
            out[name] = "no result source writes it (experiments/results_sources.py SOURCES)"
        elif entry is None:
            out[name] = f"docs/results/manifest.json has no entry for source {source!r}"
        elif entry.get("size") not in QUOTABLE_SIZES:
            out[name] = f"committed at {entry.get('size')!r} size ({entry['command']})"
        elif not (results_dir / f"{name}.json").exists():
            out[name] = f"docs/results/{name}.json is missing"
    return out


def test_every_experiment_is_committed_at_default_size():
    manifest = results_sources.read_manifest(ROOT)
    missing = short_of_default(EXPERIMENTS, results_sources.SOURCES, manifest, RESULTS)
    unexplained = {n: why for n, why in missing.items() if n not in SHORT_OF_DEFAULT}
    assert not unexplained, (
        f"experiments without a default-size result file: {unexplained}; run "
        "`pyro-mpt render-results --rerun SOURCE` at the default size and commit docs/results/, "
        "README.md and docs/ (or name the experiment in SHORT_OF_DEFAULT with the reason)."
    )


def test_allow_list_names_only_experiments_still_short_of_default():
    manifest = results_sources.read_manifest(ROOT)
    missing = short_of_default(EXPERIMENTS, results_sources.SOURCES, manifest, RESULTS)
    unknown = set(SHORT_OF_DEFAULT) - set(EXPERIMENTS)
    assert not unknown, f"SHORT_OF_DEFAULT names no experiment: {sorted(unknown)}"
    stale = set(SHORT_OF_DEFAULT) - set(missing)
    assert not stale, f"{sorted(stale)} now have default-size results: drop them from the list"
    for name, reason in SHORT_OF_DEFAULT.items():
        assert reason.strip(), f"SHORT_OF_DEFAULT[{name!r}] gives no reason"


def test_the_check_finds_smoke_missing_and_unsourced_results(tmp_path):
    # A hand-built registry: one experiment at each state the check must tell apart.
    sources = {
        "a": dict(files=["a.json"]),
        "pair": dict(files=["pair.json", "b.json"]),
        "c": dict(files=["c.json"]),
        "d": dict(files=["d.json"]),
        "e": dict(files=["e.json"]),
    }
    manifest = {
        "a": dict(size="default", command="pyro-mpt reproduce a"),
        "pair": dict(size="full", command="pyro-mpt reproduce pair --full"),
        "c": dict(size="smoke", command="pyro-mpt reproduce c --smoke"),
        "e": dict(size="default", command="pyro-mpt reproduce e"),
    }
    for name in ("a", "pair", "b", "c", "d"):
        (tmp_path / f"{name}.json").write_text(json.dumps({}), encoding="utf-8")
    experiments = ["a", "b", "c", "d", "e", "f"]
    found = short_of_default(experiments, sources, manifest, tmp_path)
    assert sorted(found) == ["c", "d", "e", "f"]
    assert "'smoke' size" in found["c"]
    assert "no entry for source 'd'" in found["d"]
    assert "e.json is missing" in found["e"]
    assert "no result source" in found["f"]
