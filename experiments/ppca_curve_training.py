"""Fig. 5 (left) of Moreno-Muñoz et al. (2023): the MPT curve ``M -> S(x; M)`` of a PPCA at
checkpoints of its training by MPT, and its area, which rises towards the exact log-marginal
likelihood as training proceeds.

Data: ``N`` draws of a ground-truth ``PPCA(D, K, init_scale=1.0, noise_scale=√0.2)`` (fixed
seed). Model: :class:`pyro_mpt.models.PPCA` (``W`` from ``N(0, 1)``, mean and noise scale
learned), trained with :class:`pyro.infer.SVI` on ``MPTLoss(rate="uniform")`` (one mask per
observation and step), full batch, Adam with learning rate ``1e-2``, 600 epochs. At epochs
``0, 100, ..., 600`` (the paper's checkpoints) it records the curve of
:func:`pyro_mpt.mpt_curve` over every mask size ``M = 1..D`` (``P`` masks per observation and
size), its area ``Σ_M S(x; M)`` with its Monte Carlo standard error
``(Σ_M se_M²)^½``, and the exact ``log p(x)`` of the model at that checkpoint
(:func:`pyro_mpt.log_marginal`); the exact LML is also recorded at every epoch, and the
ground-truth model's own curve and LML are drawn for reference. Everything is per
observation.

The paper does not state the size of its Fig. 5 PPCA (and its repository has no script for
it); the default here is ``N = 1000``, ``D = 50``, ``K = 5``, ``P = 10``. The curve's masks
are drawn per observation, which gives a far smaller standard error than masks shared by all
observations at the same ``P``; the random numbers of the curves are drawn aside from those of
training, so checkpoints do not change the training run.
"""

import pyro
import torch
from pyro.util import get_rng_state, set_rng_state

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from experiments._ppca import ground_truth, mean_log_marginal, trainee
from pyro_mpt import MPTLoss, mpt_curve

__all__ = ["NAME", "run"]

NAME = "ppca-curve-training"


def _config(smoke, full):
    base = dict(epochs=600, every=100, lr=1e-2, rate="uniform", noise_var=0.2)
    if smoke:
        return dict(base, N=200, D=10, K=2, P=5)
    if full:
        return dict(base, N=2000, D=50, K=5, P=100)
    return dict(base, N=1000, D=50, K=5, P=10)


def _curve(model, x, cfg, seed, *keys):
    """The model's MPT curve and exact LML, from random numbers of their own (the training
    stream is restored afterwards)."""
    state = get_rng_state()
    try:
        common.seed_everything(common.derived_seed(seed, *keys))
        with torch.no_grad(), common.Stopwatch() as watch:
            curve = mpt_curve(model.model, x, num_masks=cfg["P"])
            lml = mean_log_marginal(model, x)
    finally:
        set_rng_state(state)
    se = curve.area_stderr
    return dict(
        curve=curve,
        area=curve.area,
        area_stderr=se,
        log_marginal=lml,
        z=(curve.area - lml) / se,
        seconds=watch.seconds,
    )


def _measure(cfg, device, seed, progress):
    """The ground truth's curve, and the trained model's curve at every checkpoint and its
    exact LML at every epoch."""
    truth, x = ground_truth(
        cfg["N"], cfg["D"], cfg["K"], common.derived_seed(seed, 0), device, cfg["noise_var"]
    )
    reference = _curve(truth, x, cfg, seed, 3)
    model, svi = trainee(
        cfg["D"],
        cfg["K"],
        MPTLoss(rate=cfg["rate"]),
        cfg["lr"],
        common.derived_seed(seed, 1),
        device,
    )
    checkpoints, lml_trace = [], []
    bar = common.progress_bar(total=cfg["epochs"], enabled=progress, desc=NAME, unit="epoch")
    with common.Stopwatch() as train_watch, bar:
        for epoch in range(cfg["epochs"] + 1):
            if epoch % cfg["every"] == 0:
                point = _curve(model, x, cfg, seed, 2, epoch)
                checkpoints.append(dict(epoch=epoch, **point))
                bar.set_postfix_str(f"epoch {epoch}: area {point['area']:.2f}")
            lml_trace.append(mean_log_marginal(model, x))
            if epoch < cfg["epochs"]:
                svi.step(x)
                bar.update()
    pyro.clear_param_store()
    curve_seconds = sum(c["seconds"] for c in checkpoints)
    return dict(
        reference=reference,
        checkpoints=checkpoints,
        lml_trace=lml_trace,
        train_seconds=train_watch.seconds - curve_seconds,
        curve_seconds=curve_seconds,
    )


