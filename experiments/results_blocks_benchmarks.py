"""The rendered result blocks of the benchmarks."""

from experiments.results_format import num, ratio, spread

__all__ = [
    "bench_fast_paths_block",
    "bench_gp_active_set_block",
    "bench_importance_masks_block",
    "bench_importance_masks_long_block",
    "bench_quadrature_nodes_block",
    "bench_transformers_block",
    "bench_vae_step_block",
    "benchmarks_block",
]


def _bench(ctx, key):
    report = ctx.json("benchmarks.json")["reports"].get(key)
    if report is None:
        raise KeyError(f"docs/results/benchmarks.json has no {key!r} report; rerun benchmarks.")
    return report


def _by_dtype(results, key):
    return {r["dtype"]: r[key] for r in results}


UNIFORM_LOSS = 'MPTLoss(rate="uniform")'

#: bench_vae_step loss name -> its row label.
VAE_STEP_LOSSES = {
    "quadrature": "Quadrature(20)",
    "importance 4": "ImportanceSampling(4)",
    "importance 16": "ImportanceSampling(16)",
    "encode-decode": "EncodeDecode(3)",
}


def bench_vae_step_block(ctx):
    report = _bench(ctx, "vae_step")
    cfg = report["config"]
    threads = ctx.json("benchmarks.json")["environment"]["threads"]
    caption = (
        f"{ctx.run_text('benchmarks')}, {ctx.code('bench_vae_step.py')}: one SVI step of "
        f"{ctx.code(UNIFORM_LOSS)} with each conditional strategy as a ratio "
        f"to a one-particle {ctx.code('Trace_ELBO')} step on the same model, float32 / "
        f"float64, {'one thread' if threads == 1 else f'{threads} threads'}, batches of "
        f"{cfg['subsample_size']} of "
        f"N={cfg['num_data']} binarised MNIST images (D={cfg['num_features']}); median of "
        f"{cfg['repeats']} repeats of {cfg['steps']} steps:"
    )
    cells = {}
    for r in report["results"]:
        cells.setdefault((r["model"], r["loss"]), {})[r["dtype"]] = r
    rows = []
    for loss, label in VAE_STEP_LOSSES.items():
        if loss == "quadrature":
            label += f" ({cfg['quadrature_nodes']} nodes)"
        row, target = [label], None
        for model in ("linear", "deep"):
            entry = cells.get((model, loss))
            if entry is None:
                row.append("–")
                continue
            row.append(" / ".join(ratio(entry[d]["ratio_to_elbo"]) for d in sorted(entry)))
            target = target or next(iter(entry.values()))["target_ratio"]
        rows.append(row + ([f"≤ {target:g}×"] if target is not None else ["–"]))
    headers = ["strategy", "linear VAE, K=2", "deep VAE, K=10", "target"]
    memory = report["memory"]
    note = (
        "One step on the linear VAE raises the process's peak memory by "
        + " / ".join(f"{m['quadrature_peak_delta_mib']:.0f}" for m in memory)
        + " MiB with quadrature and by "
        + " / ".join(f"{m['elbo_peak_delta_mib']:.0f}" for m in memory)
        + f" MiB with the ELBO ({' / '.join(m['dtype'] for m in memory)})."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def bench_fast_paths_block(ctx):
    """Each hand-written fast path of ``pyro_mpt.ops`` against its plain version."""
    report = _bench(ctx, "fast_paths")
    cfg = report["config"]
    every = cfg.get("every_mask")
    if every is None:
        raise KeyError("the fast_paths report has no every_mask figures; rerun benchmarks.")
    caption = (
        f"{ctx.run_text('benchmarks')}, {ctx.code('bench_fast_paths.py')}: one forward and "
        f"backward pass of each fast path and of the plain version it replaces, float32, "
        f"median of {cfg['repeats']} repeats of {cfg['steps']} calls; G={cfg['nodes']} nodes, "
        f"N={cfg['images']} images, D={cfg['pixels']} pixels, S={cfg['samples']} samples. The "
        f"every-mask average runs through a decoder's output layer (H={every['hidden']} "
        f"hidden units, S={every['samples']} samples of N={every['images']} images) with "
        f"log-ratios spread by {every['spread']:g} nats over the samples: "
        f"{every['plain_subnormal_share']:.1%} of the plain version's gradient entries at the "
        f"logits are subnormal, {every['fast_subnormal_share']:.1%} of the fast one's:"
    )
    rows = [
        [
            r["path"],
            f"{num(r['fast_ms'], 2)} ms",
            f"{num(r['plain_ms'], 2)} ms",
            ratio(r["speedup"]),
            "yes" if r["speedup"] >= cfg["target_speedup"] else "no",
        ]
        for r in report["results"]
    ]
    headers = ["path", "fast", "plain", "speed-up", f"≥ {cfg['target_speedup']:g}×"]
    return caption + "\n\n" + ctx.table(headers, rows)


def benchmarks_block(ctx):
    svi, woodbury = _bench(ctx, "svi_step"), _bench(ctx, "woodbury")
    scfg, wcfg = svi["config"], woodbury["config"]
    svi_ratio = _by_dtype(svi["results"], "ratio_mpt_over_elbo")
    loop = [r["speedup_vs_dense_loop"] for r in woodbury["results"] if "speedup_vs_dense_loop" in r]
    batched = [r["speedup_vs_dense_batched"] for r in woodbury["results"]]
    text = (
        f"One SVI step of {ctx.code('MPTLoss')} is "
        + " and ".join(f"{ratio(v)} ({d})" for d, v in sorted(svi_ratio.items()))
        + f" a {ctx.code('Trace_ELBO')} step with a mean-field guide on PPCA with "
        f"D={scfg['num_features']}, K={scfg['latent_dim']}, batch {scfg['subsample_size']} "
        f"(target ≤ {scfg['target_ratio']:g}×); the Woodbury conditionals are "
        + (f"{spread(loop)}× faster than a per-mask dense Schur complement and " if loop else "")
        + f"{spread(batched)}× faster than the batched dense path at D={wcfg['num_features']} "
        f"(float32 and float64; target ≥ {wcfg['target_speedup']:g}×)."
    )
    table1 = ctx.json("benchmarks.json")["reports"].get("table1")
    if table1:
        text += (
            f" {ctx.code('pyro-mpt reproduce ppca-table1')} took {table1['seconds']:.1f} s "
            f"in the same process (target ≤ {table1['config']['target_seconds']:g} s)."
        )
    return "\n\n".join([bench_vae_step_block(ctx), text])


def bench_gp_active_set_block(ctx):
    report = _bench(ctx, "gp_active_set")
    cfg = report["config"]
    exact = {r["dtype"]: r["speedup"] for r in report["results"] if r["case"] == "exact GP"}
    decoder = [r for r in report["results"] if r["case"] != "exact GP"]
    text = (
        f"{ctx.run_text('benchmarks')}, {ctx.code('bench_gp_active_set.py')}: on an exact GP "
        f"with one output (N={cfg['num_data']}), a training step of "
        f"{ctx.code('MaskedPredictiveLogLikelihood')} with |R|={cfg['context']} is "
        + " and ".join(f"{v:.1f}× ({d})" for d, v in sorted(exact.items()))
        + f" faster than one of {ctx.code('ExactMarginalLogLikelihood')} (target ≥ "
        f"{cfg['target_speedup']:g}×)"
    )
    if decoder:
        r = decoder[0]
        text += (
            f"; on {ctx.code('GPDecoder')} ({r['case']}, {r['dtype']}) the active set is "
            f"{r['speedup']:.1f}× faster than the exact log marginal likelihood (no target: the "
            "work in proportion to N D, which active sets do not remove, dominates both)"
        )
    return text + "."


def bench_transformers_block(ctx):
    reports = ctx.json("benchmarks.json")["reports"]
    parts = []
    collator = reports.get("collator")
    if collator:
        cfg = collator["config"]
        parts.append(
            f"{ctx.run_text('benchmarks')}, {ctx.code('bench_collator.py')}: "
            f"{ctx.code('MPTDataCollator')} costs "
            f"{spread([r['ratio'] for r in collator['results']], 2)}× the time per batch of "
            f"{ctx.code('transformers.DataCollatorForLanguageModeling')} ({cfg['batch']} "
            f"examples of {cfg['lengths'].replace('..', '–')} tokens; fixed, uniform and random "
            f"rates, whole words, spans; target ≤ {cfg['target_ratio']:g}×)."
        )
    curve = reports.get("mlm_curve")
    if curve:
        cfg, r = curve["config"], curve["results"][0]
        parts.append(
            f"{ctx.code('bench_mlm_curve.py')}, same run: "
            f"{ctx.code('pyro_mpt.transformers.mlm_mpt_curve')} takes "
            f"{r['mpt_curve_ms']:.0f} ms for "
            f"{r['masked_sequences']} masked sequences of a {cfg['model']}, a plain loop of "
            f"forward passes over the same batches {r['plain_loop_ms']:.0f} ms: loop/curve = "
            f"{r['ratio_loop_over_curve']:.2f} (target ≥ {cfg['target_ratio']:g})."
        )
    if not parts:
        return "The transformers benchmarks did not run (the optional extra is not installed)."
    return " ".join(parts)


#: The MPT rows' loss in bench_importance_masks_training.py.
MASKS_TRAINING_LOSS = 'MPTLoss(rate="uniform", num_masks=P, guide_loss="wake")'


def bench_importance_masks_block(ctx):
    """The frontier of masks and draws per image for MPT training of a deep VAE with
    importance-sampled conditionals (``bench_importance_masks_training.py``)."""
    report = ctx.json("importance-masks-training.json")
    cfg = report["config"]
    caption = (
        f"{ctx.run_text('importance-masks-training')}: a deep Bernoulli VAE "
        f"(K={cfg['latent']}, one tanh layer of {cfg['hidden']} units in decoder and encoder) "
        f"on N={cfg['N']} binarised MNIST images, {cfg['epochs']} epochs of batches of "
        f"{cfg['batch']}, Adam at {cfg['lr']:g}, {cfg['seeds']} seeds, each seed's rows from "
        f"one initialisation and on the same batches. MPT rows: "
        f"{ctx.code(MASKS_TRAINING_LOSS)} with "
        f"{ctx.code('ImportanceSampling(S, share_samples=True, num_proposals=Q)')}: Q of the "
        f"P masks per image draw S latents each, all P masks use the S·Q pooled draws "
        f"(the model's cost per image, as IWAE's with k = S·Q). Held-out LML per image on "
        f"{cfg['N_test']} images by the IWAE bound with each run's own encoder and "
        f"{cfg['eval_samples']} draws (per seed, then the mean); vs ELBO: paired by seed. "
        f"Step: median over {cfg['timing_rounds']} interleaved rounds of "
        f"{cfg['timing_steps']} optimiser steps on a batch, over a "
        f"{ctx.code('Trace_ELBO')} step's:"
    )
    rows = []
    for r in report["results"]:
        per_seed = ", ".join(num(v, 1) for v in r["held_out_per_seed"])
        gaps = ", ".join(num(v, 1, sign=True) for v in r["vs_elbo_per_seed"])
        rows.append(
            [
                r["row"],
                str(r["draws_per_image"]),
                f"{num(r['held_out'], 2)} ({per_seed})",
                "–" if r["row"] == "Trace_ELBO" else f"{num(r['vs_elbo'], 2, sign=True)} ({gaps})",
                ratio(r["step_vs_elbo"]),
            ]
        )
    headers = ["row", "draws per image", "held-out LML (per seed)", "vs ELBO", "step / ELBO"]
    return caption + "\n\n" + ctx.table(headers, rows)


def _mean_curve(result):
    """The held-out LML curve of a row, the mean over its seeds at each evaluated epoch."""
    curves = result["curves"]
    return [sum(values) / len(values) for values in zip(*curves)]


def bench_importance_masks_long_block(ctx):
    """Three rows of ``bench_importance_masks_training.py`` trained five times as long
    (``--long``): where each stands when the ELBO has levelled off."""
    report = ctx.json("importance-masks-long.json")
    cfg = report["config"]
    epochs = cfg["curve_epochs"]
    shown = [e for e in (20, 50, cfg["epochs"]) if e in epochs]
    caption = (
        f"{ctx.run_text('importance-masks-long')}: the model, data, held-out LML (own "
        f"encoder, IWAE bound with {cfg['eval_samples']} draws on {cfg['N_test']} images) and "
        f"step timing of the table above, {cfg['epochs']} epochs, the held-out LML every "
        f"{cfg['eval_every']} epochs, mean over {cfg['seeds']} seeds; best: the highest mean "
        f"over the evaluated epochs, and its epoch:"
    )
    curves = {r["row"]: _mean_curve(r) for r in report["results"]}
    elbo_best = max(curves["Trace_ELBO"])
    rows = []
    for r in report["results"]:
        curve = curves[r["row"]]
        best = max(curve)
        at = [num(curve[epochs.index(e)], 2) for e in shown]
        gap = "–" if r["row"] == "Trace_ELBO" else num(best - elbo_best, 2, sign=True)
        rows.append(
            [r["row"], str(r["draws_per_image"]), *at,
             f"{num(best, 2)} (epoch {epochs[curve.index(best)]})", gap,
             ratio(r["step_vs_elbo"])]
        )  # fmt: skip
    headers = ["row", "draws per image", *(f"epoch {e}" for e in shown), "best", "best − ELBO's"]
    headers.append("step / ELBO")
    elbo = curves["Trace_ELBO"]
    standing = [
        _standing_text(row, curve, elbo, epochs)
        for row, curve in curves.items()
        if row != "Trace_ELBO"
    ]
    return caption + "\n\n" + ctx.table(headers, rows) + "\n\n" + " ".join(standing)


def _standing_text(label, curve, elbo, epochs):
    """Where a row's last held-out LML stands against the ELBO row's curve (from which
    epoch on the ELBO stays ahead of it), and how much each moved over the last fifth of
    the evaluations."""
    final = curve[-1]
    since = None
    for epoch, value in reversed(list(zip(epochs, elbo))):
        if value <= final:
            break
        since = epoch
    if since is None:
        where = "at or above the ELBO's last figure"
    elif since == epochs[0]:
        where = "below the ELBO's at every evaluation"
    else:
        where = f"below the ELBO's at every evaluation from epoch {since} on"
    back = max(1, len(epochs) // 5)
    moved = num(final - curve[-1 - back], 2, sign=True)
    elbo_moved = num(elbo[-1] - elbo[-1 - back], 2, sign=True)
    return (
        f"{label}: {num(final, 2)} at epoch {epochs[-1]}, {where}; it moved by {moved} "
        f"from epoch {epochs[-1 - back]} (the ELBO by {elbo_moved})."
    )


def bench_quadrature_nodes_block(ctx):
    """Accuracy and cost of quadrature rules by their nodes (``bench_quadrature_nodes.py``)."""
    report = ctx.json("quadrature-nodes.json")
    cfg = report["config"]
    reference = cfg["reference_points"]
    caption = (
        f"{ctx.run_text('quadrature-nodes')}: a linear Bernoulli VAE "
        f"(K={cfg['latent']}) trained by {ctx.code('Trace_ELBO')} for {cfg['epochs']} epochs "
        f"on N={cfg['N']} binarised MNIST images, {cfg['dtype']}. Error: the mean over the "
        f"images of log p(x) under {ctx.code('Quadrature(n)')} (centred at the prior) minus "
        f"log p(x) under a {reference} × {reference} rule (mean "
        f"{num(cfg['reference_log_marginal'], 2)} nats per image), and the largest error of "
        f"one image. Time: one loss-and-gradient evaluation of "
        f"{ctx.code(UNIFORM_LOSS)} on a batch of {cfg['timing_batch']} over "
        f"one of {ctx.code('Trace_ELBO')} ({num(cfg['elbo_ms'], 2)} ms), median of "
        f"{cfg['timing_rounds']} interleaved rounds of {cfg['timing_calls']} calls:"
    )
    rows = [
        [
            str(r["num_points"]),
            str(r["nodes"]),
            num(r["mean_error"], 4, sign=True),
            num(r["max_abs_error"], 3),
            f"{num(r['evaluation_ms'], 2)} ms ({ratio(r['vs_elbo'])})",
        ]
        for r in report["results"]
    ]
    headers = ["num_points", "nodes", "LML error (nats per image)", "worst image", "time"]
    return caption + "\n\n" + ctx.table(headers, rows)
