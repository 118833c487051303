"""Table 1 of Moreno-Muñoz et al. (2023): the cumulative MPT estimate of the PPCA
log-marginal likelihood converges to the true value as the number of random masks grows.

Setting (the paper's): ``N = 1000`` observations of ``D = 200`` features from a PPCA with
``K = 5`` latents, ``W_ij ~ N(0, 1)``, mean 0 and model noise variance ``σ² = 0.2``. The true
LML is computed with the generating parameters; the MPT estimate with the same parameters,
from the exact self-predictive conditionals.

**Estimator and the meaning of P** (the paper's convention). ``P`` counts random masks *per
mask size*, ``P · D`` masks in all, and every mask is shared by all ``N`` observations:

.. math::

    \\widehat{\\log p} = \\frac1N \\sum_n \\sum_{M=1}^{D} \\frac1P \\sum_{p=1}^{P}
        \\frac1M \\sum_{j \\in \\mathcal{M}_{M,p}} \\log p(x_{nj} \\mid x_{n,\\mathcal{R}}).

Because one mask serves every observation, its randomness does not average out over ``N``
and the spread across seeds is large. The second column group draws the masks per
observation (each observation its own ``P`` masks of each size, as
:class:`~pyro_mpt.MPTLoss` does): the same ``P`` then gives a far smaller spread. It costs
``N`` times more posteriors, so by default it runs for ``P = 1`` only (``full`` adds
``P = 10``, about a minute, and ``P = 100``, more than ten minutes).

**Data noise.** ``noise="paper"`` reproduces the paper's script, which adds *one* noise draw
per observation, ``e_n ~ N(0, 0.2²)``, to all ``D`` features alike (``x = W z + e 1``): the
data are not drawn from the model they are scored under, which is why its LML per
observation (about −60) is far above what PPCA data would give. ``noise="model"`` draws
independent noise of variance 0.2 per feature, as the model assumes (LML about −140).

Five seeds; mean ± sample std across seeds, next to the paper's figures.
"""

import functools

import torch

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from experiments._ppca import (
    check_noise,
    exact_log_marginal,
    per_observation_estimate,
    ppca_data,
    shared_mask_estimate,
)

__all__ = ["CONVENTION", "NAME", "NOISE_VAR", "PAPER", "run"]

NAME = "ppca-table1"

#: The paper's Table 1: true LML and negative MPT loss (mean ± std over 5 seeds) per P.
PAPER = {"true_lml": -60.34, "mpt": {1: (-60.44, 0.47), 10: (-60.22, 0.12), 100: (-60.34, 0.03)}}

#: The model's noise variance ``σ²``.
NOISE_VAR = 0.2

CONVENTION = (
    "P = random masks per mask size (P*D masks in all); shared: each mask is used for all N "
    "observations (the paper's convention); per-observation: each observation draws its "
    "own P masks of each size. Estimate = sum over M=1..D of the mean over the P masks of "
    "size M of (1/M) sum_{j in mask} log p(x_j | x_R), averaged over observations."
)


def _config(smoke, full):
    if smoke:
        return dict(N=300, D=30, K=3, shared_P=(1, 10, 100), per_obs_P=(1, 10), seeds=5)
    per_obs = (1, 10, 100) if full else (1,)
    return dict(N=1000, D=200, K=5, shared_P=(1, 10, 100), per_obs_P=per_obs, seeds=5)


def _noise_text(noise, noise_var, num_features):
    if noise == "paper":
        return (
            f"paper (one N(0, {noise_var}^2) draw per observation added to all "
            f"{num_features} features; the model assumes independent N(0, {noise_var}) noise)"
        )
    return f"model (independent N(0, {noise_var}) noise per feature, as the model assumes)"


def _estimates(estimate_fn, data, sizes, num_masks, seed, group, num_seeds, bar):
    values = []
    with common.Stopwatch() as watch:
        for rep in range(num_seeds):
            common.seed_everything(common.derived_seed(seed, group, num_masks, rep))
            values.append(estimate_fn(data, sizes, num_masks, bar))
    mean, std = common.mean_std(values)
    return dict(estimates=values, mean=mean, std=std, seconds=watch.seconds)


