"""The README's table of experiments names every experiment of ``pyro-mpt reproduce --list``
(the registry :data:`experiments.EXPERIMENTS`), each once, and nothing else."""

import re
from collections import Counter

import pytest

from experiments import EXPERIMENTS, results_sources

README = results_sources.repository_root() / "README.md"

pytestmark = pytest.mark.skipif(not README.exists(), reason="needs a checkout with README.md")


def readme_experiment_names(text):
    """The first cells of the table whose header is ``| name | what it reproduces |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*\| name \| what it", line))
    names = []
    for line in lines[start + 2 :]:
        match = re.match(r"\s*\| `([\w-]+)` \|", line)
        if not match:
            break
        names.append(match.group(1))
    return names


def test_readme_table_lists_every_registered_experiment_once():
    names = readme_experiment_names(README.read_text(encoding="utf-8"))
    assert [n for n, count in Counter(names).items() if count > 1] == []
    assert sorted(names) == sorted(EXPERIMENTS)


def test_the_parser_reads_a_table_to_its_end():
    text = "x\n| name | what it reproduces |\n|---|---|\n| `a` | 1 |\n| `b-c` | 2 |\n\nafter\n"
    assert readme_experiment_names(text) == ["a", "b-c"]
