"""The MPT curve of Pyro models and the exact log-marginal likelihood, checked against
dense Gaussian conditionals over every mask of a small PPCA."""

import itertools
import math

import matplotlib

matplotlib.use("Agg")

import pyro  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pyro_mpt import MPTCurve, default_rates, log_marginal, mpt_curve, plot_mpt_curve  # noqa: E402
from pyro_mpt.models import PPCA, FactorAnalysis  # noqa: E402

D = 5


def _enumerated_scores(x, loc, covariance):
    """Every mask's score ``(1/M) sum_{j in mask} log p(x_j | x_R)`` from dense Schur
    complements: ``{M: (masks, N)}`` over all ``C(D, M)`` masks of each size ``M``."""
    num_features = x.shape[-1]
    out = {}
    for size in range(1, num_features + 1):
        rows = []
        for masked in itertools.combinations(range(num_features), size):
            context = [k for k in range(num_features) if k not in masked]
            terms = []
            for j in masked:
                mean, var = loc[j].expand(x.shape[0]), covariance[j, j]
                if context:
                    gain = torch.linalg.solve(
                        covariance[context][:, context], covariance[context, j]
                    )
                    mean = mean + (x[:, context] - loc[context]) @ gain
                    var = var - covariance[j, context] @ gain
                terms.append(torch.distributions.Normal(mean, var.sqrt()).log_prob(x[:, j]))
            rows.append(torch.stack(terms).mean(0))
        out[size] = torch.stack(rows)
    return out


@pytest.fixture
def ppca():
    model = PPCA(D, 2, init_scale=1.0, noise_scale=0.5)
    x = model.sample(40)
    with torch.no_grad():
        exact = _enumerated_scores(x, model.loc, model.covariance())
    return model, x, exact


def test_enumerated_reference_sums_to_the_exact_lml(ppca):
    model, x, exact = ppca
    total = sum(scores.mean(0) for scores in exact.values())
    torch.testing.assert_close(total, log_marginal(model.model, x).detach())


def test_curve_scores_and_standard_errors_match_every_mask_enumerated(ppca):
    """Each score lies within 4 exact standard errors of the enumerated S(x; M); the
    reported standard errors match the exact ones (sampling noise of the masks' variance
    with 40 x 30 draws is about 3%; allowed 15%)."""
    model, x, exact = ppca
    num_masks = 30
    curve = mpt_curve(model.model, x, num_masks=num_masks)
    assert isinstance(curve, MPTCurve)
    assert curve.sizes.shape == (40, D) and (curve.sizes == torch.arange(1, D + 1)).all()
    assert curve.num_features.tolist() == [D] * 40
    expected = torch.stack([exact[m].mean(0).mean() for m in range(1, D + 1)])
    # Per observation the masks are i.i.d. uniform among C(D, M): population variances.
    exact_se = torch.stack(
        [exact[m].var(0, unbiased=False).sum().div(num_masks).sqrt() / 40 for m in range(1, D + 1)]
    )
    assert exact_se[-1] == 0  # one mask of size D
    torch.testing.assert_close(curve.scores[-1], expected[-1])
    assert ((curve.scores - expected).abs() <= 4 * exact_se + 1e-12).all()
    torch.testing.assert_close(curve.stderr[:-1], exact_se[:-1], rtol=0.15, atol=0)
    assert float(curve.stderr[-1]) == pytest.approx(0, abs=1e-12)
    # The area estimates the mean exact LML, within 4 of its exact standard errors.
    lml = float(log_marginal(model.model, x).mean())
    area_se = float(exact_se.pow(2).sum().sqrt())
    assert abs(curve.area - lml) <= 4 * area_se
    assert curve.area_stderr == pytest.approx(area_se, rel=0.15)
    torch.testing.assert_close(curve.observation_scores.mean(0), curve.scores)


def test_shared_masks_standard_errors_count_masks_not_observations(ppca):
    """With each mask shared by all observations the masks are the independent draws: the
    standard error is the spread over masks of the batch's mean score."""
    model, x, exact = ppca
    num_masks = 200
    curve = mpt_curve(model.model, x, rates=[0.2, 0.6], num_masks=num_masks, share_masks=True)
    assert curve.sizes[0].tolist() == [1, 3]
    torch.testing.assert_close(curve.rates, torch.tensor([0.2, 0.6]))
    for k, size in enumerate((1, 3)):
        batch_means = exact[size].mean(1)  # one value per mask
        exact_se = float(batch_means.std(unbiased=False)) / math.sqrt(num_masks)
        assert abs(float(curve.scores[k]) - float(batch_means.mean())) <= 4 * exact_se
        # The sample std over 200 masks has a relative spread of 1/sqrt(2 * 199) = 5%.
        assert float(curve.stderr[k]) == pytest.approx(exact_se, rel=0.2)


