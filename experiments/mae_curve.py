"""Fig. 6 of Moreno-Muñoz et al. (2023) on MNIST: the MPT curve of a small ViT-MAE trained
from scratch with MAE's fixed 75% ratio, with a random ratio (R2MAE) and with the uniform
schedule, against the random initialisation; the area under each curve and a linear probe
of the digit.

Data: MNIST from :func:`pyro_mpt.datasets.load_mnist` (grey levels in ``[0, 1]``, not
binarised), split at random into training and held-out images stratified by digit.

Model: :func:`pyro_mpt.transformers.vit_mae.vit_mae_from_config` with 28 x 28 images in
4 x 4 patches (``L = 49`` patches of 16 pixels), a 1-layer encoder and a 1-layer decoder of
width 64 by default, the same initial weights for every rate. Training: AdamW on
:func:`pyro_mpt.transformers.mae_loss`, learning rate 2e-3 after 200 warm-up steps and
constant after (so that a flat loss means the run has levelled off, not that the rate has
decayed to zero), 18000 steps of 64 images, one mask size per image drawn from the rate
schedule:

* ``fixed 75%``: MAE's ratio, ``M = 37`` of 49;
* ``random 55-95%``: R2MAE, ``r ~ U[0.55, 0.95)`` per step (the same mean ratio, 75%);
* ``uniform``: ``M ~ Uniform{1, ..., 48}`` (capped so one patch stays visible), the
  unbiased MPT objective.

Convergence: :func:`loss_convergence` compares each run's training loss, averaged over a
tenth of the run, at 80% and at 100% of training; a relative change below
:data:`CONVERGED_BELOW` (2%) counts as levelled off. Each run's record and the table give it.
The default size trains in about an hour on one CPU core. Most runs reach that test at this
budget; the result file records each run's change, and the note under the table counts the
runs that levelled off and says how far the others were from it.

Curve: :func:`pyro_mpt.transformers.mae_mpt_curve` on held-out images at 5%, 15%, ..., 95%, a
masked patch scored as a Gaussian with pixel standard deviation 0.1; area = ``49 · mean_r
S`` (nats per image). Linear probe: multinomial logistic regression on the mean of the
encoder's patch tokens with nothing masked, fitted on the training images and scored on the
held-out ones.

Seeds: three by default (``seeds``; one at smoke size), each drawing its own data split,
initial weights, batch order and masks, shared by the schedules within it; the table gives
mean ± sd over the seeds and each schedule's area minus the fixed-75% one of the same seed.

.. note:: The paper's Fig. 6 shows a pre-trained ViT-MAE (ImageNet) on Fashion-MNIST,
    CIFAR-100 and Tiny-ImageNet; here every model is trained from scratch on MNIST, so the
    curves are comparable with each other only.
"""

import statistics

import torch

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from experiments._probe import linear_probe_accuracy

__all__ = ["CONVERGED_BELOW", "NAME", "RATES", "loss_convergence", "run"]

NAME = "mae-curve"

#: Run name -> the ``rate`` of :func:`pyro_mpt.transformers.mae_loss`.
RATES = {"fixed 75%": 0.75, "random 55-95%": (0.55, 0.95), "uniform": "uniform"}
COLORS = {"random init.": "C7", "fixed 75%": "C3", "random 55-95%": "C2", "uniform": "C0"}
SCALE = 0.1
#: A run has levelled off when its training loss, averaged over a tenth of the run, changes
#: by less than this share between 80% and 100% of training (see :func:`loss_convergence`).
CONVERGED_BELOW = 0.02


def _config(smoke, full):
    cfg = dict(
        hidden=64, layers=1, decoder_layers=1, batch=64, lr=2e-3, warmup=200, num_masks=2,
        probe_iters=100, rates=[round(0.05 + 0.1 * k, 2) for k in range(10)],
    )  # fmt: skip
    if smoke:
        cfg.update(N=96, held_out=48, steps=3, warmup=1, hidden=32, layers=1, decoder_layers=1)
        cfg.update(rates=[0.25, 0.5, 0.75], num_masks=1, probe_iters=20, seeds=1)
    elif full:
        cfg.update(N=4000, held_out=1000, steps=20000, layers=4, decoder_layers=2, lr=1e-3)
        cfg.update(rates=None, num_masks=4, seeds=3)
    else:
        # A 1+1-layer model at a constant rate 2e-3: about an hour for three seeds on one
        # CPU core; whether each run's loss levelled off (see CONVERGED_BELOW) the result
        # file records run by run.
        cfg.update(N=4000, held_out=1000, steps=18000, seeds=3)
    return cfg


