"""What ``vae-deep`` prints and draws: the table with the verdict under it (:func:`report`)
and the figure (:func:`figure`): per group the objective and the own-encoder held-out LML
per epoch, and the held-out LML gap to the ELBO against the step time."""

from experiments import _common as common
from experiments._experiment import Report
from experiments._vae_deep_summary import TARGET, target_cell, verdict
from experiments._vae_deep_training import ALL_METHODS, GROUPS, masks_text

__all__ = ["GUIDE_TRAINED_BY", "figure", "report", "verdict_lines"]

#: (objective, guide_loss) -> what trains the encoder, as the table says it.
GUIDE_TRAINED_BY = {
    ("elbo", None): "ELBO",
    ("iwae", None): "IWAE",
    ("mpt", None): "MPT gradient",
    ("mpt", "elbo"): "ELBO",
    ("mpt", "wake"): "wake phase",
}


def _color(run):
    """One colour per objective, the same in every panel."""
    return f"C{list(GUIDE_TRAINED_BY).index((run['loss_kind'], run['guide_loss']))}"


def _groups(runs):
    return [g for g in GROUPS if any(r["group"] == g for r in runs.values())]


def figure(runs, cfg):
    """One panel per group: per epoch (from 1), the mean over seeds of each row's objective
    (dashed) and of its held-out LML with its own encoder (solid, epoch 0 being the
    initialisation); a last panel: each row's held-out LML with a fresh encoder minus the
    ELBO row's (mean ± sd over seeds) against its step time in ELBO steps."""
    groups = _groups(runs)
    fig, axes = common.new_figure(len(groups) + 1, width=4.6)
    epochs = list(range(cfg["epochs"] + 1))
    for ax, group in zip(axes, groups):
        names = [n for n in runs if runs[n]["group"] == group]
        for name in names:
            r = runs[name]
            color = _color(r)
            held_out = [r["initial_held_out_log_marginal"]] + r["held_out_log_marginal"]
            ax.plot(epochs, held_out, color=color, lw=1.5, label=r["label"])
            ax.plot(epochs[1:], r["objective"], color=color, lw=1, ls="--")
        # The first epoch climbs from far below: show the range the curves end in.
        ends = [runs[n][k][-1] for n in names for k in ("held_out_log_marginal", "objective")]
        span = max(ends) - min(ends)
        ax.set_ylim(min(ends) - span - 30, max(ends) + 0.3 * span + 5)
        ax.set_title(f"{group}: held-out LML, own encoder (solid); objective (dashed)", fontsize=8)
        ax.set_xlabel("epoch")
        ax.set_ylabel("nats per image")
        ax.legend(fontsize="x-small", loc="lower right")
    ax = axes[-1]
    for g, group in enumerate(groups):
        for name in [n for n in runs if runs[n]["group"] == group and runs[n]["gap"] is not None]:
            r = runs[name]
            ax.errorbar(
                r["step_ratio"], r["gap"], yerr=r["gap_sd"], fmt="os^"[g % 3],
                color=_color(r),
                label=f"{group}: {r['label']}", ms=5, capsize=2,
            )  # fmt: skip
    ax.axhline(TARGET["min_gap"], color="k", lw=0.8)
    ax.axvline(TARGET["max_step_ratio"], color="k", lw=0.8, ls=":")
    ax.set_xlabel("step time / Trace_ELBO step")
    ax.set_ylabel("held-out LML − ELBO's (fresh encoder, nats)")
    ax.set_title("target: on or above the line, left of the dotted one", fontsize=8)
    ax.legend(fontsize="xx-small", loc="best")
    return fig


def _cell(r, key, seeds):
    """``mean ± sd`` of ``r[key]`` over the seeds; empty when it is not measured."""
    if r[key] is None:
        return ""
    return common.spread_cell((r[key], r[f"{key}_sd"]), 2, seeds)


def _row(name, r, checks, cfg):
    corr = [c for c in r["correlation"] if c is not None]
    return [
        name,
        GUIDE_TRAINED_BY[(r["loss_kind"], r["guide_loss"])],
        f"{r['step_ratio']:.2f}",
        _cell(r, "test_log_marginal", cfg["seeds"]),
        _cell(r, "gap", cfg["seeds"]),
        _cell(r, "quadrature_minus_iwae", cfg["seeds"]),
        f"{r['held_out_log_marginal'][-1]:.2f}",
        f"{min(corr):.2f}" if corr else "–",
        target_cell(checks),
    ]


def verdict_lines(target, runs):
    """Sentences of the verdict: one per group, and the answer."""
    lines = []
    for group, g in target["groups"].items():
        if g["met"] is None:
            lines.append(f"{group}: not judged (no ELBO row, or no MPT row without the ELBO).")
            continue
        # The row the sentence is about: the best that passes, else the closest.
        name = max(g["passed"], key=lambda n: runs[n]["gap"]) if g["passed"] else g["closest"]
        r, checks = runs[name], g["checks"][name]
        lines.append(
            f"{group}: target {'met' if g['met'] else 'NOT met'} by {r['label']}: held-out "
            f"LML {r['gap']:+.2f} ± {r['gap_sd']:.2f} nats from the ELBO's, step "
            f"{r['step_ratio']:.2f}× an ELBO step, rising together: "
            f"{'yes' if checks['rising_together'] else 'no'}"
            + ("." if g["met"] else f" ({target_cell(checks)[4:]}).")
        )
    answer = {True: "yes, in every group judged", False: "no", None: "not judged"}
    lines.append(f"Answer: {answer[target['met']]}.")
    return lines


def report(cfg, measured):
    """The experiment's :class:`~experiments._experiment.Report`: the table with the
    verdict under it, the figure, and the result fields (the measured runs and the
    verdict)."""
    runs, skipped = measured["runs"], measured["skipped"]
    target = verdict(runs, ALL_METHODS, skipped)
    rows = []
    for group in _groups(runs):
        checks = target["groups"][group]["checks"]
        rows += [_row(n, r, checks.get(n), cfg) for n, r in runs.items() if r["group"] == group]
    title = (
        f"{target['question']}\nDeep VAE on MNIST, N={cfg['N']} training and {cfg['N_test']} "
        f"held-out images, {cfg['hidden']} hidden units, Adam lr {cfg['lr']}, batch "
        f"{cfg['batch']}, {cfg['epochs']} epochs, S={cfg['train_samples']} importance samples "
        f"per image ({masks_text(cfg)}; with the unmasked proposal, "
        f"{masks_text(cfg, 'masks+unmasked')}; with the unmasked proposal only, "
        f"{masks_text(cfg, 'unmasked')}; over every mask, {masks_text(cfg, 'every mask')}) "
        f"and IWAE particles, "
        f"{cfg['seeds']} seeds (mean ± sd). Held-out LML: a fresh encoder "
        f"fitted to each frozen decoder ({cfg['refit_steps']} steps of IWAE, "
        f"k={cfg['refit_samples']}), then the IWAE bound with S={cfg['final_samples']}."
    )
    headers = ["row", "guide by", "step/ELBO", "held-out LML", "vs ELBO", "quad-IWAE"]
    headers += [f"own enc. k={cfg['eval_samples']}", "min rank corr", "target"]
    notes = verdict_lines(target, runs)
    notes += [f"skipped {n}: {why}" for n, why in skipped.items()]
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, figure(runs, cfg), dict(measured, target=target))
