"""The one flow every reproduction follows: config -> train and evaluate -> report.

A reproduction module supplies three functions, and :func:`run_experiment` does the rest
(size checks, device, dtype, timing, the printed table, the JSON and the PNG):

* ``config(smoke, full) -> dict``: the experiment's sizes at the chosen size;
* ``measure(cfg, device, seed, progress) -> measured``: training and evaluation, whatever
  the experiment produces;
* ``report(cfg, measured) -> Report``: the table to print, the figure, and the result fields
  to write beside ``experiment``, ``paper_reference``, ``config`` and ``wall_seconds``.
"""

import contextlib
from typing import Any, NamedTuple

from experiments import _common as common

__all__ = ["Report", "run_experiment"]


class Report(NamedTuple):
    """What a reproduction shows and writes: a printed ``table``, a matplotlib ``figure``
    (saved as ``<name>.png``) and the ``results`` fields of ``<name>.json``."""

    table: str
    figure: Any
    results: dict


def run_experiment(
    name,
    out_dir,
    config,
    measure,
    report,
    device="cpu",
    smoke=False,
    full=False,
    seed=0,
    progress=True,
    dtype=None,
    paper_reference=None,
    settings=None,
    header=None,
):
    """Runs one reproduction and writes ``<name>.json`` and ``<name>.png`` into ``out_dir``.

    :param str name: the experiment's name, e.g. ``"ppca-curve"``.
    :param callable config: ``(smoke, full) -> cfg``.
    :param callable measure: ``(cfg, device, seed, progress) -> measured``.
    :param callable report: ``(cfg, measured) -> Report``.
    :param torch.dtype dtype: the default dtype while measuring (models create their
        parameters in it); ``None`` leaves it as it is.
    :param str paper_reference: the figure or table of the paper it reproduces.
    :param dict settings: further entries of the ``config`` field (fixed choices that are
        not sizes, e.g. a noise variance).
    :param dict header: fields written ahead of ``config`` (e.g. a convention to read the
        results by).
    :returns: the results dict, as written to JSON (with ``"outputs"``: the two paths).
    """
    common.check_size(smoke, full)
    cfg = config(smoke, full)
    total = common.Stopwatch()
    dtype_scope = common.default_dtype(dtype) if dtype is not None else contextlib.nullcontext()
    with dtype_scope:
        device = common.resolve_device(device)
        measured = measure(cfg, device=device, seed=seed, progress=progress)
    shown = report(cfg, measured)
    print(shown.table)
    results = dict(experiment=name)
    if paper_reference is not None:
        results["paper_reference"] = paper_reference
    results.update(header or {})
    results["config"] = common.run_config(cfg, seed, smoke, full, device, **(settings or {}))
    results.update(shown.results)
    results["wall_seconds"] = total.elapsed
    return common.save_outputs(out_dir, name, results, shown.figure)
