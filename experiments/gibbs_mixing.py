"""Mixing of block Gibbs on the self-predictive conditionals, and the sample efficiency of
training by fixed-size masks (Li et al., 2024, "Promises and pitfalls of generative masked
language modeling"), on two models whose joint distribution is known:

* a strongly correlated **PPCA** (``D = 8``, ``K = 1``, loadings 1.5...2.5, noise variance
  0.5: correlations near 0.9), with exact conditionals;
* a **bimodal** binary model, ``z ~ N(0, 1)``, ``x_j ~ Bernoulli(sigmoid(3 z + b_j))``
  (``D = 8``): most of its mass sits at all-zeros and all-ones; quadrature conditionals.

For each block size ``k`` a block Gibbs chain (:func:`pyro_mpt.gibbs`) runs from draws of
the model, with *joint* block updates (exact block Gibbs) and *product* updates (each
feature of the block from its own conditional, one parallel MLM pass). Reported:

* the effective sample size of a slow statistic (PPCA: the projection on the leading
  principal axis; bimodal: the mean of the bits) per step and per model evaluation, by
  :func:`pyro_mpt.diagnostics.mixing_diagnostics`; a joint ``k``-block step of an MLM
  takes ``k`` passes (unmasking one position at a time) and a product step one, so those
  are the evaluations counted. (For these latent-variable models a joint step costs one
  model run: the latent is integrated out.)
* the stationary error: PPCA, the relative Frobenius error of the chains' covariance
  against the model's ``W W^T + psi I``, beside the error predicted in closed form by
  :func:`~pyro_mpt.ops.conditional_sampling.block_gibbs_covariance`; bimodal, the error in
  the probability that all bits agree, against a fine grid integral.
* side by side, the relative error of the covariance of PPCAs trained by MPT with masks of
  fixed size ``k`` (``MPTLoss(rate=k / D)``) on ``N`` draws of the same PPCA, over seeds.
"""

import functools
import math

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from experiments import _common as common
from experiments._experiment import Report, run_experiment
from pyro_mpt import MPTLoss, gibbs
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.diagnostics.mixing import mixing_diagnostics
from pyro_mpt.models import PPCA
from pyro_mpt.ops.conditional_sampling import block_gibbs_covariance

__all__ = ["NAME", "run"]

NAME = "gibbs-mixing"
NUM_FEATURES = 8
NOISE_VAR = 0.5
SLOPE = 3.0


def _config(smoke, full):
    if smoke:
        return dict(chains=16, steps=150, sizes=[1, 2, 4, 7, 8], seeds=2, train_n=100, epochs=300)
    if full:
        return dict(
            chains=64, steps=2000, sizes=[1, 2, 3, 4, 6, 7, 8], seeds=10, train_n=100, epochs=2000
        )
    return dict(chains=32, steps=600, sizes=[1, 2, 4, 6, 7, 8], seeds=5, train_n=100, epochs=1000)


def _true_ppca(device):
    ppca = PPCA(NUM_FEATURES, 1, noise_scale=math.sqrt(NOISE_VAR)).to(device)
    ppca.weight = torch.linspace(1.5, 2.5, NUM_FEATURES, device=device).unsqueeze(-1)
    return ppca


def _bias(device):
    return torch.linspace(-1.0, 1.0, NUM_FEATURES, device=device)


def _bimodal_model(x):
    bias = _bias(x.device)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        logits = SLOPE * z.unsqueeze(-1) + bias
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def _bimodal_draws(num, device):
    z = torch.randn(num, 1, device=device)
    return torch.bernoulli(torch.sigmoid(SLOPE * z + _bias(device)))


def _bimodal_agreement(device):
    """``P(all bits agree)`` under the bimodal model, by a fine grid over ``z``."""
    z = torch.linspace(-10.0, 10.0, 20001, device=device).unsqueeze(-1)
    probs = torch.sigmoid(SLOPE * z + _bias(device))
    weights = dist.Normal(0.0, 1.0).log_prob(z.squeeze(-1)).softmax(0)
    return float((weights * (probs.prod(-1) + (1 - probs).prod(-1))).sum())


