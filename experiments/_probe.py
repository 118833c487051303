"""The linear probe of the transformer reproductions: how well frozen features predict a
label (a topic, a digit)."""

import torch

from experiments import _common as common

__all__ = ["linear_probe_accuracy"]


def linear_probe_accuracy(x_train, y_train, x_test, y_test, l2=1e-3, max_iter=200):
    """Test accuracy of a multinomial logistic regression with an L2 penalty on standardised
    features, fitted by L-BFGS in float64.

    .. math::

        \\min_{W, b} \\frac{1}{N} \\sum_n \\mathrm{CE}(W^\\top a_n + b, y_n)
            + \\lambda \\lVert W \\rVert^2

    :param torch.Tensor x_train: ``(N, F)`` features; ``y_train`` ``(N,)`` integer labels.
    :param float l2: ``lambda``.
    :param int max_iter: L-BFGS iterations.
    :returns: the share of ``x_test`` rows whose predicted label equals ``y_test``.
    """
    with common.float64(), torch.enable_grad():
        x_train, x_test = x_train.double(), x_test.double()
        mean, std = x_train.mean(0), x_train.std(0).clamp(min=1e-8)
        a, b = (x_train - mean) / std, (x_test - mean) / std
        classes = int(max(y_train.max(), y_test.max())) + 1
        weight = torch.zeros(a.shape[1], classes, dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
        optim = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure():
            optim.zero_grad()
            loss = torch.nn.functional.cross_entropy(a @ weight + bias, y_train)
            loss = loss + l2 * (weight**2).sum()
            loss.backward()
            return loss

        optim.step(closure)
        with torch.no_grad():
            return float(((b @ weight + bias).argmax(-1) == y_test).double().mean())