def _model(cfg, seed):
    from transformers import ViTMAEConfig

    from pyro_mpt.transformers.vit_mae import vit_mae_from_config

    hidden = cfg["hidden"]
    config = ViTMAEConfig(
        image_size=28,
        patch_size=4,
        num_channels=1,
        hidden_size=hidden,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        decoder_hidden_size=hidden,
        decoder_num_hidden_layers=cfg["decoder_layers"],
        decoder_num_attention_heads=4,
        decoder_intermediate_size=2 * hidden,
        mask_ratio=0.75,
    )
    common.seed_everything(seed)
    return vit_mae_from_config(config)


@torch.no_grad()
def _features(model, images, batch=256):
    """Mean of the encoder's patch tokens with every patch visible."""
    from pyro_mpt.transformers.vit_mae import masked_forward

    model.eval()
    out = []
    for chunk in images.split(batch):
        masks = torch.zeros(chunk.shape[0], 49, dtype=torch.bool, device=chunk.device)
        hidden = masked_forward(model.vit, chunk, masks).last_hidden_state
        out.append(hidden[:, 1:].mean(1))
    return torch.cat(out)


def _data(cfg, seed, device):
    from pyro_mpt.datasets import load_mnist, train_test_split

    total = cfg["N"] + cfg["held_out"]
    x, y = load_mnist(num_samples=total, binarize=False, seed=seed, dtype=torch.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, cfg["held_out"] / total, seed=seed)
    images = (t.reshape(-1, 1, 28, 28).to(device) for t in (x_train, x_test))
    return (*images, y_train.to(device), y_test.to(device))


def _evaluate(model, data, cfg, seed, progress):
    from pyro_mpt.transformers import mae_mpt_curve

    x_train, x_test, y_train, y_test = data
    common.seed_everything(common.derived_seed(seed, 3))  # the same masks for every model
    curve = mae_mpt_curve(
        model,
        x_test,
        rates=cfg["rates"],
        num_masks=cfg["num_masks"],
        batch_size=256,
        scale=SCALE,
        progress=progress,
    )
    probe = linear_probe_accuracy(
        _features(model, x_train).cpu().double(),
        y_train.cpu(),
        _features(model, x_test).cpu().double(),
        y_test.cpu(),
        max_iter=cfg["probe_iters"],
    )
    return curve, probe


def loss_convergence(losses, threshold=CONVERGED_BELOW):
    """Whether a run had levelled off when training stopped: its loss, averaged over the
    last tenth of the values, against the same average ending at 80% of them.

    :param list losses: the training losses in step order (per step, or averages over equal
        logging intervals).
    :param float threshold: the largest relative change that counts as levelled off.
    :returns: ``dict(loss_at_80=..., loss_at_end=..., relative_change=(loss_at_80 -
        loss_at_end) / |loss_at_end|, threshold=threshold, converged=|relative_change| <
        threshold)``; a positive change means the loss was still falling.
    """
    n = len(losses)
    if n == 0:
        raise ValueError("losses=[] holds no training loss; pass the losses of a run.")
    width = max(1, round(0.1 * n))
    cut = max(width, round(0.8 * n))
    at_80 = statistics.fmean(losses[cut - width : cut])
    at_end = statistics.fmean(losses[n - width :])
    change = (at_80 - at_end) / abs(at_end)
    return dict(
        loss_at_80=at_80,
        loss_at_end=at_end,
        relative_change=change,
        threshold=threshold,
        converged=abs(change) < threshold,
    )


def _train(model, images, rate, cfg, generator):
    """``cfg["steps"]`` AdamW steps of :func:`pyro_mpt.transformers.train_mae` on batches of
    ``images`` in the order of ``generator``, the learning rate rising linearly over
    ``cfg["warmup"]`` steps and constant after (so that a flat loss means the run has levelled
    off, not that the rate has decayed to zero); returns the loss of every step."""
    from pyro_mpt.transformers import train_mae

    return train_mae(
        model,
        images,
        rate,
        batch_size=cfg["batch"],
        lr=cfg["lr"],
        generator=generator,
        progress=False,
        steps=cfg["steps"],
        lr_schedule="constant",
        warmup_steps=cfg["warmup"],
    )


