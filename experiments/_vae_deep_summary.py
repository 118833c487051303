"""What ``vae-deep`` concludes from its runs: each row's figures over seeds
(:func:`summarise_row`) and whether MPT trained without the ELBO meets the target
(:data:`TARGET`, :func:`verdict`)."""

import statistics

from experiments import _common as common

__all__ = [
    "ELBO_FREE",
    "QUESTION",
    "TARGET",
    "rising_together",
    "summarise_row",
    "target_cell",
    "verdict",
]

QUESTION = (
    "Does MPT trained without the ELBO reach at least the ELBO-trained model's held-out LML, "
    "at no more than 5 times an ELBO step, with its objective and held-out LML rising together?"
)

#: The target of every MPT row trained without the ELBO: its held-out LML (fresh encoder)
#: minus the ELBO row's, mean over seeds, at least ``min_gap`` nats; its step at most
#: ``max_step_ratio`` times a ``Trace_ELBO`` step; on every seed, the per-epoch objective
#: and held-out LML both higher at the last epoch than at the first, with a rank correlation
#: (Spearman's) over the epochs of at least ``min_correlation``, and the held-out LML falling
#: by no more than ``max_late_fall`` nats over the second half of training while the
#: objective rises. Ranks say whether the curves rise and fall together whatever the size
#: of each epoch's move: Pearson's correlation is dominated by the first epoch's jump, and
#: falls below 0.9 for the ELBO row's own curves at latent size 2.
TARGET = dict(min_gap=0.0, max_step_ratio=5.0, min_correlation=0.9, max_late_fall=1.0)

#: ``MPTLoss`` guide losses that train without the ELBO: the rows the target is about.
ELBO_FREE = (None, "wake")


def _mean_curve(curves):
    return [statistics.fmean(values) for values in zip(*curves)]


def _ranks(values):
    """The rank of each value (1 for the smallest; ties share the mean of their ranks)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def _correlation(a, b):
    """Spearman's rank correlation of two curves, or None when it is undefined."""
    try:
        return statistics.correlation(_ranks(a), _ranks(b))
    except statistics.StatisticsError:  # fewer than two epochs, or a flat curve
        return None


def rising_together(objective, held_out):
    """Whether one run's per-epoch objective and held-out LML rise together (the last three
    conditions of :data:`TARGET`), and their rank correlation over the epochs."""
    corr = _correlation(objective, held_out)
    mid = len(objective) // 2
    late_fall = held_out[mid] - held_out[-1] if objective[-1] > objective[mid] else 0.0
    ok = (
        corr is not None
        and corr >= TARGET["min_correlation"]
        and objective[-1] > objective[0]
        and held_out[-1] > held_out[0]
        and late_fall <= TARGET["max_late_fall"]
    )
    return ok, corr


def _spread(key, values):
    """``{key: mean, key_sd: sample standard deviation}`` of a list of floats."""
    mean, sd = common.mean_std(values)
    return {key: mean, f"{key}_sd": sd}


def summarise_row(records, elbo_records, step_ratio):
    """A row's figures over its seeds: means, with their standard deviations under
    ``<key>_sd``; the gap to the ELBO row is paired seed by seed.

    :param list records: the row's per-seed records (training and fair evaluation).
    :param list elbo_records: the ELBO row's, seed by seed (``None`` if it did not run).
    :param float step_ratio: its step time over a ``Trace_ELBO`` step's.
    """
    together = [rising_together(r["objective"], r["held_out_log_marginal"]) for r in records]
    out = dict(step_ratio=step_ratio)
    out.update(_spread("test_log_marginal", [r["test_log_marginal"] for r in records]))
    out.update(gap=None, gap_sd=None, quadrature_minus_iwae=None, quadrature_minus_iwae_sd=None)
    if elbo_records is not None:
        pairs = zip(records, elbo_records)
        gaps = [r["test_log_marginal"] - e["test_log_marginal"] for r, e in pairs]
        out.update(_spread("gap", gaps))
    if records[0]["quadrature_log_marginal"] is not None:
        differences = [r["quadrature_log_marginal"] - r["test_log_marginal"] for r in records]
        out.update(_spread("quadrature_minus_iwae", differences))
    out.update(rising_together=all(ok for ok, _ in together), correlation=[c for _, c in together])
    # Per-epoch curves and final figures averaged over seeds (what vae-compare reads).
    for key in ("objective", "log_marginal", "held_out_log_marginal", "seconds_per_epoch"):
        out[key] = _mean_curve([r[key] for r in records])
    for key in ("initial_log_marginal", "initial_held_out_log_marginal"):
        out[key] = statistics.fmean(r[key] for r in records)
    out["final_weights"] = _final_weights(records)
    return out


