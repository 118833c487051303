"""Models that run at many latent values at once without error but score them wrongly are
refused, and log_marginal leaves Pyro's param store as it found it.

The broken models are plain Pyro that ``Trace_ELBO`` scores right: they only go wrong when a
strategy adds batch dims left of their plates. Their fixed versions are scored against grid
integrals and closed forms.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from experiments.zoo.references import grid_log_marginal_2d, mvn_log_prob, standard_normal_log_prob
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import EncodeDecode, Exact, ImportanceSampling, Quadrature
from pyro_mpt.trace.vectorized_run_check import tolerance

NUM_TOPICS, NUM_WORDS, NUM_DOCS = 2, 5, 6


def _prodlda(softmax_dim, count=None, dtype=torch.float64):
    """A ProdLDA-style decoder: topic proportions ``theta`` per document, word rates
    ``total * softmax(theta @ beta)``. ``count`` (a list) counts the model's runs."""
    beta0 = torch.randn(NUM_TOPICS, NUM_WORDS, generator=torch.Generator().manual_seed(1))
    beta0 = beta0.to(dtype)

    def model(x):
        if count is not None:
            count.append(1)
        beta = pyro.param("beta", beta0.clone())
        total = x.sum(-1, keepdim=True)
        with pyro.plate("docs", x.shape[-2]):
            theta = pyro.sample(
                "theta", dist.Normal(torch.zeros(NUM_TOPICS, dtype=dtype), 1.0).to_event(1)
            )
            probs = torch.softmax(theta @ beta, dim=softmax_dim)
            pyro.sample("x", dist.Poisson(total * probs).to_event(1), obs=x)

    return model, beta0


def _counts(dtype=torch.float64):
    rates = torch.linspace(1.0, 6.0, NUM_WORDS)
    generator = torch.Generator().manual_seed(2)
    return torch.poisson(rates.expand(NUM_DOCS, NUM_WORDS), generator=generator).to(dtype)


def _prodlda_reference(x, beta):
    """``log p(x_n)`` by a 2-D trapezoid sum over the topic proportions."""
    total = x.sum(-1, keepdim=True)

    def log_joint(t):  # t: (G, 2)
        log_probs = torch.log_softmax(t @ beta, -1)  # (G, V)
        rate = total * log_probs.exp().unsqueeze(1)  # (G, N, V)
        log_lik = torch.distributions.Poisson(rate).log_prob(x).sum(-1)
        return log_lik + standard_normal_log_prob(t).sum(-1, keepdim=True)

    return grid_log_marginal_2d(log_joint, lo=-9.0, hi=9.0, num_points=361)


@pytest.mark.parametrize("conditionals", ["auto", "quadrature", Quadrature(num_points=30)])
def test_a_softmax_over_dim_1_is_refused_naming_the_site(conditionals):
    """With a batch dim added, ``softmax(..., dim=1)`` normalises over documents: the run
    at the nodes succeeds, and only a plain run at the same latent values shows it."""
    model, _ = _prodlda(softmax_dim=1)
    with pytest.raises(ValueError, match=r"Observed site 'x' has log-likelihood") as caught:
        log_marginal(model, _counts(), conditionals=conditionals)
    message = str(caught.value)
    assert "softmax(..., dim=1)" in message and "softmax(..., dim=-1)" in message
    assert "x.shape[-2]" in message and "nats per observation" in message
    with pytest.raises(ValueError, match=r"Observed site 'x'"):
        MPTLoss(conditionals=conditionals).loss(model, None, _counts())


def test_the_same_model_over_dim_minus_1_gives_the_grid_log_marginal():
    model, beta = _prodlda(softmax_dim=-1)
    x = _counts()
    expected = _prodlda_reference(x, beta)
    for conditionals in ["auto", Quadrature(num_points=60)]:
        actual = log_marginal(model, x, conditionals=conditionals)
        assert torch.allclose(actual, expected, atol=1e-3, rtol=0), (actual - expected).abs()