def _one_seed(cfg, run_seed, device, progress, bar):
    """Trains every rate from one seed (data split, initial weights, batch order, masks) and
    evaluates them and the untrained model; returns ``{name: record}``."""
    data = _data(cfg, run_seed, device)
    models = {"random init.": _model(cfg, common.derived_seed(run_seed, 1)).to(device)}
    losses, seconds = {}, {}
    for key, (name, rate) in enumerate(RATES.items()):
        # Warm-up: one step of a throwaway model, the random state restored after, so that
        # one-off costs are not charged to the training seconds of the first rate timed.
        with common.preserved_rng():
            warm = _model(cfg, common.derived_seed(run_seed, 1)).to(device)
            _train(warm, data[0][: cfg["batch"]], rate, dict(cfg, steps=1), None)
        model = _model(cfg, common.derived_seed(run_seed, 1)).to(device)
        order = torch.Generator().manual_seed(common.derived_seed(run_seed, 2))
        common.seed_everything(common.derived_seed(run_seed, 4, key))
        with common.Stopwatch() as watch:
            losses[name] = _train(model, data[0], rate, cfg, order)
        seconds[name] = watch.seconds
        models[name] = model
        bar.update()
    records = {}
    for name, model in models.items():
        curve, probe = _evaluate(model, data, cfg, run_seed, progress)
        records[name] = dict(
            rates=curve.rates.tolist(),
            scores=curve.scores.tolist(),
            stderr=curve.stderr.tolist(),
            area=common.rate_mean_area(curve),
            area_stderr=49 * float(curve.stderr.pow(2).sum().sqrt()) / len(curve.rates),
            probe_accuracy=probe,
            train_loss=losses.get(name),
            train_seconds=seconds.get(name),
            convergence=loss_convergence(losses[name]) if name in losses else None,
        )
    return records


def _measure(cfg, device, seed, progress):
    """Every model's record at every seed: ``{name: [record per seed]}``."""
    runs = {name: [] for name in ("random init.", *RATES)}
    work = cfg["seeds"] * len(RATES)
    with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="model") as bar:
        for run_seed in cfg["run_seeds"]:
            for name, record in _one_seed(cfg, run_seed, device, progress, bar).items():
                runs[name].append(record)
    return runs


def _summary(reps, fixed, at75):
    """One model's means (± sd) over the seeds."""
    trained = reps[0]["train_loss"] is not None
    final_losses = [statistics.fmean(r["train_loss"][-10:]) for r in reps] if trained else None
    out = dict(
        area=common.mean_std([r["area"] for r in reps]),
        # Paired by seed: the models of one seed share data, initial weights and batches.
        area_minus_fixed=common.mean_std([r["area"] - f["area"] for r, f in zip(reps, fixed)]),
        area_stderr=statistics.fmean(r["area_stderr"] for r in reps),
        score_lowest_rate=common.mean_std([r["scores"][0] for r in reps]),
        score_75=common.mean_std([r["scores"][at75] for r in reps]),
        score_highest_rate=common.mean_std([r["scores"][-1] for r in reps]),
        probe_accuracy=common.mean_std([r["probe_accuracy"] for r in reps]),
        probe_minus_fixed=common.mean_std(
            [r["probe_accuracy"] - f["probe_accuracy"] for r, f in zip(reps, fixed)]
        ),
        final_train_loss=statistics.fmean(final_losses) if trained else None,
        train_seconds=statistics.fmean(r["train_seconds"] for r in reps) if trained else None,
        relative_change=None,
        converged=None,
    )
    if trained:
        changes = [r["convergence"]["relative_change"] for r in reps]
        out["relative_change"] = common.mean_std(changes)
        out["converged"] = sum(r["convergence"]["converged"] for r in reps)
    return out


