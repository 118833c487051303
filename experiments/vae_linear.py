"""Fig. 3 (top) of Moreno-Muñoz et al. (2023): a linear VAE with a Bernoulli likelihood,
trained by variational inference and by masked pre-training with conditionals from numerical
integration, raises its log-marginal likelihood (LML) to similar values either way.

Data: binarised MNIST from :func:`pyro_mpt.datasets.load_mnist` (``N`` training images and
a held-out set, stratified by digit). Model: :class:`pyro_mpt.models.LinearVAE` with
``K = 2``, the same initialisation for the three objectives:

* ``ELBO``: :class:`pyro.infer.Trace_ELBO` with the model's amortized linear encoder;
* ``MPT uniform``: ``MPTLoss(rate="uniform", conditionals=Quadrature(num_points=20))``;
* ``MPT fixed 33%``: ``MPTLoss(rate=0.33, conditionals=Quadrature(num_points=20))``.

The MPT conditionals integrate ``z`` out with a 20 x 20 Gauss–Hermite rule placed under the
prior, so MPT needs and trains no guide. Training: minibatches of the shuffled training set
(the same order for all three), Adam, float32. Each epoch records the objective (minus the
loss per observation, averaged over the epoch's steps) and the LML per observation after the
epoch, on a fixed subset of at most 500 training images and on the held-out images.

The LML uses the 60 x 60 rule of ``Quadrature(num_points=60)`` with prior-centred nodes, in
float64. For this decoder the rule has a closed form,
``log p(x) ≈ LSE_g(log w_g + xᵀ(W z_g + b) − Σ_j softplus(W z_g + b)_j)``, which costs
``O(G D + N G)``, not the ``O(G N D)`` of the generic :func:`pyro_mpt.log_marginal` (seconds
per 100 images). The final models are checked against ``log_marginal(...,
conditionals=Quadrature(60))`` (float32, in chunks) and against 100 x 100 nodes (JSON).

.. note:: The paper's script trains full batch for 800 epochs, integrates on a uniform grid
    over ``[-5, 5]^2``, and scores each masked pixel by its marginal ``p(x_j)`` rather than
    the conditional ``p(x_j | x_R)``; here the conditionals are the quadrature's.
"""

import math

import pyro
import pyro.optim
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.datasets import load_mnist, train_test_split
from pyro_mpt.models import LinearVAE
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid

__all__ = [
    "CHECK_NODES",
    "COLORS",
    "CURVES",
    "EVAL_NODES",
    "MNIST_PIXELS",
    "NAME",
    "OBJECTIVES",
    "TRAIN_NODES",
    "gauss_hermite_log_marginal",
    "run",
]

NAME = "vae-linear"

#: Objective name -> the ``rate`` of :class:`~pyro_mpt.MPTLoss`, or ``None`` for the ELBO.
OBJECTIVES = {"ELBO": None, "MPT uniform": "uniform", "MPT fixed 33%": 0.33}
COLORS = {"ELBO": "C3", "MPT uniform": "C0", "MPT fixed 33%": "C2"}

TRAIN_NODES = 20
EVAL_NODES = 60
CHECK_NODES = 100

#: Pixels of an MNIST image (28 x 28), the features of the model.
MNIST_PIXELS = 784


def _config(smoke, full):
    cfg = dict(K=2, batch=50, lr=5e-2, eval_max=500, check_obs=50, chunk=10)
    if smoke:
        cfg.update(N=40, held_out=20, batch=20, epochs=2, check_obs=4, chunk=4)
    elif full:
        cfg.update(N=2000, held_out=500, epochs=20)
    else:
        cfg.update(N=1000, held_out=500, epochs=6)
    return cfg


def _no_guide(x):
    """The quadrature integrates ``z`` out under the prior: MPT uses no guide."""


def gauss_hermite_log_marginal(vae, x, num_points=EVAL_NODES, chunk=2500):
    """``log p(x)`` of every row of binary ``x`` under a Bernoulli :class:`LinearVAE`, by the
    prior-centred Gauss–Hermite rule of ``Quadrature(num_points)``, in float64.

    :param LinearVAE vae: a model with ``likelihood="bernoulli"``.
    :param torch.Tensor x: binary data of shape ``(N, D)``.
    :param int num_points: nodes per latent dimension (``num_points ** K`` in all).
    :param int chunk: nodes per pass, which bounds memory to ``O(chunk * (N + D))``.
    :returns: a float64 tensor of shape ``(N,)``.
    """
    with torch.no_grad():
        weight = vae.weight.detach().double()
        bias = vae.bias.detach().double()
        nodes, log_weights = gauss_hermite_grid(
            num_points, weight.shape[-1], torch.float64, x.device
        )
        xd = x.double()
        x_weight, x_bias = xd @ weight, xd @ bias
        total = torch.full_like(x_bias, -math.inf)
        for z, log_w in zip(nodes.split(chunk), log_weights.split(chunk)):
            log_normalizer = F.softplus(z @ weight.T + bias).sum(-1)
            terms = x_weight @ z.T + x_bias[:, None] + (log_w - log_normalizer)
            total = torch.logaddexp(total, terms.logsumexp(-1))
    return total