def test_the_same_model_in_float32_passes():
    """Rounding in float32 stays within :func:`tolerance`; a wrong dim does not."""
    assert tolerance(torch.float64) == 1e-5
    assert 1e-3 < tolerance(torch.float32) < 1e-2
    x = _counts(torch.float32)
    model, beta = _prodlda(softmax_dim=-1, dtype=torch.float32)
    actual = log_marginal(model, x, conditionals=Quadrature(60))
    expected = _prodlda_reference(x.double(), beta.double())
    assert torch.allclose(actual.double(), expected, atol=1e-3, rtol=0)
    model, _ = _prodlda(softmax_dim=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Observed site 'x'.*tolerance 3\.5e-03"):
        log_marginal(model, x, conditionals=Quadrature(30))


def test_a_size_read_off_a_positive_dim_is_refused():
    """``theta.shape[1]`` is the number of topics in a plain run but the number of
    documents once a dim is added on the left; ``x.shape[0]`` of the data is harmless, as
    the data argument gets no extra dims."""
    _, beta0 = _prodlda(softmax_dim=-1)

    def model(x, size_dim):
        beta = pyro.param("beta", beta0.clone())
        total = x.sum(-1, keepdim=True)
        with pyro.plate("docs", x.shape[0]):
            theta = pyro.sample("theta", dist.Normal(torch.zeros(NUM_TOPICS), 1.0).to_event(1))
            centred = theta - theta.sum(-1, keepdim=True) / theta.shape[size_dim]
            probs = torch.softmax(centred @ beta, dim=-1)
            pyro.sample("x", dist.Poisson(total * probs).to_event(1), obs=x)

    x = _counts()
    with pytest.raises(ValueError, match=r"Observed site 'x'.*x\.shape\[0\]"):
        log_marginal(model, x, 1, conditionals="auto")
    ones = torch.ones(NUM_TOPICS, NUM_TOPICS) / NUM_TOPICS
    centring = torch.eye(NUM_TOPICS) - ones
    expected = _prodlda_reference(x, centring @ beta0)
    actual = log_marginal(model, x, -1, conditionals="auto")
    assert torch.allclose(actual, expected, atol=1e-3, rtol=0), (actual - expected).abs()


def _centred_ppca(dim):
    """A linear-Gaussian model whose decoder output is centred over ``dim``: over features
    with ``dim=-1``, over documents with ``dim=1`` once a dim is added on the left."""
    weight = torch.tensor([[1.0], [-0.5], [2.0], [0.3]])

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            h = z @ weight.T
            loc = h - h.mean(dim, keepdim=True)
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    return model, weight


def test_the_exact_path_checks_its_probes_too():
    """The exact path fits an affine map at probe points: a decoder centred over the wrong
    dim is still affine there, so only the plain run shows the mistake."""
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
    model, _ = _centred_ppca(dim=1)
    for conditionals in ["exact", "auto"]:
        with pytest.raises(ValueError, match=r"Observed site 'x'.*dims from the right"):
            log_marginal(model, x, conditionals=conditionals)
    model, weight = _centred_ppca(dim=-1)
    centred = weight - weight.mean(0)
    cov = centred @ centred.T + 0.25 * torch.eye(4)
    actual = log_marginal(model, x, conditionals=Exact())
    assert torch.allclose(actual, mvn_log_prob(x, torch.zeros(4), cov), atol=1e-10)


def test_a_latent_prior_over_the_wrong_dim_names_the_latent():
    """``z2``'s prior mean normalises ``z1`` over documents once a dim is added: the
    likelihood at the latent values agrees, the prior density of ``z2`` does not."""
    weight = torch.tensor([[1.0], [-1.0], [0.5]])
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = torch.softmax(z1, dim=1)[..., :1]
            z2 = pyro.sample("z2", dist.Normal(loc, 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z2 @ weight.T, 0.5).to_event(1), obs=x)

    with pytest.raises(ValueError, match=r"Latent site 'z2' has log-density"):
        log_marginal(model, x, conditionals=Quadrature(num_points=6))


def _amortized_guide():
    encoder = torch.nn.Linear(NUM_WORDS, 2 * NUM_TOPICS)
    torch.nn.init.zeros_(encoder.weight)

    def guide(x):
        pyro.module("encoder", encoder)
        h = encoder(torch.log1p(x))
        scale = torch.nn.functional.softplus(h[..., NUM_TOPICS:]) + 0.5
        with pyro.plate("docs", x.shape[-2]):
            pyro.sample("theta", dist.Normal(h[..., :NUM_TOPICS], scale).to_event(1))

    return guide


@pytest.mark.parametrize("conditionals", [ImportanceSampling(num_samples=16), EncodeDecode()])
def test_a_guided_run_of_a_model_over_dim_1_is_refused(conditionals):
    """At the guide's samples the model runs inside plates over samples and masks: there
    ``softmax(..., dim=1)`` normalises over masks."""
    model, _ = _prodlda(softmax_dim=1)
    with pytest.raises(ValueError, match=rf"Observed site 'x'.*'{conditionals.name}'"):
        MPTLoss(conditionals=conditionals).loss(model, _amortized_guide(), _counts())


def test_importance_scores_the_fixed_model_against_the_grid():
    """Importance sampling with a wide proposal: within 4 standard errors of the grid."""
    model, beta = _prodlda(softmax_dim=-1)
    x = _counts()
    expected = _prodlda_reference(x, beta)
    estimates = torch.stack(
        [
            log_marginal(model, x, guide=_amortized_guide(), conditionals=ImportanceSampling(500))
            for _ in range(8)
        ]
    ).detach()
    error = estimates.mean(0) - expected
    standard_error = estimates.std(0) / 8**0.5
    assert (error.abs() <= 4 * standard_error + 1e-3).all(), (error, standard_error)


def test_the_check_costs_no_model_run_on_later_steps():
    """After the first step the check runs no more: quadrature runs the model once a step
    (at the nodes), importance once (it replays the model at the guide's samples; the
    structure read on the first step is remembered)."""
    x = _counts()
    count = []
    model, _ = _prodlda(softmax_dim=-1, count=count)
    for conditionals, guide in [
        (Quadrature(20), None),
        (ImportanceSampling(64), _amortized_guide()),
    ]:
        loss = MPTLoss(conditionals=conditionals)
        loss.loss(model, guide, x)
        loss.loss(model, guide, x)  # a rule given by the user checks itself here
        first = len(count)
        loss.loss(model, guide, x)
        assert len(count) - first == 1, conditionals
        del count[:]


def _guide_sized_by(size):
    """A guide with one free location per observation, sized by ``size(x)``."""

    def guide(x):
        loc = pyro.param("q_loc", lambda: torch.zeros(size(x), NUM_TOPICS))
        with pyro.plate("docs", x.shape[-2]):
            pyro.sample("theta", dist.Normal(loc, 1.0).to_event(1))

    return guide


def test_log_marginal_leaves_the_param_store_as_it_found_it():
    """A guide sized by the data's length, on success (``x.shape[-2]``) and on failure
    (``len(x)``, the plate over masks under importance sampling): afterwards the store holds
    the same tensors as before, and Trace_ELBO trains on data of another size."""
    model, beta0 = _prodlda(softmax_dim=-1)
    x = _counts()
    store = pyro.get_param_store()
    beta = pyro.param("beta", beta0.clone()).unconstrained()
    for size, fails in [(lambda x: x.shape[-2], False), (len, True)]:
        guide = _guide_sized_by(size)
        if fails:
            with pytest.raises(ValueError, match="guide"):
                log_marginal(model, x, guide=guide, conditionals=ImportanceSampling(8))
        else:
            log_marginal(model, x, guide=guide, conditionals=ImportanceSampling(8))
        assert list(store.keys()) == ["beta"]
        assert dict(store.named_parameters())["beta"] is beta
        assert torch.equal(beta, beta0)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        svi.step(x[:4])
        assert store.get_param("q_loc").shape == (4, NUM_TOPICS)
        del store["q_loc"]
        with torch.no_grad():
            beta.copy_(beta0)


@pytest.mark.parametrize("conditionals", ["importance", "encode-decode"])
def test_a_max_plate_nesting_above_the_models_own_is_a_bound_as_for_trace_elbo(conditionals):
    # Trace_ELBO takes any bound; the check of the guide's broadcasting read the dims of
    # size one it adds as a guide sizing its plate from the left, and refused the guide.
    import math
    import warnings

    from pyro_mpt.models import LinearVAE

    vae = LinearVAE(6, latent_dim=2, init_scale=1.0)
    x = vae.sample(10)
    values = []
    for nesting in (math.inf, 3):
        pyro.set_rng_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = MPTLoss(conditionals=conditionals, num_masks=2, max_plate_nesting=nesting)
            values.append(loss.loss(vae.model, vae.guide, x))
    assert values[0] == pytest.approx(values[1], abs=1e-10)
