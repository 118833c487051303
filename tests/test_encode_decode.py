"""Recursive encoding-decoding against its closed form for PPCA with the exact posterior."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import STRATEGIES, EncodeDecode, Exact, Quadrature, as_conditionals
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.models import PPCA, LinearVAE
from pyro_mpt.ops.gaussian import latent_gaussian_conditionals, normal_log_prob
from pyro_mpt.ops.masks import masks_of_sizes, mpt_estimate


class _Setup:
    """PPCA with random weights, data from it, and its guide set to the exact posterior
    ``q(z | x) = N(A (x - mu), s^2 M^-1)``, ``M = W^T W + s^2 I``, ``A = M^-1 W^T``."""

    def __init__(
        self, num_features=6, latent_dim=2, num_data=8, posterior_scale=1.0, noise_scale=0.7
    ):
        pyro.clear_param_store()  # PyroModules share parameters by name
        ppca = PPCA(num_features, latent_dim, noise_scale=noise_scale)
        with torch.no_grad():
            ppca.weight.copy_(torch.randn(num_features, latent_dim))
            ppca.loc.copy_(0.5 * torch.randn(num_features))
        self.w, self.mu = ppca.weight.detach(), ppca.loc.detach()
        self.var = ppca.noise_scale.detach() ** 2
        self.precision = self.w.T @ self.w + self.var * torch.eye(latent_dim)  # M
        self.encoder = torch.linalg.solve(self.precision, self.w.T)  # A
        self.q_cov = posterior_scale**2 * self.var * torch.linalg.inv(self.precision)
        with torch.no_grad():
            ppca.encoder_weight.copy_(self.encoder)
        # A constrained PyroParam is set by assignment, not by an in-place copy.
        ppca.encoder_scale_tril = torch.linalg.cholesky(self.q_cov)
        self.ppca, self.x = ppca, ppca.sample(num_data)

    def guide(self, x):
        """PPCA's encoder, written to broadcast over leading dims of x."""
        ppca = self.ppca
        with pyro.plate("data", x.shape[-2]):
            loc = (x - ppca.loc) @ ppca.encoder_weight.T + ppca.encoder_bias
            pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=ppca.encoder_scale_tril))

    def codes(self, x, mask, num_iterations):
        """Mean and covariance of the final codes of one chain (zero fill): the chain is
        ``z_{t+1} = A_R y_R + G z_t + eta``, ``G = A_m W_m``, ``eta ~ N(0, q_cov)``."""
        y = x - self.mu
        g = self.encoder[:, mask] @ self.w[mask]
        offset = self.encoder[:, ~mask] @ y[~mask]
        mean, cov = self.encoder @ torch.where(mask, -self.mu, y), self.q_cov
        for _ in range(num_iterations):
            mean, cov = offset + g @ mean, g @ cov @ g.T + self.q_cov
        return mean, cov

    def closed_form(self, masks, num_iterations):
        """``log E_z[p(x_j | z)]`` under the final codes, for masks ``(P, N, D)``."""
        out = torch.zeros(masks.shape)
        for p, n in torch.cartesian_prod(*map(torch.arange, masks.shape[:2])).tolist():
            mean, cov = self.codes(self.x[n], masks[p, n], num_iterations)
            var = (self.w @ cov @ self.w.T).diagonal() + self.var
            out[p, n] = normal_log_prob(self.x[n], self.w @ mean + self.mu, var)
        return out

    def spectral_radius(self, masks):
        """The largest contraction factor ``rho(G)`` of the chains over all masks."""
        return max(
            torch.linalg.eigvals(self.encoder[:, m] @ self.w[m]).abs().max().item()
            for m in masks.reshape(-1, masks.shape[-1])
        )


def _assert_within_monte_carlo_error(prepared, masks, expected, num_replicates=16):
    """Independent estimates for the same masks (repeated along the mask dim) agree with
    ``expected`` within 6 standard errors of their mean, plus ``sd^2``: the order of the
    bias of a log-mean of ``S`` samples."""
    repeated = masks.repeat(num_replicates, 1, 1)
    with torch.no_grad():
        estimates = prepared.log_prob(repeated).reshape((num_replicates,) + masks.shape)
    estimates = estimates[:, masks]
    sd = estimates.std(0)
    tolerance = 6 * sd / math.sqrt(num_replicates) + sd**2
    assert ((estimates.mean(0) - expected[masks]).abs() < tolerance).all()
    return estimates.mean(0)


