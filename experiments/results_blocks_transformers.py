"""The rendered result blocks of the transformer experiments: the BERT and ViT-MAE curves, the
masking-rate comparison and the samplers of a masked language model."""

import math

from experiments.results_format import num, percent, pm

__all__ = [
    "bert_curve_block",
    "bert_rates_block",
    "mae_curve_block",
    "mlm_generation_block",
]


def _block(ctx, name, parts):
    """The block of experiment ``name``: its run, then what ``parts(ctx, res, cfg)`` makes of
    its result ``res`` and config ``cfg``: a caption, the table's headers and rows, a note."""
    res = ctx.json(f"{name}.json")
    caption, headers, rows, note = parts(ctx, res, res["config"])
    return "\n\n".join([f"{ctx.run_text(name)}: {caption}", ctx.table(headers, rows), note])


def bert_curve_block(ctx):
    """AntiBERTy's MPT-curve areas, pre-trained and random, beside the uniform guess."""
    return _block(ctx, "bert-curve", _bert_curve_parts)


def mae_curve_block(ctx):
    """The ViT-MAE areas, scores and probes of each masking schedule, over seeds."""
    return _block(ctx, "mae-curve", _mae_curve_parts)


def bert_rates_block(ctx):
    """The held-out metrics of the BERTs trained with each masking scheme, over seeds."""
    return _block(ctx, "bert-rates", _bert_rates_parts)


def mlm_generation_block(ctx):
    """AntiBERTy's samples from masked starts by each sampler, beside the real sequences."""
    return _block(ctx, "mlm-generation", _mlm_generation_parts)


def _bert_curve_parts(ctx, res, cfg):
    rates = cfg["rates"]
    caption = (
        f"paper Fig. 5 / Table 2 analogue; {cfg['model']} on {len(cfg['sequences'])} "
        f"therapeutic antibody variable domains of {ctx.code('ANTIBODY_SEQUENCES')}, mean D = "
        f"{cfg['mean_num_features']:.1f} residues; "
        f"{len(rates)} rates {percent(min(rates), 0)}…{percent(max(rates), 0)}, "
        f"{cfg['num_masks']} mask(s) per sequence and rate; area = sum of S over every mask "
        "size 1…D, sizes between the rates' interpolated, in nats per sequence (± Monte "
        "Carlo s.e. where there are several masks):"
    )
    rows = []
    for model, s in res["summary"].items():
        area = num(s["area"], 1)
        if s.get("area_stderr") is not None:
            area = pm(s["area"], s["area_stderr"], 1)
        chains = s.get("areas_by_chain", {})
        rows.append(
            [
                model,
                area,
                num(chains.get("vh"), 1),
                num(chains.get("vl"), 1),
                num(s["score_first_rate"], 3),
                num(s["score_last_rate"], 3),
            ]
        )
    first, last = percent(min(rates), 0), percent(max(rates), 0)
    headers = ["model", "area", "area VH", "area VL", f"S({first})", f"S({last})"]
    ax = res["paper_table2"]["AX"]
    note = (
        f"The uniform guess over the 25 tokens scores −D log 25 = "
        f"{num(res['uniform_guess_area'], 1)}. The paper's Table 2 (BERT-base on 512-token "
        f"GLUE sequences) reports {num(ax[0], 0)} random against {num(ax[1], 0)} pre-trained "
        "on AX: a different model and data, so only the pattern can carry over."
    )
    return caption, headers, rows, note


def _spread_cell(pair, digits, seeds, scale=1.0):
    """``mean ± sd`` of a ``(mean, sd)`` pair over ``seeds`` seeds, or the mean for one."""
    mean, std = scale * pair[0], scale * pair[1]
    return pm(mean, std, digits) if seeds > 1 else num(mean, digits)


def _seeds_text(seeds, drawn):
    """The end of a caption: how many seeds, and what each one draws anew."""
    return (
        "one seed:"
        if seeds == 1
        else f"mean ± sd over {seeds} seeds ({drawn} drawn anew for each):"
    )


