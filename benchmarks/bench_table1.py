"""Wall-clock time of ``pyro-mpt reproduce ppca-table1`` at its default size.

Runs :func:`experiments.ppca_table1.run` in-process into a temporary directory and
prints the total seconds against the one-minute target. If that module is not available in
this checkout, the script says so and exits with status 0.

Usage::

    python benchmarks/bench_table1.py [--device cuda] [--smoke] [--json out.json]
"""

import importlib
import pathlib
import sys
import tempfile
import time

from _common import benchmark_main, environment, format_table, synchronize

__all__ = ["MODULE", "load", "main", "print_report", "run"]

MODULE = "experiments.ppca_table1"
TARGET_SECONDS = 60.0


#: The checkout holding ``experiments/`` (the script runs with ``benchmarks/`` on the path).
ROOT = pathlib.Path(__file__).resolve().parents[1]


def load():
    """The ``ppca_table1`` module, or None if this checkout does not have it."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError as error:
        if error.name is not None and MODULE.startswith(error.name):
            return None
        raise


def run(device="cpu", smoke=False, seed=0):
    """Times one in-process run of the reproduction.

    :returns: a report dict, or None if the module is not available.
    """
    module = load()
    if module is None:
        return None

    with tempfile.TemporaryDirectory(prefix="ppca_table1_") as out_dir:
        synchronize(device)
        start = time.perf_counter()
        result = module.run(out_dir, device=str(device), smoke=smoke, seed=seed, progress=False)
        synchronize(device)
        seconds = time.perf_counter() - start
    config = {"smoke": smoke, "seed": seed, "target_seconds": TARGET_SECONDS}
    summary = {k: v for k, v in (result or {}).items() if isinstance(v, (int, float, str, bool))}
    return {
        "config": config,
        "environment": environment(device),
        "seconds": seconds,
        "result_scalars": summary,
    }


def print_report(report):
    """Prints the total time against the target (or why there is none)."""
    if report is None:
        print(f"{MODULE} is not available in this checkout; nothing to time.")
        return
    cfg = report["config"]
    env = report["environment"]
    size = "smoke size" if cfg["smoke"] else "default size"
    print(f"pyro-mpt reproduce ppca-table1, {size} ({env['device']}, {env['threads']} threads)")
    row = ("ppca-table1", f"{report['seconds']:.1f}", f"<= {cfg['target_seconds']:.0f}")
    print(format_table(["command", "seconds", "target"], [row]))


def main(argv=None):
    smoke = ("--smoke", {"action": "store_true", "help": "time the smoke-size run instead"})
    return benchmark_main(__doc__, argv, run, print_report, options=[smoke])


if __name__ == "__main__":
    main()