def _data(cfg, seed, device):
    total = cfg["N"] + cfg["held_out"]
    x, y = load_mnist(num_samples=total, seed=seed, dtype=torch.float32)
    x_train, x_test, _, _ = train_test_split(x, y, cfg["held_out"] / total, seed=seed)
    return x_train.to(device), x_test.to(device)


def _svi(vae, rate, lr):
    optim = pyro.optim.Adam({"lr": lr})
    if rate is None:
        return SVI(vae.model, vae.guide, optim, loss=Trace_ELBO())
    loss = MPTLoss(rate=rate, conditionals=Quadrature(num_points=TRAIN_NODES))
    return SVI(vae.model, _no_guide, optim, loss=loss)


def _warm_up(x_train, cfg, rate):
    """One step of the objective on a throwaway model, so that one-off costs (torch's and
    Pyro's first calls, the loss's set-up) are not charged to the seconds per epoch of the
    first objective timed. The random state is left as it was: the runs are unchanged."""
    with common.preserved_rng():
        vae = LinearVAE(x_train.shape[1], cfg["K"]).to(x_train.device)
        _svi(vae, rate, cfg["lr"]).step(x_train[: cfg["batch"]])


def _train(x_train, x_eval, x_test, cfg, rate, seed, bar):
    _warm_up(x_train, cfg, rate)
    # The same initial model and minibatches for every objective.
    common.seed_everything(common.derived_seed(seed, 1))
    vae = LinearVAE(x_train.shape[1], cfg["K"]).to(x_train.device)
    svi = _svi(vae, rate, cfg["lr"])
    order = torch.Generator().manual_seed(common.derived_seed(seed, 2))
    lml_train = [float(gauss_hermite_log_marginal(vae, x_eval).mean())]
    lml_test = [float(gauss_hermite_log_marginal(vae, x_test).mean())]
    objective, seconds = [], []
    num_obs = x_train.shape[0]
    for _ in range(cfg["epochs"]):
        perm = torch.randperm(num_obs, generator=order).to(x_train.device)
        with common.Stopwatch() as watch:
            loss = sum(svi.step(x_train[idx]) for idx in perm.split(cfg["batch"]))
        seconds.append(watch.seconds)
        objective.append(-loss / num_obs)
        lml_train.append(float(gauss_hermite_log_marginal(vae, x_eval).mean()))
        lml_test.append(float(gauss_hermite_log_marginal(vae, x_test).mean()))
        bar.update()
    run = dict(
        objective=objective,
        log_marginal_train=lml_train,
        log_marginal_held_out=lml_test,
        epoch_seconds=seconds,
    )
    return vae, run


def _checks(vae, x_eval, x_test, cfg):
    """Node-count convergence (60 vs 100 nodes per dimension) and agreement with the generic
    :func:`pyro_mpt.log_marginal`, on the final model."""
    out = {}
    for split, x in (("train", x_eval), ("held_out", x_test)):
        coarse = gauss_hermite_log_marginal(vae, x, EVAL_NODES)
        fine = gauss_hermite_log_marginal(vae, x, CHECK_NODES)
        out[split] = {
            f"mean_{EVAL_NODES}": float(coarse.mean()),
            f"mean_{CHECK_NODES}": float(fine.mean()),
            "mean_difference": float(fine.mean() - coarse.mean()),
            "max_abs_difference": float((fine - coarse).abs().max()),
        }
    part, rule = x_eval[: cfg["check_obs"]], Quadrature(num_points=EVAL_NODES)
    with torch.no_grad():  # the generic path forms (nodes, rows, D) tensors: a few rows a call
        generic = [log_marginal(vae.model, x, conditionals=rule) for x in part.split(cfg["chunk"])]
    generic = torch.cat(generic).double()
    closed = gauss_hermite_log_marginal(vae, part, EVAL_NODES)
    out["log_marginal_api"] = {
        "num_obs": part.shape[0],
        "dtype": str(vae.weight.dtype).replace("torch.", ""),
        "max_abs_difference": float((generic - closed).abs().max()),
    }
    return out


def _measure(cfg, device, seed, progress):
    """Trains the three objectives from one initialisation; per objective its curves
    (:func:`_train`) and the checks of its final model (:func:`_checks`)."""
    runs, checks = {}, {}
    with pyro.settings.context(module_local_params=True):
        x_train, x_test = _data(cfg, seed, device)
        x_eval = x_train[: cfg["eval_max"]]
        work = len(OBJECTIVES) * cfg["epochs"]
        with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="epoch") as bar:
            for name, rate in OBJECTIVES.items():
                vae, runs[name] = _train(x_train, x_eval, x_test, cfg, rate, seed, bar)
                checks[name] = _checks(vae, x_eval, x_test, cfg)
                bar.set_postfix_str(f"{name}: LML {runs[name]['log_marginal_train'][-1]:.2f}")
    return dict(runs=runs, checks=checks, num_eval=x_eval.shape[0], num_test=x_test.shape[0])


