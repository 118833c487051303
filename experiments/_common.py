"""Plumbing shared by the reproductions: seeds, device and dtype, progress bars, tables, and
output files that are never left half-written."""

import contextlib
import json
import math
import numbers
import os
import statistics
import tempfile
import time

import numpy as np
import pyro
import torch

from pyro_mpt.progress import progress_bar as _text_or_widget_bar

__all__ = [
    "Stopwatch",
    "check_size",
    "derived_seed",
    "float64",
    "format_table",
    "mean_std",
    "new_figure",
    "num_threads",
    "pm",
    "preserved_rng",
    "progress_bar",
    "resolve_device",
    "run_config",
    "save_outputs",
    "seed_everything",
    "spread_cell",
    "with_seeds",
]


def derived_seed(seed, *keys):
    """A reproducible 32-bit seed for one part of an experiment, from the run's ``seed`` and
    integer ``keys`` (panel, number of masks, repetition...), so that each part gets the same
    random numbers whatever else runs before it."""
    state = np.random.SeedSequence([int(seed), *(int(k) for k in keys)]).generate_state(1)
    return int(state[0])


def run_config(cfg, seed, smoke, full, device, **settings):
    """The ``config`` entry of a result file: the experiment's sizes ``cfg``, its further
    ``settings``, and the run's seed, size flags and device."""
    return dict(cfg, **settings, seed=seed, smoke=smoke, full=full, device=str(device))


def check_size(smoke, full):
    """Rejects ``smoke=True`` together with ``full=True``."""
    if smoke and full:
        raise ValueError("smoke=True and full=True exclude each other; choose one size.")


def seed_everything(seed):
    """Seeds Python, NumPy and torch (CPU and CUDA) through :func:`pyro.set_rng_seed`."""
    pyro.set_rng_seed(seed)


def resolve_device(device):
    """Checks a device name and returns a :class:`torch.device`.

    :param device: ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``) or a :class:`torch.device`.
    :raises ValueError: for another name, or for CUDA on a machine without it.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a device name; use 'cpu' or 'cuda'.") from error
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not supported; use 'cpu' or 'cuda'.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} was requested but torch reports no CUDA device "
            f"(torch {torch.__version__}); use device='cpu'."
        )
    return device


@contextlib.contextmanager
def default_dtype(dtype):
    """Makes ``dtype`` the default dtype inside the block (models create their parameters
    in the default dtype), restoring the previous default afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def float64():
    """:func:`default_dtype` for float64, the dtype of the PPCA experiments."""
    return default_dtype(torch.float64)


@contextlib.contextmanager
def num_threads(count):
    """Limits torch's intra-op threads inside the block. Loops of many tiny tensor operations
    (training a 10-feature model) run faster on one thread than on several, and much faster
    when other processes compete for the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(count, previous)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def progress_bar(iterable=None, enabled=True, **kwargs):
    """A tqdm progress bar (on stderr), or the bare iterable when ``enabled`` is False."""
    return _text_or_widget_bar(
        iterable, disable=not enabled, leave=False, dynamic_ncols=True, **kwargs
    )


@contextlib.contextmanager
def preserved_rng():
    """Restores the random states of Python, NumPy and torch on leaving the block, so that a
    warm-up run inside it takes no draws from the measured run that follows."""
    state = pyro.util.get_rng_state()
    try:
        yield
    finally:
        pyro.util.set_rng_state(state)


class Stopwatch:
    """Wall-clock seconds since construction (``elapsed``) or of a ``with`` block
    (``seconds``)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = None

    @property
    def elapsed(self):
        return time.perf_counter() - self.start

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = self.elapsed
        return False


def rate_mean_area(curve):
    """The area under an MPT curve as the papers compute it: ``D`` times the mean score over
    the masking rates, averaged over observations, a Riemann sum of the curve over the
    rates. It weighs each mask size by how many rates round to it, which biases it as an
    estimate of ``log p(x)`` where the rates fall unevenly on the sizes (small ``D``);
    :attr:`pyro_mpt.MPTCurve.area` weighs each size once."""
    d = curve.num_features.double()
    return float((d * curve.observation_scores.double().mean(1)).mean())