@pytest.mark.parametrize("num_iterations", [0, 3])
def test_matches_its_closed_form_on_ppca(num_iterations):
    setup = _Setup()
    masks = masks_of_sizes(torch.randint(1, 7, (1, 8)), 6)
    strategy = EncodeDecode(num_iterations=num_iterations, num_samples=1000)
    prepared = strategy.prepare(setup.ppca.model, setup.guide, (setup.x,), {})
    _assert_within_monte_carlo_error(prepared, masks, setup.closed_form(masks, num_iterations))


def test_posterior_mean_refill_converges_to_the_exact_conditional_mean():
    """With a (near) deterministic posterior-mean encoder the refill is a linear map with
    fixed point ``x_m = E[x_m | x_R]``, so the score tends to ``N(x_j; E[x_j | x_R], s^2)``:
    the exact conditional mean, but only the noise variance."""
    setup = _Setup(posterior_scale=1e-9)
    masks = masks_of_sizes(torch.randint(1, 6, (2, 8)), 6)
    rho = setup.spectral_radius(masks)
    assert rho < 0.99
    num_iterations = math.ceil(math.log(1e-12) / math.log(rho))
    prepared = EncodeDecode(num_iterations).prepare(setup.ppca.model, setup.guide, (setup.x,), {})
    with torch.no_grad():
        got = prepared.log_prob(masks)
    mean, _ = latent_gaussian_conditionals(setup.x, setup.w, setup.mu, setup.var.expand(6), ~masks)
    expected = normal_log_prob(setup.x, mean, setup.var)
    torch.testing.assert_close(got[masks], expected[masks], atol=1e-6, rtol=0)


def test_stationary_codes_have_the_exact_mean_and_too_small_a_covariance():
    """With the exact posterior as guide and T -> oo the codes converge to
    ``N(E[z | x_R], s^2 (M - H M^-1 H)^-1)``, ``H = W_m^T W_m``, not the posterior
    covariance ``s^2 (M - H)^-1``: the conditionals are too narrow."""
    setup = _Setup(num_data=4)
    masks = masks_of_sizes(torch.randint(1, 6, (1, 4)), 6)
    num_iterations = math.ceil(math.log(1e-8) / math.log(setup.spectral_radius(masks)))
    var, big_m = setup.var, setup.precision
    mean, exact_var = latent_gaussian_conditionals(
        setup.x, setup.w, setup.mu, var.expand(6), ~masks
    )
    expected = torch.zeros(masks.shape)
    for n in range(4):
        w_m = setup.w[masks[0, n]]
        h = w_m.T @ w_m
        stationary = var * torch.linalg.inv(big_m - h @ torch.linalg.solve(big_m, h))
        # The chain's moments by iteration agree with the stationary closed form.
        _, cov = setup.codes(setup.x[n], masks[0, n], num_iterations)
        torch.testing.assert_close(cov, stationary, atol=1e-6, rtol=0)
        ed_var = (setup.w @ stationary @ setup.w.T).diagonal() + var
        assert (ed_var[masks[0, n]] < exact_var[0, n, masks[0, n]]).all()
        expected[0, n] = normal_log_prob(setup.x[n], mean[0, n], ed_var)
    prepared = EncodeDecode(num_iterations, num_samples=1000).prepare(
        setup.ppca.model, setup.guide, (setup.x,), {}
    )
    estimates = _assert_within_monte_carlo_error(prepared, masks, expected)
    exact = Exact().prepare(setup.ppca.model, None, (setup.x,), {}).log_prob(masks)[masks]
    assert (estimates - exact).abs().max() > 0.05  # an approximation, not exact


def test_gradients_reach_every_encoder_and_decoder_parameter():
    vae = LinearVAE(num_features=7, latent_dim=3, likelihood="normal")
    x = vae.sample(5)
    masks = masks_of_sizes(torch.randint(1, 8, (2, 5)), 7)
    prepared = EncodeDecode(num_iterations=2).prepare(vae.model, vae.guide, (x,), {})
    params = list(vae.parameters())
    assert len(params) == 6  # weight, bias, noise scale and three encoder parameters
    grads = torch.autograd.grad(prepared.log_prob(masks)[masks].sum(), params)
    assert all(g.abs().sum() > 0 for g in grads)


