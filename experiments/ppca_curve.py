"""Fig. 4 of Moreno-Muñoz et al. (2023): the MPT curve ``M -> S(x; M)`` of a PPCA and its
area, which estimates the log-marginal likelihood.

Three panels, each the curve of :func:`pyro_mpt.mpt_curve` over every mask size
``M = 1..D`` (``D = 200``) with masks shared by all observations (the paper's convention),
scored with the generating parameters of a ground-truth :class:`pyro_mpt.models.PPCA`
(``init_scale=1.0``, noise variance 0.2) on its own samples:

* ``K = 5`` latents, ``P = 1`` mask per size: a noisy curve whose area misses the LML a little;
* ``K = 5``, ``P = 100``: a smooth curve whose area matches the LML;
* ``K = 50`` latents, ``P = 100``: the scores stay high until about half the features are
  masked and then decay.

The area is ``D`` times the mean score (the sum over all sizes); the legend compares it with
the exact ``log p(x)`` per observation. By default the curves use ``N = 200`` observations
(the paper used 1000, as ``full`` does): the cost of a shared-mask curve grows with ``N``.
"""

import math

import pyro
import torch

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from pyro_mpt import log_marginal, mpt_curve, plot_mpt_curve
from pyro_mpt.models import PPCA

__all__ = ["NAME", "run"]

NAME = "ppca-curve"


def _config(smoke, full):
    if smoke:
        return dict(N=50, D=20, panels=[(2, 1), (2, 5), (8, 2)])
    if full:
        return dict(N=1000, D=200, panels=[(5, 1), (5, 100), (50, 100)])
    return dict(N=200, D=200, panels=[(5, 1), (5, 100), (50, 100)])


def _curve(cfg, latent_dim, num_masks, seed, index, device, progress):
    """Samples data from a ground-truth PPCA and computes its MPT curve and exact LML."""
    pyro.clear_param_store()
    # The same ground truth and data for panels sharing K, whatever P.
    common.seed_everything(common.derived_seed(seed, latent_dim))
    truth = PPCA(cfg["D"], latent_dim, init_scale=1.0, noise_scale=math.sqrt(0.2)).to(device)
    x = truth.sample(cfg["N"])
    with torch.no_grad():
        lml = float(log_marginal(truth.model, x).mean())
    common.seed_everything(common.derived_seed(seed, latent_dim, num_masks, index))
    with common.Stopwatch() as watch:
        curve = mpt_curve(truth.model, x, num_masks=num_masks, share_masks=True, progress=progress)
    pyro.clear_param_store()
    return curve, lml, watch.seconds


def _measure(cfg, device, seed, progress):
    """The panels: each one's curve, exact LML and seconds."""
    panels = []
    steps = common.progress_bar(list(enumerate(cfg["panels"])), enabled=progress, desc=NAME)
    for index, (latent_dim, num_masks) in steps:
        curve, lml, seconds = _curve(cfg, latent_dim, num_masks, seed, index, device, progress)
        panels.append(
            dict(
                label=f"K={latent_dim}, P={num_masks}",
                latent_dim=latent_dim,
                num_masks=num_masks,
                curve=curve,
                log_marginal=lml,
                area=curve.area,
                seconds=seconds,
            )
        )
    return panels


def _report(cfg, panels):
    rows = []
    for p in panels:
        diff = p["area"] - p["log_marginal"]
        rows.append(
            [
                p["label"],
                f"{p['area']:.3f}",
                f"{p['log_marginal']:.3f}",
                f"{diff:+.3f}",
                f"{abs(diff) / abs(p['log_marginal']):.2e}",
                f"{p['seconds']:.1f}",
            ]
        )
    title = (
        f"Fig. 4 (PPCA N={cfg['N']}, D={cfg['D']}, ground-truth parameters; masks shared by "
        "all observations, P per mask size): area under the MPT curve vs exact LML per "
        "observation."
    )
    headers = ["curve", "area", "exact LML", "area - LML", "rel. diff", "s"]
    fig, axes = common.new_figure(len(panels), width=4.8)
    for ax, p in zip(axes, panels):
        plot_mpt_curve(p["curve"], ax=ax, label=p["label"], log_marginal=p["log_marginal"])
        ax.set_title(f"D={cfg['D']}, K={p['latent_dim']}, P={p['num_masks']}")
    written = [
        dict(
            {k: v for k, v in p.items() if k != "curve"},
            sizes=p["curve"].sizes[0],
            rates=p["curve"].rates,
            scores=p["curve"].scores,
            stderr=p["curve"].stderr,
        )
        for p in panels
    ]
    return Report(common.format_table(headers, rows, title=title), fig, dict(panels=written))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 4; writes ``ppca-curve.json`` and ``ppca-curve.png``.

    ``smoke``: ``D = 20``, ``N = 50``, ``K = 2`` and 8, few masks (seconds); ``full``:
    ``N = 1000`` observations, as in the paper (default 200). The other arguments are
    those of :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report,
        device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 4",
        settings=dict(noise_var=0.2, share_masks=True, dtype="float64"),
    )  # fmt: skip
