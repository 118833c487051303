"""Generation from a masked language model's conditionals (Li et al., 2024, "Promises and
pitfalls of generative masked language modeling"): antibody sequences drawn
by an antibody BERT from masked starts with the three samplers of
:func:`pyro_mpt.transformers.sample_mlm`, and what each costs and produces.

Model: AntiBERTy (8 layers, 26M parameters, 20 residues and 5 special tokens), pre-trained
by masked language modelling; its weights ship with the PyPI package ``antiberty`` and load
offline (:func:`pyro_mpt.transformers.antiberty.load_antiberty`). The package ships no
sequences.

Data: the variable domains of approved therapeutic antibodies in
:data:`pyro_mpt.transformers.antiberty.ANTIBODY_SEQUENCES` (16 heavy, 16 light chains),
cut to their first ``length`` residues at smoke size. From ``B`` of them (heavy and light
alternating) two kinds of start: *fully masked* (every residue a ``[MASK]``, same lengths)
and *half masked* (a random half of the residues masked, the rest given).

Samplers, each from the same starts:

* ``sequential``: the masks are filled one per forward pass in a random order, each residue
  drawn from the model's conditional given all filled so far (``M`` passes for ``M`` masks);
* ``parallel``: every mask filled in one pass, each from its own conditional given the start;
* ``mask-predict``: ``T = 10`` passes, re-masking the least confident residues, a linearly
  decaying number (Ghazvininejad et al., 2019).

Per sampler: the fraction of adjacent residues that repeat (stutter), the model's
pseudo-log-likelihood per residue (one pass per position), the total variation between the
residue frequencies of the samples and of all 32 sequences (cut alike), and the sampling time
per sequence. The real sequences are scored alike as a reference row.
"""

import torch

from experiments import _common as common
from experiments._antibody_chains import ANTIBERTY, alternating_chains
from experiments._experiment import Report, run_experiment

__all__ = ["NAME", "run"]

NAME = "mlm-generation"
METHODS = ("sequential", "parallel", "mask-predict")
STARTS = ("fully masked", "half masked")
MASK_PREDICT_STEPS = 10


def _config(smoke, full):
    num_sequences = 2 if smoke else 16 if full else 4
    return dict(
        num_sequences=num_sequences,
        length=24 if smoke else None,
        mask_fraction=0.5,
        batch_size=64,
        sequences=alternating_chains()[:num_sequences],
        model=ANTIBERTY,
        methods=list(METHODS),
        starts=list(STARTS),
        mask_predict_steps=MASK_PREDICT_STEPS,
    )


def _starts(tokenizer, ids, attention, mask_fraction, seed):
    """The fully masked and the half masked copies of the real sequences ``ids``."""
    from pyro_mpt.transformers.generation import content_positions

    content = content_positions(ids, tokenizer, attention)
    fully = ids.masked_fill(content, tokenizer.mask_token_id)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.rand(ids.shape, generator=gen).masked_fill(~content, 2.0)
    ranks = keys.argsort(1).argsort(1)
    counts = (mask_fraction * content.sum(1)).round().long().clamp(min=1)
    half = ids.masked_fill(ranks < counts[:, None], tokenizer.mask_token_id)
    return {"fully masked": fully, "half masked": half}


def _encode(tokenizer, sequences, device):
    from pyro_mpt.transformers.antiberty import spaced

    batch = tokenizer([spaced(s) for s in sequences], padding=True, return_tensors="pt")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def _row(tokenizer, ids, diagnostics):
    d = diagnostics
    per_residue = d.pseudo_log_likelihood / d.num_tokens.double()
    return dict(
        passes=d.num_passes,
        stutter_rate=float(d.stutter_rate.mean()),
        stutter_rates=d.stutter_rate,
        pll_per_residue=float(per_residue.mean()),
        pseudo_log_likelihood=d.pseudo_log_likelihood,
        token_distance=d.token_distance,
        seconds_per_sequence=d.seconds_per_sequence,
        sequences=[tokenizer.decode(row, skip_special_tokens=True).replace(" ", "") for row in ids],
    )


