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

.. note:: The paper's script sums one mask of *every* size per step (``P = 1`` per size,
    i.e. ``MPTLoss(rate="uniform", num_masks=D)``) and learns only ``W``; here each
    observation draws one mask, which is the ordinary use of ``MPTLoss``.
"""

import math

import pyro
import pyro.optim
import torch
from pyro.infer import SVI

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.models import PPCA
from pyro_mpt.reproduce._common import (
    Stopwatch,
    check_size,
    derived_seed,
    float64,
    format_table,
    mean_std,
    new_figure,
    pm,
    progress_bar,
    resolve_device,
    save_outputs,
    seed_everything,
)

__all__ = ["NAME", "run"]

NAME = "ppca-training"

#: Objective name -> the ``rate`` argument of :class:`~pyro_mpt.MPTLoss`.
SCHEDULES = {"uniform": "uniform", "fixed 20%": 0.2}


def _config(smoke):
    if smoke:
        return dict(N=500, D=10, K=2, epochs=20, inits=2, lr=1e-2)
    return dict(N=2000, D=10, K=2, epochs=1000, inits=5, lr=1e-2)


def _no_guide(x):
    """MPTLoss integrates the latents out exactly, so no guide is needed."""


def _ground_truth(cfg, seed, device):
    pyro.clear_param_store()
    seed_everything(derived_seed(seed, 0))
    truth = PPCA(cfg["D"], cfg["K"], init_scale=1.0, noise_scale=math.sqrt(0.2)).to(device)
    x = truth.sample(cfg["N"])
    with torch.no_grad():
        lml = float(log_marginal(truth.model, x).mean())
    pyro.clear_param_store()  # the trained models reuse the parameter names
    return x, lml


def _train(x, cfg, rate, seed, bar):
    pyro.clear_param_store()
    seed_everything(seed)
    model = PPCA(cfg["D"], cfg["K"], init_scale=1.0).to(x.device)
    svi = SVI(model.model, _no_guide, pyro.optim.Adam({"lr": cfg["lr"]}), loss=MPTLoss(rate=rate))
    objective, lml = [], []
    for _ in range(cfg["epochs"]):
        with torch.no_grad():
            lml.append(float(log_marginal(model.model, x).mean()))
        objective.append(-svi.step(x) / x.shape[0])
        bar.update()
    pyro.clear_param_store()
    return objective, lml


def _tail_mean(values, window):
    return sum(values[-window:]) / len(values[-window:])


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 2; writes ``ppca-training.json`` and ``ppca-training.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: 20 epochs, 2 initialisations, ``N = 500``; runs in seconds.
    :param bool full: accepted for uniformity; the default already has the paper's sizes
        (1000 epochs).
    :param int seed: base seed.
    :param bool progress: show progress bars.
    :returns: the results dict (also written as JSON).
    """
    check_size(smoke, full)
    cfg = _config(smoke)
    total = Stopwatch()
    runs = {}
    with float64():
        device = resolve_device(device)
        x, truth_lml = _ground_truth(cfg, seed, device)
        work = len(SCHEDULES) * cfg["inits"] * cfg["epochs"]
        with progress_bar(total=work, enabled=progress, desc=NAME, unit="epoch") as bar:
            for name, rate in SCHEDULES.items():
                runs[name] = []
                for init in range(cfg["inits"]):
                    # The same initialisations for both schedules.
                    objective, lml = _train(x, cfg, rate, derived_seed(seed, 1, init), bar)
                    runs[name].append(dict(objective=objective, log_marginal=lml))
                    bar.set_postfix_str(f"{name} init {init}: LML {lml[-1]:.3f}")

    window = max(1, cfg["epochs"] // 20)
    summary, rows = {}, []
    for name, results in runs.items():
        final_obj = [_tail_mean(r["objective"], window) for r in results]
        final_lml = [_tail_mean(r["log_marginal"], window) for r in results]
        bias = [o - lml for o, lml in zip(final_obj, final_lml)]
        summary[name] = dict(
            final_objective=mean_std(final_obj),
            final_log_marginal=mean_std(final_lml),
            bias=mean_std(bias),
            first_log_marginal=mean_std([r["log_marginal"][0] for r in results]),
        )
        s = summary[name]
        rows.append(
            [
                name,
                pm(*s["final_objective"], 3),
                pm(*s["final_log_marginal"], 3),
                f"{truth_lml:.3f}",
                pm(*s["bias"], 3),
            ]
        )
    title = (
        f"Fig. 2 (PPCA N={cfg['N']}, D={cfg['D']}, K={cfg['K']}; SVI + MPTLoss, P=1, full "
        f"batch, Adam lr {cfg['lr']}, {cfg['epochs']} epochs, {cfg['inits']} inits): per "
        f"observation, mean ± std over inits;\nfinal = mean of the last {window} epochs; "
        "bias = final objective - final LML."
    )
    headers = ["objective", "final MPT objective", "final exact LML", "GT LML", "bias"]
    print(format_table(headers, rows, title=title))

    fig, axes = new_figure(3, width=4.8)
    epochs = list(range(cfg["epochs"]))
    for ax, name in zip(axes[:2], SCHEDULES):
        _plot_runs(ax, epochs, runs[name])
        ax.set_title(f"MPT, {name} masking rate")
    start = cfg["epochs"] // 2
    for color, name in zip(("C0", "C3"), SCHEDULES):
        _plot_runs(axes[2], epochs[start:], runs[name], start, color, name)
    lows = [min(r["log_marginal"][start:]) for rs in runs.values() for r in rs]
    highs = [max(r["objective"][start:]) for rs in runs.values() for r in rs]
    axes[2].set_ylim(min(lows + [truth_lml]) - 0.05, max(highs + [truth_lml]) + 0.05)
    axes[2].set_title("zoom: second half of training")
    for ax in axes:
        ax.axhline(truth_lml, color="k", ls="--", lw=1.2, label="ground-truth LML")
        ax.set_xlabel("epoch")
        ax.set_ylabel("per observation (nats)")
        ax.legend(fontsize="small")

    results = dict(
        experiment=NAME,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 2",
        config=dict(
            cfg,
            schedules={k: str(v) for k, v in SCHEDULES.items()},
            masks_per_step=1,
            seed=seed,
            smoke=smoke,
            full=full,
            device=str(device),
            dtype="float64",
            final_window=window,
        ),
        ground_truth_log_marginal=truth_lml,
        summary=summary,
        runs=runs,
        wall_seconds=total.elapsed,
    )
    return save_outputs(out_dir, NAME, results, fig)


def _plot_runs(ax, epochs, results, start=0, color="C0", name=None):
    for i, r in enumerate(results):
        first = i == 0
        prefix = f"{name}: " if name else ""
        ax.plot(
            epochs,
            r["objective"][start:],
            color=color,
            alpha=0.25,
            lw=1,
            label=f"{prefix}MPT objective" if first else None,
        )
        ax.plot(
            epochs,
            r["log_marginal"][start:],
            color=color,
            lw=1.5,
            label=f"{prefix}exact LML" if first else None,
        )
