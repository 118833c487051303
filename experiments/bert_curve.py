"""Fig. 5 (right) and Table 2 of Moreno-Muñoz et al. (2023) with an antibody BERT: the MPT
curve of a pre-trained masked language model against the same architecture randomly
initialised, and the areas under both.

Model: AntiBERTy (8 layers, hidden size 512, 26M parameters, 25-token vocabulary),
pre-trained by masked language modelling on natural antibody repertoires; its weights ship
with the PyPI package ``antiberty`` and load offline
(:func:`pyro_mpt.transformers.antiberty.load_antiberty`). The random baseline is
``BertForMaskedLM`` with the same configuration and its initialiser (weights
``N(0, 0.02^2)``).

Data: the 32 variable domains (16 heavy, 16 light chains, 106-127 residues) of approved
therapeutic antibodies in :data:`pyro_mpt.transformers.antiberty.ANTIBODY_SEQUENCES`.

Curve: :func:`pyro_mpt.transformers.mlm_mpt_curve`; at rate ``r`` each sequence of ``D``
residues has ``max(1, floor(r D + 1/2))`` of them replaced by ``[MASK]`` (``[CLS]`` and ``[SEP]``
are never masked), ``P`` random masks per sequence and rate; the score is the mean
log-probability of a masked residue and the area (:attr:`pyro_mpt.MPTCurve.area`: the sum of
the curve over every mask size, those between the rates' sizes interpolated) estimates
``log p(x)`` per sequence (nats). The default evaluates the 25 midpoints ``2%, 6%, ..., 98%`` (the
midpoint rule for the sum over all mask sizes) with ``P = 2``; ``--full`` the paper's
``1%, ..., 99%`` with ``P = 10``.

.. note:: The paper's Table 2 reports BERT-base (110M parameters, 30,522 tokens) on
    512-token GLUE sequences: areas -5245 (random) and -1716 (pre-trained) on AX. Ours are
    a different model on ~115-residue proteins with 20 possible residues, so the numbers are
    not comparable; the reference point is the uniform guess, ``-D log 25``.
"""

import math

import torch

from experiments import _common as common
from experiments._antibody_chains import ANTIBERTY, alternating_chains
from experiments._experiment import Report, run_experiment

__all__ = ["NAME", "PAPER_TABLE2", "run"]

NAME = "bert-curve"

#: Paper Table 2 (BERT-base, GLUE, 512 tokens): dataset -> (random init., pre-trained).
PAPER_TABLE2 = {
    "AX": (-5245.31, -1715.75),
    "COLA": (-5283.52, -1657.68),
    "QNLI": (-5343.98, -1770.28),
    "MRPC": (-5362.21, -1773.45),
}


def _config(smoke, full):
    from pyro_mpt import default_rates
    from pyro_mpt.transformers.antiberty import ANTIBODY_SEQUENCES

    if smoke:
        cfg = dict(num_sequences=2, rates=[0.1, 0.5, 0.9], num_masks=1, batch_size=8)
    elif full:
        cfg = dict(num_sequences=None, rates=default_rates().tolist(), num_masks=10, batch_size=64)
    else:
        rates = default_rates(0.02, 0.98, 0.04).tolist()
        cfg = dict(num_sequences=None, rates=rates, num_masks=2, batch_size=64)
    # A small run takes one heavy and one light chain first, so it sees both.
    names = list(ANTIBODY_SEQUENCES) if cfg["num_sequences"] is None else alternating_chains()
    return dict(cfg, sequences=names[: cfg["num_sequences"]], model=ANTIBERTY)


def _chain_areas(curve, names):
    per_sequence = curve.observation_areas()
    out = {}
    for chain in ("vh", "vl"):
        keep = torch.tensor([n.endswith(f"_{chain}") for n in names])
        if keep.any():
            out[chain] = float(per_sequence[keep].mean())
    return out


def _measure(cfg, device, seed, progress):
    """The MPT curve of each model and its seconds; records the vocabulary size and the mean
    number of residues in ``cfg`` (the JSON's ``config``)."""
    from pyro_mpt.transformers import mlm_mpt_curve
    from pyro_mpt.transformers.antiberty import (
        ANTIBODY_SEQUENCES,
        load_antiberty,
        random_antiberty,
        spaced,
    )

    texts = [spaced(ANTIBODY_SEQUENCES[n]) for n in cfg["sequences"]]
    with common.default_dtype(torch.float32):  # the checkpoint's dtype, whatever the caller's
        pretrained, tokenizer = load_antiberty()
        models = {
            "random init.": random_antiberty(common.derived_seed(seed, 1)),
            "pre-trained": pretrained,
        }
    curves, seconds = {}, {}
    for key, (label, model) in enumerate(models.items()):
        common.seed_everything(common.derived_seed(seed, 2, key))
        with common.Stopwatch() as watch:
            curves[label] = mlm_mpt_curve(
                model.to(device),
                tokenizer,
                texts,
                rates=cfg["rates"],
                num_masks=cfg["num_masks"],
                batch_size=cfg["batch_size"],
                progress=progress,
            )
        seconds[label] = watch.seconds
    cfg["vocab_size"] = len(tokenizer)
    cfg["mean_num_features"] = float(curves["random init."].num_features.double().mean())
    return curves, seconds