def _mae_curve_parts(ctx, res, cfg):
    seeds = cfg["seeds"]
    rates = next(iter(res["curves"].values()))["rates"]
    caption = (
        f"paper Fig. 6 analogue; a ViT-MAE with 4×4 patches of 28×28 MNIST images, width "
        f"{cfg['hidden']}, {cfg['layers']}+{cfg['decoder_layers']} "
        f"layers, trained from the same initial weights on the same batches of {cfg['N']} "
        f"images for {_training_text(cfg)} with each masking schedule; curves on "
        f"{cfg['held_out']} held-out images at {len(rates)} rates "
        f"{percent(min(rates), 0)}…{percent(max(rates), 0)} with {cfg['num_masks']} mask(s) "
        f"each, a masked patch scored as a Gaussian with pixel sd {cfg['pixel_scale']:g}; "
        "area = number of patches · mean_r S in nats per image (higher is better), − fixed "
        "75% the area (or probe accuracy) minus that of the fixed-75% model of the same seed; "
        "linear probe of the digit on the mean encoder token; converged: "
        + _converged_header_text(res)
        + "; "
        + _seeds_text(seeds, "split, weights, batches and masks")
    )
    # S(75%) gets a column of its own unless 75% is the lowest or highest rate.
    middle = not any(math.isclose(r, 0.75) for r in (min(rates), max(rates)))
    rows = []
    for model, s in res["summary"].items():
        scores = [s["score_lowest_rate"]] + ([s["score_75"]] if middle else [])
        scores.append(s["score_highest_rate"])
        paired = model not in ("fixed 75%", "random init.") and "probe_minus_fixed" in s
        rows.append(
            [
                model,
                _spread_cell(s["area"], 0, seeds),
                _spread_cell(s["area_minus_fixed"], 0, seeds) if model != "fixed 75%" else "",
            ]
            + [_spread_cell(v, 2, seeds) for v in scores]
            + [_spread_cell(s["probe_accuracy"], 1, seeds, 100) + "%"]
            + [_spread_cell(s["probe_minus_fixed"], 1, seeds, 100) if paired else ""]
            + [_converged_cell(s, seeds)]
        )
    first, last = percent(min(rates), 0), percent(max(rates), 0)
    headers = ["model", "area", "− fixed 75%", f"S({first})"] + (["S(75%)"] if middle else [])
    headers += [f"S({last})", "probe accuracy", "− fixed 75%", "converged (change)"]
    paper = (
        "Paper counterpart: Fig. 6, curves only, of one ViT-MAE pre-trained on ImageNet "
        "(random initialisation against pre-trained) on Fashion-MNIST, CIFAR-100 and "
        "Tiny-ImageNet at 5%…95%: low and flat at random initialisation, higher at low rates "
        "after training, with an area that rises with training. What differs: here small "
        "ViT-MAEs are trained from scratch on MNIST under three masking schedules (the paper "
        "trains none and compares no schedules), and a masked patch is scored as a Gaussian "
        f"with a fixed pixel sd of {cfg['pixel_scale']:g} (the paper does not say how it "
        "scores a patch), so the areas are comparable with one another only."
    )
    verdict = _comparison_text(
        res, "fixed 75%", [("area_minus_fixed", "nats of area", 0, 1.0)]
        + [("probe_minus_fixed", "points of probe accuracy", 1, 100.0)], seeds
    )  # fmt: skip
    return caption, headers, rows, _convergence_text(res, cfg) + " " + verdict + "\n\n" + paper


