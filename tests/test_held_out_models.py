"""Held-out models: hand-written Pyro models of kinds the model zoo does not cover, each
checked against an exact reference computed here (closed-form Gaussian marginals, trapezoid
grids over the latent in float64). Long because each model and its reference is written
out in full, so a reader sees exactly what is checked.

For every scored model the tests check ``log_marginal`` under the strategy ``auto`` picks
(and under a reference-quality rule), and that ``MPTLoss(rate="uniform").estimate`` averaged
over seeded draws is within 4.5 standard errors of the reference (exact and quadrature
strategies; importance sampling is consistent, not unbiased, and is checked on
``log_marginal`` with many samples). Models the package refuses are checked for an error
that names the site and says what to do.
"""

from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoNormal,
)

from experiments.zoo import cases as zoo
from experiments.zoo.references import grid_log_marginal_1d, mvn_log_prob
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import EncodeDecode, Exact, ImportanceSampling, Quadrature
from pyro_mpt.errors import NotApplicableError

QUADRATURE_TOL = 1e-3


@pytest.fixture(autouse=True)
def _float64():
    """Every test runs in float64, and leaves the default dtype as it found it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@dataclass
class Case(zoo.ModelCase):
    """One held-out model: the fields of :class:`experiments.zoo.cases.ModelCase`, with
    ``reference`` and ``strategy`` required, ``guide`` a function that builds the guide from
    the model, and

    :ivar unbiased: whether the uniform-rate estimate is checked for unbiasedness.
    :ivar coarse: whether auto's quadrature rule is expected to warn that it is coarse.
    """

    unbiased: bool = True
    coarse: bool = False


def _quadrature_case(name, model, args, reference, num_points, **settings):
    """A model ``conditionals="auto"`` scores by quadrature, checked under a rule of
    ``num_points`` nodes per latent dimension (to ``QUADRATURE_TOL`` nats, and to ``1e-2``
    under auto's own rule, unless ``settings`` say otherwise)."""
    settings = {"tol": QUADRATURE_TOL, "auto_tol": 1e-2, **settings}
    return Case(
        name,
        model,
        args,
        reference,
        Quadrature,
        conditionals=lambda: Quadrature(num_points=num_points),
        **settings,
    )


# --------------------------------------------------------------------------------------
# Linear-Gaussian models: closed-form references.
# --------------------------------------------------------------------------------------


def two_latents_of_different_sizes():
    """``z ~ N(0, I_2)`` and ``c ~ N(0.5, 0.8)`` in one plate: ``x ~ N(W z + v c + b, 0.6)``."""
    with zoo.seeded(101):
        weight, v, bias = torch.randn(5, 2), torch.randn(5), torch.randn(5)
    mean = bias + 0.5 * v
    cov = weight @ weight.T + 0.64 * torch.outer(v, v) + 0.36 * torch.eye(5)
    with zoo.seeded(102):
        x = torch.distributions.MultivariateNormal(mean, cov).sample((8,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            c = pyro.sample("c", dist.Normal(0.5, 0.8))
            loc = z @ weight.T + c.unsqueeze(-1) * v + bias
            pyro.sample("x", dist.Normal(loc, 0.6).to_event(1), obs=x)

    return Case(
        "two_latents_of_different_sizes", model, (x,), lambda: mvn_log_prob(x, mean, cov), Exact
    )


def nested_time_plate():
    """Observations (dim -2) by time steps (dim -1): a latent ``z_i`` per observation and a
    latent ``u_it`` per observation and step; each cell holds 2 features (``.to_event``).
    ``x_it = a_t z_i + c u_it + b_t + noise``: the marginal of the ``T x 2`` features is
    Gaussian."""
    num_steps = 2
    with zoo.seeded(103):
        a, c, b = torch.randn(num_steps, 2), torch.randn(2), torch.randn(num_steps, 2)
    # Flattened features (t, f): loading on z, on u_1, on u_2.
    load = torch.zeros(num_steps * 2, 1 + num_steps)
    load[:, 0] = a.reshape(-1)
    for t in range(num_steps):
        load[2 * t : 2 * t + 2, 1 + t] = c
    mean = b.reshape(-1)
    cov = load @ load.T + 0.25 * torch.eye(num_steps * 2)
    with zoo.seeded(104):
        x = torch.distributions.MultivariateNormal(mean, cov).sample((7,)).reshape(7, num_steps, 2)

    def model(x):
        with pyro.plate("data", x.shape[-3], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))  # (N, 1)
            with pyro.plate("time", x.shape[-2], dim=-1):
                u = pyro.sample("u", dist.Normal(0.0, 1.0))  # (N, T)
                loc = z.unsqueeze(-1) * a + u.unsqueeze(-1) * c + b  # (N, T, 2)
                pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    return Case(
        "nested_time_plate", model, (x,), lambda: mvn_log_prob(x.reshape(7, -1), mean, cov), Exact
    )


def covariate_dependent_prior():
    """``z_i ~ N(0.7 s_i, exp(0.4 s_i))`` with a covariate ``s_i`` per observation,
    ``x ~ N(w z + b, 0.5)``: the prior differs between observations."""
    with zoo.seeded(105):
        s = torch.randn(9)
        w, bias = torch.randn(4), torch.randn(4)
    prior_loc, prior_scale = 0.7 * s, torch.exp(0.4 * s)
    mean = prior_loc[:, None] * w + bias
    cov = prior_scale[:, None, None] ** 2 * torch.outer(w, w) + 0.25 * torch.eye(4)
    with zoo.seeded(106):
        x = torch.distributions.MultivariateNormal(mean, cov).sample()

    def model(x, s):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.7 * s, torch.exp(0.4 * s)))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) * w + bias, 0.5).to_event(1), obs=x)

    return Case(
        "covariate_dependent_prior", model, (x, s), lambda: mvn_log_prob(x, mean, cov), Exact
    )


