"""Fig. 6 of Moreno-Muñoz et al. (2023) on MNIST: the MPT curve of a small ViT-MAE trained
from scratch with MAE's fixed 75% ratio, with a random ratio (R2MAE) and with the uniform
schedule, against the random initialisation; the area under each curve and a linear probe
of the digit.

Data: MNIST from :func:`pyro_mpt.datasets.load_mnist` (grey levels in ``[0, 1]``, not
binarised), split at random into training and held-out images stratified by digit.

Model: :func:`pyro_mpt.transformers.vit_mae.vit_mae_from_config` with 28 x 28 images in
4 x 4 patches (``L = 49`` patches of 16 pixels), a 4-layer encoder and a 2-layer decoder of
width 64 (about 0.2M parameters), the same initial weights for every rate. Training:
:func:`pyro_mpt.transformers.train_mae` (AdamW, learning rate 1e-3 with cosine decay,
batches of 32, 12 epochs), one mask size per step drawn from the rate schedule:

* ``fixed 75%``: MAE's ratio, ``M = 37`` of 49;
* ``random 55-95%``: R2MAE, ``r ~ U[0.55, 0.95)`` per step (the same mean ratio, 75%);
* ``uniform``: ``M ~ Uniform{1, ..., 48}`` (capped so one patch stays visible), the
  unbiased MPT objective.

Curve: :func:`pyro_mpt.transformers.mae_mpt_curve` on held-out images at 5%, 10%, ..., 95%, a
masked patch scored as a Gaussian with pixel standard deviation 0.1; area = ``49 · mean_r
S`` (nats per image). Linear probe: multinomial logistic regression on the mean of the
encoder's patch tokens with nothing masked, fitted on the training images and scored on the
held-out ones.

.. note:: The paper's Fig. 6 shows a pre-trained ViT-MAE (ImageNet) on Fashion-MNIST,
    CIFAR-100 and Tiny-ImageNet; here every model is trained from scratch on MNIST, so the
    curves are comparable with each other only.
"""

import torch

from pyro_mpt.reproduce._common import (
    Stopwatch,
    check_size,
    default_dtype,
    derived_seed,
    format_table,
    new_figure,
    progress_bar,
    resolve_device,
    save_outputs,
    seed_everything,
)
from pyro_mpt.reproduce._probe import linear_probe_accuracy

__all__ = ["NAME", "RATES", "run"]

NAME = "mae-curve"

#: Run name -> the ``rate`` of :func:`pyro_mpt.transformers.mae_loss`.
RATES = {"fixed 75%": 0.75, "random 55-95%": (0.55, 0.95), "uniform": "uniform"}
COLORS = {"random init.": "C7", "fixed 75%": "C3", "random 55-95%": "C2", "uniform": "C0"}
SCALE = 0.1


def _config(smoke, full):
    cfg = dict(
        hidden=64, layers=4, decoder_layers=2, batch=32, lr=1e-3, num_masks=2, probe_iters=100
    )
    if smoke:
        cfg.update(N=96, held_out=48, epochs=1, hidden=32, layers=1, decoder_layers=1)
        cfg.update(rates=[0.25, 0.5, 0.75], num_masks=1, probe_iters=20)
    elif full:
        cfg.update(N=4000, held_out=1000, epochs=100, rates=None, num_masks=4)
    else:
        cfg.update(N=4000, held_out=1000, epochs=12, rates=None)
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
    seed_everything(seed)
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
    shape = (-1, 1, 28, 28)
    return (
        x_train.reshape(shape).to(device),
        x_test.reshape(shape).to(device),
        y_train.to(device),
        y_test.to(device),
    )


