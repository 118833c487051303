"""The rendered result block of ``coherence``: the spread of chain-rule sums across orderings
for exact, importance-sampled, encode-decode and masked-LM conditionals."""

from experiments.results_format import MINUS, num, pm

__all__ = ["coherence_block"]


def _pm_small(mean, se, digits=3):
    """``mean ± se``, in scientific notation when both are below the last decimal (a spread
    at rounding level); ``–`` for a missing value."""
    if mean is None:
        return "–"
    if se is None:
        return num(mean, digits)
    if max(abs(mean), abs(se)) < 10**-digits:
        return f"{mean:.1e} ± {se:.1e}".replace("-", MINUS)
    return pm(mean, se, digits)


def coherence_block(ctx):
    """The table of ``coherence.json``: per model and conditionals, the mean chain-rule sum,
    its spread across orderings, the gap to a reference, and the seconds."""
    res = ctx.json("coherence.json")
    cfg = res["config"]
    training = res["vae_training"]
    bert = res["bert"]
    mean_d = sum(bert["num_features"]) / len(bert["num_features"])
    caption = (
        f"{ctx.run_text('coherence')}: the chain rule summed along random orderings of each "
        "observation's features, in nats per observation; spread = standard deviation "
        "across orderings, averaged over observations (± its standard error); gap = mean "
        "sum minus the reference (± the Monte Carlo error of both). "
        f"PPCA: D={cfg['ppca_D']}, K={cfg['ppca_K']}, ground-truth parameters on "
        f"{cfg['ppca_N']} of its own samples, float64, against the dense Gaussian density. "
        f"Deep VAE: Bernoulli, K={cfg['vae_latent']}, {cfg['vae_hidden']} hidden units, "
        f"trained by {ctx.code('Trace_ELBO')} for {cfg['vae_epochs']} epochs on "
        f"{cfg['vae_N']} binarised MNIST images (final ELBO {num(training['final_elbo'])} "
        f"per image, {training['seconds']:.0f} s), scored on {cfg['vae_held_out']} held-out "
        f"images of D=784 pixels, float32, against the importance estimate of log p(x) with "
        f"the encoder on the whole image and S={cfg['vae_reference_samples']}. AntiBERTy: "
        f"{len(cfg['bert_names'])} antibody variable domains (mean D = {mean_d:.1f} "
        "residues), pre-trained and with random weights of the same configuration, float32, "
        f"against the area under the MPT curve ({len(cfg['bert_rates'])} rates, "
        f"{cfg['bert_masks']} masks each). s = seconds of the orderings; ms/prefix = per "
        "prefix and observation (one ordering of one observation has D prefixes):"
    )
    rows = []
    for row in res["rows"]:
        rows.append(
            [
                row["group"],
                ctx.code(row["label"]) if row["group"] == "deep VAE" else row["label"],
                f"{row['num_orderings']} × {row['num_observations']}",
                num(row["mean"], 3),
                _pm_small(row["spread"], row["spread_se"]),
                _pm_small(row["gap"], row.get("gap_se")),
                row["reference_kind"],
                f"{row['seconds']:.1f}",
                f"{1000 * row['seconds'] / row['prefixes']:.3f}",
            ]
        )
    headers = ["model", "conditionals", "orderings × obs.", "mean sum", "spread", "gap",
               "gap to", "s", "ms/prefix"]  # fmt: skip
    return "\n\n".join([caption, ctx.table(headers, rows), _note(res["rows"])])


def _note(rows):
    """What the rows show, in figures taken from them: the exact spread against rounding,
    how the importance spread and gap move with ``S``, and the AntiBERTy gaps in standard
    errors."""
    by_group = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    parts = []
    for row in by_group.get("PPCA", []):
        parts.append(
            f"Exact conditionals agree across orderings to rounding (a spread of at most "
            f"{row['max_spread']:.1e} nats on a sum of {num(row['mean'], 1)}).".replace("-", MINUS)
        )
    importance = [
        r for r in by_group.get("deep VAE", []) if r["label"].startswith("ImportanceSampling")
    ]
    if len(importance) > 1:
        first, last = importance[0], importance[-1]
        samples = [int(r["label"][len("ImportanceSampling(") : -1]) for r in (first, last)]
        factor = samples[1] / samples[0]
        parts.append(
            f"From S={samples[0]} to S={samples[1]} ({factor:.0f}× the samples) the "
            f"importance spread goes from {num(first['spread'])} to {num(last['spread'])} "
            f"nats (×{last['spread'] / first['spread']:.2f}, where an error falling as "
            f"1/√S would give ×{factor**-0.5:.2f}) and the gap from {num(first['gap'], 1)} to "
            f"{num(last['gap'], 1)} (the encoder was trained by the ELBO on whole images "
            "only, never as a proposal for p(z | x_R))."
        )
        if abs(last["gap"]) > last["spread"]:
            side = "low" if last["gap"] < 0 else "high"
            parts.append(
                f"The gap exceeds the spread: the sums are biased {side}, by more than they "
                "differ from one ordering to another."
            )
    for row in by_group.get("deep VAE", []):
        if row["label"].startswith("EncodeDecode"):
            parts.append(
                f"Encode–decode spreads by {num(row['spread'])} nats, an approximation that no "
                "joint distribution produces."
            )
    bert = by_group.get("AntiBERTy", [])
    if bert:
        gaps = ", ".join(
            f"{r['label']} {num(r['gap'] / r['gap_se'], 1, sign=True)}"
            for r in bert
            if r.get("gap_se")
        )
        parts.append(
            "The mean over orderings and the MPT-curve area estimate the same figure, the "
            "chain rule averaged over orderings, whether or not the conditionals are coherent; "
            f"the AntiBERTy gaps in standard errors: {gaps}."
        )
    return " ".join(parts)