def mean_std(values):
    """``(mean, sample standard deviation)`` of a list of floats (std is 0 for one value)."""
    values = [float(v) for v in values]
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def pm(mean, std, digits=2):
    """Formats ``mean ± std``; a std too small for ``digits`` decimals gets one significant
    digit instead of reading as zero."""
    std_digits = digits
    if 0 < std < 0.5 * 10**-digits:
        std_digits = -math.floor(math.log10(std))
    return f"{mean:.{digits}f} ± {std:.{std_digits}f}"


def format_table(headers, rows, title=None, notes=()):
    """A plain-text table with aligned columns.

    :param list headers: column titles.
    :param list rows: rows of cells (converted with ``str``).
    :param str title: a caption printed above the table.
    :param notes: lines printed below the table.
    :returns: the table as one string.
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        # The first column holds row labels: left-aligned; numbers are right-aligned.
        padded = [row[0].ljust(widths[0])]
        padded += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        return "  ".join(padded).rstrip()

    rule = "-" * len(line(["-" * w for w in widths]))
    out = [title] if title else []
    out += [rule, line(cells[0]), rule] + [line(row) for row in cells[1:]] + [rule]
    out += list(notes)
    return "\n".join(out)


def new_figure(ncols, width=5.0, height=3.8):
    """A matplotlib figure with ``ncols`` panels, drawn by the Agg canvas without pyplot, so
    running an experiment never changes the caller's matplotlib backend."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None  # strict JSON has no NaN
    if value is None or isinstance(value, str):
        return value
    return str(value)


def _written_temporary(out_dir, final_name, write):
    """Writes through ``write(path)`` into a temporary file of ``out_dir`` (named after
    ``final_name``, with the permissions ``open`` would give) and returns its path; removes
    it if the write fails."""
    fd, tmp_path = tempfile.mkstemp(dir=out_dir, prefix=f".{final_name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; give what open() would
    try:
        write(tmp_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
    return tmp_path


def save_outputs(out_dir, name, results, fig):
    """Writes ``<name>.json`` (``results``, tensors converted to lists, NaN to null) and
    ``<name>.png`` (``fig``) into ``out_dir``, creating the folder if needed, then records
    both paths in ``results["outputs"]``.

    Both are written to temporary files first and renamed only once both are complete, so
    a crash, an interrupt or a failing write leaves the earlier outputs as they were: never
    a truncated file, nor a new JSON beside an old figure.

    :returns: ``results``, with ``"outputs"`` set to ``{"json": ..., "png": ...}``.
    :raises IsADirectoryError: if an output's path is a folder (nothing is written).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: os.path.join(out_dir, f"{name}.{kind}") for kind in ("json", "png")}
    for path in paths.values():
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"{path} is a folder, where the results file would go; nothing was written. "
                f"Move the folder away, or pass another --out."
            )
    payload = json.dumps(_jsonable(results), indent=2, allow_nan=False)

    def write_json(path):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(payload + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    writers = dict(json=write_json, png=lambda path: fig.savefig(path, format="png", dpi=120))
    written = {}
    try:
        for kind, write in writers.items():
            written[kind] = _written_temporary(out_dir, os.path.basename(paths[kind]), write)
        for kind in list(written):
            os.replace(written.pop(kind), paths[kind])
    finally:
        for tmp_path in written.values():
            with contextlib.suppress(OSError):
                os.remove(tmp_path)
    results["outputs"] = dict(paths)
    return results


def with_seeds(cfg, seeds, seed):
    """``cfg`` repeated ``seeds`` times (its own count when ``None``): sets ``cfg["seeds"]``
    and ``cfg["run_seeds"]``, the seed of each repetition, derived from ``seed``."""
    if seeds is not None:
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"seeds={seeds!r} must be a positive integer, e.g. seeds=3.")
        cfg["seeds"] = seeds
    cfg["run_seeds"] = [derived_seed(seed, 10, rep) for rep in range(cfg["seeds"])]
    return cfg


def spread_cell(pair, digits, seeds, scale=1.0):
    """A table cell: ``mean ± sd`` of a ``(mean, sd)`` pair over ``seeds`` seeds, or the
    mean alone for one seed."""
    mean, std = scale * pair[0], scale * pair[1]
    return pm(mean, std, digits) if seeds > 1 else f"{mean:.{digits}f}"