def _evaluate(model, data, cfg, seed, progress):
    from pyro_mpt.transformers import mae_mpt_curve

    x_train, x_test, y_train, y_test = data
    seed_everything(derived_seed(seed, 3))  # the same masks for every model
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


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 6 on MNIST; writes ``mae-curve.json`` and ``mae-curve.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: 96 training images, a one-layer model, one epoch; runs in seconds.
    :param bool full: 100 epochs and 4 masks per image and rate (a GPU run); the default is
        12 epochs on 4000 images (several minutes on two CPU cores).
    :param int seed: base seed (data split, initial weights, masks).
    :param bool progress: show progress bars.
    :returns: the results dict (also written as JSON).
    """
    from pyro_mpt.transformers import train_mae

    check_size(smoke, full)
    cfg = _config(smoke, full)
    device = resolve_device(device)
    total = Stopwatch()
    with default_dtype(torch.float32):
        data = _data(cfg, seed, device)
        models = {"random init.": _model(cfg, derived_seed(seed, 1)).to(device)}
        losses, seconds = {}, {}
        with progress_bar(total=len(RATES), enabled=progress, desc=NAME, unit="model") as bar:
            for key, (name, rate) in enumerate(RATES.items()):
                model = _model(cfg, derived_seed(seed, 1)).to(device)
                order = torch.Generator().manual_seed(derived_seed(seed, 2))
                seed_everything(derived_seed(seed, 4, key))
                with Stopwatch() as watch:
                    losses[name] = train_mae(
                        model,
                        data[0],
                        rate=rate,
                        epochs=cfg["epochs"],
                        batch_size=cfg["batch"],
                        lr=cfg["lr"],
                        generator=order,
                        progress=False,
                    )
                seconds[name] = watch.seconds
                models[name] = model
                bar.update()
        results = {name: _evaluate(m, data, cfg, seed, progress) for name, m in models.items()}

    summary, rows = {}, []
    for name, (curve, probe) in results.items():
        rates = curve.rates.tolist()
        at75 = min(range(len(rates)), key=lambda k: abs(rates[k] - 0.75))
        summary[name] = dict(
            area=curve.area,
            area_stderr=49 * float(curve.stderr.pow(2).sum().sqrt()) / len(rates),
            score_lowest_rate=float(curve.scores[0]),
            score_75=float(curve.scores[at75]),
            score_highest_rate=float(curve.scores[-1]),
            probe_accuracy=probe,
            final_train_loss=(
                sum(losses[name][-10:]) / len(losses[name][-10:]) if name in losses else None
            ),
            train_seconds=seconds.get(name),
        )
        s = summary[name]
        rows.append(
            [
                name,
                f"{s['area']:.0f} ± {s['area_stderr']:.0f}",
                f"{s['score_lowest_rate']:.2f}",
                f"{s['score_75']:.2f}",
                f"{s['score_highest_rate']:.2f}",
                f"{100 * probe:.1f}",
                "-" if s["train_seconds"] is None else f"{s['train_seconds']:.0f}",
            ]
        )
    first = results["random init."][0].rates
    title = (
        f"Fig. 6 analogue: ViT-MAE (49 patches of 4x4, width {cfg['hidden']}, "
        f"{cfg['layers']}+{cfg['decoder_layers']} layers) trained on {cfg['N']} MNIST images "
        f"for {cfg['epochs']} epochs; curves on {cfg['held_out']} held-out images, "
        f"{len(first)} rates {100 * float(first[0]):.0f}%...{100 * float(first[-1]):.0f}%, "
        f"{cfg['num_masks']} mask(s) each; patch log-likelihood with pixel sd {SCALE}; "
        "area = 49 * mean_r S (nats per image)"
    )
    r0, r1 = 100 * float(first[0]), 100 * float(first[-1])
    headers = [
        "model",
        "area",
        f"S({r0:.0f}%)",
        "S(75%)",
        f"S({r1:.0f}%)",
        "probe acc %",
        "train s",
    ]
    print(format_table(headers, rows, title=title))

    fig = _figure(results, losses)
    out = dict(
        experiment=NAME,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 6; R2MAE random ratio",
        config=dict(
            cfg,
            rates_by_run={k: str(v) for k, v in RATES.items()},
            pixel_scale=SCALE,
            dtype="float32",
            seed=seed,
            smoke=smoke,
            full=full,
            device=str(device),
            threads=torch.get_num_threads(),
        ),
        summary=summary,
        curves={
            name: dict(rates=c.rates, scores=c.scores, stderr=c.stderr)
            for name, (c, _) in results.items()
        },
        train_losses=losses,
        wall_seconds=total.elapsed,
    )
    return save_outputs(out_dir, NAME, out, fig)


def _figure(results, losses):
    from pyro_mpt import plot_mpt_curve

    fig, (left, right) = new_figure(2, width=5.5)
    for name, (curve, _) in results.items():
        plot_mpt_curve(curve, ax=left, label=name, color=COLORS[name], marker=".")
    left.set_xlabel("masked patches (%)")
    left.set_ylabel("mean log-likelihood of a masked patch")
    left.set_title("ViT-MAE on MNIST: MPT curves (held-out)")
    for name, values in losses.items():
        right.plot(values, color=COLORS[name], label=name, lw=1)
    right.set_xlabel("step")
    right.set_ylabel("MAE loss (masked-patch MSE)")
    right.set_yscale("log")
    right.set_title("training loss at each run's own mask sizes")
    right.legend(fontsize="small")
    return fig
