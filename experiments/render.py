"""The result tables of the README and the docs, rendered from the JSON files committed under
``docs/results/``, and the reruns that write those files.

Every figure quoted in the README's Results section and in the docs' result and benchmark
tables sits between a pair of marker comments,

.. code-block:: text

    <!-- results:ppca-table1 -->          (Markdown)
    <!-- /results:ppca-table1 -->

    .. results:bench-vae-step             (reStructuredText)
    .. /results:bench-vae-step

and is rendered from ``docs/results/*.json`` by :func:`render_block`; text outside the markers
is left as it is. Each JSON file is written by one *source*, a command of this repository
(:data:`SOURCES`): ``pyro-mpt reproduce NAME`` or ``benchmarks/run_all.py``.
``docs/results/manifest.json`` records, per source, the command that produced its files, its
size, its wall time, the machine and the commit, and the captions are rendered from it.

Usage (from a checkout of the repository)::

    python -m experiments.render              # rewrite the tables from the JSON
    python -m experiments.render --check      # exit 1 if a table is not up to date
    python -m experiments.render --rerun      # rerun every source, then rewrite
    python -m experiments.render --rerun ppca-table1 benchmarks

``pyro-mpt render-results`` is the same command.
"""

import argparse
import re
import sys
import time
from pathlib import Path

from experiments.results_blocks_benchmarks import (
    bench_fast_paths_block,
    bench_gp_active_set_block,
    bench_importance_masks_block,
    bench_importance_masks_long_block,
    bench_quadrature_nodes_block,
    bench_transformers_block,
    bench_vae_step_block,
    benchmarks_block,
)
from experiments.results_blocks_coherence import coherence_block
from experiments.results_blocks_notes import gp_decoder_summary_block
from experiments.results_blocks_ppca import (
    ppca_curve_training_block,
    ppca_table1_block,
    ppca_training_block,
)
from experiments.results_blocks_sampling import (
    gibbs_mixing_block,
    ppca_convergence_block,
    ppca_curve_block,
)
from experiments.results_blocks_transformers import (
    bert_curve_block,
    bert_rates_block,
    mae_curve_block,
    mlm_generation_block,
)
from experiments.results_blocks_vae_gp import (
    gp_decoder_block,
    vae_compare_block,
    vae_deep_block,
)
from experiments.results_format import Context
from experiments.results_sources import (
    DOCUMENTS,
    SIZE_FLAGS,
    SOURCES,
    ResultsFileError,
    read_manifest,
    repository_root,
    rerun,
    write_text,
)

__all__ = ["BLOCKS", "add_arguments", "main", "render_block", "render_files", "run_from_args"]

#: Marker name -> the function rendering the text between its markers.
BLOCKS = {
    "ppca-table1": ppca_table1_block,
    "ppca-training": ppca_training_block,
    "ppca-convergence": ppca_convergence_block,
    "ppca-curve": ppca_curve_block,
    "ppca-curve-training": ppca_curve_training_block,
    "gibbs-mixing": gibbs_mixing_block,
    "vae-deep": vae_deep_block,
    "vae-compare": vae_compare_block,
    "gp-decoder": gp_decoder_block,
    "gp-decoder-summary": gp_decoder_summary_block,
    "bert-curve": bert_curve_block,
    "mae-curve": mae_curve_block,
    "bert-rates": bert_rates_block,
    "mlm-generation": mlm_generation_block,
    "coherence": coherence_block,
    "benchmarks": benchmarks_block,
    "bench-vae-step": bench_vae_step_block,
    "bench-fast-paths": bench_fast_paths_block,
    "bench-gp-active-set": bench_gp_active_set_block,
    "bench-importance-masks": bench_importance_masks_block,
    "bench-importance-masks-long": bench_importance_masks_long_block,
    "bench-quadrature-nodes": bench_quadrature_nodes_block,
    "bench-transformers": bench_transformers_block,
}


# --------------------------------------------------------------------------------------------
# Documents

_MARKERS = {
    "md": (
        re.compile(
            r"^<!-- results:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /results:(?P=name) -->$",
            re.S | re.M,
        ),
        re.compile(r"^<!-- /?results:", re.M),
    ),
    "rst": (
        re.compile(
            r"^\.\. results:(?P<name>[\w-]+)\n(?P<body>.*?)^\.\. /results:(?P=name)$", re.S | re.M
        ),
        re.compile(r"^\.\. /?results:", re.M),
    ),
}


