"""The chain-rule coherence of self-predictive conditionals, measured on three kinds of model:
how far the sums ``sum_i log p(x_s(i) | x_s(<i))`` along random orderings ``s`` disagree.

Conditionals that come from one joint distribution give every ordering the same sum, its
``log p(x)``; the spread across orderings (:func:`pyro_mpt.ordering_log_likelihoods`,
:doc:`/coherence`) measures how far approximate ones are from any joint. Three groups:

* **PPCA, exact conditionals** (float64, ground-truth parameters on their own samples): the
  spread is rounding, and the mean is the exact ``log p(x)``, checked against the dense
  Gaussian density ``N(x; mu, W W^T + sigma^2 I)``.
* **A deep Bernoulli VAE** (:class:`pyro_mpt.models.VAE` on binarised MNIST from
  :func:`pyro_mpt.datasets.load_mnist`, trained briefly by ``Trace_ELBO``), on a few held-out
  images: :class:`~pyro_mpt.conditionals.ImportanceSampling` at several ``S`` and
  :class:`~pyro_mpt.conditionals.EncodeDecode`. The gap is to the importance estimate of
  ``log p(x)`` with the encoder on the full image and many samples (the IWAE bound).
* **AntiBERTy** (:mod:`pyro_mpt.transformers.antiberty`), pre-trained and randomly
  initialised with the same configuration, on a few antibody variable domains
  (:func:`pyro_mpt.transformers.mlm_ordering_log_likelihoods`). The gap is to the area under
  its MPT curve (:func:`pyro_mpt.transformers.mlm_mpt_curve`, as in ``bert-curve``): both
  estimate the mean over orderings of the chain-rule sum, so they agree within Monte Carlo
  error whatever the model.

One ordering costs ``D`` prefixes (784 for an MNIST image, one forward pass per residue for
an antibody); the table gives the seconds of each row and the milliseconds per prefix and
observation.
"""

import math

import pyro
import torch
from pyro.infer import Trace_ELBO

from experiments import _common as common
from experiments._antibody_chains import ANTIBERTY, alternating_chains
from experiments._experiment import Report, run_experiment
from experiments._vae_deep_training import count_warnings

__all__ = ["GROUPS", "NAME", "run"]

NAME = "coherence"

#: The groups of rows, in the order of the table and the figure's panels.
GROUPS = ("PPCA", "deep VAE", "AntiBERTy")

#: The sizes of each preset: ``ppca_*`` the PPCA (``N`` observations, ``D`` features, ``K``
#: latents); ``vae_*`` the VAE (training images ``N``, held-out images scored, hidden units,
#: latent size, epochs, batch, learning rate, the ``S`` of each ``ImportanceSampling`` row, the
#: ``EncodeDecode`` iterations, the samples of the reference); ``bert_*`` AntiBERTy (how many
#: sequences, residues kept per sequence, ``None`` for all, and the MPT curve's rates and
#: masks); ``*_orderings`` orderings per observation. The default takes about 8 minutes of
#: one core, half of it AntiBERTy's forward passes.
_PRESETS = {
    "smoke": dict(
        ppca_N=8, ppca_D=10, ppca_K=2, ppca_orderings=4,
        vae_N=64, vae_held_out=4, vae_hidden=16, vae_latent=4, vae_epochs=2, vae_batch=32,
        vae_lr=1e-2, vae_samples=[4, 16], vae_iterations=2, vae_reference_samples=256,
        vae_orderings=8,
        bert_sequences=4, bert_residues=12, bert_orderings=8, bert_rates=[0.1, 0.5, 0.9],
        bert_masks=2, bert_batch=64,
    ),
    "default": dict(
        ppca_N=100, ppca_D=50, ppca_K=5, ppca_orderings=8,
        vae_N=2000, vae_held_out=16, vae_hidden=64, vae_latent=8, vae_epochs=30,
        vae_batch=100, vae_lr=3e-3, vae_samples=[8, 32, 128], vae_iterations=5,
        vae_reference_samples=5000, vae_orderings=4,
        bert_sequences=4, bert_residues=None, bert_orderings=4, bert_rates="2%...98%",
        bert_masks=2, bert_batch=64,
    ),
    "full": dict(
        ppca_N=1000, ppca_D=200, ppca_K=5, ppca_orderings=16,
        vae_N=4000, vae_held_out=64, vae_hidden=200, vae_latent=16, vae_epochs=50,
        vae_batch=100, vae_lr=1e-3, vae_samples=[8, 32, 128, 512], vae_iterations=5,
        vae_reference_samples=10000, vae_orderings=8,
        bert_sequences=None, bert_residues=None, bert_orderings=8, bert_rates="1%...99%",
        bert_masks=10, bert_batch=64,
    ),
}  # fmt: skip