@pytest.mark.parametrize("share_masks", [False, True])
def test_the_area_over_uneven_rates_estimates_the_lml(ppca, share_masks):
    """The 99 default rates give the 5 sizes of D = 5 unevenly (29, 20, 20, 20, 10 times):
    D times the mean score over the rates weighs the score of one masked feature 29 / 19.8
    times too much, and the full mask's half as much as it should. The area weighs each
    size once, whatever its count of rates: it lies within 4 of
    its exact standard errors (from the enumeration) of the mean exact LML, where the
    rate-weighted mean lies far outside, and the reported standard error is those."""
    model, x, exact = ppca
    rates = default_rates()
    num_masks = 8
    curve = mpt_curve(model.model, x, rates=rates, num_masks=num_masks, share_masks=share_masks)
    counts = torch.bincount(curve.sizes[0], minlength=D + 1)[1:]
    assert counts.tolist() == [29, 20, 20, 20, 10]
    lml = float(log_marginal(model.model, x).mean())
    means = torch.stack([exact[m].mean() for m in range(1, D + 1)])
    # Each size's scores pool counts[m] * num_masks masks; the per-size means are independent.
    if share_masks:  # masks shared by the batch: the spread of the batch means over masks
        variance = torch.stack([exact[m].mean(1).var(unbiased=False) for m in range(1, D + 1)])
    else:
        variance = torch.stack(
            [exact[m].var(0, unbiased=False).mean() / len(x) for m in range(1, D + 1)]
        )
    area_se = float((variance / (counts * num_masks)).sum().sqrt())
    assert abs(curve.area - lml) <= 4 * area_se
    rate_weighted = float(D * (means[curve.sizes[0] - 1]).mean())
    assert abs(rate_weighted - lml) > 8 * area_se  # what the plain mean over rates estimates
    assert curve.area_stderr == pytest.approx(area_se, rel=0.35)


def test_area_weights_interpolate_the_sizes_no_rate_gives():
    from pyro_mpt.diagnostics.curve import area_weights

    # D = 8 from sizes 2 and 5: S(1) = S(2); S(3) = (2 S(2) + S(5)) / 3; S(4) = (S(2) + 2 S(5))
    # / 3; S(6..8) = S(5): S(2) counts 1 + 1 + 2/3 + 1/3 = 3 times, S(5) 1/3 + 2/3 + 1 + 3 = 5.
    torch.testing.assert_close(
        area_weights(torch.tensor([5, 2]), 8), torch.tensor([5.0, 3.0]).double()
    )
    # Repeats share their size's weight; every size once: all ones.
    torch.testing.assert_close(
        area_weights(torch.tensor([2, 2, 3]), 3), torch.tensor([1.0, 1.0, 1.0]).double()
    )
    torch.testing.assert_close(area_weights(torch.arange(1, 7), 6), torch.ones(6).double())


def test_rates_become_sizes_as_fixed_rate_rounds_them(ppca):
    model, x, _ = ppca
    curve = mpt_curve(model.model, x, rates=[0.1, 0.3, 0.5, 0.7, 1.0], num_masks=2)
    # max(1, round half up of r D): 0.5 -> 1, 1.5 -> 2, 2.5 -> 3, 3.5 -> 4, 5.
    assert curve.sizes[0].tolist() == [1, 2, 3, 4, 5]


def test_default_rates_are_the_paper_s_one_to_ninety_nine_percent():
    rates = default_rates()
    assert len(rates) == 99 and rates[0] == 0.01 and rates[-1] == 0.99
    torch.testing.assert_close(rates[1:] - rates[:-1], torch.full((98,), 0.01))


def test_log_marginal_of_models_matches_their_dense_covariance():
    for cls in (PPCA, FactorAnalysis):
        pyro.clear_param_store()  # PyroModule parameters live in the global param store
        model = cls(7, 3, init_scale=1.0, noise_scale=0.4)
        x = model.sample(20)
        dense = torch.distributions.MultivariateNormal(model.loc, model.covariance())
        torch.testing.assert_close(log_marginal(model.model, x), dense.log_prob(x))


def test_plot_mpt_curve_draws_the_area_in_the_legend():
    model = PPCA(6, 2)
    x = model.sample(20)
    curve = mpt_curve(model.model, x, num_masks=3)
    ax = plot_mpt_curve(curve, label="PPCA", log_marginal=-1.5)
    text = ax.get_legend().get_texts()[0].get_text()
    assert text == f"PPCA: area {curve.area:.2f} (log p(x) -1.50)"
    assert len(ax.lines) == 1


def test_plot_mpt_curve_draws_rates_given_in_any_order_as_one_line():
    # Rates given out of order were joined in that order: a zigzag.
    model = PPCA(6, 2)
    x = model.sample(20)
    curve = mpt_curve(model.model, x, rates=[0.9, 0.2, 0.5, 0.35], num_masks=3)
    xs, ys = plot_mpt_curve(curve).lines[0].get_data()
    order = curve.rates.argsort()
    assert list(xs) == sorted(xs) == (100 * curve.rates[order]).tolist()
    assert list(ys) == curve.scores[order].tolist()
    with pytest.raises(TypeError, match="curve must be an MPTCurve .* got Tensor"):
        plot_mpt_curve(curve.scores)
    with pytest.raises(TypeError, match="log_marginal must be a number, .* got 'high'"):
        plot_mpt_curve(curve, log_marginal="high")
    with pytest.raises(TypeError, match="ax must be a matplotlib axis, got str"):
        plot_mpt_curve(curve, ax="left")


def test_log_marginal_by_quadrature_matches_exact():
    from pyro_mpt.conditionals import Quadrature

    pyro.clear_param_store()
    model = PPCA(5, 2, init_scale=1.0, noise_scale=0.8)
    x = model.sample(6)
    exact = log_marginal(model.model, x)
    quad = log_marginal(model.model, x, conditionals=Quadrature(num_points=150))
    torch.testing.assert_close(quad, exact, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_masks=0), ValueError, r"num_masks must be at least 1, got 0"),
        (dict(num_masks=2.0), TypeError, r"num_masks must be a positive integer, got 2.0"),
        (dict(sizes=[2.7]), TypeError, r"sizes must be whole numbers .* got \[2.7\]"),
        (dict(sizes=[True]), TypeError, r"sizes must be whole numbers .* got \[True\]"),
    ],
)
def test_bad_curve_arguments_are_refused_by_name(ppca, kwargs, error, match):
    model, x, _ = ppca
    with pytest.raises(error, match=match):
        mpt_curve(model.model, x, **kwargs)
