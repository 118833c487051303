"""Pictures of the MPT curve."""

from pyro_mpt.diagnostics.curve import MPTCurve

__all__ = ["plot_mpt_curve"]


def plot_mpt_curve(curve, ax=None, label=None, log_marginal=None, **plot_kwargs):
    """Draws an :class:`~pyro_mpt.diagnostics.curve.MPTCurve`: the score of each masking rate
    with a band of two standard errors, its area in the legend, and optionally the exact
    ``log p(x)`` for comparison.

    :param MPTCurve curve: the curve.
    :param ax: a matplotlib axis (a new figure when None).
    :param str label: legend label; the area is appended.
    :param float log_marginal: the exact mean ``log p(x)``, shown in the legend.
    :returns: the matplotlib axis.
    """
    import matplotlib.pyplot as plt

    if not isinstance(curve, MPTCurve):
        raise TypeError(
            f"curve must be an MPTCurve (as mpt_curve returns), got {type(curve).__name__}."
        )
    if log_marginal is not None:
        try:
            log_marginal = float(log_marginal)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"log_marginal must be a number, the mean log p(x) per observation (e.g. "
                f"log_marginal(model, x).mean()), got {log_marginal!r:.60}."
            ) from None
    if ax is not None and not hasattr(ax, "fill_between"):
        raise TypeError(f"ax must be a matplotlib axis, got {type(ax).__name__}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.5))
    # In increasing rate, so that rates given in any order draw one line.
    order = curve.rates.cpu().argsort().numpy()
    rates = 100 * curve.rates.cpu().numpy()[order]
    scores = curve.scores.cpu().numpy()[order]
    stderr = curve.stderr.cpu().numpy()[order]
    text = f"area {curve.area:.2f}"
    if log_marginal is not None:
        text += f" (log p(x) {log_marginal:.2f})"
    line = ax.plot(rates, scores, label=f"{label}: {text}" if label else text, **plot_kwargs)[0]
    ax.fill_between(
        rates, scores - 2 * stderr, scores + 2 * stderr, color=line.get_color(), alpha=0.2
    )
    ax.set_xlabel("masked features (%)")
    ax.set_ylabel(r"$\mathcal{S}(x; M)$  (nats per masked feature)")
    ax.legend(fontsize="small")
    return ax
