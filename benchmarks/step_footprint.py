"""What one SVI step costs besides arithmetic: how much of ``pyro_mpt`` it walks through,
how often it runs the model, and how often it waits for the device.

For each case the script takes a first step, two more, and then measures a steady step
(the fourth), each on a fresh mini-batch of the same shape:

* ``linear-gaussian auto``: a hand-written PPCA-like model (Normal latents of size 2 mapped
  affinely to 6 Normal features) under ``MPTLoss(conditionals="auto")``, which picks exact
  conditionals, with a guide that samples nothing;
* ``nonlinear auto``: a hand-written model with a 2-dimensional Normal latent and a
  Bernoulli likelihood through ``tanh``, under ``MPTLoss(conditionals="auto")``, which picks
  quadrature;
* ``vae importance``: :class:`pyro_mpt.models.VAE` (8 latents, 20 binary features) under
  ``MPTLoss(conditionals=ImportanceSampling(8))`` with its amortized guide;
* ``vae elbo``: the same VAE under ``Trace_ELBO``, for reference.

Figures per case:

* ``files`` and ``functions``: distinct source files of ``pyro_mpt`` and distinct (file,
  function) pairs whose Python code runs during the steady step (``sys.setprofile``), and
  the same for Pyro, with Pyro's validation on (its default); ``files`` and ``functions
  (validation off)``: the same for the next step with validation off, as in production,
  where the checks of data that Pyro makes only under validation do not run;
* ``model runs first`` (of which ``auto`` search) and ``model runs steady``: calls of the
  model function in the first step (the calls made while ``conditionals="auto"`` searches
  are counted apart) and in the steady step;
* ``syncs``: host synchronisations in the steady step whose caller is code of ``pyro_mpt``,
  with Pyro's validation off (``pyro.enable_validation(False)``, as in production): calls of
  ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``, ``__float__``,
  ``__index__``, ``nonzero``, ``torch.equal`` and ``torch.allclose``, and indexing with a
  boolean tensor; on the CPU these do not wait, but on a GPU each one stalls the step.
  ``syncs (validation on)`` is the same count with validation on. Reads of CPU tensors in
  the CPU-only branches of :mod:`pyro_mpt.ops.masks`, of
  :func:`pyro_mpt.ops.bernoulli.log_sigmoid` and of the Bernoulli quadrature
  (``CPU_ONLY`` of ``experiments/zoo/host_reads.py``) are not counted:
  those branches never see a GPU tensor. Before this count existed, those functions read
  every tensor, so the "before" figures count them.

Usage::

    python benchmarks/step_footprint.py [--json benchmarks/results/step_footprint.json] [--list]

``--list`` prints, for each case, the ``(file, function)`` pairs of ``pyro_mpt`` that the
steady step runs.
"""

import argparse
import collections
import contextlib
import json
import os
import platform
import sys

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_mpt
from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.models import VAE

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.zoo.host_reads import READ_METHODS, host_reads  # noqa: E402

__all__ = ["count_syncs", "main", "measure", "run", "visited"]

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "step_footprint.json")
PACKAGE_DIR = os.path.dirname(os.path.abspath(pyro_mpt.__file__)) + os.sep
PYRO_DIR = os.path.dirname(os.path.abspath(pyro.__file__)) + os.sep
NUM_DATA, BATCH, SEED = 256, 32, 0
#: The step that is measured; the ones before it are the first step and warm-up steps.
STEADY_STEP = 4


def _linear_gaussian_model(x):
    num_features, latent_dim = x.shape[-1], 2
    weight = pyro.param("lg_weight", lambda: 0.3 * torch.randn(num_features, latent_dim))
    loc = pyro.param("lg_loc", lambda: torch.zeros(num_features))
    noise = pyro.param("lg_noise", lambda: torch.tensor(0.5), constraint=constraints.positive)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(latent_dim), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ weight.T + loc, noise).to_event(1), obs=x)


def _nonlinear_model(x):
    num_features, latent_dim = x.shape[-1], 2
    weight = pyro.param("nl_weight", lambda: 0.3 * torch.randn(num_features, latent_dim))
    bias = pyro.param("nl_bias", lambda: torch.zeros(num_features))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(latent_dim), 1.0).to_event(1))
        logits = 3.0 * torch.tanh(z @ weight.T + bias)
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def _no_guide(x):
    """A guide that samples nothing (the latents are integrated out)."""


