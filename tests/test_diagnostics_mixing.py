"""``pyro_mpt.diagnostics.mixing_diagnostics`` against chains whose mixing is known."""

import warnings

import pytest
import torch

from pyro_mpt.diagnostics import Mixing, mixing_diagnostics


def _ar1(rho, num_chains, num_draws, seed):
    """Stationary AR(1) chains ``x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t``, ``x_0 ~ N(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(num_chains, num_draws, generator=gen, dtype=torch.float64)
    x = torch.empty_like(noise)
    x[:, 0] = noise[:, 0]
    scale = (1 - rho**2) ** 0.5
    for t in range(1, num_draws):
        x[:, t] = rho * x[:, t - 1] + scale * noise[:, t]
    return x


# ESS / (C N) -> (1 - rho) / (1 + rho) for an AR(1) chain. The estimator's spread, measured
# over 30 seeds at 4 chains of 2000 draws, is 3.4% (rho = 0), 4.6% (0.5) and 8% (0.8) of the
# limit; at 4 x 4000 draws it is sqrt(2) smaller. The tolerances are 4 of those spreads.
@pytest.mark.parametrize("rho, rel_tol", [(0.0, 0.10), (0.5, 0.13), (0.8, 0.30)])
@pytest.mark.parametrize("method", ["bulk", "mean"])
def test_ess_of_an_ar1_chain_matches_its_closed_form(rho, rel_tol, method):
    chains = _ar1(rho, 4, 4000, seed=int(10 * rho) + 1)
    d = mixing_diagnostics(chains, evaluations_per_step=3, method=method)
    expected = (1 - rho) / (1 + rho)
    assert float(d.ess_per_step) == pytest.approx(expected, rel=rel_tol)
    assert float(d.ess) == pytest.approx(16000 * float(d.ess_per_step), rel=1e-12)
    assert float(d.ess_per_evaluation) == pytest.approx(float(d.ess_per_step) / 3, rel=1e-12)
    assert (d.num_chains, d.num_draws, d.names) == (4, 4000, None)
    assert d.ess.shape == () and d.ess.dtype == torch.float64


def test_ess_orders_chains_by_autocorrelation():
    fast, slow = _ar1(0.2, 4, 1000, seed=3), _ar1(0.9, 4, 1000, seed=3)
    d = mixing_diagnostics(torch.stack([fast, slow], -1))
    assert d.ess.shape == (2,) and d.ess[0] > 3 * d.ess[1]


def test_rhat_is_near_one_for_iid_chains_and_far_above_for_stuck_chains():
    gen = torch.Generator().manual_seed(0)
    iid = torch.randn(4, 500, generator=gen, dtype=torch.float64)
    # Four chains stuck in different modes, 2 standard deviations apart.
    stuck = iid + torch.tensor([0.0, 2.0, 4.0, 6.0], dtype=torch.float64)[:, None]
    d = mixing_diagnostics({"iid": iid, "stuck": stuck})
    assert isinstance(d, Mixing) and d.names == ("iid", "stuck")
    assert abs(float(d.rhat[0]) - 1) < 0.01
    assert float(d.rhat[1]) > 2.0
    assert float(d.ess[1]) < 0.01 * float(d.ess[0])


def test_mixing_diagnostics_errors():
    with pytest.raises(ValueError, match="R-hat needs at least 2 chains"):
        mixing_diagnostics(torch.randn(1, 100))
    with pytest.raises(ValueError, match=r"shape \(chains, draws\) or"):
        mixing_diagnostics(torch.randn(100))
    with pytest.raises(ValueError, match="method must be one of"):
        mixing_diagnostics(torch.randn(2, 100), method="median")
    with pytest.raises(ValueError, match="evaluations_per_step must be a positive number"):
        mixing_diagnostics(torch.randn(2, 100), evaluations_per_step=0)
    with pytest.raises(TypeError, match="evaluations_per_step must be a positive number"):
        mixing_diagnostics(torch.randn(2, 100), evaluations_per_step="3")
    with pytest.raises(ValueError, match="same shape"):
        mixing_diagnostics({"a": torch.randn(2, 100), "b": torch.randn(2, 50)})
    with pytest.raises(ValueError, match="empty dict"):
        mixing_diagnostics({})


def test_a_chain_that_never_moves_has_no_effective_sample_size():
    # ArviZ counts every draw of constant chains as independent (ESS = C N); a stuck chain
    # is the worst mixing, not the best: NaN figures and a warning naming it.
    gen = torch.Generator().manual_seed(0)
    moving = torch.randn(4, 100, generator=gen, dtype=torch.float64)
    stuck = moving.clone()
    stuck[2] = 1.5
    match = r"statistic\(s\) \['stuck'\] never change within chain\(s\) \[2\]"
    with pytest.warns(RuntimeWarning, match=match):
        d = mixing_diagnostics({"moving": moving, "stuck": stuck})
    assert torch.isfinite(d.ess[0]) and torch.isnan(d.ess[1]) and torch.isnan(d.rhat[1])
    with pytest.warns(RuntimeWarning, match="never change"):
        d = mixing_diagnostics(torch.ones(4, 100))
    assert torch.isnan(d.ess) and torch.isnan(d.ess_per_step)


def test_non_finite_draws_are_refused_and_a_draws_first_array_warns():
    # One NaN left every figure NaN, and one inf gave a finite bulk ESS, with no word.
    chains = torch.randn(4, 200, generator=torch.Generator().manual_seed(0))
    for bad in (float("nan"), float("inf")):
        holed = chains.clone()
        holed[2, 17] = bad
        with pytest.raises(ValueError, match="samples holds 1 NaN or infinite draws"):
            mixing_diagnostics(holed)
    # Four chains of 200 draws passed draws first read as 200 chains of 4 draws.
    with pytest.warns(RuntimeWarning, match=r"200 chains of 4 draws .*movedim\(0, 1\)"):
        transposed = mixing_diagnostics(chains.T)
    assert float(transposed.ess) > 200  # what it reports: more than the draws there are
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        mixing_diagnostics(torch.randn(40, 50))  # many short chains, chains first: no word
