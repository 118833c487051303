"""Fig. 2 of Moreno-Muñoz et al. (2023): training a PPCA by masked pre-training raises its
exact log-marginal likelihood, with a uniform masking rate (an unbiased objective) and with
a fixed 20% rate (an objective with a constant bias).

Data: ``N = 2000`` draws of a ground-truth ``PPCA(10, 2, init_scale=1.0,
noise_scale=√0.2)`` (fixed seed). Model: :class:`pyro_mpt.models.PPCA` (``W``, mean and
noise scale learned, ``W`` initialised from ``N(0, 1)``), trained with :class:`pyro.infer.SVI`
on ``MPTLoss(rate="uniform")`` or ``MPTLoss(rate=0.2)`` (``M = 2`` of 10 features), one mask
per observation and step (``P = 1``), full batch, Adam with learning rate ``1e-2``, five
random initialisations. Each epoch records the negative loss per observation (the MPT
objective, evaluated before the step) and the exact ``log p(x)`` per observation at the same
parameters.

**Mask conventions** (``masks``). ``"per-observation"``: each observation draws its own mask
every step (``MPTLoss(rate)``, the ordinary use). ``"shared"``: the paper's scripts, which
draw ``D`` masks per step, each shared by all ``N`` observations
(``MPTLoss(rate, num_masks=D, share_masks=True)``, see :func:`mpt_loss`): with the uniform
rate one mask of every size ``M = 1..D`` (the sizes are stratified), with the fixed 20% rate
``D`` masks of ``M = 2`` features (``exp_3_training_fig2.py`` loops ``D`` times over the same
``M = int(0.2 D)``). Both conventions start from the same initialisations.

For each run the table gives the distance of its final exact LML to the ground truth (the LML
of the data-generating model on the same data), as mean ± sd over the initialisations and in
standard errors of that mean, and its distance to the largest LML any PPCA reaches on these
data (the closed-form maximum-likelihood PPCA of Tipping & Bishop, 1999), which lies above
the ground truth: a run that maximises the LML ends there, not at the ground truth.

.. note:: The paper's script learns only ``W`` (mean 0 and noise variance 0.2 fixed) and adds
    one noise draw per observation to all features; here the mean and the noise scale are
    learned too, and the data are drawn from the ground-truth PPCA itself.
"""

import functools
import math

import pyro
import torch

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from experiments._ppca import (
    ground_truth,
    maximum_log_marginal,
    mean_log_marginal,
    trainee,
)
from pyro_mpt import MPTLoss

__all__ = [
    "CONVENTIONS",
    "NAME",
    "SCHEDULES",
    "maximum_log_marginal",
    "mpt_loss",
    "run",
    "run_name",
    "standard_errors",
]

NAME = "ppca-training"

#: Objective name -> the ``rate`` argument of :class:`~pyro_mpt.MPTLoss`.
SCHEDULES = {"uniform": "uniform", "fixed 20%": 0.2}

#: Mask conventions: each observation its own mask per step, or the paper's ``D`` masks per
#: step shared by all observations.
CONVENTIONS = ("per-observation", "shared")


def mpt_loss(rate, masks, num_features):
    """The :class:`~pyro_mpt.MPTLoss` of one run.

    :param rate: a value of :data:`SCHEDULES`.
    :param str masks: ``"per-observation"`` (one mask per observation and step) or
        ``"shared"`` (the paper's scripts: ``D`` masks per step, each used for every
        observation; with ``rate="uniform"`` one of each size ``1..D``).
    :param int num_features: ``D``.
    """
    if masks == "per-observation":
        return MPTLoss(rate=rate)
    if masks == "shared":
        return MPTLoss(rate=rate, num_masks=num_features, share_masks=True)
    raise ValueError(f"masks={masks!r} is not known; use one of {CONVENTIONS}.")


def run_name(schedule, masks):
    """The key of a run in the results: the schedule's name, plus ``", shared masks"`` for
    the paper's convention (the per-observation runs keep the plain names)."""
    return schedule if masks == "per-observation" else f"{schedule}, shared masks"


def _config(smoke, full):
    if smoke:
        return dict(N=500, D=10, K=2, epochs=20, inits=2, lr=1e-2)
    return dict(N=2000, D=10, K=2, epochs=1000, inits=5, lr=1e-2)


def standard_errors(values, reference):
    """``(mean - reference) / (sd / sqrt(n))`` of ``values``: how many standard errors of the
    mean over the runs separate their mean from ``reference`` (``nan`` for fewer than two
    runs or identical values)."""
    mean, std = common.mean_std(values)
    if len(values) < 2 or std == 0:
        return math.nan
    return (mean - reference) / (std / math.sqrt(len(values)))