def _config(smoke, full):
    from pyro_mpt import default_rates

    cfg = dict(_PRESETS["smoke" if smoke else "full" if full else "default"])
    if cfg["bert_rates"] == "2%...98%":  # the midpoints 2%, 6%, ..., 98%, as bert-curve
        cfg["bert_rates"] = default_rates(0.02, 0.98, 0.04).tolist()
    elif cfg["bert_rates"] == "1%...99%":
        cfg["bert_rates"] = default_rates().tolist()
    cfg["bert_names"] = alternating_chains()[: cfg["bert_sequences"]]
    cfg["bert_model"] = ANTIBERTY
    return cfg


def _row(group, label, conditionals, result, reference, reference_kind, seconds, **extra):
    """One row: the orderings' sums summarised against ``reference`` (per observation);
    ``label`` names the conditionals within the ``group``."""
    from pyro_mpt import OrderingLogLikelihoods

    against = OrderingLogLikelihoods.from_values(result.values, reference)
    own = None if result.log_marginal is None else float(result.log_marginal.mean())
    summary = against.summary()
    # The reference's own Monte Carlo error, where it has one, adds to that of the mean.
    summary["gap_se"] = math.hypot(summary["mean_se"], extra.pop("reference_se", 0.0))
    return dict(
        group=group,
        label=label,
        conditionals=conditionals,
        summary=summary,
        describe=result.describe(),
        reference_kind=reference_kind,
        own_log_marginal=own,
        values=result.values,
        reference=against.log_marginal,
        seconds=seconds,
        dtype=str(result.values.dtype).replace("torch.", ""),
        **extra,
    )


def _ppca_rows(cfg, device, seed, progress):
    """Exact conditionals of a ground-truth PPCA, against its dense Gaussian density."""
    from pyro_mpt import ordering_log_likelihoods
    from pyro_mpt.models import PPCA

    with common.float64():
        pyro.clear_param_store()
        common.seed_everything(common.derived_seed(seed, 0))
        truth = PPCA(cfg["ppca_D"], cfg["ppca_K"], init_scale=1.0, noise_scale=math.sqrt(0.2))
        truth = truth.to(device)
        x = truth.sample(cfg["ppca_N"]).to(device)
        with torch.no_grad():
            dense = torch.distributions.MultivariateNormal(truth.loc, truth.covariance())
            reference = dense.log_prob(x)
        common.seed_everything(common.derived_seed(seed, 0, 1))
        with common.Stopwatch() as watch:
            result = ordering_log_likelihoods(
                truth.model, x, num_orderings=cfg["ppca_orderings"], conditionals="exact",
                progress=progress,
            )  # fmt: skip
        pyro.clear_param_store()
    return [
        _row("PPCA", "exact", "exact", result, reference, "dense Gaussian log p(x)", watch.seconds,
             num_features=cfg["ppca_D"])
    ]  # fmt: skip


def _train_vae(cfg, x, seed):
    """A Bernoulli VAE trained by ``Trace_ELBO`` with Adam; returns it and a record."""
    from pyro_mpt.models import VAE

    pyro.clear_param_store()
    common.seed_everything(common.derived_seed(seed, 2))
    vae = VAE(784, latent_dim=cfg["vae_latent"], hidden_dim=cfg["vae_hidden"])
    vae = vae.to(device=x.device, dtype=x.dtype)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["vae_lr"])
    loss = Trace_ELBO(max_plate_nesting=1)
    elbo = []
    with common.Stopwatch() as watch:
        for _ in range(cfg["vae_epochs"]):
            total = 0.0
            for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["vae_batch"]):
                optimizer.zero_grad()
                total += loss.loss_and_grads(vae.model, vae.guide, x[idx])
                optimizer.step()
            elbo.append(-total / x.shape[0])
    return vae, dict(elbo_per_epoch=elbo, final_elbo=elbo[-1], seconds=watch.seconds)


