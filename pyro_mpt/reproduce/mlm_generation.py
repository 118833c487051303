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

from pyro_mpt.reproduce import _common as common

__all__ = ["NAME", "run"]

NAME = "mlm-generation"
METHODS = ("sequential", "parallel", "mask-predict")
STARTS = ("fully masked", "half masked")
MASK_PREDICT_STEPS = 10


def _config(smoke, full):
    if smoke:
        return dict(num_sequences=2, length=24, mask_fraction=0.5, batch_size=64)
    if full:
        return dict(num_sequences=16, length=None, mask_fraction=0.5, batch_size=64)
    return dict(num_sequences=4, length=None, mask_fraction=0.5, batch_size=64)


def _sequences(num_sequences, length):
    """``(names, sequences)``: heavy and light chains alternating, cut to ``length``."""
    from pyro_mpt.transformers.antiberty import ANTIBODY_SEQUENCES

    names = list(ANTIBODY_SEQUENCES)
    heavy = [n for n in names if n.endswith("_vh")]
    light = [n for n in names if n.endswith("_vl")]
    names = [n for pair in zip(heavy, light) for n in pair]
    return names[:num_sequences], [ANTIBODY_SEQUENCES[n][:length] for n in names]


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


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """Samples antibody sequences from AntiBERTy by the three samplers; writes
    ``mlm-generation.json`` and ``mlm-generation.png``.

    :param str out_dir: output folder (created if needed).
    :param str device: ``"cpu"`` or ``"cuda"``.
    :param bool smoke: 2 sequences cut to 24 residues; well under a minute on one core.
    :param bool full: 16 full-length sequences; the default is 4 (several minutes on CPU,
        most of it the pseudo-log-likelihoods).
    :param int seed: seed of the masks and of the samplers.
    :param bool progress: show progress bars.
    :returns: the results dict (also written as JSON).
    """
    from pyro_mpt.transformers import generation_diagnostics, sample_mlm
    from pyro_mpt.transformers.antiberty import load_antiberty

    common.check_size(smoke, full)
    cfg = _config(smoke, full)
    device = common.resolve_device(device)
    total = common.Stopwatch()
    common.seed_everything(seed)
    with common.default_dtype(torch.float32):  # the checkpoint's dtype, whatever the caller's
        model, tokenizer = load_antiberty()
    model.to(device)
    names, all_sequences = _sequences(cfg["num_sequences"], cfg["length"])
    reference = _encode(tokenizer, all_sequences, device)[0].tolist()
    ids, attention = _encode(tokenizer, all_sequences[: len(names)], device)
    starts = _starts(tokenizer, ids.cpu(), attention.cpu(), cfg["mask_fraction"], seed)

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
    _print_table(results, cfg, names)
    summary = {
        start: {method: {k: v for k, v in row.items() if k != "sequences"}}
        for start, rows in results.items()
        for method, row in rows.items()
    }
    payload = dict(
        experiment=NAME,
        paper_reference=(
            "Li et al. (2024), Promises and pitfalls of generative masked language modeling; "
            "Ghazvininejad et al. (2019), Mask-predict"
        ),
        config=common.run_config(
            cfg,
            seed,
            smoke,
            full,
            device,
            sequences=names,
            model="AntiBERTy_md_smooth (antiberty 0.1.3)",
            methods=list(METHODS),
            starts=list(STARTS),
            mask_predict_steps=MASK_PREDICT_STEPS,
            masked_per_sequence={
                k: (v == tokenizer.mask_token_id).sum(1) for k, v in starts.items()
            },
            threads=torch.get_num_threads(),
        ),
        results=results,
        summary=summary,
        wall_seconds=total.elapsed,
    )
    return common.save_outputs(out_dir, NAME, payload, _figure(results))


def _print_table(results, cfg, names):
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
        f"Sampling AntiBERTy from masked starts: {len(names)} antibody variable domains "
        f"({length}), {100 * cfg['mask_fraction']:.0f}% masked in the half-masked starts; "
        f"mask-predict T = {MASK_PREDICT_STEPS}"
    )
    notes = [
        "stutter: adjacent residues that repeat; PLL: sum_i log p(x_i | x_-i) per residue "
        "(nats); TV: total variation of residue frequencies to the 32 reference sequences.",
    ]
    print(common.format_table(headers, rows, title=title, notes=notes))


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