def _report(cfg, runs):
    rates = runs["random init."][0]["rates"]
    at75 = min(range(len(rates)), key=lambda k: abs(rates[k] - 0.75))
    summary = {name: _summary(reps, runs["fixed 75%"], at75) for name, reps in runs.items()}
    rows = []
    for name, s in summary.items():
        cells = [(s["area"], 0), (s["area_minus_fixed"], 0), (s["score_lowest_rate"], 2)]
        cells += [(s["score_75"], 2), (s["score_highest_rate"], 2)]
        rows.append(
            [name]
            + [common.spread_cell(pair, digits, cfg["seeds"]) for pair, digits in cells]
            + [common.spread_cell(s["probe_accuracy"], 1, cfg["seeds"], 100)]
            + [_convergence_cell(s, cfg["seeds"])]
            + ["-" if s["train_seconds"] is None else f"{s['train_seconds']:.0f}"]
        )
    spread = f"{cfg['seeds']} seeds, mean ± sd" if cfg["seeds"] > 1 else "one seed"
    title = (
        f"Fig. 6 analogue: ViT-MAE (49 patches of 4x4, width {cfg['hidden']}, "
        f"{cfg['layers']}+{cfg['decoder_layers']} layers) trained on {cfg['N']} MNIST images "
        f"for {cfg['steps']} steps of {cfg['batch']} at a constant learning rate {cfg['lr']:g} "
        f"after {cfg['warmup']} warm-up steps; curves on {cfg['held_out']} held-out images, "
        f"{len(rates)} rates {100 * rates[0]:.0f}%...{100 * rates[-1]:.0f}%, "
        f"{cfg['num_masks']} mask(s) each; patch log-likelihood with pixel sd {SCALE}; "
        f"area = 49 * mean_r S (nats per image); {spread}; - fixed 75%: area minus the fixed "
        "75% model's area of the same seed; converged: runs whose training loss (mean over a "
        "tenth of the run) changed by less than "
        f"{100 * CONVERGED_BELOW:g}% from 80% to 100% of training, and that relative change"
    )
    r0, r1 = 100 * rates[0], 100 * rates[-1]
    headers = ["model", "area", "- fixed 75%", f"S({r0:.0f}%)", "S(75%)", f"S({r1:.0f}%)"]
    headers += ["probe acc %", "converged (change %)", "train s"]
    results = dict(
        summary=summary,
        # Per model: the mean curve over the seeds.
        curves={name: dict(rates=rates, scores=_mean_curve(reps)) for name, reps in runs.items()},
        runs=runs,
    )
    return Report(common.format_table(headers, rows, title=title), _figure(runs), results)


def _convergence_cell(s, seeds):
    """``k/n (change %)`` for a trained model, ``-`` for the untrained one."""
    if s["converged"] is None:
        return "-"
    change = common.spread_cell(s["relative_change"], 2, seeds, 100)
    return f"{s['converged']}/{seeds} ({change})"


def _mean_curve(reps):
    return [statistics.fmean(v) for v in zip(*(r["scores"] for r in reps))]


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, seeds=None):
    """Reproduces Fig. 6 on MNIST; writes ``mae-curve.json`` and ``mae-curve.png``.

    ``smoke``: 96 training images, a one-layer model of width 32, three steps, one seed
    (seconds); ``full``: a 4+2-layer model, 20000 steps, 19 rates and 4 masks per image and
    rate (a GPU run); the default is a 1+1-layer model of width 64, 18000 steps of 64 of
    4000 images, three seeds (about 21 minutes per seed on one busy CPU core). ``seed`` is
    the base seed;
    ``seeds``: how many times to repeat everything (data split, initial weights, batch
    order, masks) from seeds derived from it, the table giving mean ± sd over them (default:
    1 at smoke size, 3 otherwise). The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """

    def config(smoke, full):
        return common.with_seeds(_config(smoke, full), seeds, seed)

    return run_experiment(
        NAME, out_dir, config, _measure, _report, device, smoke, full, seed, progress,
        dtype=torch.float32,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 6; R2MAE random ratio",
        settings=dict(
            rates_by_run={k: str(v) for k, v in RATES.items()},
            pixel_scale=SCALE,
            dtype="float32",
            threads=torch.get_num_threads(),
        ),
    )  # fmt: skip


def _figure(runs):
    """Left: each model's MPT curve, mean over the seeds (one line per seed, faint). Right:
    the training loss of the first seed."""
    fig, (left, right) = common.new_figure(2, width=5.5)
    for name, reps in runs.items():
        rates = [100 * r for r in reps[0]["rates"]]
        for rep in reps:
            left.plot(rates, rep["scores"], color=COLORS[name], lw=0.8, alpha=0.3)
        left.plot(rates, _mean_curve(reps), ".-", color=COLORS[name], label=name)
        if reps[0]["train_loss"] is not None:
            right.plot(reps[0]["train_loss"], color=COLORS[name], label=name, lw=1)
    left.set_xlabel("masked patches (%)")
    left.set_ylabel("mean log-likelihood of a masked patch")
    left.set_title("ViT-MAE on MNIST: MPT curves (held-out)")
    left.legend(fontsize="small")
    right.set_xlabel("step")
    right.set_ylabel("MAE loss (masked-patch MSE)")
    right.set_yscale("log")
    right.set_title("training loss at each run's own mask sizes (first seed)")
    right.legend(fontsize="small")
    return fig