def _summary(run):
    """The first and final values of one objective's curves, and its training s/epoch."""
    return dict(
        first_log_marginal_train=run["log_marginal_train"][0],
        final_objective=run["objective"][-1],
        final_log_marginal_train=run["log_marginal_train"][-1],
        final_log_marginal_held_out=run["log_marginal_held_out"][-1],
        seconds_per_epoch=sum(run["epoch_seconds"]) / len(run["epoch_seconds"]),
    )


def _report(cfg, measured):
    runs, checks = measured["runs"], measured["checks"]
    summary = {name: _summary(r) for name, r in runs.items()}
    shown = ("final_objective", "final_log_marginal_train", "final_log_marginal_held_out")
    shown += ("seconds_per_epoch",)
    rows = [[name] + [f"{s[k]:.2f}" for k in shown] for name, s in summary.items()]
    node_gap = max(
        abs(c[k]["mean_difference"]) for c in checks.values() for k in ("train", "held_out")
    )
    api_gap = max(c["log_marginal_api"]["max_abs_difference"] for c in checks.values())
    title = (
        f"Fig. 3 top (linear VAE, Bernoulli, K={cfg['K']}, binarised MNIST N={cfg['N']}, "
        f"batch {cfg['batch']}, Adam lr {cfg['lr']}, {cfg['epochs']} epochs, float32; MPT "
        f"conditionals by {TRAIN_NODES}x{TRAIN_NODES} Gauss-Hermite nodes under the prior):\n"
        f"per observation; LML by {EVAL_NODES}x{EVAL_NODES} prior-centred nodes (float64) on "
        f"{measured['num_eval']} training and {measured['num_test']} held-out images; "
        "s/epoch = training only."
    )
    notes = [
        f"LML convergence: |mean LML({CHECK_NODES}^2 nodes) - mean LML({EVAL_NODES}^2)| <= "
        f"{node_gap:.1e}; pyro_mpt.log_marginal(Quadrature({EVAL_NODES})) in float32 agrees "
        f"to {api_gap:.1e} nats."
    ]
    headers = ["objective", "final objective", "LML train", "LML held-out", "s/epoch"]
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, _figure(runs, cfg), dict(summary=summary, checks=checks, runs=runs))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 3 (top); writes ``vae-linear.json`` and ``vae-linear.png``.

    ``smoke``: ``N = 40``, 2 epochs (seconds); ``full``: ``N = 2000``, 20 epochs (about 20
    minutes on one core); the default is ``N = 1000``, 6 epochs (a few minutes). Neither is
    the paper's size: its script trains full batch for 800 epochs. ``seed`` sets the data
    subset, initialisation, minibatch order and masks; the other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    cfg = _config(smoke, full)
    settings = dict(
        D=MNIST_PIXELS,
        objectives={k: str(v) for k, v in OBJECTIVES.items()},
        nodes_per_dim=dict(train=TRAIN_NODES, eval=EVAL_NODES, check=CHECK_NODES),
        num_eval_train=min(cfg["N"], cfg["eval_max"]),
        dtype=dict(train="float32", eval="float64"),
        threads=torch.get_num_threads(),
    )
    return run_experiment(
        NAME, out_dir, _config, _measure, _report,
        device, smoke, full, seed, progress,
        dtype=torch.float32,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 3 (top row, MNIST)",
        settings=settings,
    )  # fmt: skip


#: Curve -> (its key in a run, line style): objectives light and thick, as in the paper.
CURVES = {
    "objective": ("objective", dict(alpha=0.3, lw=4)),
    "LML": ("log_marginal_train", dict(lw=1.8)),
    "held-out LML": ("log_marginal_held_out", dict(lw=1.2, ls=":")),
}


def _figure(runs, cfg):
    fig, axes = common.new_figure(2, width=5.5)
    epochs = cfg["epochs"]
    for ax, first in zip(axes, (0, epochs // 2)):
        for name, r in runs.items():
            for curve, (key, style) in CURVES.items():
                # Objectives average over an epoch's steps: drawn at the epoch's middle.
                shift = 0.5 if key == "objective" else 0.0
                x = [e + shift for e in range(first, len(r[key]))]
                label = f"{name}: {curve}"
                ax.plot(x, r[key][first:], color=COLORS[name], label=label, **style)
        ax.set_xlabel("epoch")
        ax.set_ylabel("per observation (nats)")
    axes[0].set_title("linear VAE, Bernoulli, MNIST: objectives (thick, light) and LML")
    axes[1].set_title("zoom: second half of training")
    # One legend for both panels, below them, where it covers no curve: a row per objective.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(CURVES), fontsize="small")
    return fig
