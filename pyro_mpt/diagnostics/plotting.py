"""Pictures of the MPT curve."""

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

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.5))
    rates = 100 * curve.rates.cpu().numpy()
    scores = curve.scores.cpu().numpy()
    stderr = curve.stderr.cpu().numpy()
    text = f"area {curve.area:.2f}"
    if log_marginal is not None:
        text += f" (log p(x) {float(log_marginal):.2f})"
    line = ax.plot(rates, scores, label=f"{label}: {text}" if label else text, **plot_kwargs)[0]
    ax.fill_between(
        rates, scores - 2 * stderr, scores + 2 * stderr, color=line.get_color(), alpha=0.2
    )
    ax.set_xlabel("masked features (%)")
    ax.set_ylabel(r"$\mathcal{S}(x; M)$  (nats per masked feature)")
    ax.legend(fontsize="small")
    return ax