def _final_weights(records):
    """The weight figures of the last epoch's last batch, averaged over seeds (None for rows
    without importance weights, or records that have none)."""
    finals = [r["weights"][-1] for r in records if r.get("weights") and r["weights"][-1]]
    if not finals:
        return None
    out = {}
    for key in finals[0]:
        values = [f[key] for f in finals if f[key] is not None and f[key] == f[key]]
        out[key] = statistics.fmean(values) if values else None
    return out


#: The checks of :func:`_checks` that must all pass.
_PASS = ("held_out_lml", "step_time", "rising_together")


def _checks(row):
    """One row's checks against :data:`TARGET`, and by how much it misses the first two."""
    gap, ratio = row["gap"], row["step_ratio"]
    return dict(
        held_out_lml=gap >= TARGET["min_gap"],
        step_time=ratio <= TARGET["max_step_ratio"],
        rising_together=row["rising_together"],
        lml_short_by=max(0.0, TARGET["min_gap"] - gap),
        step_ratio_over_by=max(0.0, ratio - TARGET["max_step_ratio"]),
    )


def verdict(runs, methods, skipped):
    """Whether the target is met, group by group and over all groups.

    A group meets it when one of its MPT rows trained without the ELBO (guide losses of
    :data:`ELBO_FREE`) passes every check; its ``closest`` row is the one with the highest
    held-out LML, and, when none passes, ``short_by`` says what that row misses by (nats of
    held-out LML, step-time ratio over the limit, whether it rises together). Groups
    without an ELBO row or without such an MPT row are not judged (``met`` is ``None``).

    :param dict runs: row name -> summary (:func:`summarise_row`).
    :param dict methods: row name -> its row of ``ALL_METHODS``.
    :param dict skipped: row name -> why it did not run.
    """
    groups = {}
    for group in dict.fromkeys(methods[n]["group"] for n in list(runs) + list(skipped)):
        names = [n for n in runs if methods[n]["group"] == group]
        candidates = [
            n
            for n in names
            if methods[n]["loss_kind"] == "mpt"
            and methods[n]["guide_loss"] in ELBO_FREE
            and runs[n]["gap"] is not None
        ]
        checks = {n: _checks(runs[n]) for n in candidates}
        passed = [n for n in candidates if all(checks[n][k] for k in _PASS)]
        closest = max(candidates, key=lambda n: runs[n]["gap"]) if candidates else None
        short_by = None
        if candidates and not passed:
            c = checks[closest]
            short_by = dict(
                held_out_lml_nats=c["lml_short_by"],
                step_ratio=c["step_ratio_over_by"],
                rising_together=c["rising_together"],
            )
        groups[group] = dict(
            met=bool(passed) if candidates else None,
            passed=passed,
            closest=closest,
            short_by=short_by,
            checks=checks,
            not_run=[n for n in skipped if methods[n]["group"] == group],
        )
    judged = [g["met"] for g in groups.values() if g["met"] is not None]
    return dict(
        question=QUESTION,
        criteria=TARGET,
        groups=groups,
        met=all(judged) if judged else None,
    )


def _fixed(value, digits):
    return f"{value:.{digits}f}"


def target_cell(checks, number=_fixed):
    """The word on one row's checks of the target: ``met``, or what it misses by.

    :param dict checks: the row's checks, as :func:`verdict` records them (None: not judged,
        an empty cell).
    :param number: ``number(value, digits)`` formats a figure (the console's plain digits by
        default; the rendered tables pass their own).
    """
    if checks is None:
        return ""
    misses = []
    if not checks["held_out_lml"]:
        misses.append(f"LML {number(checks['lml_short_by'], 1)} nats short")
    if not checks["step_time"]:
        misses.append(f"step {number(checks['step_ratio_over_by'], 2)}× over")
    if not checks["rising_together"]:
        misses.append("not rising together")
    return "met" if not misses else "no: " + ", ".join(misses)