def _mixing_rows(label, key, cfg, seed, bar, model, draw, conditionals, statistic, errors):
    """One row per block size ``k`` and update (joint, product): chains of ``model`` from
    ``draw(num)``, the ESS of ``statistic(chain)``, and ``errors(chain, k, joint)``, the
    stationary and the predicted error. The first state (the model draws) is dropped."""
    rows = []
    for k in cfg["sizes"]:
        for joint in (True, False):
            options = dict(num_steps=cfg["steps"], conditionals=conditionals, progress=False)
            # Warm-up: one untimed step from other starts, the random state restored after,
            # so that one-off costs are not charged to the first update timed.
            with common.preserved_rng():
                warm = dict(options, num_steps=1)
                gibbs(model, draw(cfg["chains"]), block_size=k, joint=joint, **warm)
            common.seed_everything(common.derived_seed(seed, key, k, joint))
            x = draw(cfg["chains"])
            with common.Stopwatch() as watch:
                chain = gibbs(model, x, block_size=k, joint=joint, **options)[1:]
            stat = statistic(chain).T  # (chains, draws)
            mixing = mixing_diagnostics(stat, evaluations_per_step=k if joint else 1)
            stationary, predicted = errors(chain, k, joint)
            rows.append(
                dict(
                    model=label,
                    k=k,
                    update="joint" if joint else "product",
                    ess_per_step=float(mixing.ess_per_step),
                    ess_per_evaluation=float(mixing.ess_per_evaluation),
                    rhat=float(mixing.rhat),
                    stationary_error=stationary,
                    predicted_error=predicted,
                    seconds=watch.seconds,
                )
            )
            bar.update()
    return rows


def _ppca_rows(cfg, seed, device, bar):
    truth = _true_ppca(device)
    cov = truth.covariance().detach()
    axis = torch.linalg.eigh(cov).eigenvectors[:, -1]

    def errors(chain, k, joint):
        sample_cov = torch.cov(chain.reshape(-1, NUM_FEATURES).T)
        predicted = block_gibbs_covariance(cov, k, joint=joint)
        return _relative(sample_cov, cov), _relative(predicted, cov)

    def stat(chain):  # the projection on the leading principal axis
        return (chain - truth.loc) @ axis

    return _mixing_rows("ppca", 1, cfg, seed, bar, truth.model, truth.sample, "exact", stat, errors)