def test_svi_with_encode_decode_raises_the_lml():
    truth = LinearVAE(num_features=12, latent_dim=2, init_scale=2.5)
    x = truth.sample(150)
    pyro.clear_param_store()
    vae = LinearVAE(num_features=12, latent_dim=2)
    quad = Quadrature(num_points=20)

    def lml():
        with torch.no_grad():
            return quad.prepare(vae.model, None, (x,), {}).log_marginal().mean().item()

    loss = MPTLoss(conditionals="encode-decode", num_masks=2)
    svi = pyro.infer.SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": 0.05}), loss)
    svi.step(x)
    before = lml()
    for _ in range(100):
        svi.step(x)
    assert lml() > before + 0.3


def test_a_guide_that_ignores_its_data_is_rejected():
    setup = _Setup(num_data=4)
    guide = AutoNormal(setup.ppca.model)
    guide(setup.x)
    match = r"(?s)guide AutoNormal gives the same q\(z\).*Amortize the guide on x.*'importance'"
    with pytest.raises(ValueError, match=match):
        EncodeDecode().prepare(setup.ppca.model, guide, (setup.x,), {})

    def free_parameters(x):  # one free q(z_n) per observation, whatever x holds
        loc = pyro.param("q_loc", torch.zeros(x.shape[-2], 2))
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))

    with pytest.raises(ValueError, match=r"guide .*free_parameters gives the same q\(z\)"):
        EncodeDecode().prepare(setup.ppca.model, free_parameters, (setup.x,), {})
    # LinearVAE's encoder starts at zero weights: the same q for every x, yet amortized.
    vae = LinearVAE(num_features=6, latent_dim=2)
    assert torch.equal(vae.encoder_weight, torch.zeros(2, 12))  # x and its hidden mask
    EncodeDecode().prepare(vae.model, vae.guide, (vae.sample(4),), {})


