"""The model zoo of ``experiments/zoo/models.py`` (checked by ``tests/test_model_zoo.py``)
through ``MPTLoss(conditionals="auto")``.

For every model: the strategy ``"auto"`` chose, and the largest error per observation of
``log_marginal`` under that strategy against the exact reference (closed-form Gaussian
marginals, fine grids), or the error the model raised. Prints a markdown table.

Usage::

    python benchmarks/model_zoo_table.py [--threads 1]
"""

import argparse
import logging
import pathlib
import re
import sys
import time

import pyro
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# The zoo is written for float64 (as the test suite runs), and its factories run at import.
torch.set_default_dtype(torch.float64)

from _common import configure  # noqa: E402

from experiments.zoo.models import ZOO  # noqa: E402
from pyro_mpt import MPTLoss, log_marginal  # noqa: E402


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _cell(text, width=90):
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def zoo_row(factory):
    """``(model, expected, chosen, result, status)`` for one factory of the zoo."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    case = factory()
    expected = case.strategy.__name__ if case.strategy is not None else "error"
    loss = MPTLoss(conditionals="auto")
    start = time.perf_counter()
    try:
        with torch.no_grad():
            loss.loss(case.model, case.guide, *case.args, **case.kwargs)
    except Exception as error:  # noqa: BLE001 - every error is a row of the table
        if case.error is not None:
            types, pattern = case.error
            ok = isinstance(error, types) and re.search(pattern, str(error)) is not None
        else:
            ok = False
        return case.name, expected, "–", _cell(_first_line(error)), "ok" if ok else "FAIL"
    chosen = loss.conditionals.chosen
    chosen_name = type(chosen).__name__
    if case.error is not None:
        return case.name, expected, chosen_name, "no error raised", "FAIL"
    status = "ok" if isinstance(chosen, case.strategy) else "FAIL (strategy)"
    if not case.check_log_marginal:
        return case.name, expected, chosen_name, "(scaled or subsampled: see the tests)", status
    try:
        with torch.no_grad():
            value = log_marginal(
                case.model, *case.args, conditionals=chosen, guide=case.guide, **case.kwargs
            )
            reference = case.reference()
        error = (value.reshape(-1) - reference.reshape(-1)).abs().max().item()
    except Exception as error:  # noqa: BLE001
        return case.name, expected, chosen_name, _cell(_first_line(error)), "FAIL"
    seconds = time.perf_counter() - start
    if error > case.auto_tol and status == "ok":
        # Importance sampling at auto's default sample size is consistent, not exact.
        status = "approximate" if case.strategy.__name__ == "ImportanceSampling" else "FAIL (error)"
    return case.name, expected, chosen_name, f"{error:.2e} ({seconds:.2f} s)", status


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    configure("cpu", args.threads)
    pyro.enable_validation(True)
    logging.getLogger("pyro").setLevel(logging.WARNING)  # Pyro's max_plate_nesting guesses
    print(
        "| model | expected | auto chose | max abs log_marginal error per obs, or error | status |"
    )
    print("|---|---|---|---|---|")
    failures = 0
    for factory in ZOO:
        row = zoo_row(factory)
        failures += row[-1] not in ("ok", "approximate")
        print("| " + " | ".join(row) + " |", flush=True)
    print(f"\n{len(ZOO) - failures} of {len(ZOO)} models as expected.")


if __name__ == "__main__":
    main()
