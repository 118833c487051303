"""impute: draws of missing entries against closed forms and brute-force integrals.

Over 300 lines because it checks the draws of every strategy (exact, quadrature, importance,
encode-decode), each against its own reference, and the errors.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoDiagonalNormal, AutoMultivariateNormal

from pyro_mpt import gibbs, impute
from pyro_mpt.conditionals import EncodeDecode, ImportanceSampling, Quadrature
from pyro_mpt.errors import ImportanceAccuracyWarning, QuadratureAccuracyWarning
from pyro_mpt.models import PPCA, LinearVAE

NUM_SE = 4.5


def _gaussian_conditional(cov, loc, x, missing):
    """Mean and covariance of ``x_S | x_R`` under ``N(loc, cov)`` by the dense Schur
    complement."""
    s, r = missing.nonzero().squeeze(-1), (~missing).nonzero().squeeze(-1)
    gain = cov[s][:, r] @ torch.linalg.inv(cov[r][:, r])
    mean = loc[s] + gain @ (x[r] - loc[r])
    return mean, cov[s][:, s] - gain @ cov[r][:, s]


def _check_gaussian_draws(draws, mean, cov):
    """Sample mean and covariance of ``draws`` (n, d) within NUM_SE standard errors."""
    n = draws.shape[0]
    var = cov.diagonal()
    assert ((draws.mean(0) - mean).abs() <= NUM_SE * (var / n).sqrt()).all()
    cov_se = ((var[:, None] * var[None, :] + cov**2) / n).sqrt()
    assert ((torch.cov(draws.T) - cov).abs() <= NUM_SE * cov_se).all()


def _ppca():
    ppca = PPCA(6, 2, init_scale=1.0, noise_scale=0.4)
    ppca.loc = torch.linspace(-1.0, 1.0, 6)
    return ppca


def test_exact_matches_gaussian_conditional():
    ppca = _ppca()
    x = ppca.sample(3)
    missing = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool
    )
    draws = impute(ppca.model, x, missing=missing, num_samples=20000, conditionals="exact")
    assert draws.shape == (20000, 3, 6)
    assert torch.equal(draws[:, ~missing], x[~missing].expand(20000, -1))
    cov, loc = ppca.covariance().detach(), ppca.loc.detach()
    for i in range(3):
        mean, block = _gaussian_conditional(cov, loc, x[i], missing[i])
        _check_gaussian_draws(draws[:, i][:, missing[i]], mean, block)


def test_exact_dense_multivariate_normal():
    cov = torch.tensor([[2.0, 1.2, 0.5, 0.1], [1.2, 1.5, 0.3, 0.2], [0.5, 0.3, 1.0, 0.6],
                        [0.1, 0.2, 0.6, 0.8]])  # fmt: skip
    loc = torch.tensor([0.5, -1.0, 0.0, 2.0])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(loc, cov), obs=x)

    x = torch.tensor([[1.0, 0.0, -1.0, 2.5], [0.0, 0.5, 1.0, 1.0]])
    missing = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    draws = impute(model, x, missing=missing, num_samples=20000, conditionals="exact")
    for i in range(2):
        mean, block = _gaussian_conditional(cov, loc, x[i], missing[i])
        _check_gaussian_draws(draws[:, i][:, missing[i]], mean, block)


def test_missing_broadcasts_over_observations():
    ppca = _ppca()
    x = ppca.sample(4)
    missing = torch.tensor([True, False, False, False, False, True])
    draws = impute(ppca.model, x, missing=missing, num_samples=2)
    assert draws.shape == (2, 4, 6)
    assert torch.equal(draws[:, :, 1:5], x[:, 1:5].expand(2, 4, 4))
    assert not torch.equal(draws[0, :, 0], draws[1, :, 0])


# A 1-D latent with strong loadings: the features depend on one another.
LOADING = torch.tensor([2.5, 2.0, -1.5, 1.0, 3.0])
BIAS = torch.tensor([0.0, 0.5, -0.5, 0.3, -1.0])


def bernoulli_model(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        logits = z.unsqueeze(-1) * LOADING + BIAS
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def poisson_model(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        rate = (0.5 * z.unsqueeze(-1) * LOADING + 0.2 * BIAS).exp()
        pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)


def _grid_joint(likelihood, x, missing, values):
    """``p(x_a = u, x_b = v | x_R)`` for the two missing features ``a < b`` by a fine
    trapezoid grid over the latent."""
    z = torch.linspace(-9.0, 9.0, 8001)
    log_prior = dist.Normal(0.0, 1.0).log_prob(z)
    fn = likelihood(z.unsqueeze(-1))
    log_context = (fn.log_prob(x) * (~missing)).sum(-1)
    a, b = missing.nonzero().squeeze(-1).tolist()
    post = (log_prior + log_context).softmax(0)
    table = torch.empty(len(values), len(values))
    for i, u in enumerate(values):
        for j, v in enumerate(values):
            table[i, j] = (post * fn.log_prob(torch.tensor(u)).exp()[:, a]
                           * fn.log_prob(torch.tensor(v)).exp()[:, b]).sum()  # fmt: skip
    return table


@pytest.mark.parametrize(
    "model, likelihood, x, values",
    [
        (
            bernoulli_model,
            lambda z: dist.Bernoulli(logits=z * LOADING + BIAS),
            torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0]]),
            [0.0, 1.0],
        ),
        (
            poisson_model,
            lambda z: dist.Poisson((0.5 * z * LOADING + 0.2 * BIAS).exp()),
            torch.tensor([[2.0, 0.0, 1.0, 1.0, 3.0], [0.0, 1.0, 0.0, 2.0, 0.0]]),
            [0.0, 1.0, 2.0],
        ),
    ],
    ids=["bernoulli", "poisson"],
)
def test_quadrature_joint_of_two_features_matches_grid(model, likelihood, x, values):
    missing = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    n = 30000
    draws = impute(model, x, missing=missing, num_samples=n, conditionals=Quadrature(130))
    for i in range(2):
        table = _grid_joint(likelihood, x[i], missing[i], values)
        a, b = missing[i].nonzero().squeeze(-1).tolist()
        pair = draws[:, i, [a, b]]
        for p, u in enumerate(values):
            for q, v in enumerate(values):
                freq = ((pair[:, 0] == u) & (pair[:, 1] == v)).double().mean()
                se = math.sqrt(table[p, q] * (1 - table[p, q]) / n) + 1e-4
                assert abs(freq - table[p, q]) <= NUM_SE * se, (i, u, v, freq, table[p, q])
        # The two features are drawn jointly: their joint is not the product of marginals,
        # by far more than the Monte Carlo error (a product sampler fails here).
        if len(values) == 2:
            both = (pair == 1).all(-1).double().mean()
            product = (pair[:, 0] == 1).double().mean() * (pair[:, 1] == 1).double().mean()
            assert abs(both - product) > 3 * NUM_SE * math.sqrt(0.25 / n)


def _narrow_posterior_model(x):
    # Eight features with noise 0.1: p(z | x_R) is far narrower than the prior.
    weight = torch.tensor([1.5, -2.0, 0.7, 3.0, 1.0, 2.0, -1.0, 0.5], dtype=x.dtype)
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        pyro.sample("x", dist.Normal(z[..., None] * weight, 0.1).to_event(1), obs=x)


def test_a_coarse_quadrature_rule_warns_where_its_draws_are_off():
    # Twenty nodes under the prior miss p(z | x_R): the draws of x_0 are off by many
    # standard errors, and impute and gibbs say so, as log_marginal does (they used not to).
    weight = torch.tensor([1.5, -2.0, 0.7, 3.0, 1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    cov = torch.outer(weight, weight) + 0.01 * torch.eye(8, dtype=torch.float64)
    x = torch.distributions.MultivariateNormal(torch.zeros(8, dtype=torch.float64), cov).sample(
        (2,)
    )
    missing = torch.zeros(2, 8, dtype=torch.bool)
    missing[:, 0] = True
    n = 4000
    with pytest.warns(QuadratureAccuracyWarning, match="impute"):
        draws = impute(
            _narrow_posterior_model, x, missing=missing, num_samples=n, conditionals="quadrature"
        )
    off = 0
    for i in range(2):
        mean, block = _gaussian_conditional(
            cov, torch.zeros(8, dtype=torch.float64), x[i], missing[i]
        )
        off = max(off, ((draws[:, i, 0].mean() - mean[0]).abs() / (block[0, 0] / n).sqrt()).item())
    assert off > NUM_SE  # the warning is warranted
    with pytest.warns(QuadratureAccuracyWarning, match="gibbs"):
        gibbs(
            _narrow_posterior_model,
            x,
            block_size=1,
            num_steps=1,
            conditionals="quadrature",
            progress=False,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        impute(
            _narrow_posterior_model,
            x,
            missing=missing,
            conditionals="quadrature",
            check_rule=False,
        )


def test_the_rule_check_of_impute_ignores_the_values_at_the_entries_to_draw():
    # Those values are ignored by the draws, so they must not move the check either: a
    # placeholder of 30 made log p(x) of the full data move by 25 nats under refinement,
    # and impute warned, while its draws were as accurate as with 0 there.
    weight = torch.tensor([[1.5], [1.0], [-1.2], [0.8]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.6).to_event(1), obs=x)

    cov = weight @ weight.T + 0.36 * torch.eye(4, dtype=torch.float64)
    x = torch.distributions.MultivariateNormal(torch.zeros(4, dtype=torch.float64), cov).sample(
        (6,)
    )
    missing = torch.zeros(6, 4, dtype=torch.bool)
    missing[:, :2] = True
    n = 4000
    for fill in (0.0, 30.0):
        given = torch.where(missing, torch.full_like(x, fill), x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", QuadratureAccuracyWarning)
            draws = impute(
                model, given, missing=missing, num_samples=n, conditionals=Quadrature(60)
            )
        for i in range(6):
            mean, block = _gaussian_conditional(
                cov, torch.zeros(4, dtype=torch.float64), x[i], missing[i]
            )
            se = (block.diagonal() / n).sqrt()
            assert ((draws[:, i, :2].mean(0) - mean).abs() <= NUM_SE * se).all()


def test_a_rule_that_draws_many_hidden_entries_from_too_few_nodes_warns():
    """Two visible entries and 28 hidden Bernoulli(sigmoid(2 z)) ones: 20 nodes score the
    visible entries well but draw the hidden ones jointly from a few nodes, so the count
    of hidden ones is a comb, off its distribution (a grid over z) by many standard
    errors. The check on the observations the draws complete says so; 100 nodes pass it,
    and their draws are within 4.5 standard errors."""
    num_features, num_samples, slope = 30, 20000, 2.0

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            logits = (slope * z).unsqueeze(-1).expand(z.shape + (num_features,))
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    x = torch.zeros(1, num_features, dtype=torch.float64)
    x[0, 0] = 1.0
    missing = torch.ones(1, num_features, dtype=torch.bool)
    missing[0, :2] = False
    z = torch.linspace(-12, 12, 40001, dtype=torch.float64)[:, None]
    visible = dist.Bernoulli(logits=slope * z).log_prob(torch.tensor([1.0, 0.0])).sum(-1)
    posterior = torch.softmax(visible + dist.Normal(0.0, 1.0).log_prob(z[:, 0]), 0)
    counts = torch.arange(num_features - 1, dtype=torch.float64)
    binomial = dist.Binomial(num_features - 2, logits=slope * z).log_prob(counts).exp()
    reference = posterior @ binomial  # p(number of hidden ones | x_R)

    def worst_z(draws):
        found = torch.bincount(draws[:, 0, 2:].sum(-1).long(), minlength=num_features - 1)
        frequency = found.double() / num_samples
        return (
            ((frequency - reference) / (reference * (1 - reference) / num_samples).sqrt())
            .abs()
            .max()
        )

    pyro.set_rng_seed(1)
    with pytest.warns(QuadratureAccuracyWarning, match="its own draws of x_S"):
        coarse = impute(
            model, x, missing=missing, num_samples=num_samples, conditionals=Quadrature(20)
        )
    assert worst_z(coarse) > 2 * NUM_SE  # the warning is due
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        fine = impute(
            model, x, missing=missing, num_samples=num_samples, conditionals=Quadrature(100)
        )
    assert worst_z(fine) < NUM_SE


@pytest.mark.parametrize("function", ["impute", "gibbs"])
def test_quadrature_at_the_guide_is_refused_for_draws(function):
    # The guide reads the whole data, the entries to draw too: nodes at its q(z | x) would
    # make the draws depend on values impute and gibbs ignore.
    vae = LinearVAE(5, 1)
    x = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 1.0]])
    rule = Quadrature(40, center="guide")
    # Refused before the rule checks itself: no run is spent on it, and no warning comes first.
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"center='guide'.*Quadrature\(num_points=...\)"),
    ):
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        if function == "impute":
            missing = torch.tensor([1, 1, 0, 0, 0], dtype=torch.bool)
            impute(vae.model, x, missing=missing, conditionals=rule, guide=vae.guide)
        else:
            gibbs(
                vae.model,
                x,
                block_size=1,
                num_steps=1,
                conditionals=rule,
                guide=vae.guide,
                progress=False,
            )


@pytest.mark.parametrize("autoguide", [AutoDiagonalNormal, AutoMultivariateNormal])
def test_importance_draws_weigh_each_observation_by_its_block_of_a_joint_autoguide(autoguide):
    # An AutoContinuous guide draws every observation's latents as one vector; each
    # observation's weight takes its own block's density (the joint one made the weights
    # heavy-tailed: a warning on every call and draws off by ~5 standard errors).
    weight, noise = torch.tensor([1.0, -0.8, 0.6, 1.2], dtype=torch.float64), 0.5

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            pyro.sample("x", dist.Normal(z[..., None] * weight, noise).to_event(1), obs=x)

    generator = torch.Generator().manual_seed(0)
    z = torch.randn(12, 1, generator=generator, dtype=torch.float64)
    x = z * weight + noise * torch.randn(12, 4, generator=generator, dtype=torch.float64)
    missing = torch.zeros(12, 4, dtype=torch.bool)
    missing[:, 0] = True
    # The guide at the exact posterior of z given the whole x: a proposal for p(z | x_R).
    precision = 1 + (weight**2).sum() / noise**2
    pyro.clear_param_store()
    guide = autoguide(model)
    guide(x)
    with torch.no_grad():
        guide.loc.copy_((x @ weight) / noise**2 / precision)
        guide.scale = torch.full((12,), precision.rsqrt().item(), dtype=torch.float64)
    n = 4000
    pyro.set_rng_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportanceAccuracyWarning)
        draws = impute(
            model,
            x,
            missing=missing,
            num_samples=n,
            conditionals=ImportanceSampling(256),
            guide=guide,
        )
    cov = torch.outer(weight, weight) + noise**2 * torch.eye(4, dtype=torch.float64)
    for i in range(12):
        mean, block = _gaussian_conditional(
            cov, torch.zeros(4, dtype=torch.float64), x[i], missing[i]
        )
        # Resampling 256 proposals: an effective sample size of at least 64 is assumed.
        se = (block[0, 0] / 64).sqrt()
        assert (draws[:, i, 0].mean() - mean[0]).abs() <= NUM_SE * se


def test_importance_resampling_converges_to_exact():
    ppca = _ppca()
    x = ppca.sample(2)
    missing = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    n = 4000
    draws = impute(
        ppca.model,
        x,
        missing=missing,
        num_samples=n,
        conditionals=ImportanceSampling(num_samples=4000),
        guide=ppca.guide,  # zero encoder weights: q(z | x) is the prior, a broad proposal
    )
    assert torch.equal(draws[:, ~missing], x[~missing].expand(n, -1))
    cov, loc = ppca.covariance().detach(), ppca.loc.detach()
    for i in range(2):
        mean, block = _gaussian_conditional(cov, loc, x[i], missing[i])
        se = (block.diagonal() / n).sqrt()
        # Resampling 4000 proposals adds a little bias and duplicates: a looser bound.
        assert ((draws[:, i][:, missing[i]].mean(0) - mean).abs() <= 2 * NUM_SE * se).all()


def test_encode_decode_chain_draws_missing_entries():
    vae = LinearVAE(5, 2)
    x = torch.bernoulli(torch.full((3, 5), 0.5))
    missing = torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)
    draws = impute(
        vae.model,
        x,
        missing=missing,
        num_samples=50,
        conditionals=EncodeDecode(num_iterations=3),
        guide=vae.guide,
    )
    assert draws.shape == (50, 3, 5)
    assert torch.equal(draws[:, :, ~missing], x[:, ~missing].expand(50, 3, 3))
    assert set(draws[:, :, missing].unique().tolist()) == {0.0, 1.0}  # drawn, not means


def test_encode_decode_refill_option():
    assert repr(EncodeDecode(refill="sample")).endswith("refill='sample')")
    with pytest.raises(ValueError, match="refill must be 'mean' or 'sample', got 'mode'"):
        EncodeDecode(refill="mode")


def test_encode_decode_sampled_refill_scores_masks():
    vae = LinearVAE(5, 2)
    x = torch.bernoulli(torch.full((3, 5), 0.5))
    masks = torch.zeros(2, 3, 5, dtype=torch.bool)
    masks[:, :, :2] = True
    for refill in ("mean", "sample"):
        prepared = EncodeDecode(num_iterations=2, refill=refill).prepare(
            vae.model, vae.guide, (x,), {}
        )
        assert torch.isfinite(prepared.log_prob(masks)).all()


def test_errors_name_argument_value_and_fix():
    ppca = _ppca()
    x = ppca.sample(3)
    good = torch.zeros(3, 6, dtype=torch.bool)
    good[0, 0] = True
    with pytest.raises(TypeError, match=r"missing must be a boolean tensor.*torch\.float64"):
        impute(ppca.model, x, missing=good.double())
    with pytest.raises(TypeError, match="missing must be a boolean tensor.*list"):
        impute(ppca.model, x, missing=[[True]])
    with pytest.raises(ValueError, match=r"missing has no True entry \(shape \(3, 6\)\)"):
        impute(ppca.model, x, missing=torch.zeros(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*shape \(3, 6\) of the observed site"):
        impute(ppca.model, x, missing=torch.ones(3, 5, dtype=torch.bool))
    # A mask of the wrong shape is refused for its shape, whatever it holds.
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*shape \(3, 6\) of the observed site"):
        impute(ppca.model, x, missing=torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_samples must be at least 1, got 0"):
        impute(ppca.model, x, missing=good, num_samples=0)
    with pytest.raises(ValueError, match="conditionals='nope' is not a known strategy"):
        impute(ppca.model, x, missing=good, conditionals="nope")


@pytest.mark.parametrize("conditionals", ["exact", Quadrature(num_points=40)])
def test_entries_the_model_masks_come_back_as_the_model_had_them(conditionals):
    """Scoring fills the entries a model masks with stand-ins; generation must not return
    them: what it does not draw comes back as the model observed it."""
    import pyro.poutine as poutine

    from pyro_mpt import gibbs

    weight = torch.tensor([[1.0], [0.5], [-1.0]])
    keep_rows = torch.tensor([True, True, False])

    def model(x, observed):
        with poutine.mask(mask=keep_rows.unsqueeze(-1)), pyro.plate("data", 3, dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            with pyro.plate("features", 3, dim=-1):
                loc = (z @ weight.T).squeeze(-2)
                pyro.sample("x", dist.Normal(loc, 0.5), obs=x, obs_mask=observed)

    x = torch.tensor([[1.0, 2.0, 3.0], [-7.0, 5.0, 6.0], [8.0, 9.0, 10.0]])
    observed = torch.tensor([[True, True, True], [False, True, True], [True, True, True]])
    missing = torch.zeros(3, 3, dtype=torch.bool)
    missing[0, 1] = True
    pyro.set_rng_seed(0)
    draws = impute(model, x, observed, missing=missing, num_samples=50, conditionals=conditionals)
    untouched = ~missing
    assert torch.equal(draws[:, untouched], x[untouched].expand(50, -1))
    assert draws[:, 0, 1].std() > 0.1  # the one selected entry is drawn
    # A Gibbs step redraws one entry per observation; every other entry, the ones the model
    # masks included, keeps its state.
    chain = gibbs(model, x, observed, block_size=1, num_steps=20, conditionals=conditionals)
    changed = (chain[1:] != chain[:-1]).sum(-1)  # (steps, observations)
    assert changed.max() <= 1


@pytest.mark.parametrize("conditionals", ["exact", Quadrature(num_points=20)])
def test_float64_data_into_a_float32_model_come_back_unrounded(conditionals):
    """Conditionals run in the model's dtype; what generation returns keeps the data's:
    entries it does not draw are the data exactly, not rounded through float32."""
    from pyro_mpt import gibbs

    weight = torch.tensor([[1.0], [0.5], [-1.0], [0.25]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x)

    pyro.set_rng_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64) / 3  # not representable in float32
    missing = torch.zeros(5, 4, dtype=torch.bool)
    missing[:, 0] = True
    draws = impute(model, x, missing=missing, num_samples=3, conditionals=conditionals)
    assert draws.dtype == torch.float64
    assert torch.equal(draws[:, ~missing], x[~missing].expand(3, -1))
    chain = gibbs(model, x, block_size=1, num_steps=2, conditionals=conditionals, progress=False)
    assert chain.dtype == torch.float64
    assert ((chain[1:] != chain[:-1]).sum(-1) <= 1).all()
