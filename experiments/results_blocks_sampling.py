"""The rendered result blocks of the shared-mask PPCA estimates (Fig. 1 and Fig. 4 of the
paper) and of block Gibbs sampling on the self-predictive conditionals."""

from experiments._common import mean_std
from experiments.results_format import MINUS, num, pm

__all__ = ["gibbs_mixing_block", "ppca_convergence_block", "ppca_curve_block"]


def _sci(value, sign=False):
    """``value`` in scientific notation with two significant digits and a typographic minus."""
    return f"{value:{'+' if sign else ''}.1e}".replace("-", MINUS)


def ppca_convergence_block(ctx):
    res = ctx.json("ppca-convergence.json")
    cfg, panels = res["config"], res["panels"]
    caption = (
        f"{ctx.run_text('ppca-convergence')}: paper Fig. 1; PPCA with N={cfg['N']}, "
        f"K={cfg['K']}, noise variance {cfg['noise_var']:g}, the paper's data noise, scored "
        "with its generating parameters; the estimate from P random masks per mask size, each "
        f"shared by all observations; relative error |MPT − LML| / |LML|, mean over "
        f"{cfg['reps']} repetitions; last rows: the signed relative error with "
        f"{cfg['limit_masks']} masks in all ± its standard error, and the exact LML per "
        "observation:"
    )
    headers = ["P"] + [p["label"] for p in panels]
    rows = []
    for p in cfg["P"]:
        means = [mean_std(panel["relative_error"][str(p)])[0] for panel in panels]
        rows.append([str(p)] + [_sci(m) for m in means])
    rows.append(
        ["many masks"]
        + [
            f"{_sci(p['limit_relative_error'], sign=True)} ± {_sci(p['limit_relative_error_se'])}"
            for p in panels
        ]
    )
    rows.append(["exact LML"] + [num(p["log_marginal"], 3) for p in panels])
    uniform = [p for p in panels if p["rate"] == "uniform"]
    fixed = [p for p in panels if p["rate"] != "uniform"]
    notes = []
    if uniform:
        largest = max(cfg["P"])
        shrink = "; ".join(
            f"{p['label']}: {_sci(mean_std(p['relative_error'][str(cfg['P'][0])])[0])} at "
            f"P={cfg['P'][0]}, {_sci(mean_std(p['relative_error'][str(largest)])[0])} at "
            f"P={largest}"
            for p in uniform
        )
        notes.append(f"At the uniform rate the error shrinks as P grows ({shrink}).")
    for p in fixed:
        notes.append(
            f"At the fixed rate ({p['label']}) it levels off at the bias of the fixed-size "
            f"estimate, {_sci(abs(p['limit_relative_error']))} of |LML| "
            f"({abs(p['limit_estimate'] - p['log_marginal']):.2f} nats per observation)."
        )
    return "\n\n".join([caption, ctx.table(headers, rows), " ".join(notes)])


def ppca_curve_block(ctx):
    res = ctx.json("ppca-curve.json")
    cfg, panels = res["config"], res["panels"]
    caption = (
        f"{ctx.run_text('ppca-curve')}: paper Fig. 4; N={cfg['N']} draws of a ground-truth "
        f"PPCA with D={cfg['D']} and noise variance {cfg['noise_var']:g}, scored with its "
        f"own parameters; the MPT curve of {ctx.code('mpt_curve')} over every mask size "
        "M=1…D with P masks per size, each shared by all observations; its area Σ_M S(x; M) "
        "against the exact LML, per observation, one seed:"
    )
    headers = ["K", "P", "area", "exact LML", "area − LML", "s"]
    rows = [
        [
            str(p["latent_dim"]),
            str(p["num_masks"]),
            num(p["area"], 3),
            num(p["log_marginal"], 3),
            num(p["area"] - p["log_marginal"], 3, sign=True),
            f"{p['seconds']:.1f}",
        ]
        for p in panels
    ]
    return "\n\n".join([caption, ctx.table(headers, rows)])


def gibbs_mixing_block(ctx):
    res = ctx.json("gibbs-mixing.json")
    cfg = res["config"]
    caption = (
        f"{ctx.run_text('gibbs-mixing')}: block Gibbs with {ctx.code('pyro_mpt.gibbs')} on a "
        f"PPCA with D={cfg['num_features']}, K=1 and noise variance {cfg['noise_var']:g} "
        "(exact conditionals) and on a bimodal binary model with a 1-D latent (quadrature); "
        f"{cfg['chains']} chains of {cfg['steps']} steps per block size k, joint updates (k "
        "passes of a masked model per step) and product updates (one pass); ESS of a slow "
        "statistic per step and per pass, R-hat, and the stationary error (PPCA: relative "
        "Frobenius error of the chains' covariance, beside the closed-form stationary error "
        "of the chain; bimodal: error of the probability that all bits agree, "
        f"{res['bimodal_agreement']:.4f} by a grid integral), one seed:"
    )
    headers = ["model", "k", "update", "ESS/step", "ESS/pass", "R-hat", "error", "predicted"]
    rows = []
    for m in res["mixing"]:
        predicted = m.get("predicted_error")
        rows.append(
            [
                "PPCA" if m["model"] == "ppca" else m["model"],
                str(m["k"]),
                m["update"],
                f"{m['ess_per_step']:.3f}",
                f"{m['ess_per_evaluation']:.3f}",
                f"{m['rhat']:.3f}",
                f"{m['stationary_error']:.3f}",
                "" if predicted is None else f"{predicted:.3f}",
            ]
        )
    train_caption = (
        f"Beside it, PPCAs trained on N={cfg['train_n']} draws by "
        f"{ctx.code('MPTLoss(rate=k/D)')} for {cfg['epochs']} full-batch steps, from "
        f"{cfg['seeds']} seeds: relative error of the learned covariance, mean ± sd over the "
        "seeds; MLE: the closed-form maximum-likelihood PPCA of the same data."
    )
    train_rows = [
        ["MLE" if t["k"] is None else str(t["k"]), pm(t["mean"], t["std"], 3)]
        for t in res["training"]
    ]
    return "\n\n".join(
        [
            caption,
            ctx.table(headers, rows),
            train_caption,
            ctx.table(["k (mask size)", "rel. covariance error"], train_rows),
        ]
    )