def _bert_rates_parts(ctx, res, cfg):
    seeds = cfg["seeds"]
    caption = (
        f"a {cfg['layers']}-layer BERT of width {cfg['hidden']}, {cfg['vocab_size']}-piece "
        f"WordPiece vocabulary, {cfg['length']}-token sequences, "
        f"trained from the same weights on the same batches of BBC News by "
        f"{ctx.code('MPTTrainer')} + {ctx.code('MPTDataCollator')} for {cfg['steps']} steps of "
        f"{cfg['batch']} at learning rate {cfg['lr']:g} ({_schedule_text(cfg)}); "
        f"held-out area over {len(cfg['rates'])} "
        f"rates with {cfg['num_masks']} mask(s) each, nats per sequence (higher is better), "
        "− fixed 15% the area (or accuracy) minus that of the fixed-15% model of the same "
        "seed; converged: "
        + _converged_header_text(res)
        + "; "
        + _seeds_text(seeds, "split, tokenizer, weights, batches and masks")
    )
    rows = []
    for scheme, s in res["summary"].items():
        paired = scheme not in ("fixed 15%", "random init") and "acc15_minus_fixed" in s
        rows.append(
            [
                scheme,
                _spread_cell(s["area"], 1, seeds),
                _spread_cell(s["area_minus_fixed"], 1, seeds) if scheme != "fixed 15%" else "",
                _spread_cell(s["area_per_token"], 3, seeds),
                _spread_cell(s["acc15"], 1, seeds, 100) + "%",
                _spread_cell(s["acc15_minus_fixed"], 1, seeds, 100) if paired else "",
                _spread_cell(s["probe"], 1, seeds, 100) + "%",
                _spread_cell(s["probe_minus_fixed"], 1, seeds, 100) if paired else "",
                _converged_cell(s, seeds),
            ]
        )
    headers = ["scheme", "held-out area", "− fixed 15%", "area / token", "acc@15%"]
    headers += ["− fixed 15%", "topic probe", "− fixed 15%", "converged (change)"]
    paper = (
        "Paper counterpart: none trains a BERT. Its Sec. 3.2 (Fig. 5, Table 2) draws the MPT "
        "curves of BERT-base, pre-trained and at random initialisation, on GLUE, and its "
        "Sec. 5 suggests that a uniform mask size, an unbiased estimate of the LML, may train "
        "better than a fixed rate; R2MAE (Tian et al., 2025) reports that random ratios beat "
        "a fixed one. What differs: a small BERT trained from scratch on BBC News. Its areas "
        "are not comparable with the paper's Table 2."
    )
    verdict = _comparison_text(
        res,
        "fixed 15%",
        [
            ("area_minus_fixed", "nats of area", 1, 1.0),
            ("acc15_minus_fixed", "points of acc@15%", 1, 100.0),
            ("probe_minus_fixed", "points of topic probe", 1, 100.0),
        ],
        seeds,
    )
    return caption, headers, rows, _convergence_text(res, cfg) + " " + verdict + "\n\n" + paper


def _schedule_text(cfg):
    """The learning-rate schedule of a ``bert-rates`` run."""
    warmup = cfg["warmup"]
    warmup = f"{warmup:g} of the steps" if warmup < 1 else f"{warmup} steps"
    if "constant" in cfg["schedule"]:
        return f"constant after a warm-up over {warmup}"
    return f"warm-up over {warmup}, then a linear decay to zero"


def _training_text(cfg):
    """How long and at what learning rate the MAEs trained (steps, or epochs in older files)."""
    if "steps" not in cfg:
        return f"{cfg['epochs']} epoch(s)"
    return (
        f"{cfg['steps']} steps of {cfg['batch']} at a constant learning rate {cfg['lr']:g} "
        f"after {cfg['warmup']} warm-up steps"
    )


def _threshold(res):
    """The convergence threshold of a result file, from its first trained run."""
    for reps in res["runs"].values():
        for rep in reps:
            if rep.get("convergence"):
                return rep["convergence"].get("threshold")
    return None


def _converged_header_text(res):
    threshold = _threshold(res)
    if threshold is None:
        return "not measured in this file"
    return (
        "how many seeds' runs had a training loss (mean over a tenth of the run, each scheme "
        "its own loss at its own rates) that changed by less than "
        f"{100 * threshold:g}% between 80% and 100% of training, and that relative change "
        "(mean ± sd, positive while still falling)"
    )


def _converged_cell(s, seeds):
    """``k/n (change %)`` for a trained model, empty for the untrained one."""
    if s.get("converged") is None:
        return ""
    change = _spread_cell(s["relative_change"], 2, seeds, 100)
    return f"{s['converged']}/{seeds} ({change}%)"


def _convergence_text(res, cfg):
    """Whether every trained run had levelled off when training stopped."""
    trained = {k: s for k, s in res["summary"].items() if s.get("converged") is not None}
    if not trained:
        return "This file records no convergence measure."
    runs = sum(len(res["runs"][k]) for k in trained)
    done = sum(s["converged"] for s in trained.values())
    if done == runs:
        return (
            f"Every trained run ({done} of {runs}) had levelled off by this measure, so the "
            "schemes are compared at convergence."
        )
    lagging = ", ".join(
        f"{k} ({len(res['runs'][k]) - s['converged']})"
        for k, s in trained.items()
        if s["converged"] < len(res["runs"][k])
    )
    text = (
        f"Only {done} of {runs} trained runs had levelled off by this measure (not converged: "
        f"{lagging}), so those comparisons are at one point of training, not at convergence."
    )
    records = [
        r["convergence"]
        for k in trained
        for r in res["runs"][k]
        if "convergence" in r and not r["convergence"]["converged"]
    ]
    if records and len(records) == runs - done:
        largest = max(abs(c["relative_change"]) for c in records)
        threshold = records[0]["threshold"]
        text += (
            f" The runs that had not levelled off changed their loss by at most "
            f"{100 * largest:.1f}% (the measure's threshold: {100 * threshold:g}%)."
        )
    return text