def _report(cfg, measured):
    curves, seconds = measured
    log_v, mean_d = math.log(cfg["vocab_size"]), cfg["mean_num_features"]
    summary = {}
    for label, curve in curves.items():
        summary[label] = dict(
            area=curve.area,
            area_stderr=curve.area_stderr,
            areas_by_chain=_chain_areas(curve, cfg["sequences"]),
            mean_score=float(curve.scores.mean()),
            score_first_rate=float(curve.scores[0]),
            score_last_rate=float(curve.scores[-1]),
            seconds=seconds[label],
        )
    rows = []
    for label, s in summary.items():
        chains = s["areas_by_chain"]
        rows.append(
            [
                label,
                f"{s['area']:.1f} ± {s['area_stderr']:.1f}",
                f"{chains.get('vh', math.nan):.1f}",
                f"{chains.get('vl', math.nan):.1f}",
                f"{s['score_first_rate']:.3f}",
                f"{s['score_last_rate']:.3f}",
                f"{s['seconds']:.0f}",
            ]
        )
    rates = cfg["rates"]
    title = (
        f"Fig. 5 / Table 2 analogue: AntiBERTy (26M parameters) on {len(cfg['sequences'])} "
        f"antibody variable domains (mean D = {mean_d:.1f} residues), {len(rates)} rates "
        f"{100 * rates[0]:.0f}%...{100 * rates[-1]:.0f}%, {cfg['num_masks']} mask(s) per "
        "sequence and rate; area = sum of S over every mask size 1..D, sizes between the rates' "
        "interpolated (nats per sequence, ± Monte Carlo s.e.)"
    )
    headers = ["model", "area", "area VH", "area VL"]
    headers += [f"S({100 * rates[0]:.0f}%)", f"S({100 * rates[-1]:.0f}%)", "seconds"]
    notes = [
        f"uniform guess over the 25 tokens: -D log 25 = {-mean_d * log_v:.1f}; over the 20 "
        f"residues: {-mean_d * math.log(20):.1f}.",
        "paper Table 2 (BERT-base, 512-token GLUE sequences, 30,522 tokens): random "
        + ", ".join(f"{k} {v[0]:.0f}" for k, v in PAPER_TABLE2.items())
        + "; pre-trained "
        + ", ".join(f"{k} {v[1]:.0f}" for k, v in PAPER_TABLE2.items())
        + ".",
    ]
    fields = ("rates", "scores", "stderr", "masked_fraction", "num_features")
    results = dict(
        summary=summary,
        uniform_guess_area=-mean_d * log_v,
        paper_table2=PAPER_TABLE2,
        curves={label: {f: getattr(c, f) for f in fields} for label, c in curves.items()},
    )
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, _figure(curves, mean_d, log_v), results)


def _figure(curves, mean_d, log_v):
    from pyro_mpt import plot_mpt_curve

    fig, (ax,) = common.new_figure(1, width=6.0)
    for (label, curve), color in zip(curves.items(), ("C3", "C0")):
        plot_mpt_curve(curve, ax=ax, label=label, color=color, marker=".")
    ax.axhline(-log_v, color="gray", ls=":", lw=1, label="uniform over 25 tokens")
    ax.set_xlabel("masked residues (%)")
    ax.set_ylabel("mean log-probability of a masked residue")
    ax.set_title(f"AntiBERTy MPT curve (mean D = {mean_d:.0f})")
    ax.legend(fontsize="small")
    return fig


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Reproduces Fig. 5 (right) / Table 2 with AntiBERTy; writes ``bert-curve.json`` and
    ``bert-curve.png``.

    ``smoke``: 2 sequences, 3 rates, one mask each (seconds); ``full``: the paper's 99 rates
    (1%...99%) with 10 masks per sequence and rate; the default is 25 rates with 2 masks (a
    few minutes on two CPU cores). ``seed`` seeds the random initialisation and the masks.
    The other arguments are those of :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report, device, smoke, full, seed, progress,
        paper_reference="Moreno-Muñoz et al. (2023), Fig. 5 (right) and Table 2",
        settings=dict(dtype="float32", threads=torch.get_num_threads()),
    )  # fmt: skip
