"""Runs every benchmark in one process and prints one summary of ratios against targets.

Running them together means the ratios in the summary come from one run on one machine
state. Each benchmark's own tables are printed first.

Usage::

    python benchmarks/run_all.py [--device cuda] [--threads 1] [--json all.json]
"""

import argparse

import bench_fast_paths
import bench_gp_active_set
import bench_svi_step
import bench_table1
import bench_vae_step
import bench_woodbury
from _common import add_common_args, configure, environment, format_table, write_json

try:  # needs the optional extra pyro-mpt[transformers]
    import bench_collator
except ImportError:
    bench_collator = None
try:  # needs the optional extra pyro-mpt[transformers]
    import bench_mlm_curve
    import transformers  # noqa: F401
except ImportError:
    bench_mlm_curve = None

__all__ = ["main", "summary_rows"]


def _row(label, measured, op, target, fmt=".2f", target_fmt=".0f", unit="x"):
    """``(label, measured, target, meets)`` for a figure that should be ``op`` (``"<="`` or
    ``">="``) its target."""
    ok = measured <= target if op == "<=" else measured >= target
    return label, f"{measured:{fmt}}{unit}", f"{op} {target:{target_fmt}}{unit}", _status(ok)


def _status(ok):
    return "yes" if ok else "no"


def _results(reports, key):
    """``(config, result)`` for each result of the report ``key``; none if it did not run."""
    report = reports.get(key)
    return [(report["config"], r) for r in report["results"]] if report is not None else []


def summary_rows(reports):
    """One row per figure with a target: ``(benchmark, measured, target, meets target)``."""
    rows = []
    for cfg, r in _results(reports, "svi_step"):
        label = f"SVI step MPT/ELBO, {r['dtype']}"
        rows.append(_row(label, r["ratio_mpt_over_elbo"], "<=", cfg["target_ratio"]))
    for cfg, r in _results(reports, "woodbury"):
        for key, method in (
            ("speedup_vs_dense_batched", "dense batched"),
            ("speedup_vs_dense_loop", "dense loop"),
        ):
            if key in r:
                label = f"Woodbury speed-up vs {method}, {r['dtype']}"
                rows.append(_row(label, r[key], ">=", cfg["target_speedup"], fmt=".3g"))
    table1 = reports.get("table1")
    if table1 is not None:
        target = table1["config"]["target_seconds"]
        label = "reproduce ppca-table1 (s)"
        rows.append(_row(label, table1["seconds"], "<=", target, fmt=".1f", unit=""))
    elif "table1" in reports:
        rows.append(("reproduce ppca-table1 (s)", "n/a", "<= 60", "-"))
    for _, r in _results(reports, "vae_step"):
        if r["target_ratio"] is not None:
            label = f"{r['model']} VAE step MPT ({r['loss']})/ELBO, {r['dtype']}"
            rows.append(_row(label, r["ratio_to_elbo"], "<=", r["target_ratio"]))
    for _, r in _results(reports, "gp_active_set"):
        if r["target"] is not None:
            label = f"GP active set |R|=128 vs exact MLL, N=2048, {r['dtype']}"
            rows.append(_row(label, r["speedup"], ">=", r["target"], fmt=".1f"))
    for cfg, r in _results(reports, "collator"):
        label = f"MPTDataCollator/HF collator, {r['case']}"
        rows.append(_row(label, r["ratio"], "<=", cfg["target_ratio"], target_fmt=""))
    for cfg, r in _results(reports, "fast_paths"):
        label = f"fast path / plain version, {r['path']}"
        rows.append(_row(label, r["speedup"], ">=", cfg["target_speedup"], target_fmt=""))
    for cfg, r in _results(reports, "mlm_curve"):
        label = "plain forward loop / mlm_mpt_curve"
        ratio, target = r["ratio_loop_over_curve"], cfg["target_ratio"]
        rows.append(_row(label, ratio, ">=", target, target_fmt="", unit=""))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeats=5)
    parser.add_argument("--svi-steps", type=int, default=20, help="SVI steps per repeat")
    parser.add_argument("--woodbury-steps", type=int, default=10, help="Woodbury calls per repeat")
    parser.add_argument("--no-loop", action="store_true", help="skip the per-mask Python loop")
    parser.add_argument("--skip-table1", action="store_true", help="skip the reproduction run")
    args = parser.parse_args(argv)
    device = configure(args.device, args.threads)

    # report key -> (benchmark module, keywords of its run besides the device)
    runs = {
        "svi_step": (bench_svi_step, dict(steps=args.svi_steps, repeats=args.repeats)),
        "woodbury": (
            bench_woodbury,
            dict(steps=args.woodbury_steps, repeats=args.repeats, loop=not args.no_loop),
        ),
        "table1": (None if args.skip_table1 else bench_table1, {}),
        "vae_step": (bench_vae_step, dict(repeats=args.repeats)),
        "gp_active_set": (bench_gp_active_set, dict(repeats=args.repeats)),
        "fast_paths": (bench_fast_paths, dict(repeats=args.repeats)),
        "collator": (bench_collator, dict(repeats=args.repeats)),
        "mlm_curve": (bench_mlm_curve, dict(repeats=args.repeats)),
    }
    reports = {}
    for key, (module, kwargs) in runs.items():
        if module is None:
            continue
        if reports:
            print()
        reports[key] = module.run(device, **kwargs)
        module.print_report(reports[key])

    env = environment(device)
    print()
    print(f"Summary ({env['device']}, {env['threads']} threads, torch {env['torch']})")
    print(format_table(["figure", "measured", "target", "meets"], summary_rows(reports)))
    if args.json:
        write_json(args.json, {"environment": env, "reports": reports})
    return reports


if __name__ == "__main__":
    main()