def test_applicability_errors():
    vae = LinearVAE(num_features=6, latent_dim=2)
    x = vae.sample(4)
    with pytest.raises(NotApplicableError, match=r"encode-decode draws .* no guide was given"):
        EncodeDecode().prepare(vae.model, None, (x,), {})

    def categorical(data):
        with pyro.plate("data", data.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            logits = torch.stack([z.sum(-1), -z.sum(-1)], -1)[..., None, :].expand(
                z.shape[:-1] + (6, 2)
            )
            pyro.sample("x", dist.Categorical(logits=logits).to_event(1), obs=data)

    def guide(data):
        vae.guide(data.to(torch.get_default_dtype()))

    with pytest.raises(NotApplicableError, match=r"Categorical likelihood of site 'x' has none"):
        EncodeDecode().prepare(categorical, guide, (x.long(),), {})


def test_selectable_by_name_only():
    assert isinstance(as_conditionals("encode-decode"), EncodeDecode)
    assert list(STRATEGIES)[:3] == ["exact", "quadrature", "importance"]
    vae = LinearVAE(num_features=6, latent_dim=5)
    with pytest.raises(NotApplicableError) as info:
        MPTLoss().loss(vae.model, None, vae.sample(3))
    assert "encode-decode" not in str(info.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_iterations must be 0 or more, got -1"):
        EncodeDecode(num_iterations=-1)
    with pytest.raises(TypeError, match=r"num_iterations must be an integer, got 1.5"):
        EncodeDecode(num_iterations=1.5)
    with pytest.raises(ValueError, match=r"num_samples must be at least 1, got 0"):
        EncodeDecode(num_samples=0)
    with pytest.raises(ValueError, match=r"fill must be 'zeros' or 'mean', got None"):
        EncodeDecode(fill=None)
    assert repr(EncodeDecode()) == "EncodeDecode(num_iterations=5, num_samples=16, fill='zeros')"


def test_prepare_works_under_no_grad():
    vae = LinearVAE(6, latent_dim=2)
    x = torch.bernoulli(torch.full((5, 6), 0.5))
    with torch.no_grad():
        prepared = EncodeDecode(num_iterations=1).prepare(vae.model, vae.guide, (x,), {})
        log_p = prepared.log_prob(
            torch.zeros(1, 5, 6, dtype=torch.bool).index_fill(-1, torch.tensor([0]), True)
        )
    assert log_p.shape == (1, 5, 6) and bool(torch.isfinite(log_p[..., 0]).all())


def test_encode_decode_says_once_that_its_error_is_unmeasured():
    """Its conditionals can be far off with no other word: the first use of each strategy
    object says so, naming the strategy and what to compare it with; later uses do not."""
    import warnings

    from pyro_mpt.errors import UnmeasuredAccuracyWarning

    ppca = PPCA(4, 1)
    x = ppca.sample(6)
    strategy = EncodeDecode(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            MPTLoss(conditionals=strategy).loss(ppca.model, ppca.guide, x)
    said = [w for w in caught if issubclass(w.category, UnmeasuredAccuracyWarning)]
    assert len(said) == 1 and said[0].filename == __file__
    assert "EncodeDecode(" in str(said[0].message) and "conditionals='importance'" in str(
        said[0].message
    )


def test_draws_of_a_discrete_latent_come_from_the_guide_itself():
    # A Gaussian mixture with the exact p(z | x_R) as guide: the chain's draws are exact.
    # The codes were drawn from the defensive mixture 0.7 q + 0.3 uniform that importance
    # weights correct for, unweighted here: means 75 standard errors off at 4000 draws.
    from pyro_mpt import impute

    num_classes, num_features, noise = 3, 5, 0.8
    means = 2.0 * torch.randn(num_classes, num_features, generator=torch.Generator().manual_seed(4))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Categorical(torch.full((num_classes,), 1.0 / num_classes)))
            pyro.sample("x", dist.Normal(means[z], noise).to_event(1), obs=x)

    def posterior_logits(x, seen):
        log_lik = dist.Normal(means, noise).log_prob(x.unsqueeze(-2))
        return (log_lik * seen.unsqueeze(-2)).sum(-1)

    def guide(x, hidden=None):
        with pyro.plate("data", x.shape[-2]):
            seen = torch.ones_like(x) if hidden is None else (~hidden).to(x.dtype)
            pyro.sample("z", dist.Categorical(logits=posterior_logits(x, seen)))

    generator = torch.Generator().manual_seed(5)
    classes = torch.tensor([0, 1, 2, 2])
    x = means[classes] + noise * torch.randn(4, num_features, generator=generator)
    missing = torch.zeros(4, num_features, dtype=torch.bool)
    missing[:, :3] = True
    num_draws = 4000
    strategy = EncodeDecode(num_iterations=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strategy's unmeasured-accuracy warning
        draws = impute(
            model, x, missing=missing, num_samples=num_draws, conditionals=strategy, guide=guide
        )
    weights = torch.softmax(posterior_logits(x, (~missing).to(x.dtype)), -1)  # (4, C)
    exact_mean = weights @ means[:, :3]
    exact_var = weights @ (means[:, :3] ** 2 + noise**2) - exact_mean**2
    z = (draws[..., :3].mean(0) - exact_mean) / (exact_var / num_draws).sqrt()
    assert z.abs().max() < 5.0, z


def test_a_copy_of_a_used_strategy_warns_again_of_its_unmeasured_accuracy():
    # ddp_spawn pickles the loss into processes that never showed the warning.
    import copy
    import pickle

    from pyro_mpt.errors import UnmeasuredAccuracyWarning

    vae = LinearVAE(6, latent_dim=2)
    x = torch.randint(0, 2, (8, 6)).to(torch.get_default_dtype())
    loss = MPTLoss(conditionals=EncodeDecode(num_iterations=2))
    with pytest.warns(UnmeasuredAccuracyWarning):
        loss.loss(vae.model, vae.guide, x)
    for copied in (pickle.loads(pickle.dumps(loss)), copy.deepcopy(loss)):
        with pytest.warns(UnmeasuredAccuracyWarning):
            copied.loss(vae.model, vae.guide, x)


def _ppca_steps(ppca, guide, x, num_steps=2):
    """SVI steps of ``EncodeDecode()`` that change nothing (learning rate 0): the warnings
    they give and the loss's ``rule_check``."""
    from pyro.infer import SVI

    loss = MPTLoss(conditionals=EncodeDecode())
    svi = SVI(ppca.model, guide, pyro.optim.Adam({"lr": 0.0}), loss=loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(num_steps):
            svi.step(x)
    return [str(w.message) for w in caught], loss.rule_check


def test_mpt_loss_measures_how_far_below_log_p_x_encode_decode_falls():
    """With little noise, encode-decode with the exact posterior as guide scores hundreds
    of nats per observation below log p(x) (Exact on the same masks' estimate shows it);
    the first and second steps say so with a figure that is a lower bound of that
    shortfall."""
    from pyro_mpt import log_marginal

    pyro.set_rng_seed(0)
    setup = _Setup(num_features=12, latent_dim=2, num_data=64, noise_scale=0.1)
    ppca, x = setup.ppca, setup.x
    messages, check = _ppca_steps(ppca, setup.guide, x)
    exact = log_marginal(ppca.model, x, conditionals="exact").detach()
    masks = torch.rand(32, 64, 12) < torch.rand(32, 64, 1)
    masks[..., 0] |= ~masks.any(-1)
    with torch.no_grad():
        prepared = EncodeDecode().prepare(ppca.model, setup.guide, (x,), {})
        estimate = mpt_estimate(prepared.log_prob(masks), masks).mean()
    shortfall = float(exact.mean() - estimate)
    assert shortfall > 100  # nats per observation
    said = [m for m in messages if "below an importance-sampling lower bound" in m]
    assert len(said) == 2 and check["compared_with"] == "importance"
    assert "(step 1;" in said[0] and "(step 2;" in said[1]
    assert 10 < check["mean_gap"] <= 1.2 * shortfall
    assert "raise num_samples" in said[0]


def test_mpt_curve_holds_encode_decode_to_a_lower_bound_of_log_p_x():
    """The setting above (little noise, the exact posterior as guide: hundreds of nats per
    observation below log p(x)): ``mpt_curve``'s check of its conditionals warns with a
    figure that is a lower bound of the exact shortfall of its curve's area; with
    ``check_rule=False`` it does not measure, and with much noise it stays quiet."""
    from pyro_mpt import log_marginal, mpt_curve
    from pyro_mpt.errors import UnmeasuredAccuracyWarning

    def curve_warnings(setup, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            curve = mpt_curve(
                setup.ppca.model,
                setup.x,
                guide=setup.guide,
                conditionals=EncodeDecode(),
                sizes=list(range(1, setup.x.shape[-1] + 1)),  # the area estimates log p(x)
                num_masks=4,
                **options,
            )
        said = [
            str(w.message)
            for w in caught
            if issubclass(w.category, UnmeasuredAccuracyWarning)
            and "below an importance-sampling lower bound" in str(w.message)
        ]
        return curve, said, caught

    pyro.set_rng_seed(0)
    sharp = _Setup(num_features=12, latent_dim=2, num_data=64, noise_scale=0.1)
    exact = log_marginal(sharp.ppca.model, sharp.x, conditionals="exact").detach()
    curve, said, caught = curve_warnings(sharp)
    shortfall = float(exact.mean()) - curve.area
    assert shortfall > 100  # nats per observation, against the exact log p(x)
    assert len(said) == 1 and said[0].startswith("mpt_curve with EncodeDecode(")
    figure = float(said[0].split("at least ")[1].split(" nats")[0])
    assert 10 < figure <= 1.2 * shortfall
    assert "raise num_samples" in said[0]
    assert all(w.filename == __file__ for w in caught)
    assert not curve_warnings(sharp, check_rule=False)[1]

    pyro.set_rng_seed(0)
    blunt = _Setup(num_features=6, latent_dim=1, num_data=64, noise_scale=3.0)
    assert not curve_warnings(blunt)[1]


def test_ordering_log_likelihoods_holds_encode_decode_to_a_lower_bound_of_log_p_x():
    """Every ordering's chain-rule sum shares encode-decode's bias, so their spread does
    not show it: the call's check against an importance-sampling lower bound does, with a
    figure below the exact shortfall of the sums' mean."""
    from pyro_mpt import log_marginal, ordering_log_likelihoods
    from pyro_mpt.errors import UnmeasuredAccuracyWarning

    pyro.set_rng_seed(0)
    sharp = _Setup(num_features=12, latent_dim=2, num_data=32, noise_scale=0.1)
    exact = log_marginal(sharp.ppca.model, sharp.x, conditionals="exact").detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ordering_log_likelihoods(
            sharp.ppca.model, sharp.x, guide=sharp.guide, conditionals=EncodeDecode()
        )
    said = [
        str(w.message)
        for w in caught
        if issubclass(w.category, UnmeasuredAccuracyWarning)
        and "below an importance-sampling lower bound" in str(w.message)
    ]
    shortfall = float((exact - result.values.mean(0)).mean())
    assert shortfall > 100
    assert len(said) == 1 and said[0].startswith("ordering_log_likelihoods with EncodeDecode(")
    figure = float(said[0].split("at least ")[1].split(" nats")[0])
    assert 10 < figure <= 1.2 * shortfall
    assert all(w.filename == __file__ for w in caught)
