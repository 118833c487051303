"""Fig. 1 of Moreno-Muñoz et al. (2023): the relative error ``|MPT − LML| / |LML|`` of the
cumulative MPT estimate as the number of random masks ``P`` grows.

Three panels, each a PPCA with ``K = 2`` latents scored with its generating parameters
(``W_ij ~ N(0, 1)``, mean 0, model noise variance 0.2; data noise as in
:mod:`~experiments.ppca_table1`, the paper's by default):

* ``D = 5`` and ``D = 50``, uniform rate: the cumulative estimate ``Σ_{M=1..D} S(x; M)``
  with ``P`` masks per size is unbiased, and its error shrinks like ``1/√P``;
* ``D = 512`` at a fixed 15% rate (``M = floor(0.15 D + 1/2) = 77``; the paper's script used 76):
  the estimate ``D · S(x; M)`` converges to ``D · S(x; M) ≠ log p(x)``, a *bias*. The bias
  is measured with many more masks and drawn as a dashed line; it is nonzero.

Masks are shared by all observations (the paper's convention; ``P`` masks per size). Each
``P`` is repeated with independent masks; the figure shows every repetition and their mean.
"""

import functools
import math

import torch

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from experiments._ppca import check_noise, exact_log_marginal, ppca_data
from experiments._ppca import shared_mask_estimate as _estimate
from pyro_mpt.ops.mask_rates import as_rate_schedule

__all__ = ["NAME", "run"]

NAME = "ppca-convergence"


def _config(smoke, full):
    if smoke:
        panels = [(5, "uniform"), (20, "uniform"), (64, 0.15)]
        return dict(N=200, K=2, panels=panels, P=(1, 5, 20), reps=3, limit_masks=2000)
    panels = [(5, "uniform"), (50, "uniform"), (512, 0.15)]
    if full:  # the paper's scripts went up to 300 masks per size
        P = (1, 2, 5, 10, 20, 50, 100, 200, 300)
        return dict(N=1000, K=2, panels=panels, P=P, reps=5, limit_masks=50000)
    return dict(N=1000, K=2, panels=panels, P=(1, 2, 5, 10, 20, 50, 100), reps=5, limit_masks=20000)


def _panel_sizes(num_features, rate):
    """Mask sizes the estimate averages over: all of ``1..D``, or the fixed one."""
    if rate == "uniform":
        return torch.arange(1, num_features + 1)
    fixed = as_rate_schedule(rate).sizes_from_quantiles(torch.zeros(1), num_features)
    return fixed.reshape(1)


def _panel_label(num_features, rate, sizes):
    if rate == "uniform":
        return f"D={num_features}, uniform rate"
    return f"D={num_features}, fixed {rate:.0%} (M={int(sizes[0])})"


def _limit(data, sizes, limit_masks, seed, panel, bar, batches=4):
    """The estimate with ``limit_masks`` masks in all, from ``batches`` independent batches,
    with its standard error."""
    per_size = max(1, math.ceil(limit_masks / (batches * len(sizes))))
    values = []
    for batch in range(batches):
        common.seed_everything(common.derived_seed(seed, panel, 10**6, batch))
        values.append(_estimate(data, sizes, per_size, bar))
    mean, std = common.mean_std(values)
    return mean, std / math.sqrt(batches), per_size * batches


def _panel(cfg, index, num_features, rate, seed, device, noise, bar):
    """One panel: the relative errors of every repetition at every ``P``, and the limit."""
    common.seed_everything(common.derived_seed(seed, index, 0))
    data = ppca_data(cfg["N"], num_features, cfg["K"], 0.2, noise, device)
    lml = exact_log_marginal(data)
    sizes = _panel_sizes(num_features, rate)
    errors = {}
    for num_masks in cfg["P"]:
        rel = []
        for rep in range(cfg["reps"]):
            common.seed_everything(common.derived_seed(seed, index, num_masks, rep))
            rel.append((_estimate(data, sizes, num_masks, bar) - lml) / abs(lml))
        errors[num_masks] = rel
    limit, limit_se, limit_p = _limit(data, sizes, cfg["limit_masks"], seed, index, bar)
    return dict(
        label=_panel_label(num_features, rate, sizes),
        num_features=num_features,
        rate=rate,
        mask_sizes=sizes.tolist() if len(sizes) == 1 else "1..D",
        log_marginal=lml,
        relative_error={p: [abs(e) for e in v] for p, v in errors.items()},
        signed_relative_error=errors,
        limit_masks_per_size=limit_p,
        limit_estimate=limit,
        limit_relative_error=(limit - lml) / abs(lml),
        limit_relative_error_se=limit_se / abs(lml),
    )


