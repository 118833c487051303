"""Execute every tutorial notebook in memory and fail if any cell raises.

The notebooks read ``CI=true`` from the environment and switch to their small
smoke-test sizes. Outputs are never written back to the committed files.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 900


def run_notebook(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    os.environ["CI"] = "true"
    os.environ.setdefault("MPLBACKEND", "Agg")

    if argv:
        notebooks = [Path(a).resolve() for a in argv]
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
            elapsed = run_notebook(path)
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
