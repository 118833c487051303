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

import math

import pyro
import pyro.optim
import torch
from pyro.infer import SVI

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.models import PPCA
from pyro_mpt.reproduce import _common as common

__all__ = ["NAME", "maximum_log_marginal", "run", "standard_errors"]

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


def _config(smoke):
    if smoke:
        return dict(N=500, D=10, K=2, epochs=20, inits=2, lr=1e-2)
    return dict(N=2000, D=10, K=2, epochs=1000, inits=5, lr=1e-2)


def _no_guide(x):
    """MPTLoss integrates the latents out exactly, so no guide is needed."""


def maximum_log_marginal(x, latent_dim):
    """The largest per-observation ``log p(x)`` of a PPCA with ``latent_dim`` factors and
    isotropic noise on the data ``x`` (``N x D``), at its closed-form maximum-likelihood
    parameters (Tipping & Bishop, 1999): mean the sample mean, ``σ²`` the mean of the
    ``D - K`` smallest eigenvalues of the sample covariance ``S``, and ``W W^T + σ² I``
    equal to ``S`` on its top ``K`` eigenvectors. Every trained run is compared with it.
    """
    num_obs, num_features = x.shape
    if not 0 < latent_dim < num_features:
        raise ValueError(
            f"latent_dim={latent_dim} must lie in 1..{num_features - 1} (D - 1) for data with "
            f"D={num_features} features."
        )
    residual = x - x.mean(0)
    eigenvalues = torch.linalg.eigvalsh(residual.T @ residual / num_obs).flip(0)
    noise_var = eigenvalues[latent_dim:].mean()
    log_det = eigenvalues[:latent_dim].log().sum() + (num_features - latent_dim) * noise_var.log()
    # At the maximum, tr(C^-1 S) = D.
    return float(-0.5 * (num_features * math.log(2 * math.pi) + log_det + num_features))


def standard_errors(values, reference):
    """``(mean - reference) / (sd / sqrt(n))`` of ``values``: how many standard errors of the
    mean over the runs separate their mean from ``reference`` (``nan`` for fewer than two
    runs or identical values)."""
    mean, std = common.mean_std(values)
    if len(values) < 2 or std == 0:
        return math.nan
    return (mean - reference) / (std / math.sqrt(len(values)))


def _ground_truth(cfg, seed, device):
    pyro.clear_param_store()
    common.seed_everything(common.derived_seed(seed, 0))
    truth = PPCA(cfg["D"], cfg["K"], init_scale=1.0, noise_scale=math.sqrt(0.2)).to(device)
    x = truth.sample(cfg["N"])
    with torch.no_grad():
        lml = float(log_marginal(truth.model, x).mean())
    pyro.clear_param_store()  # the trained models reuse the parameter names
    return x, lml


def _train(x, cfg, loss, seed, bar):
    pyro.clear_param_store()
    common.seed_everything(seed)
    model = PPCA(cfg["D"], cfg["K"], init_scale=1.0).to(x.device)
    svi = SVI(model.model, _no_guide, pyro.optim.Adam({"lr": cfg["lr"]}), loss=loss)
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


def run(
    out_dir,
    device="cpu",
    smoke=False,
    full=False,
    seed=0,
    progress=True,
    masks=CONVENTIONS,
):
    """Reproduces Fig. 2; writes ``ppca-training.json`` and ``ppca-training.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: 20 epochs, 2 initialisations, ``N = 500``; runs in seconds.
    :param bool full: accepted for uniformity; the default already has the paper's sizes
        (1000 epochs).
    :param int seed: base seed.
    :param bool progress: show progress bars.
    :param masks: the mask conventions to train with, from :data:`CONVENTIONS` (default:
        both): ``"per-observation"`` and ``"shared"`` (the paper's scripts).
    :returns: the results dict (also written as JSON).
    """
    common.check_size(smoke, full)
    masks = (masks,) if isinstance(masks, str) else tuple(masks)
    unknown = [m for m in masks if m not in CONVENTIONS]
    if unknown or not masks:
        raise ValueError(f"masks={masks!r}: choose one or more of {CONVENTIONS}.")
    cfg = _config(smoke)
    total = common.Stopwatch()
    runs, settings = {}, {}
    with common.float64():
        device = common.resolve_device(device)
        x, truth_lml = _ground_truth(cfg, seed, device)
        max_lml = maximum_log_marginal(x, cfg["K"])
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
                        with common.Stopwatch() as watch:
                            objective, lml = _train(
                                x, cfg, loss, common.derived_seed(seed, 1, init), bar
                            )
                        runs[name].append(
                            dict(objective=objective, log_marginal=lml, seconds=watch.seconds)
                        )
                        bar.set_postfix_str(f"{name} init {init}: LML {lml[-1]:.3f}")

    window = max(1, cfg["epochs"] // 20)
    summary, rows = {}, []
    for name, results in runs.items():
        final_obj = [_tail_mean(r["objective"], window) for r in results]
        final_lml = [_tail_mean(r["log_marginal"], window) for r in results]
        bias = [o - lml for o, lml in zip(final_obj, final_lml)]
        summary[name] = dict(
            final_objective=common.mean_std(final_obj),
            final_log_marginal=common.mean_std(final_lml),
            bias=common.mean_std(bias),
            first_log_marginal=common.mean_std([r["log_marginal"][0] for r in results]),
            distance_to_truth=common.mean_std([lml - truth_lml for lml in final_lml]),
            distance_to_truth_se=standard_errors(final_lml, truth_lml),
            distance_to_maximum=common.mean_std([lml - max_lml for lml in final_lml]),
            seconds_per_epoch=sum(r["seconds"] for r in results) / (len(results) * cfg["epochs"]),
            **settings[name],
        )
        s = summary[name]
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
        f"mean ± std over inits;\nfinal = mean of the last {window} epochs; LML - GT = final "
        "LML - ground-truth LML (in se: in standard errors of the mean over inits); LML - max "
        f"= final LML - the maximum-likelihood PPCA's LML ({max_lml:.3f}); bias = final "
        "objective - final LML. Masks: one per "
        f"observation and step, or 'shared masks' (the paper's: D={cfg['D']} masks per step, "
        "each used for all observations)."
    )
    headers = [
        "objective",
        "final MPT objective",
        "final exact LML",
        "GT LML",
        "LML - GT",
        "in se",
        "LML - max",
        "bias",
        "ms/epoch",
    ]
    print(common.format_table(headers, rows, title=title))

    fig = _figure(runs, masks, cfg, truth_lml)
    results = dict(
        experiment=NAME,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 2",
        config=common.run_config(
            cfg,
            seed,
            smoke,
            full,
            device,
            schedules={k: str(v) for k, v in SCHEDULES.items()},
            masks=list(masks),
            masks_per_step=1,
            shared_masks_per_step=cfg["D"],
            dtype="float64",
            final_window=window,
        ),
        ground_truth_log_marginal=truth_lml,
        maximum_log_marginal=max_lml,
        summary=summary,
        # Per schedule: the runs with per-observation masks, and with the paper's shared ones.
        runs={s: runs[n] for s in SCHEDULES if (n := run_name(s, "per-observation")) in runs},
        shared_mask_runs={s: runs[n] for s in SCHEDULES if (n := run_name(s, "shared")) in runs},
        wall_seconds=total.elapsed,
    )
    return common.save_outputs(out_dir, NAME, results, fig)


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