def _vae_rows(cfg, device, seed, progress):
    """ImportanceSampling at each ``S`` and encode-decode on held-out images of a trained VAE."""
    from pyro_mpt import log_marginal, ordering_log_likelihoods
    from pyro_mpt.conditionals import EncodeDecode, ImportanceSampling
    from pyro_mpt.datasets import load_mnist

    with common.default_dtype(torch.float32):
        size = cfg["vae_N"] + cfg["vae_held_out"]
        images, _ = load_mnist(size, seed=common.derived_seed(seed, 1), dtype=torch.float32)
        x, x_test = images[: cfg["vae_N"]].to(device), images[cfg["vae_N"] :].to(device)
        vae, training = _train_vae(cfg, x, seed)
        counts = {}
        common.seed_everything(common.derived_seed(seed, 4))
        with (
            torch.no_grad(),
            count_warnings("ImportanceAccuracyWarning", counts, "reference"),
            common.Stopwatch() as watch,
        ):
            reference = torch.cat([
                log_marginal(vae.model, part,
                             conditionals=ImportanceSampling(cfg["vae_reference_samples"]),
                             guide=vae.guide)
                for part in x_test.split(4)
            ])  # fmt: skip
        training.update(reference_seconds=watch.seconds)
        strategies = [ImportanceSampling(s) for s in cfg["vae_samples"]]
        # One draw per chain: the setting of the committed figures (the default is now 16).
        strategies.append(EncodeDecode(num_iterations=cfg["vae_iterations"], num_samples=1))
        kind = f"importance log p(x), S={cfg['vae_reference_samples']}"
        rows = []
        for index, strategy in enumerate(strategies):
            key = f"row {index}"
            common.seed_everything(common.derived_seed(seed, 3, index))
            with (
                count_warnings("ImportanceAccuracyWarning", counts, key),
                common.Stopwatch() as watch,
            ):
                result = ordering_log_likelihoods(
                    vae.model, x_test, guide=vae.guide, num_orderings=cfg["vae_orderings"],
                    conditionals=strategy, progress=progress,
                )  # fmt: skip
            label = (
                f"ImportanceSampling({strategy.num_samples})"
                if isinstance(strategy, ImportanceSampling)
                else f"EncodeDecode({strategy.num_iterations})"
            )
            rows.append(
                _row("deep VAE", label, repr(strategy), result, reference, kind, watch.seconds,
                     num_features=784, importance_warnings=counts.get(key, 0))
            )  # fmt: skip
        training.update(reference_warnings=counts.get("reference", 0))
        pyro.clear_param_store()
    return rows, training


def _bert_rows(cfg, device, seed, progress):
    """AntiBERTy, random and pre-trained: the orderings against the area of the MPT curve."""
    from pyro_mpt.transformers import mlm_mpt_curve, mlm_ordering_log_likelihoods
    from pyro_mpt.transformers.antiberty import (
        ANTIBODY_SEQUENCES,
        load_antiberty,
        random_antiberty,
        spaced,
    )

    keep = cfg["bert_residues"]
    texts = [spaced(ANTIBODY_SEQUENCES[n][:keep]) for n in cfg["bert_names"]]
    with common.default_dtype(torch.float32):  # the checkpoint's dtype, whatever the caller's
        pretrained, tokenizer = load_antiberty()
        models = {
            "random init.": random_antiberty(common.derived_seed(seed, 5)),
            "pre-trained": pretrained,
        }
    rows, curves = [], {}
    for key, (label, model) in enumerate(models.items()):
        model = model.to(device)
        common.seed_everything(common.derived_seed(seed, 6, key))
        with common.Stopwatch() as watch:
            result = mlm_ordering_log_likelihoods(
                model, tokenizer, texts, num_orderings=cfg["bert_orderings"],
                batch_size=cfg["bert_batch"], progress=progress,
            )  # fmt: skip
        common.seed_everything(common.derived_seed(seed, 7, key))
        with common.Stopwatch() as curve_watch:
            curve = mlm_mpt_curve(
                model, tokenizer, texts, rates=cfg["bert_rates"], num_masks=cfg["bert_masks"],
                batch_size=cfg["bert_batch"], progress=progress,
            )  # fmt: skip
        num_features = curve.num_features.double()
        areas = curve.observation_areas().double()
        curves[label] = dict(
            area=curve.area, area_stderr=curve.area_stderr, areas=areas, scores=curve.scores,
            rates=curve.rates, seconds=curve_watch.seconds,
        )  # fmt: skip
        rows.append(
            _row("AntiBERTy", label, "masked LM", result, areas.to(result.values),
                 "MPT-curve area", watch.seconds, num_features=num_features.tolist(),
                 reference_se=curve.area_stderr)
        )  # fmt: skip
    info = dict(curves=curves, vocab_size=len(tokenizer), num_features=num_features.tolist())
    return rows, info


