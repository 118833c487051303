"""Execute every tutorial notebook and fail if any cell raises.

The notebooks read ``CI=true`` from the environment and switch to their small
smoke-test sizes. Outputs are never written back to the committed files: the
executed copies go to ``docs/_build/executed/`` (``--executed-dir``), where the
documentation build (``docs/conf.py``) picks them up instead of executing the
notebooks a second time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 900
EXECUTED_DIR = ROOT / "docs" / "_build" / "executed"


def run_notebook(path: Path, executed_dir: Path | None = None) -> float:
    if executed_dir is not None:  # a failed run leaves no stale copy behind
        (executed_dir / path.name).unlink(missing_ok=True)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    if executed_dir is not None:
        executed_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, executed_dir / path.name)
    return elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="default: tutorials/*.ipynb")
    parser.add_argument(
        "--executed-dir",
        type=Path,
        default=EXECUTED_DIR,
        help="where the executed copies go (default: docs/_build/executed)",
    )
    args = parser.parse_args(argv)
    os.environ["CI"] = "true"
    # The kernel's own inline backend keeps the figures as outputs, for the docs; a
    # non-interactive MPLBACKEND inherited from CI would drop them.
    os.environ.pop("MPLBACKEND", None)

    if args.notebooks:
        notebooks = [Path(a).resolve() for a in args.notebooks]
    else:
        notebooks = sorted((ROOT / "tutorials").glob("*.ipynb"))
    if not notebooks:
        print("No notebooks found in tutorials/; nothing to execute.")
        return 0

    failures: list[str] = []
    for path in notebooks:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"--> executing {name}", flush=True)
        start = time.perf_counter()
        try:
            elapsed = run_notebook(path, args.executed_dir)
        except (CellExecutionError, CellTimeoutError) as err:
            elapsed = time.perf_counter() - start
            print(f"FAILED {name} after {elapsed:.1f} s:\n{err}", flush=True)
            failures.append(str(name))
            continue
        except Exception as err:  # kernel died, malformed notebook, ...
            elapsed = time.perf_counter() - start
            print(f"FAILED {name} after {elapsed:.1f} s: {type(err).__name__}: {err}", flush=True)
            failures.append(str(name))
            continue
        print(f"ok     {name} in {elapsed:.1f} s", flush=True)

    if failures:
        print(f"{len(failures)} of {len(notebooks)} notebook(s) failed: {', '.join(failures)}")
        return 1
    print(f"All {len(notebooks)} notebook(s) executed successfully.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