def concatenated_covariate():
    """A decoder on ``torch.cat([z, covariate], -1)``, with the covariate expanded to the
    latent's batch shape (as a model that broadcasts over extra leading dims must)."""
    with zoo.seeded(107):
        covariate = torch.randn(8, 1)
        weight, bias = torch.randn(4, 2), torch.randn(4)
    mean = covariate * weight[:, 1] + bias
    cov = torch.outer(weight[:, 0], weight[:, 0]) + 0.36 * torch.eye(4)
    with zoo.seeded(108):
        x = torch.distributions.MultivariateNormal(mean, cov).sample()

    def model(x, covariate):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            h = torch.cat([z, covariate.expand(z.shape[:-1] + (1,))], -1)
            pyro.sample("x", dist.Normal(h @ weight.T + bias, 0.6).to_event(1), obs=x)

    return Case(
        "concatenated_covariate", model, (x, covariate), lambda: mvn_log_prob(x, mean, cov), Exact
    )


def low_rank_mvn_prior():
    """A ``LowRankMultivariateNormal`` prior over a 3-dim latent."""
    with zoo.seeded(109):
        factor, diag = torch.randn(3, 1), 0.2 + torch.rand(3)
        prior_loc = torch.randn(3)
        weight, bias = torch.randn(5, 3), torch.randn(5)
    prior_cov = factor @ factor.T + torch.diag(diag)
    mean = weight @ prior_loc + bias
    cov = weight @ prior_cov @ weight.T + 0.3 * torch.eye(5)
    with zoo.seeded(110):
        x = torch.distributions.MultivariateNormal(mean, cov).sample((8,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.LowRankMultivariateNormal(prior_loc, factor, diag))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, 0.3**0.5).to_event(1), obs=x)

    return Case("low_rank_mvn_prior", model, (x,), lambda: mvn_log_prob(x, mean, cov), Exact)


