"""Chain-rule sums along random orderings (``ordering_log_likelihoods``) and their pure
helpers (``pyro_mpt.ops.orderings``): exact conditionals give log p(x) for every ordering
(closed-form Gaussian marginals, dense grids), missing entries give log p(x_observed), and
importance-sampled conditionals disagree across orderings by less as their samples grow. Long
because every model is written out beside its closed-form or grid reference."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch

import pyro_mpt
from experiments.zoo.cases import grid_1d, grid_2d, seeded
from experiments.zoo.references import mvn_log_prob, mvn_observed_log_prob
from pyro_mpt import OrderingLogLikelihoods, log_marginal, ordering_log_likelihoods
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature
from pyro_mpt.diagnostics import coherence
from pyro_mpt.models import PPCA, FactorAnalysis
from pyro_mpt.ops.orderings import (
    observed_steps,
    prefix_masks,
    random_orderings,
    select_steps,
    summarize_orderings,
)

# ---------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------


def test_random_orderings_are_permutations_with_missing_entries_last():
    entries = torch.tensor([[True, False, True, True, False], [False] * 5, [True] * 5])
    orderings = random_orderings(7, (3,), 5, entries=entries)
    assert orderings.shape == (7, 3, 5) and orderings.dtype == torch.long
    assert (orderings.sort(-1).values == torch.arange(5)).all()
    flags = observed_steps(orderings, entries)
    counts = entries.sum(-1)
    # Observed entries come first: the first counts[b] steps of every ordering are observed.
    assert (flags == (torch.arange(5) < counts.unsqueeze(-1))).all()
    assert observed_steps(orderings).all()


def test_random_orderings_are_uniform():
    """Each of the 4! orderings of 4 features appears 1/24 of the time, within 4.5 SE."""
    orderings = random_orderings(24_000, (), 4)
    codes = (orderings * torch.tensor([64, 16, 4, 1])).sum(-1)
    counts = torch.bincount(codes, minlength=256)
    counts = counts[counts > 0].double()
    assert counts.numel() == 24
    p = 1 / 24
    se = math.sqrt(24_000 * p * (1 - p))
    assert ((counts - 24_000 * p).abs() < 4.5 * se).all()


def test_prefix_masks_and_selected_steps_against_a_loop():
    orderings = random_orderings(3, (2,), 5)
    masks = prefix_masks(orderings)
    assert masks.shape == (3, 5, 2, 5)
    log_probs = torch.randn(3, 5, 2, 5)
    terms = select_steps(log_probs, orderings)
    for o in range(3):
        for b in range(2):
            order = orderings[o, b].tolist()
            for i in range(5):
                expected = torch.zeros(5, dtype=torch.bool)
                expected[order[i:]] = True  # the feature scored and those after it
                assert (masks[o, i, b] == expected).all()
                assert terms[o, i, b] == log_probs[o, i, b, order[i]]
    some = [1, 4]
    assert (prefix_masks(orderings, some) == masks[:, some]).all()
    assert (select_steps(log_probs[:, some], orderings, some) == terms[:, some]).all()
    assert (prefix_masks(orderings, slice(2, 4)) == masks[:, 2:4]).all()


def test_summary_against_numpy_and_the_spread_of_sample_deviations():
    values = torch.randn(10, 3)
    mean, spread, spread_se = summarize_orderings(values)
    assert torch.allclose(mean, torch.from_numpy(values.numpy().mean(0)))
    assert torch.allclose(spread, torch.from_numpy(values.numpy().std(0, ddof=1)))
    # The standard error matches the spread of sample deviations over many replicates.
    with seeded(3):
        draws = 2.0 * torch.randn(40, 4000)
    _, spreads, ses = summarize_orderings(draws)
    assert abs(ses.mean() / spreads.std() - 1) < 0.1
    one = summarize_orderings(values[:1])
    assert torch.isnan(one[1]).all() and torch.isnan(one[2]).all()
    two = summarize_orderings(values[:2])
    assert torch.isfinite(two[1]).all() and torch.isnan(two[2]).all()


@pytest.mark.parametrize("num_orderings", [4, 8])
@pytest.mark.parametrize("family", ["normal", "exponential"])
def test_the_spread_s_standard_error_is_not_short_with_few_orderings(num_orderings, family):
    """Over 20000 replicates, the root mean square of the standard error is at least the
    true spread of the sample deviations (less 5%, several standard errors of that
    spread's own estimate), and not above 1.35 times it: a few orderings are the common case, where
    a fourth-moment formula fell 1.4 to 2.5 times short."""
    with seeded(5):
        draws = torch.randn(num_orderings, 20000, dtype=torch.float64)
        if family == "exponential":
            draws = torch.distributions.Exponential(1.0).sample(draws.shape).double()
    _, spreads, ses = summarize_orderings(draws)
    ratio = float(ses.pow(2).mean().sqrt() / spreads.std())
    assert 0.95 < ratio < 1.35
    constant = summarize_orderings(torch.ones(4, 2))
    assert (constant[1] == 0).all() and (constant[2] == 0).all()


def test_from_values_and_summary():
    values = torch.tensor([[1.0, 2.0], [3.0, 2.0], [2.0, 2.0]])
    result = OrderingLogLikelihoods.from_values(values, torch.tensor([2.5, 2.0]))
    assert torch.allclose(result.gap, torch.tensor([-0.5, 0.0]))
    s = result.summary()
    assert s["num_orderings"] == 3 and s["num_observations"] == 2
    assert s["mean"] == pytest.approx(2.0) and s["spread"] == pytest.approx(0.5)
    assert s["max_spread"] == pytest.approx(1.0) and s["gap"] == pytest.approx(-0.25)
    assert s["mean_se"] == pytest.approx(1 / (2 * math.sqrt(3)))
    assert "not coherent" in result.describe()
    assert OrderingLogLikelihoods.from_values(values).summary()["gap"] is None
    with pytest.raises(ValueError, match=r"log_marginal must have the batch shape \(2,\)"):
        OrderingLogLikelihoods.from_values(values, torch.zeros(3))
    with pytest.raises(ValueError, match="leading dim of orderings"):
        OrderingLogLikelihoods.from_values(torch.tensor(1.0))


# ---------------------------------------------------------------------------------------
# Exact conditionals: every ordering gives log p(x)
# ---------------------------------------------------------------------------------------


def _random_linear_gaussian(cls, seed, num_features=6, latent_dim=2):
    pyro.clear_param_store()  # PyroModules share parameters by name
    with seeded(seed):
        model = cls(num_features, latent_dim, noise_scale=0.6)
        with torch.no_grad():
            model.weight.copy_(torch.randn(num_features, latent_dim))
            model.loc.copy_(torch.randn(num_features))
            model.noise_scale.copy_(0.3 + torch.rand(model.noise_scale.shape))
        x = model.sample(12)
    return model, x


@pytest.mark.parametrize("cls", [PPCA, FactorAnalysis])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_ordering_of_a_linear_gaussian_model_gives_its_log_marginal(cls, seed):
    model, x = _random_linear_gaussian(cls, seed)
    pyro.set_rng_seed(seed)
    result = ordering_log_likelihoods(model.model, x, num_orderings=6, conditionals="exact")
    reference = mvn_log_prob(x, model.loc.detach(), model.covariance().detach())
    assert result.values.shape == (6, 12)
    assert (result.values - reference).abs().max() < 1e-9
    assert (result.values - log_marginal(model.model, x)).abs().max() < 1e-9
    assert (result.gap.abs() < 1e-9).all() and (result.spread < 1e-9).all()
    assert "coherent conditionals" in result.describe()


def _hierarchical_case(seed):
    """``z1 ~ N(0, I_2)``, ``z2 ~ N(A z1 + c, s^2 I_3)``, ``x ~ N(W z2 + b, diag(psi))``:
    Gaussian with mean ``W c + b`` and covariance ``W (A A^T + s^2 I) W^T + diag(psi)``."""
    with seeded(seed):
        a, c = torch.randn(3, 2), torch.randn(3)
        w, b = torch.randn(5, 3), torch.randn(5)
        psi = 0.2 + torch.rand(5)
        s = 0.7
        mean = w @ c + b
        cov = w @ (a @ a.T + s**2 * torch.eye(3)) @ w.T + torch.diag(psi)
        x = torch.distributions.MultivariateNormal(mean, cov).sample((10,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            z2 = pyro.sample("z2", dist.Normal(z1 @ a.T + c, s).to_event(1))
            pyro.sample("x", dist.Normal(z2 @ w.T + b, psi.sqrt()).to_event(1), obs=x)

    return model, x, mean, cov


@pytest.mark.parametrize("seed", [0, 1])
def test_every_ordering_of_a_hierarchical_linear_gaussian_model_is_exact(seed):
    model, x, mean, cov = _hierarchical_case(seed)
    pyro.set_rng_seed(10 + seed)
    result = ordering_log_likelihoods(model, x, num_orderings=5, conditionals=Exact())
    assert (result.values - mvn_log_prob(x, mean, cov)).abs().max() < 1e-9
    assert (result.values - log_marginal(model, x)).abs().max() < 1e-9


def test_chunks_of_steps_give_the_same_sums(monkeypatch):
    """With room for fewer masks than one ordering has steps, the steps are split across
    calls; the sums stay exact."""
    model, x, mean, cov = _hierarchical_case(3)
    # Room for two masks: a mask costs the data's size times the 5 latent dims (2 + 3).
    monkeypatch.setattr(coherence, "_CHUNK_ELEMENTS", 2 * x.numel() * 5)
    calls = []
    prepare = Exact.prepare

    def counting_prepare(self, *args):
        prepared = prepare(self, *args)
        log_prob = prepared.log_prob
        prepared.log_prob = lambda masks: calls.append(masks.shape[0]) or log_prob(masks)
        return prepared

    monkeypatch.setattr(Exact, "prepare", counting_prepare)
    result = ordering_log_likelihoods(model, x, num_orderings=3, conditionals="exact")
    assert max(calls) == 2 and sum(calls) == 3 * 5
    assert (result.values - mvn_log_prob(x, mean, cov)).abs().max() < 1e-9


# ---------------------------------------------------------------------------------------
# Quadrature: every ordering gives the rule's log p(x), close to a dense grid
# ---------------------------------------------------------------------------------------


def test_quadrature_orderings_of_a_one_dimensional_latent_bernoulli_model():
    with seeded(4):
        w, b = 1.5 * torch.randn(7), 0.5 * torch.randn(7)
        z = torch.randn(9, 1)
        x = torch.bernoulli(torch.sigmoid(z * w + b))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Bernoulli(logits=z.unsqueeze(-1) * w + b).to_event(1), obs=x)

    def log_lik(t):  # (G, 1) -> (G, N)
        logits = (t * w + b).unsqueeze(1)  # (G, 1, D)
        return dist.Bernoulli(logits=logits).log_prob(x).sum(-1)

    reference = grid_1d(log_lik)
    result = ordering_log_likelihoods(
        model, x, num_orderings=6, conditionals=Quadrature(num_points=100)
    )
    # Coherent for the rule: every ordering gives the rule's own log p(x) ...
    assert (result.values - result.log_marginal).abs().max() < 1e-9
    # ... which is the grid's log p(x) to the rule's accuracy.
    assert (result.values - reference).abs().max() < 1e-6


def test_quadrature_orderings_of_a_two_dimensional_latent_bernoulli_model():
    with seeded(5):
        w, b = torch.randn(6, 2), 0.5 * torch.randn(6)
        z = torch.randn(7, 2)
        x = torch.bernoulli(torch.sigmoid(z @ w.T + b))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ w.T + b).to_event(1), obs=x)

    def log_lik(t):  # (G, 2) -> (G, N)
        logits = (t @ w.T + b).unsqueeze(1)
        return dist.Bernoulli(logits=logits).log_prob(x).sum(-1)

    reference = grid_2d(log_lik)
    result = ordering_log_likelihoods(
        model, x, num_orderings=4, conditionals=Quadrature(num_points=40)
    )
    assert (result.values - result.log_marginal).abs().max() < 1e-9
    assert (result.values - reference).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------
# Missing entries: orderings over the observed entries give log p(x_observed)
# ---------------------------------------------------------------------------------------


def _missing_case(form):
    with seeded(8):
        weight, bias = torch.randn(5, 2), torch.randn(5)
        cov = weight @ weight.T + 0.5 * torch.eye(5)
        x = torch.distributions.MultivariateNormal(bias, cov).sample((8,))
        observed = torch.rand(8, 5) > 0.35
    observed[0] = True
    observed[2] = False  # nothing observed: log p = 0
    x = torch.where(observed, x, 100.0)  # values at missing entries must not matter

    def obs_mask_model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = (z @ weight.T).squeeze(-2) + bias
            with pyro.plate("features", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Normal(loc, 0.5**0.5), obs=x, obs_mask=observed)

    def poutine_mask_model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = (z @ weight.T).squeeze(-2) + bias
            with pyro.plate("features", x.shape[-1], dim=-1), poutine.mask(mask=observed):
                pyro.sample("x", dist.Normal(loc, 0.5**0.5), obs=x)

    model = {"obs_mask": obs_mask_model, "poutine_mask": poutine_mask_model}[form]
    return model, x, observed, bias, cov


@pytest.mark.parametrize("form", ["obs_mask", "poutine_mask"])
def test_orderings_over_observed_entries_give_their_marginal(form):
    model, x, observed, bias, cov = _missing_case(form)
    result = ordering_log_likelihoods(model, x, num_orderings=5, conditionals="exact")
    reference = mvn_observed_log_prob(x, observed, bias, cov)
    assert (result.values - reference).abs().max() < 1e-9
    assert (result.values[:, 2] == 0).all()


# ---------------------------------------------------------------------------------------
# Importance sampling: orderings disagree, by less as the samples grow
# ---------------------------------------------------------------------------------------


def _importance_case():
    with seeded(6):
        w, b = torch.randn(6), torch.randn(6)
        x = torch.randn(16, 1) * w + b + 0.4 * torch.randn(16, 6)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) * w + b, 0.4).to_event(1), obs=x)

    def guide(x):  # a wide proposal that ignores the data: poor, but valid
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(x.new_zeros(x.shape[:-1]), 1.5))

    return model, guide, x


def test_importance_spread_is_positive_and_shrinks_with_more_samples():
    model, guide, x = _importance_case()
    exact = log_marginal(model, x)
    spreads = {}
    for num_samples in (8, 512):
        pyro.set_rng_seed(num_samples)
        result = ordering_log_likelihoods(
            model, x, guide=guide, num_orderings=24, conditionals=ImportanceSampling(num_samples)
        )
        s = result.summary()
        spreads[num_samples] = s
        assert s["spread"] > 4 * s["spread_se"]
        assert "not coherent" in result.describe()
    # The error falls like 1/sqrt(S): 8 times from S=8 to S=512; ask for 3 times, beyond the
    # standard errors.
    small, large = spreads[8], spreads[512]
    assert large["spread"] + 4 * large["spread_se"] < (small["spread"] - 4 * small["spread_se"]) / 3
    assert large["gap"] is not None
    # The mean over orderings approaches log p(x) too.
    result = ordering_log_likelihoods(
        model, x, guide=guide, num_orderings=24, conditionals=ImportanceSampling(512)
    )
    assert (result.mean - exact).abs().mean() < 0.1


def test_importance_leaves_the_param_store_as_found():
    model, _, x = _importance_case()

    def guide(x):
        loc = pyro.param("loc", torch.zeros(x.shape[-2]))
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(loc, 1.5))

    pyro.clear_param_store()
    ordering_log_likelihoods(model, x, guide=guide, num_orderings=2, conditionals="importance")
    assert list(pyro.get_param_store().keys()) == []


# ---------------------------------------------------------------------------------------
# Arguments, exports and progress
# ---------------------------------------------------------------------------------------


def test_bad_arguments_name_the_argument_and_value():
    ppca = PPCA(num_features=4, latent_dim=1)
    x = ppca.sample(3)
    with pytest.raises(ValueError, match=r"num_orderings must be at least 1, got 0\..*e\.g\."):
        ordering_log_likelihoods(ppca.model, x, num_orderings=0)
    with pytest.raises(TypeError, match=r"num_orderings must be a positive integer, got 2\.5"):
        ordering_log_likelihoods(ppca.model, x, num_orderings=2.5)
    with pytest.raises(ValueError, match=r"conditionals='nope' is not a known strategy"):
        ordering_log_likelihoods(ppca.model, x, conditionals="nope")


def test_one_ordering_and_exports(capsys):
    ppca = PPCA(num_features=4, latent_dim=1)
    x = ppca.sample(3)
    result = ordering_log_likelihoods(ppca.model, x, num_orderings=1, progress=True)
    assert result.values.shape == (1, 3) and torch.isnan(result.spread).all()
    assert "one ordering shows no spread" in result.describe()
    assert "orderings" in capsys.readouterr().err  # the progress bar
    for name in ("ordering_log_likelihoods", "OrderingLogLikelihoods"):
        assert name in pyro_mpt.__all__ and name in pyro_mpt.diagnostics.__all__


def test_values_follow_the_data_dtype():
    ppca = PPCA(num_features=4, latent_dim=1).float()
    x = ppca.sample(3).float()
    result = ordering_log_likelihoods(ppca.model, x, num_orderings=2)
    assert result.values.dtype == torch.float32 and result.values.device == x.device
    # float32 rounding is not called incoherence.
    assert "coherent conditionals" in result.describe()
    assert np.isfinite(result.values.cpu().numpy()).all()