def _measure(cfg, device, seed, progress, noise):
    """The true LML, and the estimates of every seed with shared and per-observation masks."""
    common.seed_everything(common.derived_seed(seed, 0))
    data = ppca_data(cfg["N"], cfg["D"], cfg["K"], NOISE_VAR, noise, device)
    sizes = torch.arange(1, cfg["D"] + 1)
    shared, per_obs = {}, {}
    # One bar per phase: a per-observation mask costs N posteriors, a shared one a single
    # posterior, so one bar counting masks would sit near its end through the slow last phase.
    work = cfg["seeds"] * cfg["D"] * sum(cfg["shared_P"])
    desc = f"{NAME} shared masks"
    with common.progress_bar(total=work, enabled=progress, desc=desc, unit="mask") as bar:
        for num_masks in cfg["shared_P"]:
            shared[num_masks] = _estimates(
                shared_mask_estimate, data, sizes, num_masks, seed, 1, cfg["seeds"], bar
            )
    work = cfg["seeds"] * cfg["D"] * sum(cfg["per_obs_P"])
    desc = f"{NAME} per-observation masks (N={cfg['N']} posteriors each)"
    with common.progress_bar(total=work, enabled=progress, desc=desc, unit="mask") as bar:
        for num_masks in cfg["per_obs_P"]:
            per_obs[num_masks] = _estimates(
                per_observation_estimate, data, sizes, num_masks, seed, 2, cfg["seeds"], bar
            )
    return dict(true_lml=exact_log_marginal(data), shared=shared, per_observation=per_obs)


def _report(cfg, measured, noise, smoke):
    true_lml, shared, per_obs = (
        measured["true_lml"],
        measured["shared"],
        measured["per_observation"],
    )
    rows = [["true LML", f"{PAPER['true_lml']:.2f}", f"{true_lml:.2f}", "", f"{true_lml:.2f}", ""]]
    for num_masks in sorted(set(cfg["shared_P"]) | set(cfg["per_obs_P"])):
        paper = PAPER["mpt"].get(num_masks)
        row = [f"P={num_masks}", common.pm(*paper) if paper else "-"]
        for group in (shared, per_obs):
            res = group.get(num_masks)
            row += (
                [common.pm(res["mean"], res["std"]), f"{res['seconds']:.1f}"] if res else ["-", "-"]
            )
        rows.append(row)
    largest = max(cfg["shared_P"])
    title = (
        f"Table 1 (PPCA N={cfg['N']}, D={cfg['D']}, K={cfg['K']}, model noise variance "
        f"{NOISE_VAR}): negative MPT loss per observation, mean ± std over {cfg['seeds']} "
        "seeds.\nP = random masks per mask size (P*D masks in all). shared: each mask used for "
        "all N observations (paper's convention); per-obs: each observation its own masks."
    )
    notes = [
        f"data noise: {_noise_text(noise, NOISE_VAR, cfg['D'])}",
        f"P={largest} (shared masks, {cfg['seeds']} seeds): "
        f"{shared[largest]['seconds']:.2f} s in all, "
        f"{shared[largest]['seconds'] / cfg['seeds']:.2f} s per seed",
    ]
    if smoke:
        notes.append("smoke size: the paper's figures are for N=1000, D=200, K=5")
    headers = ["", "paper", "shared masks", "s", "per-obs masks", "s"]
    results = dict(
        paper=PAPER,
        true_lml=true_lml,
        shared=shared,
        per_observation=per_obs,
        p100_seconds=shared[largest]["seconds"],
    )
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, _figure(cfg, measured, noise), results)


def _figure(cfg, measured, noise):
    """Both estimates' mean ± std across seeds against ``P``, and the true LML."""
    fig, (ax,) = common.new_figure(1, width=6.0, height=4.2)
    groups = (
        ("shared masks", measured["shared"]),
        ("per-observation masks", measured["per_observation"]),
    )
    for offset, (label, group) in zip((0.97, 1.03), groups):
        keys = sorted(group)
        ax.errorbar(
            [k * offset for k in keys],
            [group[k]["mean"] for k in keys],
            yerr=[group[k]["std"] for k in keys],
            marker="o",
            capsize=4,
            label=f"MPT, {label}",
        )
    true_lml = measured["true_lml"]
    ax.axhline(true_lml, color="k", ls="--", label=f"true LML {true_lml:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("P (random masks per mask size)")
    ax.set_ylabel("log p(x) per observation (nats)")
    ax.set_title(f"PPCA D={cfg['D']}, K={cfg['K']}, noise={noise}: mean ± std over seeds")
    ax.legend(fontsize="small")
    return fig


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, noise="paper"):
    """Reproduces Table 1; writes ``ppca-table1.json`` and ``ppca-table1.png``.

    ``smoke``: a small problem (``N=300, D=30, K=3``) that runs in seconds; ``full``: adds
    per-observation masks with ``P = 10`` and ``100``. ``noise``: ``"paper"`` or ``"model"``
    data noise (see the module docstring). The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    check_noise(noise)

    def report(cfg, measured):
        return _report(cfg, measured, noise, smoke)

    def settings(cfg):
        noise_text = _noise_text(noise, NOISE_VAR, cfg["D"])
        return dict(noise_var=NOISE_VAR, noise=noise, noise_description=noise_text, dtype="float64")

    return run_experiment(
        NAME, out_dir, _config, functools.partial(_measure, noise=noise), report,
        device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Moreno-Muñoz et al. (2023), Table 1",
        header=dict(convention=CONVENTION),
        settings=settings(_config(smoke, full)),
    )  # fmt: skip