def latent_in_component_plate():
    """Two latents per observation in a ``components`` plate (dim -1) nested inside the data
    plate (dim -2); the observation sits in the data plate only (``.to_event(1)``):
    ``x_i = A z_i + b + noise``."""
    with zoo.seeded(128):
        weight, bias = torch.randn(4, 2), torch.randn(4)
    cov = weight @ weight.T + 0.36 * torch.eye(4)
    with zoo.seeded(129):
        x = torch.distributions.MultivariateNormal(bias, cov).sample((8,))

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            with pyro.plate("components", 2, dim=-1):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))  # (N, 2)
            loc = (z @ weight.T + bias).unsqueeze(-2)  # (N, 1, D)
            pyro.sample("x", dist.Normal(loc, 0.6).to_event(1), obs=x.unsqueeze(-2))

    return Case(
        "latent_in_component_plate",
        model,
        (x,),
        lambda: mvn_log_prob(x, bias, cov),
        Exact,
    )


# --------------------------------------------------------------------------------------
# Quadrature: priors and likelihoods the zoo does not have.
# --------------------------------------------------------------------------------------


def halfnormal_prior_scale():
    """``s ~ HalfNormal(1)`` per observation, ``x_j ~ N(b_j, 0.3 + s)``: a scale mixture
    (HalfNormal is ``|N(0, 1)|``, a transformed normal)."""
    with zoo.seeded(111):
        bias = torch.randn(4)
        s = torch.randn(8).abs()
        x = bias + (0.3 + s[:, None]) * torch.randn(8, 4)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            s = pyro.sample("s", dist.HalfNormal(1.0))
            scale = (0.3 + s).unsqueeze(-1).expand(s.shape + (4,))
            pyro.sample("x", dist.Normal(bias, scale).to_event(1), obs=x)

    def reference():  # s = |t|, t standard normal
        return zoo.grid_1d(
            lambda t: dist.Normal(bias, (0.3 + t.abs()).unsqueeze(1)).log_prob(x).sum(-1),
            num_points=24001,
        )

    return _quadrature_case(
        "halfnormal_prior_scale",
        model,
        (x,),
        reference,
        200,
        # |u| has a kink at 0: Gauss-Hermite converges slowly (0.12 nats at 45 nodes, 6e-3
        # at 200), and auto says its rule is coarse.
        tol=1e-2,
        auto_tol=2e-2,
        coarse=True,
    )


def _weighted_two_normals(w):
    """Five features, each ``w N(-1.5, 0.7) + (1 - w) N(1.5, 0.7)``, for ``w`` of shape
    ``batch + (1,)``."""
    probs = torch.stack([w, 1 - w], -1).expand(w.shape[:-1] + (5, 2))
    components = dist.Normal(torch.tensor([-1.5, 1.5]).expand(probs.shape), 0.7)
    return dist.MixtureSameFamily(dist.Categorical(probs=probs), components)


def logitnormal_mixture_weight():
    """A mixture weight per observation, ``w = sigmoid(t)``, ``t ~ N(0, 1.5)`` (a
    ``TransformedDistribution`` with a ``SigmoidTransform``), and features from
    ``w N(-1.5, 0.7) + (1 - w) N(1.5, 0.7)``."""
    likelihood = _weighted_two_normals
    with zoo.seeded(112):
        w = torch.sigmoid(1.5 * torch.randn(8, 1))
        x = likelihood(w).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            prior = dist.TransformedDistribution(
                dist.Normal(0.0, 1.5), [dist.transforms.SigmoidTransform()]
            )
            w = pyro.sample("w", prior)
            pyro.sample("x", likelihood(w.unsqueeze(-1)).to_event(1), obs=x)

    def reference():
        return zoo.grid_1d(
            lambda t: likelihood(torch.sigmoid(1.5 * t).unsqueeze(1)).log_prob(x).sum(-1)
        )

    return _quadrature_case("logitnormal_mixture_weight", model, (x,), reference, 80)