def _train(x, cfg, loss, seed, bar):
    model, svi = trainee(cfg["D"], cfg["K"], loss, cfg["lr"], seed, x.device)
    objective, lml = [], []
    for _ in range(cfg["epochs"]):
        lml.append(mean_log_marginal(model, x))
        objective.append(-svi.step(x) / x.shape[0])
        bar.update()
    return objective, lml


def _tail_mean(values, window):
    return sum(values[-window:]) / len(values[-window:])


def _measure(cfg, device, seed, progress, masks):
    """Trains every (convention, schedule) from the same initialisations, on data from the
    ground truth; also the ground truth's LML and the largest LML a PPCA reaches on them."""
    truth, x = ground_truth(cfg["N"], cfg["D"], cfg["K"], common.derived_seed(seed, 0), device)
    truth_lml = mean_log_marginal(truth, x)
    runs, settings = {}, {}
    work = len(masks) * len(SCHEDULES) * cfg["inits"] * cfg["epochs"]
    with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="epoch") as bar:
        for convention in masks:
            for schedule, rate in SCHEDULES.items():
                name = run_name(schedule, convention)
                loss = mpt_loss(rate, convention, cfg["D"])
                settings[name] = dict(
                    schedule=schedule,
                    masks=convention,
                    masks_per_step=loss.num_masks,
                    share_masks=loss.share_masks,
                )
                runs[name] = []
                for init in range(cfg["inits"]):
                    # The same initialisations for every schedule and convention.
                    init_seed = common.derived_seed(seed, 1, init)
                    with common.Stopwatch() as watch:
                        objective, lml = _train(x, cfg, loss, init_seed, bar)
                    runs[name].append(
                        dict(objective=objective, log_marginal=lml, seconds=watch.seconds)
                    )
                    bar.set_postfix_str(f"{name} init {init}: LML {lml[-1]:.3f}")
    pyro.clear_param_store()
    return dict(
        truth_lml=truth_lml,
        max_lml=maximum_log_marginal(x, cfg["K"]),
        runs=runs,
        settings=settings,
        masks=masks,
    )