def _relative(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def _bit_mean(chain):
    return chain.mean(-1)


def _bimodal_rows(cfg, seed, device, bar):
    agreement = _bimodal_agreement(device)

    def errors(chain, k, joint):
        agree = float((chain.sum(-1) % NUM_FEATURES == 0).double().mean())
        return abs(agree - agreement), None

    draw, rule = functools.partial(_bimodal_draws, device=device), Quadrature(num_points=40)
    rows = _mixing_rows("bimodal", 2, cfg, seed, bar, _bimodal_model, draw, rule, _bit_mean, errors)
    return rows, agreement


def _no_guide(x):
    pass


def _mle_error(x, cov):
    """The covariance error of the maximum-likelihood PPCA (Tipping and Bishop, 1999)."""
    values, vectors = torch.linalg.eigh(torch.cov(x.T, correction=0))
    noise_var = values[:-1].mean()
    weight = vectors[:, -1:] * (values[-1] - noise_var).sqrt()
    eye = torch.eye(NUM_FEATURES, dtype=x.dtype, device=x.device)
    return _relative(weight @ weight.T + noise_var * eye, cov)


def _training_rows(cfg, seed, device, bar):
    """Covariance error of PPCAs trained by MPT with fixed-size-k masks, over seeds, with
    the maximum-likelihood PPCA of the same data as reference (``k = None``)."""
    truth = _true_ppca(device)
    cov = truth.covariance().detach()
    rows = []
    data = []
    for rep in range(cfg["seeds"]):
        common.seed_everything(common.derived_seed(seed, 3, rep))  # the same data for every k
        data.append(truth.sample(cfg["train_n"]))
    for k in _training_sizes(cfg):
        errors = []
        for rep, x in enumerate(data):
            pyro.clear_param_store()
            common.seed_everything(common.derived_seed(seed, 4, rep))  # the same initial model too
            model = PPCA(NUM_FEATURES, 1, init_scale=0.5, noise_scale=1.0).to(device)
            loss = MPTLoss(rate=k / NUM_FEATURES, num_masks=NUM_FEATURES, conditionals="exact")
            decay = 0.01 ** (1.0 / cfg["epochs"])  # lr from 0.1 down to 0.001
            optim = pyro.optim.ClippedAdam({"lr": 0.1, "lrd": decay})
            svi = SVI(model.model, _no_guide, optim, loss=loss)
            for _ in range(cfg["epochs"]):
                svi.step(x)
            errors.append(_relative(model.covariance().detach(), cov))
            bar.update()
        rows.append(_spread(k, errors))
    rows.append(_spread(None, [_mle_error(x, cov) for x in data]))
    pyro.clear_param_store()
    return rows


def _spread(k, errors):
    mean, std = common.mean_std(errors)
    return dict(k=k, errors=errors, mean=mean, std=std)


def _training_sizes(cfg):
    # Masks of all D features score the marginals only: no correlation can be learnt.
    return [k for k in cfg["sizes"] if k < NUM_FEATURES]


def _measure(cfg, device, seed, progress):
    """The mixing rows of both models, the bimodal agreement and the training rows."""
    work = 4 * len(cfg["sizes"]) + cfg["seeds"] * len(_training_sizes(cfg))
    with common.num_threads(1), common.progress_bar(total=work, enabled=progress, desc=NAME) as bar:
        ppca_rows = _ppca_rows(cfg, seed, device, bar)
        bimodal_rows, agreement = _bimodal_rows(cfg, seed, device, bar)
        training = _training_rows(cfg, seed, device, bar)
    return dict(mixing=ppca_rows + bimodal_rows, agreement=agreement, training=training)


def _report(cfg, measured):
    mixing, agreement, training = measured["mixing"], measured["agreement"], measured["training"]
    headers = ["model", "k", "update", "ESS/step", "ESS/eval", "R-hat", "stat. error",
               "predicted", "s"]  # fmt: skip
    measures = ("ess_per_step", "ess_per_evaluation", "rhat", "stationary_error")
    rows = [
        [r["model"], r["k"], r["update"], *(f"{r[key]:.3f}" for key in measures)]
        + ["" if r["predicted_error"] is None else f"{r['predicted_error']:.3f}"]
        + [f"{r['seconds']:.1f}"]
        for r in mixing
    ]
    title = (
        f"Block Gibbs on the self-predictive conditionals (D={NUM_FEATURES}, "
        f"{cfg['chains']} chains x {cfg['steps']} steps from model draws). ESS of the "
        f"leading principal component (PPCA) or the bit mean (bimodal); evaluations per step: "
        f"k for a joint step (an MLM unmasks one position per pass), 1 for a product step."
    )
    notes = [
        "stat. error: PPCA, ||Cov(chain) - Cov(model)||_F / ||Cov(model)||_F (predicted: the "
        "closed-form stationary covariance of the chain);",
        f"bimodal, |P(all bits agree) - {agreement:.4f}| (grid integral).",
    ]
    train_table = common.format_table(
        ["k (mask size)", "rel. covariance error"],
        [[t["k"] or "MLE", common.pm(t["mean"], t["std"], 3)] for t in training],
        title=(
            f"PPCA trained by MPTLoss(rate=k/D), N={cfg['train_n']}, {cfg['epochs']} full-batch "
            f"Adam steps (lr 0.1 decaying to 0.001), relative error of the covariance, mean ± std "
            f"over {cfg['seeds']} seeds (same data and init for every k); MLE: the "
            f"maximum-likelihood PPCA of the same data. The error after a fixed budget includes "
            f"the optimisation error: small masks give a flatter objective."
        ),
    )
    table = common.format_table(headers, rows, title=title, notes=notes) + "\n" + train_table
    results = dict(mixing=mixing, bimodal_agreement=agreement, training=training)
    return Report(table, _figure(mixing, training), results)


def _figure(mixing, training):
    fig, axes = common.new_figure(3, width=4.4)
    for model, marker in (("ppca", "o"), ("bimodal", "s")):
        for update, style in (("joint", "-"), ("product", "--")):
            sel = [r for r in mixing if r["model"] == model and r["update"] == update]
            ks = [r["k"] for r in sel]
            label = f"{model}, {update}"
            axes[0].plot(ks, [r["ess_per_step"] for r in sel], style, marker=marker, label=label)
            axes[1].plot(ks, [r["stationary_error"] for r in sel], style, marker=marker,
                         label=label)  # fmt: skip
    axes[0].set_yscale("log")
    axes[0].set_title("ESS per step")
    axes[1].set_title("stationary error")
    axes[2].errorbar(
        [t["k"] for t in training], [t["mean"] for t in training],
        yerr=[t["std"] for t in training], marker="o",
    )  # fmt: skip
    axes[2].set_title("PPCA trained by size-k masks: cov. error")
    for ax in axes:
        ax.set_xlabel("block / mask size k")
    axes[0].legend(fontsize=7)
    return fig


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Runs the study; writes ``gibbs-mixing.json`` and ``gibbs-mixing.png``.

    ``smoke``: 16 chains of 150 steps, ``k`` in 1, 2, 4, 7, 8, two training seeds of 300
    steps (under a minute on one core); ``full``: 64 chains of 2000 steps, ten training seeds
    of 2000 steps. The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report, device, smoke, full, seed, progress,
        dtype=torch.float64,
        paper_reference="Li et al. (2024), Promises and pitfalls of generative MLMs",
        settings=dict(num_features=NUM_FEATURES, noise_var=NOISE_VAR, slope=SLOPE, dtype="float64"),
    )  # fmt: skip