#: Two-sided 97.5% quantiles of Student's t by degrees of freedom (1 to 9).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
_T975[9] = 2.262


def _comparison_text(res, reference, keys, seeds):
    """Each trained scheme's paired difference from ``reference`` (mean ± sd over seeds)
    and whether its 95% t-interval over the seeds excludes zero."""
    if seeds == 1:
        return "One seed: there is no spread over seeds to judge the differences by."
    t = _T975.get(seeds - 1, 1.96)
    parts = []
    for scheme, s in res["summary"].items():
        if scheme == reference or scheme.startswith("random init"):
            continue
        for key, unit, digits, scale in keys:
            if key not in s:
                continue
            mean, sd = scale * s[key][0], scale * s[key][1]
            half = t * sd / math.sqrt(seeds)
            verdict = (
                "resolved, the paired 95% interval over seeds excludes zero"
                if abs(mean) > half
                else "within the seed spread, the paired 95% interval over seeds holds zero"
            )
            parts.append(
                f"{scheme} − {reference}: {pm(mean, sd, digits)} {unit} "
                f"(± {num(half, digits)}; {verdict})"
            )
    return "Paired by seed: " + "; ".join(parts) + "." if parts else ""


def _mean_se(values, digits, scale=1.0):
    """``mean ± s.e.`` of ``values`` (over sequences), or the value alone for one."""
    values = [scale * v for v in values]
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return num(mean, digits)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return pm(mean, math.sqrt(var / n), digits)


def _mlm_generation_parts(ctx, res, cfg):
    # A fully masked start masks every residue: its counts are the sequences' lengths.
    lengths = cfg["masked_per_sequence"]["fully masked"]
    n = len(lengths)
    length = "full length" if cfg["length"] is None else f"first {cfg['length']} residues"
    caption = (
        f"after Li et al. (2024); {cfg['model']} samples {n} therapeutic antibody variable "
        f"domains of {ctx.code('ANTIBODY_SEQUENCES')} (heavy and light alternating, {length}, "
        f"mean D = {sum(lengths) / n:.1f} residues) from two starts: fully masked, and half "
        f"masked ({percent(cfg['mask_fraction'], 0)} of the residues of the real sequence "
        "masked at random, the rest given). Samplers of "
        f"{ctx.code('sample_mlm')}: sequential (one masked residue per forward pass, in a "
        "random order), parallel (every mask in one pass) and mask-predict "
        f"(T = {cfg['mask_predict_steps']} passes, re-masking the least confident residues); "
        "the real sequences are scored alike. Stutter = adjacent residues that repeat, PLL = "
        "the model's pseudo-log-likelihood per residue (nats, one pass per position), both "
        f"mean ± s.e. over the {n} sequences; TV = total variation between the residue "
        "frequencies of the samples and of all 32 sequences (cut alike); s/seq = sampling "
        f"time per sequence; one seed (seed {cfg['seed']}):"
    )
    rows = []
    for start, by_method in res["results"].items():
        for method, r in by_method.items():
            sampled = r["passes"] >= 0
            per_residue = [pll / d for pll, d in zip(r["pseudo_log_likelihood"], lengths)]
            rows.append(
                [
                    start,
                    method,
                    str(r["passes"]) if sampled else "",
                    _mean_se(r["stutter_rates"], 1, 100),
                    _mean_se(per_residue, 3),
                    num(r["token_distance"], 3),
                    num(r["seconds_per_sequence"], 2) if sampled else "",
                ]
            )
    headers = ["start", "sampler", "passes", "stutter %", "PLL / residue", "TV", "s/seq"]
    note = (
        f"{n} sequences and one seed: a difference between samplers of less than a few "
        "standard errors is not resolved. Li et al. (2024) study other models and data, so "
        "only the pattern can carry over."
    )
    return caption, headers, rows, note