class _Counted:
    """A model function that counts its calls, apart those made while ``auto`` searches."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0
        self.search_calls = 0
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_search" and code.co_filename.endswith("auto.py"):
                self.search_calls += 1
                break
            frame = frame.f_back
        return self.fn(*args, **kwargs)


def _cases():
    """``(name, make)``: ``make()`` returns ``(model, guide, loss, data)``."""

    def linear_gaussian():
        torch.manual_seed(1)
        weight = torch.randn(6, 2)
        data = torch.randn(NUM_DATA, 2) @ weight.T + 0.5 * torch.randn(NUM_DATA, 6)
        return _linear_gaussian_model, _no_guide, MPTLoss(conditionals="auto"), data

    def nonlinear():
        torch.manual_seed(2)
        data = torch.bernoulli(torch.full((NUM_DATA, 12), 0.3))
        return _nonlinear_model, _no_guide, MPTLoss(conditionals="auto"), data

    def vae(loss):
        def make():
            torch.manual_seed(3)
            vae = VAE(20, latent_dim=8, hidden_dim=32)
            data = torch.bernoulli(torch.full((NUM_DATA, 20), 0.3))
            return vae.model, vae.guide, loss(), data

        return make

    return [
        ("linear-gaussian auto", linear_gaussian),
        ("nonlinear auto", nonlinear),
        ("vae importance", vae(lambda: MPTLoss(conditionals=ImportanceSampling(8)))),
        ("vae elbo", vae(Trace_ELBO)),
    ]


@contextlib.contextmanager
def visited(directories):
    """Records the distinct ``(file, function)`` pairs of Python code under each directory
    that runs in the block: yields ``{directory: set}``."""
    found = {d: set() for d in directories}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        for directory, seen in found.items():
            if code.co_filename.startswith(directory):
                seen.add((code.co_filename[len(directory) :], code.co_qualname))

    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(None)


@contextlib.contextmanager
def count_syncs():
    """Counts host synchronisations called from ``pyro_mpt`` code in the block (see
    :mod:`experiments.zoo.host_reads`): yields a Counter of ``"method at file:line"``."""
    counts = collections.Counter()
    with host_reads() as reads:
        yield counts
    for (file, _, what, line), number in reads.items():
        counts[f"{what} at {file}:{line}"] += number


def measure(make, validation=True):
    """The figures of one case (see the module's docstring)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED)
    pyro.enable_validation(validation)
    model, guide, loss, data = make()
    counted = _Counted(model)
    svi = SVI(counted, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    generator = torch.Generator().manual_seed(SEED)

    def batch():
        return data[torch.randint(len(data), (BATCH,), generator=generator)]

    svi.step(batch())
    first, first_search = counted.calls, counted.search_calls
    for _ in range(STEADY_STEP - 2):
        svi.step(batch())
    x = batch()
    counted.calls = 0
    with visited([PACKAGE_DIR, PYRO_DIR]) as found:
        svi.step(x)
    steady = counted.calls
    package, pyro_functions = found[PACKAGE_DIR], found[PYRO_DIR]
    pyro.enable_validation(False)
    svi.step(batch())  # a call under other validation settings is a first call again
    with visited([PACKAGE_DIR]) as found_off:
        svi.step(batch())
    package_off = found_off[PACKAGE_DIR]
    sync_figures = {}
    for on in (False, True):
        pyro.enable_validation(on)
        svi.step(batch())  # a call under other validation settings is a first call again
        x = batch()
        with count_syncs() as syncs:
            svi.step(x)
        sync_figures[on] = syncs
    pyro.enable_validation(True)
    chosen = getattr(getattr(loss, "conditionals", None), "chosen", None)
    return {
        "conditionals": repr(chosen if chosen is not None else getattr(loss, "conditionals", "-")),
        "files": len({f for f, _ in package}),
        "functions": len(package),
        "files_validation_off": len({f for f, _ in package_off}),
        "functions_validation_off": len(package_off),
        "pyro_files": len({f for f, _ in pyro_functions}),
        "pyro_functions": len(pyro_functions),
        "model_runs_first": first,
        "model_runs_first_search": first_search,
        "model_runs_steady": steady,
        "syncs": sum(sync_figures[False].values()),
        "syncs_validation_on": sum(sync_figures[True].values()),
        "sync_sites": dict(sync_figures[False]),
        "sync_sites_validation_on": dict(sync_figures[True]),
        "visited": sorted(f"{f}:{fn}" for f, fn in package),
        "visited_validation_off": sorted(f"{f}:{fn}" for f, fn in package_off),
    }


def run(label):
    """Measures every case; returns the JSON-able report for ``label``."""
    results = []
    for name, make in _cases():
        results.append({"case": name, **measure(make)})
    environment = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "machine": platform.machine(),
    }
    config = dict(
        num_data=NUM_DATA, batch=BATCH, steady_step=STEADY_STEP, sync_methods=READ_METHODS
    )
    return {"label": label, "config": config, "environment": environment, "results": results}


def _table(report):
    headers = [
        "case",
        "files",
        "functions",
        "validation off",
        "pyro files/functions",
        "model runs first (search)",
        "model runs steady",
        "syncs (validation on)",
    ]
    rows = [
        [
            r["case"],
            r["files"],
            r["functions"],
            f"{r['files_validation_off']}/{r['functions_validation_off']}",
            f"{r['pyro_files']}/{r['pyro_functions']}",
            f"{r['model_runs_first']} ({r['model_runs_first_search']})",
            r["model_runs_steady"],
            f"{r['syncs']} ({r['syncs_validation_on']})",
        ]
        for r in report["results"]
    ]
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after", help="key of this run in the JSON file")
    parser.add_argument("--json", default=DEFAULT_JSON, help="results file (runs are merged)")
    parser.add_argument(
        "--list", action="store_true", help="print the (file, function) pairs of each steady step"
    )
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float32)
    report = run(args.label)
    print(f"One steady SVI step ({report['label']}); syncs with validation off:")
    print(_table(report))
    for r in report["results"]:
        if r["sync_sites"]:
            print(f"  {r['case']}: " + ", ".join(f"{k} x{v}" for k, v in r["sync_sites"].items()))
    if args.list:
        for r in report["results"]:
            print(f"{r['case']}: {r['files']} files, {r['functions']} functions")
            for pair in r["visited"]:
                print(f"  {pair}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    merged = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            merged = json.load(f)
    merged[args.label] = report
    with open(args.json, "w") as f:
        json.dump(merged, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"figures written to {args.json}")
    return report


if __name__ == "__main__":
    main()