def laplace_likelihood_2d():
    """``z ~ N(0, I_2)``, ``x_j ~ Laplace(W_j z + b_j, 0.6)``, D=5."""
    with zoo.seeded(113):
        weight, bias = 0.7 * torch.randn(5, 2), torch.randn(5)
        x = dist.Laplace(torch.randn(8, 2) @ weight.T + bias, 0.6).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Laplace(z @ weight.T + bias, 0.6).to_event(1), obs=x)

    def reference():
        return zoo.grid_2d(
            lambda t: dist.Laplace((t @ weight.T + bias).unsqueeze(1), 0.6).log_prob(x).sum(-1)
        )

    return _quadrature_case(
        "laplace_likelihood_2d",
        model,
        (x,),
        reference,
        80,
        # The Laplace density has a kink at its mode: quadrature converges slowly (2e-2 nats at
        # 40 x 40 nodes, 1e-2 at 80 x 80), and auto says its rule is coarse.
        tol=2e-2,
        auto_tol=5e-2,
        coarse=True,
    )


def binomial_varying_total_count():
    """``x_ij ~ Binomial(n_i, logits = w_j z_i + b_j)`` with a different ``total_count`` per
    observation."""
    total = torch.tensor([2.0, 5.0, 9.0, 3.0, 12.0, 1.0, 7.0, 4.0])
    with zoo.seeded(114):
        weight, bias = 0.6 * torch.randn(5), 0.3 * torch.randn(5)
        z = torch.randn(8)
        x = dist.Binomial(total[:, None], logits=z[:, None] * weight + bias).sample()

    def model(x, total):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = z.unsqueeze(-1) * weight + bias
            pyro.sample("x", dist.Binomial(total.unsqueeze(-1), logits=logits).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            logits = (t * weight + bias).unsqueeze(1)  # (G, 1, D)
            return dist.Binomial(total[:, None], logits=logits).log_prob(x).sum(-1)

        return zoo.grid_1d(log_lik)

    return _quadrature_case("binomial_varying_total_count", model, (x, total), reference, 80)


def geometric_probs():
    """``x_j ~ Geometric(probs = sigmoid(w_j z + b_j))``: counts with few distinct values,
    parameterised by ``probs``."""
    with zoo.seeded(115):
        weight, bias = 0.5 * torch.randn(6), 0.2 * torch.randn(6)
        z = torch.randn(8)
        x = dist.Geometric(probs=torch.sigmoid(z[:, None] * weight + bias)).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            probs = torch.sigmoid(z.unsqueeze(-1) * weight + bias)
            pyro.sample("x", dist.Geometric(probs=probs).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            probs = torch.sigmoid(t * weight + bias).unsqueeze(1)
            return dist.Geometric(probs=probs).log_prob(x).sum(-1)

        return zoo.grid_1d(log_lik)

    return _quadrature_case("geometric_probs", model, (x,), reference, 80)


def _bernoulli_data(seed, num_obs, weight, bias):
    with zoo.seeded(seed):
        z = torch.randn(num_obs)
        return torch.bernoulli(torch.sigmoid(z[:, None] * weight + bias))


def bernoulli_mask_per_observation():
    """``poutine.mask`` with a boolean tensor over observations around a Bernoulli model:
    masked observations contribute exactly 0."""
    with zoo.seeded(116):
        weight, bias = torch.randn(6), 0.4 * torch.randn(6)
    x = _bernoulli_data(117, 9, weight, bias)
    keep = torch.tensor([True, False, True, True, True, False, True, True, False])

    def model(x):
        with poutine.mask(mask=keep), pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = z.unsqueeze(-1) * weight + bias
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            return dist.Bernoulli(logits=(t * weight + bias).unsqueeze(1)).log_prob(x).sum(-1)

        return torch.where(keep, zoo.grid_1d(log_lik), 0.0)

    return _quadrature_case("bernoulli_mask_per_observation", model, (x,), reference, 80)


def bernoulli_obs_mask_missing_rows():
    """``obs_mask`` on a Bernoulli site in a feature plate, with two rows entirely missing:
    the reference integrates the observed entries only."""
    with zoo.seeded(118):
        weight, bias = torch.randn(6), 0.4 * torch.randn(6)
    x = _bernoulli_data(119, 9, weight, bias)
    with zoo.seeded(120):
        observed = torch.rand(9, 6) > 0.3
    observed[0] = True
    observed[3] = False
    observed[7] = False

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))  # (N, 1)
            with pyro.plate("features", x.shape[-1], dim=-1):
                logits = z * weight + bias
                pyro.sample("x", dist.Bernoulli(logits=logits), obs=x, obs_mask=observed)

    def reference():
        def log_lik(t):
            logits = (t * weight + bias).unsqueeze(1)
            return torch.where(observed, dist.Bernoulli(logits=logits).log_prob(x), 0.0).sum(-1)

        return torch.where(observed.any(-1), zoo.grid_1d(log_lik), 0.0)

    return _quadrature_case("bernoulli_obs_mask_missing_rows", model, (x,), reference, 80)