def _measure(cfg, device, seed, progress):
    """Each start's samples by each sampler, and the real sequences, diagnosed; records the
    number of masks of each start in ``cfg`` (the JSON's ``config``)."""
    from pyro_mpt.transformers import generation_diagnostics, sample_mlm
    from pyro_mpt.transformers.antiberty import ANTIBODY_SEQUENCES, load_antiberty

    common.seed_everything(seed)
    with common.default_dtype(torch.float32):  # the checkpoint's dtype, whatever the caller's
        model, tokenizer = load_antiberty()
    model.to(device)
    # The reference: all sequences, cut alike.
    every = [ANTIBODY_SEQUENCES[n][: cfg["length"]] for n in alternating_chains()]
    reference = _encode(tokenizer, every, device)[0].tolist()
    ids, attention = _encode(tokenizer, every[: cfg["num_sequences"]], device)
    starts = _starts(tokenizer, ids.cpu(), attention.cpu(), cfg["mask_fraction"], seed)
    cfg["masked_per_sequence"] = {
        k: (v == tokenizer.mask_token_id).sum(1) for k, v in starts.items()
    }

    def diagnose(samples):
        return generation_diagnostics(
            model, tokenizer, samples, reference=reference, batch_size=cfg["batch_size"]
        )

    results = {"real sequences": {"real": _row(tokenizer, ids, diagnose(ids))}}
    for i, start_name in enumerate(STARTS):
        results[start_name] = {}
        for j, method in enumerate(METHODS):
            gen = torch.Generator(device=device).manual_seed(common.derived_seed(seed, i, j))
            samples = sample_mlm(
                model,
                tokenizer,
                starts[start_name].to(device),
                attention_mask=attention,
                method=method,
                num_steps=MASK_PREDICT_STEPS if method == "mask-predict" else 0,
                generator=gen,
                progress=progress,
            )
            results[start_name][method] = _row(tokenizer, samples.sequences, diagnose(samples))
    return results


def _report(cfg, results):
    summary = {
        start: {method: {k: v for k, v in row.items() if k != "sequences"}}
        for start, rows in results.items()
        for method, row in rows.items()
    }
    return Report(_table(results, cfg), _figure(results), dict(results=results, summary=summary))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Samples antibody sequences from AntiBERTy by the three samplers; writes
    ``mlm-generation.json`` and ``mlm-generation.png``.

    ``smoke``: 2 sequences cut to 24 residues (well under a minute on one core); ``full``: 16
    full-length sequences; the default is 4 (several minutes on CPU, most of it the
    pseudo-log-likelihoods). ``seed`` seeds the masks and the samplers. The other arguments
    are those of :func:`~experiments._experiment.run_experiment`.
    """
    return run_experiment(
        NAME, out_dir, _config, _measure, _report, device, smoke, full, seed, progress,
        paper_reference=(
            "Li et al. (2024), Promises and pitfalls of generative masked language modeling; "
            "Ghazvininejad et al. (2019), Mask-predict"
        ),
        settings=dict(threads=torch.get_num_threads()),
    )  # fmt: skip


def _table(results, cfg):
    headers = ["start", "sampler", "passes", "stutter %", "PLL/residue", "TV residues", "s/seq"]
    rows = []
    for start, by_method in results.items():
        for method, r in by_method.items():
            passes = "-" if r["passes"] < 0 else str(r["passes"])
            seconds = "-" if r["passes"] < 0 else f"{r['seconds_per_sequence']:.2f}"
            rows.append(
                [
                    start,
                    method,
                    passes,
                    f"{100 * r['stutter_rate']:.1f}",
                    f"{r['pll_per_residue']:.3f}",
                    f"{r['token_distance']:.3f}",
                    seconds,
                ]
            )
    length = "full length" if cfg["length"] is None else f"first {cfg['length']} residues"
    title = (
        f"Sampling AntiBERTy from masked starts: {cfg['num_sequences']} antibody variable domains "
        f"({length}), {100 * cfg['mask_fraction']:.0f}% masked in the half-masked starts; "
        f"mask-predict T = {MASK_PREDICT_STEPS}"
    )
    notes = [
        "stutter: adjacent residues that repeat; PLL: sum_i log p(x_i | x_-i) per residue "
        "(nats); TV: total variation of residue frequencies to the 32 reference sequences.",
    ]
    return common.format_table(headers, rows, title=title, notes=notes)


def _figure(results):
    fig, axes = common.new_figure(2, width=5.5)
    real = results["real sequences"]["real"]
    width = 0.38
    for ax, key, label in (
        (axes[0], "pll_per_residue", "pseudo-log-likelihood per residue (nats)"),
        (axes[1], "stutter_rate", "adjacent repeated residues (fraction)"),
    ):
        for offset, (start, color) in enumerate(zip(STARTS, ("C0", "C1"))):
            values = [results[start][m][key] for m in METHODS]
            xs = [x + (offset - 0.5) * width for x in range(len(METHODS))]
            ax.bar(xs, values, width=width, color=color, label=start)
        ax.axhline(real[key], color="gray", ls=":", lw=1, label="real sequences")
        ax.set_xticks(range(len(METHODS)), METHODS)
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    axes[0].set_title("AntiBERTy samples: model's pseudo-log-likelihood")
    axes[1].set_title("stutter")
    return fig