def _window(cfg):
    """How many last epochs the final values average over."""
    return max(1, cfg["epochs"] // 20)


def _summary(cfg, results, truth_lml, max_lml):
    """One run's final objective, LML and bias, and its distances to the reference LMLs."""
    window = _window(cfg)
    final_obj = [_tail_mean(r["objective"], window) for r in results]
    final_lml = [_tail_mean(r["log_marginal"], window) for r in results]
    return dict(
        final_objective=common.mean_std(final_obj),
        final_log_marginal=common.mean_std(final_lml),
        bias=common.mean_std([o - lml for o, lml in zip(final_obj, final_lml)]),
        first_log_marginal=common.mean_std([r["log_marginal"][0] for r in results]),
        distance_to_truth=common.mean_std([lml - truth_lml for lml in final_lml]),
        distance_to_truth_se=standard_errors(final_lml, truth_lml),
        distance_to_maximum=common.mean_std([lml - max_lml for lml in final_lml]),
        seconds_per_epoch=sum(r["seconds"] for r in results) / (len(results) * cfg["epochs"]),
    )


def _report(cfg, measured):
    runs, truth_lml, max_lml = measured["runs"], measured["truth_lml"], measured["max_lml"]
    summary, rows = {}, []
    for name, results in runs.items():
        s = summary[name] = dict(
            _summary(cfg, results, truth_lml, max_lml), **measured["settings"][name]
        )
        rows.append(
            [
                name,
                common.pm(*s["final_objective"], 3),
                common.pm(*s["final_log_marginal"], 3),
                f"{truth_lml:.3f}",
                common.pm(*s["distance_to_truth"], 3),
                f"{s['distance_to_truth_se']:+.1f}",
                common.pm(*s["distance_to_maximum"], 3),
                common.pm(*s["bias"], 3),
                f"{1000 * s['seconds_per_epoch']:.1f}",
            ]
        )
    title = (
        f"Fig. 2 (PPCA N={cfg['N']}, D={cfg['D']}, K={cfg['K']}; SVI + MPTLoss, full batch, "
        f"Adam lr {cfg['lr']}, {cfg['epochs']} epochs, {cfg['inits']} inits): per observation, "
        f"mean ± std over inits;\nfinal = mean of the last {_window(cfg)} epochs; LML - GT = "
        "final LML - ground-truth LML (in se: in standard errors of the mean over inits); LML "
        f"- max = final LML - the maximum-likelihood PPCA's LML ({max_lml:.3f}); bias = final "
        "objective - final LML. Masks: one per "
        f"observation and step, or 'shared masks' (the paper's: D={cfg['D']} masks per step, "
        "each used for all observations)."
    )
    headers = ["objective", "final MPT objective", "final exact LML", "GT LML", "LML - GT"]
    headers += ["in se", "LML - max", "bias", "ms/epoch"]
    results = dict(
        ground_truth_log_marginal=truth_lml,
        maximum_log_marginal=max_lml,
        summary=summary,
        # Per schedule: the runs with per-observation masks, and with the paper's shared ones.
        runs={s: runs[n] for s in SCHEDULES if (n := run_name(s, "per-observation")) in runs},
        shared_mask_runs={s: runs[n] for s in SCHEDULES if (n := run_name(s, "shared")) in runs},
    )
    fig = _figure(runs, measured["masks"], cfg, truth_lml)
    return Report(common.format_table(headers, rows, title=title), fig, results)


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, masks=CONVENTIONS):
    """Reproduces Fig. 2; writes ``ppca-training.json`` and ``ppca-training.png``.

    ``smoke``: 20 epochs, 2 initialisations, ``N = 500`` (seconds); ``full`` is accepted for
    uniformity, the default already has the paper's sizes (1000 epochs). ``masks``: the mask
    conventions to train with, from :data:`CONVENTIONS` (default: both). The other arguments
    are those of :func:`~experiments._experiment.run_experiment`.
    """
    common.check_size(smoke, full)
    masks = (masks,) if isinstance(masks, str) else tuple(masks)
    unknown = [m for m in masks if m not in CONVENTIONS]
    if unknown or not masks:
        raise ValueError(f"masks={masks!r}: choose one or more of {CONVENTIONS}.")
    cfg = _config(smoke, full)
    settings = dict(
        schedules={k: str(v) for k, v in SCHEDULES.items()},
        masks=list(masks),
        masks_per_step=1,
        shared_masks_per_step=cfg["D"],
        dtype="float64",
        final_window=_window(cfg),
    )
    return run_experiment(
        NAME, out_dir, _config, functools.partial(_measure, masks=masks), _report,
        device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 2",
        settings=settings,
    )  # fmt: skip


def _figure(runs, masks, cfg, truth_lml):
    """One row of panels per mask convention: each schedule's runs, and the second half of
    training of both."""
    from matplotlib.figure import Figure

    width, height = 4.8, 3.8
    fig = Figure(figsize=(3 * width, len(masks) * height), layout="constrained")
    grid = fig.subplots(len(masks), 3, squeeze=False)
    epochs = list(range(cfg["epochs"]))
    start = cfg["epochs"] // 2
    for axes, convention in zip(grid, masks):
        names = [run_name(schedule, convention) for schedule in SCHEDULES]
        where = "per observation" if convention == "per-observation" else "shared, D per step"
        for ax, schedule, name in zip(axes[:2], SCHEDULES, names):
            _plot_runs(ax, epochs, runs[name])
            ax.set_title(f"MPT, {schedule} masking rate (masks {where})", fontsize="medium")
        for color, name in zip(("C0", "C3"), names):
            _plot_runs(axes[2], epochs[start:], runs[name], start, color, name)
        lows = [min(r["log_marginal"][start:]) for n in names for r in runs[n]]
        highs = [max(r["objective"][start:]) for n in names for r in runs[n]]
        axes[2].set_ylim(min(lows + [truth_lml]) - 0.05, max(highs + [truth_lml]) + 0.05)
        axes[2].set_title(f"zoom: second half (masks {where})", fontsize="medium")
        for ax in axes:
            ax.axhline(truth_lml, color="k", ls="--", lw=1.2, label="ground-truth LML")
            ax.set_xlabel("epoch")
            ax.set_ylabel("per observation (nats)")
            ax.legend(fontsize="small")
    return fig


def _plot_runs(ax, epochs, results, start=0, color="C0", name=None):
    prefix = f"{name}: " if name else ""
    for i, r in enumerate(results):
        labels = (f"{prefix}MPT objective", f"{prefix}exact LML") if i == 0 else (None, None)
        ax.plot(epochs, r["objective"][start:], color=color, alpha=0.25, lw=1, label=labels[0])
        ax.plot(epochs, r["log_marginal"][start:], color=color, lw=1.5, label=labels[1])