class _TanhDecoder(torch.nn.Module):
    def __init__(self, latent_dim, hidden, num_features):
        super().__init__()
        self.hidden = torch.nn.Linear(latent_dim, hidden)
        self.out = torch.nn.Linear(hidden, num_features)

    def forward(self, z):
        return self.out(torch.tanh(self.hidden(z)))


def module_decoder_2d():
    """A ``torch.nn.Module`` decoder (Linear-Tanh-Linear) registered with ``pyro.module``,
    ``z ~ N(0, I_2)``, ``x ~ N(decoder(z), 0.5)``."""
    with zoo.seeded(121):
        decoder = _TanhDecoder(2, 6, 4).double()
        with torch.no_grad():
            x = decoder(torch.randn(8, 2)) + 0.5 * torch.randn(8, 4)

    def model(x):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(decoder(z), 0.5).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            with torch.no_grad():
                loc = decoder(t).unsqueeze(1)
            return dist.Normal(loc, 0.5).log_prob(x).sum(-1)

        return zoo.grid_2d(log_lik)

    return _quadrature_case("module_decoder_2d", model, (x,), reference, 40)


def subsampled_with_pyro_subsample():
    """A subsampled data plate whose observation is ``pyro.subsample(x, event_dim=1)``, a
    Poisson likelihood: the loss is unbiased for minus the full data's log p(x)."""
    with zoo.seeded(122):
        weight, bias = 0.5 * torch.randn(4), 0.5 + 0.2 * torch.randn(4)
        z = torch.randn(12)
        x = torch.poisson(torch.exp(z[:, None] * weight + bias))

    def model(x):
        with pyro.plate("data", x.shape[-2], subsample_size=4):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            rate = torch.exp(z.unsqueeze(-1) * weight + bias)
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=pyro.subsample(x, event_dim=1))

    def reference():
        return zoo.grid_1d(
            lambda t: dist.Poisson(torch.exp(t * weight + bias).unsqueeze(1)).log_prob(x).sum(-1)
        )

    case = _quadrature_case(
        "subsampled_with_pyro_subsample",
        model,
        (x,),
        reference,
        80,
        unbiased=False,  # checked on the loss below
    )
    case.subsampled = True
    return case


# --------------------------------------------------------------------------------------
# Non-normal priors: importance sampling with an autoguide.
# --------------------------------------------------------------------------------------


def _importance_case(name, model, x, reference, autoguide):
    """A model ``conditionals="auto"`` scores by importance sampling with ``autoguide`` (at
    ``init_scale=1``), checked at 20000 samples to 0.05 nats, and to 0.3 nats at auto's
    ImportanceSampling(64) (a few tenths of a nat of Monte Carlo error); not checked for
    unbiasedness."""
    return Case(
        name,
        model,
        (x,),
        reference,
        ImportanceSampling,
        conditionals=lambda: ImportanceSampling(num_samples=20000),
        tol=0.05,
        guide=lambda model: autoguide(model, init_scale=1.0),
        auto_tol=0.3,
        unbiased=False,
    )


