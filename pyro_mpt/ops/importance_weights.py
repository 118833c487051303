"""How far importance weights can be trusted: Kish's effective sample size and the Pareto
shape k-hat of their upper tail, computed row by row on tensors of log-weights.

Both figures describe the unnormalised weights ``w_s = p(z_s, x) / q(z_s)`` of ``S``
proposals, and both ignore a common factor of the weights (they are shift-invariant in the
log-weights).

- **Effective sample size** ``(sum_s w_s)^2 / sum_s w_s^2`` lies between 1 and ``S``: the
  number of equally weighted samples whose average would be as variable as the weighted one
  (Kish, 1965). When it is small, a few samples carry the whole estimate, whatever ``S``.
- **Pareto k-hat** is the fitted shape of a generalized Pareto distribution on the largest
  weights (Vehtari et al., 2024). The weights have about ``1 / k`` finite moments: for
  ``k < 0.5`` the variance is finite and the central limit theorem applies; for
  ``0.5 <= k < 0.7`` the estimate still converges at a usable rate; for ``k >= 0.7`` (or,
  for ``S < 2200``, ``k > 1 - 1 / log10(S)``) importance sampling is unreliable, and more
  samples hardly help. The ESS can look fine while k-hat says otherwise: a heavy tail is
  seldom sampled, so the ESS computed from one draw is itself unreliable.

Everything is vectorised over rows, with shapes fixed by the input's shape: no host
synchronisation, so both can run inside a training step on a GPU. This module is pure
tensor code: no Pyro.

References:

- L. Kish (1965), *Survey Sampling*, Wiley, section 11.7.
- A. Vehtari, D. Simpson, A. Gelman, Y. Yao, J. Gabry (2024), Pareto smoothed importance
  sampling, *Journal of Machine Learning Research* 25(72):1-58.
- J. Zhang, M. A. Stephens (2009), A new and efficient estimation method for the generalized
  Pareto distribution, *Technometrics* 51(3):316-325.
"""

import math

import torch

__all__ = ["effective_sample_size", "pareto_shape", "ratio_bias"]

# Zhang & Stephens' prior on the grid of b = -k / sigma, and the weakly informative prior
# of Vehtari et al. that pulls k-hat towards 0.5 as if from this many extra tail points.
_GRID_PRIOR = 3.0
_PRIOR_SHAPE = 0.5
_PRIOR_COUNT = 10.0
_MIN_TAIL = 5


def _check_floating(log_weights, name):
    if not isinstance(log_weights, torch.Tensor) or not log_weights.is_floating_point():
        got = type(log_weights).__name__
        if isinstance(log_weights, torch.Tensor):
            got = f"a tensor of dtype {log_weights.dtype}"
        raise TypeError(
            f"{name}: log_weights must be a floating-point tensor, got {got}; "
            "convert it with torch.as_tensor(log_weights, dtype=torch.float64)."
        )


