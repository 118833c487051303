"""One table for both VAE reproductions: ELBO against MPT with a uniform and a fixed rate.

Runs ``vae-linear`` (quadrature conditionals) and the Bernoulli rows of ``vae-deep``
(encode-decode conditionals) with the same options, each writing its own JSON and PNG, and
gathers per model and objective the final training LML, the held-out LML and the training
wall time per epoch into ``vae-compare.json`` / ``vae-compare.png``. The LMLs are the
reference evaluators of each reproduction (fine quadrature for the linear VAE, importance
sampling for the deep one), per image in nats.
"""

from pyro_mpt.reproduce import _common as common
from pyro_mpt.reproduce import vae_deep, vae_linear

__all__ = ["NAME", "comparison_rows", "run"]

NAME = "vae-compare"


def comparison_rows(linear, deep):
    """Rows ``(model, objective, final LML, held-out LML, s/epoch)`` from the results of
    :func:`pyro_mpt.reproduce.vae_linear.run` and :func:`pyro_mpt.reproduce.vae_deep.run`."""
    rows = []
    for name, summary in linear["summary"].items():
        rows.append(
            dict(
                model="linear VAE (quadrature)",
                objective=name,
                log_marginal=summary["final_log_marginal_train"],
                held_out_log_marginal=summary["final_log_marginal_held_out"],
                seconds_per_epoch=summary["seconds_per_epoch"],
            )
        )
    for name, run in deep["runs"].items():
        seconds = run["seconds_per_epoch"]
        rows.append(
            dict(
                model="deep VAE (encode-decode)",
                objective=name,
                log_marginal=run["log_marginal"][-1],
                held_out_log_marginal=run["test_log_marginal"],
                seconds_per_epoch=sum(seconds) / len(seconds),
            )
        )
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


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Runs ``vae-linear`` and ``vae-deep`` and writes ``vae-compare.json`` and
    ``vae-compare.png`` beside their outputs.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: both reproductions at smoke size (seconds).
    :param bool full: both at the paper's sizes.
    :param int seed: base seed, passed to both.
    :param bool progress: show progress bars.
    :returns: the results dict (also written as JSON).
    """
    total = common.Stopwatch()
    options = dict(device=device, smoke=smoke, full=full, seed=seed, progress=progress)
    linear = vae_linear.run(out_dir, **options)
    deep = vae_deep.run(out_dir, methods=list(vae_deep.METHODS), **options)  # Bernoulli rows
    rows = comparison_rows(linear, deep)
    table = [
        [
            r["model"],
            r["objective"],
            f"{r['log_marginal']:.2f}",
            f"{r['held_out_log_marginal']:.2f}",
            f"{r['seconds_per_epoch']:.2f}",
        ]
        for r in rows
    ]
    headers = ["model", "objective", "final LML", "held-out LML", "s/epoch"]
    title = (
        f"ELBO vs MPT on binarised MNIST (linear VAE N={linear['config']['N']}, deep VAE "
        f"N={deep['config']['N']}): per image in nats; s/epoch = training only."
    )
    notes = [
        "LML: 60x60 Gauss-Hermite nodes (linear), importance sampling with the guide "
        f"(deep, S={deep['config']['eval_samples']}).",
        "Deep VAE MPT rows train the decoder by MPT and the encoder by the ELBO, except the last.",
    ]
    print(common.format_table(headers, table, title=title, notes=notes))
    results = dict(
        experiment=NAME,
        config=dict(smoke=smoke, full=full, seed=seed, device=str(device)),
        rows=rows,
        sources=dict(linear=linear["outputs"], deep=deep["outputs"]),
        wall_seconds=total.elapsed,
    )
    return common.save_outputs(out_dir, NAME, results, _figure(rows))