def gamma_precision():
    """``tau ~ Gamma(3, 2)`` per observation, ``x_j ~ N(m_j, 1 / sqrt(tau))``: a Gamma prior,
    importance sampling with ``AutoNormal``."""
    with zoo.seeded(123):
        loc = torch.randn(4)
        tau = dist.Gamma(3.0, 2.0).sample((8,))
        x = loc + torch.randn(8, 4) / tau.sqrt()[:, None]

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            tau = pyro.sample("tau", dist.Gamma(3.0, 2.0))
            scale = tau.rsqrt().unsqueeze(-1).expand(tau.shape + (4,))
            pyro.sample("x", dist.Normal(loc, scale).to_event(1), obs=x)

    def reference():
        def log_joint(v):  # tau = exp(v)
            tau = v.exp()
            ll = dist.Normal(loc, tau.rsqrt().unsqueeze(1)).log_prob(x).sum(-1)
            return ll + dist.Gamma(3.0, 2.0).log_prob(tau) + v

        return grid_log_marginal_1d(log_joint, lo=-15.0, hi=6.0)

    return _importance_case("gamma_precision", model, x, reference, AutoNormal)


def beta_mixture_weight():
    """A mixture weight per observation with a ``Beta(2, 2)`` prior, features from
    ``w N(-1.5, 0.7) + (1 - w) N(1.5, 0.7)``; importance sampling with
    ``AutoDiagonalNormal`` (a joint Gaussian over every observation's weight)."""
    likelihood = _weighted_two_normals
    with zoo.seeded(124):
        w = dist.Beta(2.0, 2.0).sample((8, 1))
        x = likelihood(w).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            w = pyro.sample("w", dist.Beta(2.0, 2.0))
            pyro.sample("x", likelihood(w.unsqueeze(-1)).to_event(1), obs=x)

    def reference():
        def log_joint(v):  # w = sigmoid(v)
            w = torch.sigmoid(v)
            ll = likelihood(w.unsqueeze(1)).log_prob(x).sum(-1)
            log_jacobian = torch.nn.functional.logsigmoid(v) + torch.nn.functional.logsigmoid(-v)
            return ll + dist.Beta(2.0, 2.0).log_prob(w) + log_jacobian

        return grid_log_marginal_1d(log_joint, lo=-30.0, hi=30.0, num_points=12001)

    return _importance_case("beta_mixture_weight", model, x, reference, AutoDiagonalNormal)