def render_block(name, root=None, markup="md"):
    """The text between the markers of block ``name``, from the committed JSON files.

    :param str name: a key of :data:`BLOCKS`.
    :param root: the repository checkout (default: the one this module lives in).
    :param str markup: ``"md"`` (Markdown) or ``"rst"`` (reStructuredText).
    """
    if name not in BLOCKS:
        raise KeyError(f"unknown results block {name!r}; the blocks are {list(BLOCKS)}.")
    return BLOCKS[name](Context(root or repository_root(), markup))


def render_text(text, root=None, markup="md", where="<text>"):
    """``text`` with every block between markers rendered anew; the rest is unchanged."""
    pattern, any_marker = _MARKERS[markup]
    matches = list(pattern.finditer(text))
    if 2 * len(matches) != len(any_marker.findall(text)):
        raise ValueError(f"{where}: a results marker has no matching end marker.")

    def replace(match):
        name = match["name"]
        body = render_block(name, root, markup)
        start, end = match.group(0).split("\n", 1)[0], match.group(0).rsplit("\n", 1)[-1]
        return f"{start}\n\n{body}\n\n{end}"

    return pattern.sub(replace, text)


def documents(root=None):
    """The files whose result blocks are rendered: the README and the docs' pages."""
    root = Path(root or repository_root())
    paths = []
    for pattern in DOCUMENTS:
        paths += sorted(root.glob(pattern))
    return paths


def render_files(root=None, check=False):
    """Renders every result block of the README and the docs from ``docs/results/``.

    Every document is rendered before any is written, so that a result file that cannot be
    read (:class:`~experiments.results_sources.ResultsFileError`) leaves them all as they were.

    :param bool check: compare only, writing nothing.
    :returns: the paths (relative to ``root``) whose blocks differ from the rendering (with
        ``check=False``: that were rewritten).
    """
    root = Path(root or repository_root())
    rendered = {}
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        markup = "rst" if path.suffix == ".rst" else "md"
        new = render_text(text, root, markup, where=str(path))
        if new != text:
            rendered[path] = new
    if not check:
        for path, new in rendered.items():
            write_text(path, new)
    return [path.relative_to(root).as_posix() for path in rendered]


# --------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser):
    """Adds the options of ``pyro-mpt render-results`` to ``parser``."""
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit with status 1 if a table differs from its JSON",
    )
    parser.add_argument(
        "--rerun",
        nargs="*",
        metavar="SOURCE",
        default=None,
        help=(
            "first rerun these sources (default: all of them: "
            + ", ".join(SOURCES)
            + ") and write their JSON into docs/results/"
        ),
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZE_FLAGS),
        default=None,
        help="with --rerun: run the reproductions at this size instead of their own",
    )
    parser.add_argument(
        "--root", default=None, metavar="DIR", help="repository checkout (default: this one)"
    )
    return parser


def run_from_args(args):
    """Runs ``pyro-mpt render-results`` with parsed ``args``; returns the exit status. A
    result file that is not valid JSON returns 2 after one line naming it and the rerun that
    writes it again, with no document written."""
    root = Path(args.root) if args.root else repository_root()
    if not (root / "README.md").exists() or not (root / "docs").is_dir():
        print(f"{root} is not a checkout of pyro_mpt (no README.md and docs/).", file=sys.stderr)
        return 2
    try:
        if args.rerun is not None:
            if args.check:
                print("--check and --rerun exclude each other.", file=sys.stderr)
                return 2
            unknown = [name for name in args.rerun if name not in SOURCES]
            if unknown:
                print(
                    f"--rerun {' '.join(unknown)}: no such result source; choose from "
                    f"{', '.join(SOURCES)} (or give --rerun alone to rerun them all).",
                    file=sys.stderr,
                )
                return 2
            read_manifest(root)  # a corrupt manifest stops the reruns before, not after, them
            start = time.perf_counter()
            rerun(args.rerun, root, size=args.size)
            print(f"reran in {time.perf_counter() - start:.0f} s")
        elif args.size is not None:
            print("--size applies only with --rerun.", file=sys.stderr)
            return 2
        changed = render_files(root, check=args.check)
    except ResultsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check:
        if changed:
            print("out of date: " + ", ".join(changed), file=sys.stderr)
            print("run `pyro-mpt render-results` to render them.", file=sys.stderr)
            return 1
        print("every results table matches docs/results/")
        return 0
    print("rendered: " + (", ".join(changed) if changed else "nothing changed"))
    return 0


def main(argv=None):
    """``python -m experiments.render``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.render", description=__doc__.split("\n\n")[0]
    )
    return run_from_args(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