def _pm_small(mean, se, digits=3):
    """``mean ± se`` with ``digits`` decimals, or in scientific notation when both are
    below the last decimal (a spread at rounding level)."""
    if max(abs(mean), abs(se)) < 10**-digits:
        return f"{mean:.1e} ± {se:.1e}"
    return common.pm(mean, se, digits)


def _measure(cfg, device, seed, progress):
    rows = _ppca_rows(cfg, device, seed, progress)
    vae_rows, training = _vae_rows(cfg, device, seed, progress)
    bert_rows, bert = _bert_rows(cfg, device, seed, progress)
    return dict(rows=rows + vae_rows + bert_rows, vae_training=training, bert=bert)


def _prefixes(row):
    """Prefixes scored in all: orderings times the features of every observation."""
    features = row["num_features"]
    total = sum(features) if isinstance(features, list) else features * row["values"].shape[1]
    return row["values"].shape[0] * total


def _report(cfg, measured):
    rows = measured["rows"]
    table_rows = []
    for row in rows:
        s = row["summary"]
        table_rows.append([
            f"{row['group']}: {row['label']}",
            f"{s['num_orderings']} x {s['num_observations']}",
            f"{s['mean']:.3f}",
            _pm_small(s["spread"], s["spread_se"]),
            _pm_small(s["gap"], s["gap_se"]),
            row["reference_kind"],
            f"{row['seconds']:.1f}",
            f"{1000 * row['seconds'] / _prefixes(row):.3f}",
        ])  # fmt: skip
    headers = ["model: conditionals", "orderings x obs.", "mean sum", "spread ± se",
               "gap ± se", "gap to", "s", "ms/prefix"]  # fmt: skip
    training = measured["vae_training"]
    title = (
        "Chain-rule coherence: log p(x) summed along random orderings of each observation's "
        "features (nats per observation); spread = sd across orderings, averaged over "
        "observations; gap = mean sum minus the reference"
    )
    notes = [
        f"VAE: hidden {cfg['vae_hidden']}, trained by Trace_ELBO for {cfg['vae_epochs']} "
        f"epochs on {cfg['vae_N']} MNIST images (final ELBO {training['final_elbo']:.2f}); "
        f"scored on {cfg['vae_held_out']} held-out images.",
        f"AntiBERTy: {len(cfg['bert_names'])} variable domains; the area uses "
        f"{len(cfg['bert_rates'])} rates with {cfg['bert_masks']} mask(s) each; both estimate "
        "the mean over orderings, so the gap is Monte Carlo error.",
    ]
    written = []
    for row in rows:
        entry = {k: v for k, v in row.items() if k not in ("values", "reference")}
        entry.update(row["summary"], values=row["values"].double(), reference=row["reference"])
        entry["prefixes"] = _prefixes(row)
        del entry["summary"]
        written.append(entry)
    results = dict(rows=written, vae_training=training, bert=measured["bert"])
    table = common.format_table(headers, table_rows, title=title, notes=notes)
    return Report(table, _figure(rows), results)


def _figure(rows):
    """One panel per group: each ordering's sum minus the mean over orderings of its
    observation, the rows side by side and their observations spread within each."""
    fig, axes = common.new_figure(len(GROUPS), width=4.6, height=4.2)
    for ax, group in zip(axes, GROUPS):
        chosen = [r for r in rows if r["group"] == group]
        for slot, row in enumerate(chosen):
            values = row["values"].double().cpu()
            deviation = values - values.mean(0)
            count = values.shape[1]
            offsets = torch.linspace(-0.3, 0.3, count) if count > 1 else torch.zeros(1)
            xs = (slot + offsets).expand_as(deviation)
            ax.plot(xs.flatten(), deviation.flatten(), ".", ms=3, alpha=0.7, color=f"C{slot}")
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(chosen)))
        ax.set_xticklabels([r["label"].replace("(", "\n(") for r in chosen], fontsize="small")
        ax.set_title(group)
        ax.set_ylabel("sum minus its mean over orderings (nats)")
    return fig


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Measures the chain-rule coherence of exact, importance, encode-decode and masked-LM
    conditionals; writes ``coherence.json`` and ``coherence.png``.

    ``smoke``: a PPCA with 10 features, a VAE trained for 2 epochs scored on 2 images, and
    AntiBERTy on 2 sequences cut to 12 residues (seconds); the default scores 16 held-out
    images with 4 orderings at ``S`` = 8, 32, 128 and 4 full antibody sequences (about 8
    minutes of one busy core); ``full`` more of everything, for a GPU. The other arguments are
    those of :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report, device, smoke, full, seed, progress,
        settings=dict(threads=torch.get_num_threads()),
    )  # fmt: skip