def low_rank_guide_importance():
    """A linear-Gaussian model with a scalar latent, scored by importance sampling with an
    ``AutoLowRankMultivariateNormal`` guide (one joint Gaussian over every observation's
    latent, whose per-observation marginals are the proposals); auto takes exact."""
    with zoo.seeded(125):
        weight, bias = 0.6 * torch.randn(5), torch.randn(5)
    cov = torch.outer(weight, weight) + 0.5 * torch.eye(5)
    with zoo.seeded(126):
        x = torch.distributions.MultivariateNormal(bias, cov).sample((6,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample(
                "x", dist.Normal(z.unsqueeze(-1) * weight + bias, 0.5**0.5).to_event(1), obs=x
            )

    return Case(
        "low_rank_guide_importance",
        model,
        (x,),
        lambda: mvn_log_prob(x, bias, cov),
        Exact,
        # The proposals are broad (the guide is untrained): observations in the tail of the
        # prior keep about 0.1 nats of Monte Carlo error at S=50000.
        conditionals=lambda: ImportanceSampling(num_samples=50000),
        tol=0.15,
        guide=lambda model: AutoLowRankMultivariateNormal(model, rank=2, init_scale=1.0),
        unbiased=False,
    )


SCORED = [
    two_latents_of_different_sizes,
    nested_time_plate,
    covariate_dependent_prior,
    concatenated_covariate,
    low_rank_mvn_prior,
    latent_in_component_plate,
    halfnormal_prior_scale,
    logitnormal_mixture_weight,
    laplace_likelihood_2d,
    binomial_varying_total_count,
    geometric_probs,
    bernoulli_mask_per_observation,
    bernoulli_obs_mask_missing_rows,
    module_decoder_2d,
    subsampled_with_pyro_subsample,
    gamma_precision,
    beta_mixture_weight,
    low_rank_guide_importance,
]
CHECKED_LML = [f for f in SCORED if not getattr(f(), "subsampled", False)]
UNBIASED = [f for f in SCORED if f().unbiased]


def _guide(case):
    return None if case.guide is None else case.guide(case.model)


@pytest.mark.parametrize("factory", CHECKED_LML, ids=zoo.factory_ids(CHECKED_LML))
def test_log_marginal_matches_reference(factory):
    case = factory()
    value, reference = zoo.log_marginal_and_reference(case, case.conditionals(), _guide(case))
    assert value.shape == reference.shape
    torch.testing.assert_close(value, reference, atol=case.tol, rtol=0.0)


@pytest.mark.parametrize("factory", SCORED, ids=zoo.factory_ids(SCORED))
def test_auto_picks_a_strategy_that_is_right(factory):
    case = factory()
    guide = _guide(case)
    loss = MPTLoss(rate="uniform", conditionals="auto")
    if case.coarse:
        with pytest.warns(UserWarning, match="coarse"):
            loss.loss(case.model, guide, *case.args, **case.kwargs)
    else:
        loss.loss(case.model, guide, *case.args, **case.kwargs)
    assert isinstance(loss.conditionals.chosen, case.strategy), loss.conditionals.chosen
    if getattr(case, "subsampled", False):
        return
    value, reference = zoo.log_marginal_and_reference(case, loss.conditionals, guide)
    torch.testing.assert_close(value, reference, atol=case.auto_tol, rtol=0.0)


@pytest.mark.parametrize("factory", UNBIASED, ids=zoo.factory_ids(UNBIASED))
def test_uniform_estimate_is_unbiased(factory):
    case = factory()
    zoo.assert_uniform_estimate_unbiased(case, _guide(case), seed=1)


# --------------------------------------------------------------------------------------
# Semantics: subsampling, masked observations.
# --------------------------------------------------------------------------------------


def test_pyro_subsample_loss_is_unbiased_for_the_full_data():
    case = subsampled_with_pyro_subsample()
    (x,) = case.args
    loss = MPTLoss(rate="uniform", num_masks=2, conditionals=Quadrature(num_points=60))
    pyro.set_rng_seed(2)
    with torch.no_grad():
        assert loss.estimate(case.model, None, x).shape == (4,)
        losses = torch.tensor([loss.loss(case.model, None, x) for _ in range(300)])
        target = -case.reference().sum()
    zoo.assert_mean_loss_matches(losses, target, slack=0.01)


@pytest.mark.parametrize(
    "factory", [bernoulli_mask_per_observation, bernoulli_obs_mask_missing_rows]
)
def test_masked_out_observations_contribute_exactly_zero(factory):
    case = factory()
    empty = case.reference() == 0
    assert bool(empty.any())
    loss = MPTLoss(rate="uniform", num_masks=2, conditionals=Quadrature(num_points=30))
    draws = zoo.estimate_draws(loss, case, None, 20)
    assert bool((draws[:, empty] == 0).all())
    assert bool((draws[:, ~empty] != 0).all())


# --------------------------------------------------------------------------------------
# A discrete local latent: importance sampling against enumeration.
# --------------------------------------------------------------------------------------


def _discrete_mixture():
    mus = torch.tensor([[-1.0, 0.5, 2.0], [1.5, -1.0, 0.0]])
    weights = torch.tensor([0.3, 0.7])
    with zoo.seeded(127):
        labels = torch.distributions.Categorical(weights).sample((8,))
        x = mus[labels] + 0.7 * torch.randn(8, 3)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            c = pyro.sample("c", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(mus[c], 0.7).to_event(1), obs=x)

    def guide(x):
        q = pyro.param("q", torch.tensor([0.5, 0.5]), constraint=dist.constraints.simplex)
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("c", dist.Categorical(q))

    log_joint = weights.log()[:, None] + dist.Normal(mus[:, None, :], 0.7).log_prob(x).sum(-1)
    return model, guide, x, torch.logsumexp(log_joint, 0)


def test_discrete_latent_is_summed_over_its_values_by_auto_with_or_without_a_guide():
    model, guide, x, reference = _discrete_mixture()
    for given in (guide, None):
        loss = MPTLoss(conditionals="auto")
        loss.loss(model, given, x)
        assert isinstance(loss.conditionals.chosen, Quadrature)
        with torch.no_grad():
            value = log_marginal(model, x, guide=given, conditionals="auto")
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=0.0)


def test_discrete_latent_under_importance_matches_enumeration():
    model, guide, x, reference = _discrete_mixture()
    with torch.no_grad():
        value = log_marginal(
            model, x, conditionals=ImportanceSampling(num_samples=20000), guide=guide
        )
    torch.testing.assert_close(value, reference, atol=0.03, rtol=0.0)


# --------------------------------------------------------------------------------------
# Refusals: the error names the site and says what to do.
# --------------------------------------------------------------------------------------


def test_beta_prior_without_a_guide_names_the_site_and_the_fix():
    case = beta_mixture_weight()
    (x,) = case.args
    for conditionals in ("auto", "quadrature"):
        with pytest.raises(NotApplicableError, match=r"(?s)'w'.*Beta.*importance"):
            MPTLoss(conditionals=conditionals).loss(case.model, None, x)


def test_point_mass_guide_is_refused_as_a_proposal():
    from pyro.infer.autoguide import AutoDelta

    case = gamma_precision()
    (x,) = case.args
    with pytest.raises(ValueError, match=r"(?s)AutoDelta.*'tau'|'tau'.*AutoDelta"):
        MPTLoss(conditionals="importance").loss(case.model, AutoDelta(case.model), x)


def test_encode_decode_refuses_a_guide_that_ignores_its_data():
    case = gamma_precision()
    (x,) = case.args
    with pytest.raises(ValueError, match=r"(?s)ignores its data.*Amortize"):
        MPTLoss(conditionals="encode-decode").loss(case.model, AutoNormal(case.model), x)


def test_misspelt_strategy_lists_the_known_names():
    with pytest.raises(ValueError, match=r"'encode_decode'.*'encode-decode'"):
        MPTLoss(conditionals="encode_decode")


def test_encode_decode_with_an_amortized_encoder_gives_finite_estimates():
    case = logitnormal_mixture_weight()
    (x,) = case.args

    def encoder(x):
        weight = pyro.param("enc_w", lambda: torch.full((x.shape[-1],), -0.1))
        with pyro.plate("data", x.shape[-2]):
            loc = x @ weight
            pyro.sample(
                "w",
                dist.TransformedDistribution(
                    dist.Normal(loc, 1.0), [dist.transforms.SigmoidTransform()]
                ),
            )

    loss = MPTLoss(rate="uniform", conditionals=EncodeDecode(num_iterations=2, num_samples=4))
    estimate = loss.estimate(case.model, encoder, x)
    assert estimate.shape == (8,) and bool(torch.isfinite(estimate).all())


@pytest.mark.parametrize(
    "factory", [bernoulli_mask_per_observation, bernoulli_obs_mask_missing_rows]
)
def test_importance_estimate_with_masked_data_is_close_to_the_reference(factory):
    """MPT under importance sampling with a broad guide, on data with masked observations
    and missing entries: masked rows score 0, the rest average to the reference within Monte
    Carlo error plus the (small) bias of S=1000 samples."""
    case = factory()
    (x,) = case.args
    dim = -2 if factory is bernoulli_obs_mask_missing_rows else -1

    def guide(x):
        with pyro.plate("data", x.shape[-2], dim=dim):
            pyro.sample("z", dist.Normal(0.0, 1.2))

    loss = MPTLoss(rate="uniform", num_masks=2, conditionals=ImportanceSampling(num_samples=1000))
    draws = zoo.estimate_draws(loss, case, guide, 40)
    with torch.no_grad():
        reference = case.reference()
    empty = reference == 0
    assert bool((draws[:, empty] == 0).all())
    zoo.assert_unbiased(draws[:, ~empty], reference[~empty], bias_tol=0.05)
