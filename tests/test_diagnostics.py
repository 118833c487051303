"""The MPT curve and the exact log-marginal likelihood evaluator."""

import math

import matplotlib

matplotlib.use("Agg")

import pyro  # noqa: E402
import torch  # noqa: E402

from pyro_mpt import MPTCurve, log_marginal, mpt_curve, plot_mpt_curve  # noqa: E402
from pyro_mpt.models import PPCA, FactorAnalysis  # noqa: E402


def test_log_marginal_of_models_matches_their_dense_covariance():
    for cls in (PPCA, FactorAnalysis):
        pyro.clear_param_store()  # PyroModule parameters live in the global param store
        model = cls(7, 3, init_scale=1.0, noise_scale=0.4)
        x = model.sample(20)
        dense = torch.distributions.MultivariateNormal(model.loc, model.covariance())
        torch.testing.assert_close(log_marginal(model.model, x), dense.log_prob(x))


def test_curve_area_over_every_size_estimates_the_lml():
    model = PPCA(10, 2, init_scale=1.0, noise_scale=0.5)
    x = model.sample(200)
    exact = log_marginal(model.model, x).mean().item()
    curve = mpt_curve(model.model, x, num_masks=20)
    assert isinstance(curve, MPTCurve)
    assert curve.sizes.tolist() == list(range(1, 11)) and curve.num_features == 10
    torch.testing.assert_close(curve.area, float(curve.scores.sum()))
    # The area is a sum of independent per-size means: its standard error adds in quadrature.
    stderr = math.sqrt(float((curve.stderr**2).sum()))
    assert abs(curve.area - exact) < 4 * stderr + 1e-9
    # A trained-looking model predicts better from more context: S decreases with M.
    assert curve.scores[0] > curve.scores[-1]


def test_curve_with_rates_and_shared_masks():
    model = PPCA(20, 2, init_scale=1.0)
    x = model.sample(30)
    curve = mpt_curve(model.model, x, rates=[0.15, 0.5, 0.85], num_masks=5, share_masks=True)
    assert curve.sizes.tolist() == [3, 10, 17]
    torch.testing.assert_close(curve.rates, torch.tensor([0.15, 0.5, 0.85], dtype=torch.float64))
    assert torch.isfinite(curve.scores).all() and torch.isfinite(curve.stderr).all()


def test_plot_mpt_curve_draws_the_area_in_the_legend():
    model = PPCA(6, 2)
    x = model.sample(20)
    curve = mpt_curve(model.model, x, num_masks=3)
    ax = plot_mpt_curve(curve, label="PPCA", log_marginal=-1.5)
    text = ax.get_legend().get_texts()[0].get_text()
    assert text.startswith("PPCA: area") and "log p(x) -1.50" in text
    assert len(ax.lines) == 1


def test_log_marginal_by_quadrature_matches_exact():
    from pyro_mpt.conditionals import Quadrature

    pyro.clear_param_store()
    model = PPCA(5, 2, init_scale=1.0, noise_scale=0.8)
    x = model.sample(6)
    exact = log_marginal(model.model, x)
    quad = log_marginal(model.model, x, conditionals=Quadrature(num_points=150))
    torch.testing.assert_close(quad, exact, atol=1e-6, rtol=0)