def _measure(cfg, device, seed, progress, noise):
    work = 0
    for num_features, rate in cfg["panels"]:
        count = len(_panel_sizes(num_features, rate))
        work += cfg["reps"] * count * sum(cfg["P"]) + cfg["limit_masks"] + 4 * count
    with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="mask") as bar:
        return [
            _panel(cfg, index, num_features, rate, seed, device, noise, bar)
            for index, (num_features, rate) in enumerate(cfg["panels"])
        ]


def _report(cfg, panels, noise):
    headers = ["P"] + [p["label"] for p in panels]
    rows = []
    for num_masks in cfg["P"]:
        cells = [common.mean_std(p["relative_error"][num_masks]) for p in panels]
        rows.append([f"P={num_masks}"] + [f"{m:.2e} ± {s:.1e}" for m, s in cells])
    rows.append(
        ["limit"]
        + [f"{p['limit_relative_error']:+.2e} ± {p['limit_relative_error_se']:.1e}" for p in panels]
    )
    rows.append(["LML"] + [f"{p['log_marginal']:.3f}" for p in panels])
    title = (
        f"Fig. 1 (PPCA N={cfg['N']}, K={cfg['K']}, data noise {noise}): relative error "
        f"|MPT - LML| / |LML|, mean ± std over {cfg['reps']} repetitions.\n"
        "P = masks per mask size, each shared by all observations. 'limit': signed relative "
        "error of the estimate with many masks (± its standard error): the bias."
    )
    fig = _figure(cfg, panels)
    return Report(common.format_table(headers, rows, title=title), fig, dict(panels=panels))


def _figure(cfg, panels):
    """Per panel: every repetition's relative error against ``P``, their mean, and the
    ``1/√P`` guide of an unbiased estimate or the measured bias."""
    fig, axes = common.new_figure(len(panels), width=4.6)
    ps = list(cfg["P"])
    for ax, panel in zip(axes, panels):
        per_rep = list(zip(*(panel["relative_error"][p] for p in ps)))
        for rep, values in enumerate(per_rep):
            ax.plot(
                ps, values, color="C3", alpha=0.3, lw=1, label="repetitions" if not rep else None
            )
        means = [common.mean_std(panel["relative_error"][p])[0] for p in ps]
        ax.plot(ps, means, color="C3", lw=2.5, marker="o", label="mean")
        bias = abs(panel["limit_relative_error"])
        if panel["rate"] == "uniform":  # the Monte Carlo rate of an unbiased estimate
            guide = [means[0] / math.sqrt(p) for p in ps]
            ax.plot(ps, guide, color="k", ls=":", lw=1, label="∝ 1/√P")
        else:
            ax.axhline(bias, color="k", ls="--", label=f"bias {bias:.2e}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("P (random masks per mask size)")
        ax.set_ylabel("|MPT − LML| / |LML|")
        ax.set_title(panel["label"])
        ax.legend(fontsize="small")
    return fig


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, noise="paper"):
    """Reproduces Fig. 1; writes ``ppca-convergence.json`` and ``ppca-convergence.png``.

    ``smoke``: small panels (``D = 5, 20, 64``) and few ``P`` (seconds); ``full``: ``P`` up
    to 300 as in the paper, and 50 000 masks for the bias. ``noise``: ``"paper"`` or
    ``"model"`` data noise. The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    check_noise(noise)
    return run_experiment(
        NAME, out_dir, _config,
        functools.partial(_measure, noise=noise), functools.partial(_report, noise=noise),
        device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 1",
        settings=dict(noise=noise, noise_var=0.2, dtype="float64"),
    )  # fmt: skip
