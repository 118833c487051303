"""One table for both VAE reproductions: ELBO against MPT with a uniform and a fixed rate.

Runs ``vae-linear`` (quadrature conditionals) and the Bernoulli rows of ``vae-deep``
(encode-decode conditionals) with the same options, each writing its own JSON and PNG, and
gathers per model and objective the final training LML, the held-out LML and the training
wall time per epoch into ``vae-compare.json`` / ``vae-compare.png``. The LMLs are the
reference evaluators of each reproduction (fine quadrature for the linear VAE, importance
sampling for the deep one), per image in nats.
"""

import functools

from experiments import _common as common
from experiments import vae_deep, vae_linear
from experiments._experiment import Report, run_experiment

__all__ = ["EPOCH_WALL_TIME", "NAME", "STEP_TIMES_STEPS", "comparison_rows", "run"]

NAME = "vae-compare"


#: How each row's seconds per epoch were measured (the ``timing`` field of a row).
EPOCH_WALL_TIME = "mean wall time of a training epoch"
STEP_TIMES_STEPS = (
    "vae-deep's median time of one training step, interleaved with the other rows' steps "
    "after warm-up steps, times the steps of an epoch"
)


def _row(model, objective, log_marginal, held_out_log_marginal, seconds_per_epoch, timing):
    return dict(
        model=model,
        objective=objective,
        log_marginal=log_marginal,
        held_out_log_marginal=held_out_log_marginal,
        seconds_per_epoch=seconds_per_epoch,
        timing=timing,
    )


def comparison_rows(linear, deep):
    """Rows ``(model, objective, final LML, held-out LML, s/epoch)`` from the results of
    :func:`experiments.vae_linear.run` and :func:`experiments.vae_deep.run`."""
    rows = [
        _row(
            "linear VAE (quadrature)",
            name,
            s["final_log_marginal_train"],
            s["final_log_marginal_held_out"],
            s["seconds_per_epoch"],
            EPOCH_WALL_TIME,
        )
        for name, s in linear["summary"].items()
    ]
    # Before the seeded layout the deep rows used encode-decode conditionals, since then
    # importance sampling.
    seeded = "iterations" not in deep["config"]
    model = "deep VAE (importance)" if seeded else "deep VAE (encode-decode)"
    batch = deep["config"].get("batch") if seeded else None
    steps = -(-deep["config"]["N"] // batch) if batch else None
    for name, r in deep["runs"].items():
        if "step_seconds" in r and steps:
            # The timing vae-deep's own table uses, so that both give the same ratios.
            seconds, timing = r["step_seconds"] * steps, STEP_TIMES_STEPS
        else:
            seconds = sum(r["seconds_per_epoch"]) / len(r["seconds_per_epoch"])
            timing = EPOCH_WALL_TIME
        held_out = r["test_log_marginal"]
        rows.append(_row(model, name, r["log_marginal"][-1], held_out, seconds, timing))
    return rows


def _figure(rows):
    fig, axes = common.new_figure(2, width=5.5)
    labels = [f"{r['model'].split(' (')[0]}\n{r['objective']}" for r in rows]
    colors = ["C0" if r["model"].startswith("linear") else "C1" for r in rows]
    positions = range(len(rows))
    axes[0].barh(positions, [r["held_out_log_marginal"] for r in rows], color=colors)
    axes[0].set_title("held-out LML per image (nats; right is better)")
    axes[1].barh(positions, [r["seconds_per_epoch"] for r in rows], color=colors)
    axes[1].set_title("training seconds per epoch")
    for ax in axes:
        ax.set_yticks(list(positions))
        ax.set_yticklabels(labels, fontsize="x-small")
        ax.invert_yaxis()
    lml = [r["held_out_log_marginal"] for r in rows]
    span = max(lml) - min(lml)
    axes[0].set_xlim(min(lml) - 0.1 * span - 1, max(lml) + 0.1 * span + 1)
    return fig


def _config(smoke, full):
    # No sizes of its own: the size flags, so that its JSON config reads smoke, full, seed, device.
    return dict(smoke=smoke, full=full)


def _measure(cfg, device, seed, progress, out_dir):
    """The results of both reproductions, run with the same options (Bernoulli rows only
    for the deep VAE)."""
    options = dict(device=str(device), **cfg, seed=seed, progress=progress)
    linear = vae_linear.run(out_dir, **options)
    deep = vae_deep.run(out_dir, methods=list(vae_deep.METHODS), **options)
    return linear, deep


def _report(cfg, measured):
    linear, deep = measured
    rows = comparison_rows(linear, deep)
    keys = ("log_marginal", "held_out_log_marginal", "seconds_per_epoch")
    table = [[r["model"], r["objective"]] + [f"{r[k]:.2f}" for k in keys] for r in rows]
    headers = ["model", "objective", "final LML", "held-out LML", "s/epoch"]
    title = (
        f"ELBO vs MPT on binarised MNIST (linear VAE N={linear['config']['N']}, deep VAE "
        f"N={deep['config']['N']}): per image in nats; s/epoch = training only."
    )
    notes = [
        "LML: 60x60 Gauss-Hermite nodes (linear), importance sampling with the guide "
        f"(deep, S={deep['config']['eval_samples']}).",
        "Deep VAE MPT rows train the decoder by MPT and the encoder by the ELBO, except the last.",
        "s/epoch: "
        + "; ".join(
            f"{model}: {timing}"
            for model, timing in dict.fromkeys((r["model"], r["timing"]) for r in rows)
        )
        + ".",
    ]
    # The result files only: the figures are not committed beside them.
    sources = dict(linear=linear["outputs"]["json"], deep=deep["outputs"]["json"])
    shown = common.format_table(headers, table, title=title, notes=notes)
    return Report(shown, _figure(rows), dict(rows=rows, sources=sources))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Runs ``vae-linear`` and ``vae-deep`` and writes ``vae-compare.json`` and
    ``vae-compare.png`` beside their outputs. ``smoke`` and ``full`` choose the size of both;
    the arguments are passed to both and are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, functools.partial(_measure, out_dir=out_dir), _report,
        device, smoke, full, seed, progress,
    )  # fmt: skip
