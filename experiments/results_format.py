"""Formatting of the rendered result tables: numbers with a typographic minus, and the
:class:`Context` a block renders from (the committed JSON, the manifest and the markup)."""

import math
from pathlib import Path

from experiments.results_sources import (
    RESULTS_DIR,
    SOURCES,
    ResultsFileError,
    read_json,
    read_manifest,
)

__all__ = [
    "Context",
    "MINUS",
    "num",
    "percent",
    "pm",
    "ratio",
    "spread",
]


MINUS = "\N{MINUS SIGN}"


def num(value, digits=2, sign=False):
    """``value`` with ``digits`` decimals and a typographic minus; ``–`` for a missing value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return text.replace("-", MINUS)


def pm(mean, std, digits=2):
    """``mean ± std`` as :func:`experiments._common.pm` prints it, with a typographic
    minus."""
    from experiments._common import pm as plain_pm

    return plain_pm(mean, std, digits).replace("-", MINUS)


def percent(value, digits=1):
    return "–" if value is None else f"{100 * value:.{digits}f}%"


def ratio(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}×"


class Context:
    """What a block renders from: the committed JSON files and the manifest, and the markup
    (``"md"`` or ``"rst"``) of the document the block sits in."""

    def __init__(self, root, markup):
        self.root = Path(root)
        self.markup = markup
        self._cache = {}

    def json(self, file_name):
        """The committed JSON file ``file_name``; a :class:`ResultsFileError` naming it and
        the command that writes it if it is missing or cannot be decoded."""
        if file_name not in self._cache:
            path = self.root / RESULTS_DIR / file_name
            rerun = f"`pyro-mpt render-results --rerun {self.source_of(file_name)}`"
            if not path.exists():
                raise ResultsFileError(f"{path} is missing; write it with {rerun}.")
            self._cache[file_name] = read_json(path, f"write it again with {rerun}")
        return self._cache[file_name]

    @staticmethod
    def source_of(file_name):
        return next(n for n, s in SOURCES.items() if file_name in s["files"])

    def manifest(self, source):
        entry = read_manifest(self.root).get(source)
        if entry is None:
            raise KeyError(f"docs/results/manifest.json has no entry for {source!r}; rerun it.")
        return entry

    def code(self, text):
        return f"``{text}``" if self.markup == "rst" else f"`{text}`"

    def run_text(self, source):
        """``command`` (size; wall time on machine, torch version)."""
        entry = self.manifest(source)
        size = {
            "default": "default size",
            "smoke": "smoke size, which only shows that the experiment runs: its figures say "
            "nothing about the method",
            "full": "full size",
        }[entry["size"]]
        cores = entry["cpu_count"]
        machine = f"{cores} CPU core{'s' if cores != 1 else ''}"
        if entry.get("processor"):
            machine += f", {entry['processor']}"
        return (
            f"{self.code(entry['command'])} ({size}; {entry['seconds']:.0f} s on {machine}; "
            f"torch {entry['torch']}; {entry['date']}"
            + (f", commit {entry['commit']})" if entry.get("commit") else ")")
        )

    def table(self, headers, rows):
        if self.markup == "rst":
            return _rst_table(headers, rows)
        return _md_table(headers, rows)


def _md_table(headers, rows):
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    out = [line(headers), "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + [line(row) for row in rows])


def _rst_table(headers, rows):
    def cell(text):
        text = str(text).replace("|", "\\|")
        return text if text else ".."

    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [headers] + list(rows):
        out.append(f"   * - {cell(row[0])}")
        out += [f"     - {cell(c)}" for c in row[1:]]
    return "\n".join(out)


def spread(values, digits=3):
    """``a–b`` (or ``a``) with ``digits`` significant digits (whole numbers from 100 on),
    smallest first."""
    low, high = min(values), max(values)
    text = [f"{v:.0f}" if v >= 100 else f"{v:.{digits}g}" for v in (low, high)]
    return text[0] if text[0] == text[1] else f"{text[0]}–{text[1]}"