def effective_sample_size(log_weights, dim=0):
    """Kish's effective sample size of unnormalised importance weights, from their logs:
    how many equally weighted samples the weighted average is worth.

    .. math::

        \\mathrm{ESS} = \\frac{(\\sum_s w_s)^2}{\\sum_s w_s^2}
            = \\frac{(\\sum_s e^{\\ell_s - m})^2}{\\sum_s e^{2 (\\ell_s - m)}},
        \\qquad m = \\max_s \\ell_s,

    so no weight overflows whatever the scale of the log-weights ``l``.

    Rows whose log-weights are all ``-inf`` (every weight zero) give ``0``; rows holding a
    NaN or ``+inf`` give NaN. ``-inf`` entries elsewhere are zero weights. The result is
    differentiable in the finite log-weights.

    Example::

        >>> effective_sample_size(torch.zeros(8, 3))  # equal weights: ESS = S
        tensor([8., 8., 8.])

    :param torch.Tensor log_weights: unnormalised log-weights, floating point.
    :param int dim: the dimension of the samples.
    :returns: the ESS, a tensor of ``log_weights``' shape without ``dim``, its dtype and
        device.
    :rtype: torch.Tensor
    """
    _check_floating(log_weights, "effective_sample_size")
    # The ESS does not depend on the shift, so it carries no gradient.
    shift = log_weights.detach().amax(dim, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weights = torch.exp(log_weights - shift)
    total = weights.sum(dim)
    total_sq = weights.square().sum(dim)
    # All weights zero: 0 / 1 = 0 rather than 0 / 0, with a zero gradient.
    total_sq = torch.where(total == 0, torch.ones_like(total_sq), total_sq)
    return total.square() / total_sq


def ratio_bias(log_weights, log_likelihoods):
    """The bias, to first order, of the self-normalised importance estimate of each
    ``log p(x_j | x_R)``: the log of a ratio of two importance estimates, the numerator's
    weights ``w_s p(x_j | z_s)`` and the denominator's ``w_s``.

    The log of an estimate ``Z`` with relative variance ``V`` is biased by about ``-V / 2``
    (a second-order Taylor expansion), and Kish's ESS estimates ``V`` as ``1/ESS - 1/S``.
    The ratio's bias is the difference of its two terms' biases, in which ``1/S`` cancels:

    .. math::

        \\mathrm{bias}_j \\approx \\tfrac12 \\Big(\\frac{1}{\\mathrm{ESS}(w)}
            - \\frac{1}{\\mathrm{ESS}(w\\, p(x_j \\mid z))}\\Big).

    A proposal that fits ``p(z | x_R)`` exactly has equal weights, ``ESS(w) = S``, and
    passes every test of the weights; when ``p(z | x_R)`` is much broader than
    ``p(z | x_R, x_j)`` the numerator still rests on few draws and the estimate is low by
    this term. Like the ESS it is itself estimated from the draws: where the draws miss
    the numerator's mass altogether it understates the bias.

    :param torch.Tensor log_weights: ``log p(z_s, x_R) - log q(z_s)`` up to a constant per
        row, shape ``(S,) + rows``.
    :param torch.Tensor log_likelihoods: ``log p(x_j | z_s)``, shape ``(S,) + rows + (D,)``
        (broadcastable).
    :returns: the bias per feature, shape ``rows + (D,)``, detached.
    """
    _check_floating(log_weights, "ratio_bias")
    with torch.no_grad():
        log_weights = log_weights.detach()
        numerator = log_weights.unsqueeze(-1) + log_likelihoods.detach()
        inverse_numerator = 1 / effective_sample_size(numerator)
        inverse_denominator = 1 / effective_sample_size(log_weights)
        return 0.5 * (inverse_denominator.unsqueeze(-1) - inverse_numerator)


def _tail_size(num_samples):
    """``M = ceil(min(0.2 S, 3 sqrt(S)))``, the number of largest weights the Pareto fit
    uses (Vehtari et al. 2024, with relative efficiency 1)."""
    return math.ceil(min(num_samples / 5.0, 3.0 * math.sqrt(num_samples)))


def pareto_shape(log_weights, dim=0):
    """The Pareto-smoothed importance sampling shape k-hat of unnormalised importance
    weights, from their logs: above 0.7, importance sampling with these weights is
    unreliable (Vehtari et al., 2024).

    For each row of ``S`` log-weights ``l``, shifted so their maximum is 0:

    1. ``M = ceil(min(S / 5, 3 sqrt(S)))``; the threshold ``u`` is the ``(M + 1)``-th
       largest log-weight, raised to ``log`` of the dtype's smallest normal number if it is
       below; the tail is the ``n <= M`` log-weights above ``u`` (fewer than ``M`` when
       log-weights tie at ``u``), and ``y = e^l - e^u`` are their exceedances.
    2. A generalized Pareto distribution is fitted to ``y`` by Zhang & Stephens' (2009)
       empirical Bayes method: on a grid of ``m = 30 + floor(sqrt(n))`` values

       .. math::

           b_j = \\frac{1}{y_{(n)}} + \\frac{1 - \\sqrt{m / (j - 1/2)}}{3\\, y_{(q)}},
           \\qquad q = \\lfloor n / 4 + 1/2 \\rfloor,

       each with its profile shape ``k(b) = mean_i log(1 - b y_i)`` and profile
       log-likelihood ``L(b) = n (log(-b / k(b)) - k(b) - 1)``, ``b`` is estimated by the
       mean of the grid under weights ``softmax(L)``, and ``k = mean_i log(1 - b y_i)``
       (in the convention where a larger ``k`` is a heavier tail).
    3. The estimate is pulled towards 0.5 by a weakly informative prior worth 10 tail
       points: ``k <- (n k + 5) / (n + 10)``.

    These are the conventions of ``arviz.psislw`` with ``reff=1``, whose shape estimate
    this function reproduces to rounding in float64, except where arviz returns ``inf``
    (below). The computation follows the input's dtype; float32 agrees with float64 to
    about ``1e-5`` (k-hat moves as much when float64 log-weights move by float32
    rounding), except for rows whose top ``M + 1`` weights span more than about
    ``e^87`` (float32's range), where the threshold is raised further in float32.

    .. note::
        Rows with fewer than 5 log-weights above the threshold give NaN (arviz gives
        ``inf``): every row when ``S <= 20``, rows of constant weights, and rows whose
        largest log-weights tie. Rows holding a NaN or ``+inf``, and rows that are all
        ``-inf``, give NaN; other ``-inf`` entries are zero weights.

    The result is a diagnostic, computed without gradient.

    Example::

        >>> log_w = torch.distributions.Normal(0.0, 1.0).sample((1000, 4))
        >>> pareto_shape(log_w).shape  # one k-hat per column
        torch.Size([4])

    :param torch.Tensor log_weights: unnormalised log-weights, floating point.
    :param int dim: the dimension of the samples.
    :returns: k-hat, a tensor of ``log_weights``' shape without ``dim``, its dtype and
        device.
    :rtype: torch.Tensor
    """
    _check_floating(log_weights, "pareto_shape")
    log_weights = log_weights.detach().movedim(dim, -1)
    num_samples = log_weights.shape[-1]
    tail_size = _tail_size(num_samples) if num_samples > 0 else 0
    if tail_size < _MIN_TAIL:
        return log_weights.new_full(log_weights.shape[:-1], math.nan)

    # A NaN or +inf anywhere, or all -inf: the maximum is not finite.
    bad = ~torch.isfinite(log_weights.amax(-1))
    top = torch.topk(log_weights, tail_size + 1, dim=-1).values  # descending
    top = top - top[..., :1]
    floor = math.log(torch.finfo(top.dtype).tiny)
    threshold = top[..., -1:].clamp(min=floor)
    top = top[..., :-1]
    in_tail = top > threshold
    tail_len = in_tail.sum(-1)  # n, per row (integer)
    # Exceedances e^l - e^u, scaled by e^-u (k-hat is scale-invariant): expm1 keeps the
    # relative precision of exceedances just above the threshold.
    exceed = torch.where(in_tail, torch.expm1(top - threshold), torch.zeros_like(top))

    # The tail is the first n entries of `top`, in decreasing order: its largest is entry 0
    # and its ascending q-th is entry n - q.
    quartile = torch.div(tail_len + 2, 4, rounding_mode="floor")
    index = (tail_len - quartile).clamp(min=0).unsqueeze(-1)
    y_quartile = exceed.gather(-1, index)
    y_max = exceed[..., :1]

    n = tail_len.to(top.dtype).unsqueeze(-1)
    grid_len = 30 + torch.floor(torch.sqrt(n))  # m, per row
    max_grid_len = 30 + math.isqrt(tail_size)
    j = torch.arange(1, max_grid_len + 1, dtype=top.dtype, device=top.device)
    on_grid = j <= grid_len
    # Off the row's grid, b would leave the support; any grid point keeps it finite there.
    j = torch.where(on_grid, j, grid_len)
    b = 1.0 / y_max + (1.0 - torch.sqrt(grid_len / (j - 0.5))) / (_GRID_PRIOR * y_quartile)

    # (..., m, M): profile shape of every grid point, zero-padded tail entries add 0. The
    # product is the one large temporary; log1p runs in place on it.
    neg_exceed = -exceed
    k_grid = (b.unsqueeze(-1) * neg_exceed.unsqueeze(-2)).log1p_().sum(-1) / n
    profile = n * (torch.log(-b / k_grid) - k_grid - 1.0)
    profile = torch.where(on_grid, profile, torch.full_like(profile, -math.inf))
    b_post = (torch.softmax(profile, dim=-1) * b).sum(-1, keepdim=True)
    k = torch.log1p(b_post * neg_exceed).sum(-1) / n.squeeze(-1)

    n = n.squeeze(-1)
    k = (n * k + _PRIOR_COUNT * _PRIOR_SHAPE) / (n + _PRIOR_COUNT)
    return torch.where(bad | (tail_len < _MIN_TAIL), torch.full_like(k, math.nan), k)
