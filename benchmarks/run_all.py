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


def _status(ok):
    return "yes" if ok else "no"


def summary_rows(reports):
    """One row per figure with a target: ``(benchmark, measured, target, meets target)``."""
    rows = []
    svi = reports.get("svi_step")
    if svi is not None:
        target = svi["config"]["target_ratio"]
        for r in svi["results"]:
            ratio = r["ratio_mpt_over_elbo"]
            rows.append(
                (
                    f"SVI step MPT/ELBO, {r['dtype']}",
                    f"{ratio:.2f}x",
                    f"<= {target:.0f}x",
                    _status(ratio <= target),
                )
            )
    woodbury = reports.get("woodbury")
    if woodbury is not None:
        target = woodbury["config"]["target_speedup"]
        for r in woodbury["results"]:
            for key, label in (
                ("speedup_vs_dense_batched", "dense batched"),
                ("speedup_vs_dense_loop", "dense loop"),
            ):
                if key in r:
                    rows.append(
                        (
                            f"Woodbury speed-up vs {label}, {r['dtype']}",
                            f"{r[key]:.3g}x",
                            f">= {target:.0f}x",
                            _status(r[key] >= target),
                        )
                    )
    table1 = reports.get("table1")
    if table1 is not None:
        target = table1["config"]["target_seconds"]
        seconds = table1["seconds"]
        rows.append(
            (
                "reproduce ppca-table1 (s)",
                f"{seconds:.1f}",
                f"<= {target:.0f}",
                _status(seconds <= target),
            )
        )
    elif "table1" in reports:
        rows.append(("reproduce ppca-table1 (s)", "n/a", "<= 60", "-"))
    vae_step = reports.get("vae_step")
    if vae_step is not None:
        for r in vae_step["results"]:
            if r["target_ratio"] is not None:
                rows.append(
                    (
                        f"{r['model']} VAE step MPT ({r['loss']})/ELBO, {r['dtype']}",
                        f"{r['ratio_to_elbo']:.2f}x",
                        f"<= {r['target_ratio']:.0f}x",
                        _status(r["ratio_to_elbo"] <= r["target_ratio"]),
                    )
                )
    gp = reports.get("gp_active_set")
    if gp is not None:
        for r in gp["results"]:
            if r["target"] is not None:
                rows.append(
                    (
                        f"GP active set |R|=128 vs exact MLL, N=2048, {r['dtype']}",
                        f"{r['speedup']:.1f}x",
                        f">= {r['target']:.0f}x",
                        _status(r["speedup"] >= r["target"]),
                    )
                )
    collator = reports.get("collator")
    if collator is not None:
        target = collator["config"]["target_ratio"]
        for r in collator["results"]:
            rows.append(
                (
                    f"MPTDataCollator/HF collator, {r['case']}",
                    f"{r['ratio']:.2f}x",
                    f"<= {target}x",
                    _status(r["ratio"] <= target),
                )
            )
    fast_paths = reports.get("fast_paths")
    if fast_paths is not None:
        target = fast_paths["config"]["target_speedup"]
        for r in fast_paths["results"]:
            rows.append(
                (
                    f"fast path / plain version, {r['path']}",
                    f"{r['speedup']:.2f}x",
                    f">= {target}x",
                    _status(r["speedup"] >= target),
                )
            )
    mlm_curve = reports.get("mlm_curve")
    if mlm_curve is not None:
        target = mlm_curve["config"]["target_ratio"]
        ratio = mlm_curve["results"][0]["ratio_loop_over_curve"]
        rows.append(
            (
                "plain forward loop / mlm_mpt_curve",
                f"{ratio:.2f}",
                f">= {target}",
                _status(ratio >= target),
            )
        )
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

    reports = {}
    reports["svi_step"] = bench_svi_step.run(device, args.svi_steps, args.repeats)
    bench_svi_step.print_report(reports["svi_step"])
    print()
    reports["woodbury"] = bench_woodbury.run(
        device, args.woodbury_steps, args.repeats, loop=not args.no_loop
    )
    bench_woodbury.print_report(reports["woodbury"])
    if not args.skip_table1:
        print()
        reports["table1"] = bench_table1.run(device)
        bench_table1.print_report(reports["table1"])
    print()
    reports["vae_step"] = bench_vae_step.run(device, repeats=args.repeats)
    bench_vae_step.print_report(reports["vae_step"])
    print()
    reports["gp_active_set"] = bench_gp_active_set.run(device, repeats=args.repeats)
    bench_gp_active_set.print_report(reports["gp_active_set"])
    print()
    reports["fast_paths"] = bench_fast_paths.run(device, repeats=args.repeats)
    bench_fast_paths.print_report(reports["fast_paths"])

    if bench_collator is not None:
        print()
        reports["collator"] = bench_collator.run(device, repeats=args.repeats)
        bench_collator.print_report(reports["collator"])
    if bench_mlm_curve is not None:
        print()
        reports["mlm_curve"] = bench_mlm_curve.run(device, repeats=args.repeats)
        bench_mlm_curve.print_report(reports["mlm_curve"])

    env = environment(device)
    print()
    print(f"Summary ({env['device']}, {env['threads']} threads, torch {env['torch']})")
    print(format_table(["figure", "measured", "target", "meets"], summary_rows(reports)))
    if args.json:
        write_json(args.json, {"environment": env, "reports": reports})
    return reports


if __name__ == "__main__":
    main()