def _report(cfg, measured):
    reference, checkpoints = measured["reference"], measured["checkpoints"]
    truth_lml = reference["log_marginal"]
    rows = [
        [
            str(c["epoch"]),
            f"{c['area']:.3f} ± {c['area_stderr']:.3f}",
            f"{c['log_marginal']:.3f}",
            f"{c['z']:+.2f}",
            f"{c['log_marginal'] - truth_lml:+.3f}",
        ]
        for c in checkpoints
    ]
    rows.append(
        [
            "ground truth",
            f"{reference['area']:.3f} ± {reference['area_stderr']:.3f}",
            f"{truth_lml:.3f}",
            f"{reference['z']:+.2f}",
            "",
        ]
    )
    title = (
        f"Fig. 5 left (PPCA N={cfg['N']}, D={cfg['D']}, K={cfg['K']}; SVI + "
        f"MPTLoss(rate={cfg['rate']!r}), 1 mask per observation and step, full batch, Adam lr "
        f"{cfg['lr']}, {cfg['epochs']} epochs): per observation, area = sum over M=1..D of "
        f"S(x; M) from P={cfg['P']} masks per observation and size, ± its Monte Carlo "
        "standard error;\nz = (area - exact LML) / se; GT = the data-generating model."
    )
    headers = ["epoch", "area ± se", "exact LML", "z", "LML - GT LML"]
    train_seconds, curve_seconds = measured["train_seconds"], measured["curve_seconds"]
    notes = [f"training {train_seconds:.1f} s; {len(checkpoints)} curves {curve_seconds:.1f} s"]
    results = dict(
        ground_truth=_entry(reference),
        checkpoints=[dict(epoch=c["epoch"], **_entry(c)) for c in checkpoints],
        log_marginal_per_epoch=measured["lml_trace"],
        train_seconds=train_seconds,
        curve_seconds=curve_seconds,
    )
    fig = _figure(checkpoints, reference, measured["lml_trace"], cfg)
    return Report(common.format_table(headers, rows, title=title, notes=notes), fig, results)


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 5 (left); writes ``ppca-curve-training.json`` and
    ``ppca-curve-training.png``.

    ``smoke``: ``N = 200``, ``D = 10``, ``K = 2``, ``P = 5`` (a few seconds); ``full``:
    ``N = 2000`` and ``P = 100`` masks per observation and size. The other arguments are
    those of :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report,
        device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 5 (left)",
        settings=dict(masks_per_step=1, curve_masks="per observation", dtype="float64"),
    )  # fmt: skip


def _entry(point):
    curve = point["curve"]
    return dict(
        {k: v for k, v in point.items() if k not in ("curve", "epoch")},
        sizes=curve.sizes[0],
        rates=curve.rates,
        scores=curve.scores,
        stderr=curve.stderr,
    )


def _figure(checkpoints, reference, lml_trace, cfg):
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    fig, (left, right) = common.new_figure(2, width=5.2)
    cmap, norm = colormaps["viridis"], Normalize(0, cfg["epochs"])
    for c in checkpoints:
        rates = 100 * c["curve"].rates
        left.plot(
            rates, c["curve"].scores, color=cmap(norm(c["epoch"])), lw=1.5, label=f"{c['epoch']}"
        )
    left.plot(
        100 * reference["curve"].rates,
        reference["curve"].scores,
        color="k",
        ls="--",
        lw=1.2,
        label="ground truth",
    )
    left.set_xlabel("% of features masked (100 M / D)")
    left.set_ylabel("S(x; M) per feature (nats)")
    left.set_title(f"MPT curves over training (D={cfg['D']}, K={cfg['K']})", fontsize="medium")
    left.legend(title="epoch", fontsize="small", ncol=2, loc="center left")

    _plot_areas(right, checkpoints, lml_trace, reference, cmap, norm, labels=True)
    right.set_xlabel("epoch")
    right.set_ylabel("per observation (nats)")
    right.set_title("area vs exact LML", fontsize="medium")
    right.legend(fontsize="small", loc="lower right")
    start = cfg["epochs"] // 2  # an inset of the second half, where area and LML are close
    inset = right.inset_axes([0.4, 0.3, 0.55, 0.38])
    _plot_areas(inset, checkpoints, lml_trace, reference, cmap, norm, start=start, lw=1.0)
    inset.tick_params(labelsize="x-small")
    inset.set_title(f"epochs {start}-{cfg['epochs']}", fontsize="x-small")
    return fig


def _plot_areas(ax, checkpoints, lml_trace, reference, cmap, norm, start=0, labels=False, lw=1.2):
    """From epoch ``start`` on: the exact LML per epoch, the checkpoints' areas (± 2 se,
    coloured by epoch) and the ground-truth LML."""
    late = [c for c in checkpoints if c["epoch"] >= start]
    epochs, areas = [c["epoch"] for c in late], [c["area"] for c in late]
    label = (lambda text: text) if labels else (lambda text: None)
    ax.plot(
        range(start, len(lml_trace)),
        lml_trace[start:],
        color="C0",
        lw=1.2,
        label=label("exact LML"),
    )
    ax.errorbar(
        epochs,
        areas,
        yerr=[2 * c["area_stderr"] for c in late],
        fmt="none",
        ecolor="k",
        elinewidth=1,
        capsize=3,
        zorder=2,
    )
    ax.scatter(
        epochs,
        areas,
        c=[cmap(norm(e)) for e in epochs],
        edgecolors="k",
        zorder=3,
        label=label("area under the curve (± 2 se)"),
    )
    ax.axhline(
        reference["log_marginal"], color="k", ls="--", lw=lw, label=label("ground-truth LML")
    )
