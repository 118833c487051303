"""The model zoo: hand-written Pyro models, each with an exact reference for ``log p(x_i)``
or the error every strategy must raise. Long because every model and its reference is
written out in full, so a reader sees exactly what is checked.

Every model below is plain Pyro (no model of the package). A factory returns a
:class:`ZooCase`: the model, its guide (or ``None``), its arguments, and either a function
computing the exact ``log p(x_i)`` of every observation (closed-form Gaussian marginals,
fine trapezoid grids in float64) or the error the package must raise. ``tests/test_model_zoo.py``
checks the package against every factory, and ``benchmarks/model_zoo_table.py`` runs them
through ``conditionals="auto"``. The factories are written for float64 (the test suite's
default dtype).
"""

from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.reparam import LocScaleReparam

from experiments.zoo.cases import ModelCase, grid_1d, grid_2d
from experiments.zoo.cases import seeded as _seeded
from experiments.zoo.references import mvn_log_prob, mvn_observed_log_prob
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature

#: Quadrature rules for reference-quality ``log_marginal`` and MPT conditionals.
QUADRATURE_1D = 80
QUADRATURE_2D = 40
#: Largest |log_marginal - reference| per observation accepted from those rules.
QUADRATURE_TOL = 1e-3
#: Largest bias per observation accepted from ``conditionals="auto"`` at its default
#: settings (quadrature or importance may be approximate there).
AUTO_TOL = 1e-2


@dataclass
class ZooCase(ModelCase):
    """One model of the zoo: the fields of :class:`experiments.zoo.cases.ModelCase`
    (``guide`` is the guide itself; ``strategy`` is ``None`` for a model every strategy
    refuses), and

    :ivar exact_error: a regex the ``NotApplicableError`` of ``conditionals="exact"`` must
        match, for models exact conditionals do not apply to.
    :ivar error: ``(exception type(s), regex)`` every strategy must raise, for refused models.
    :ivar check_log_marginal: whether ``log_marginal`` equals ``reference`` (not for
        subsampled or scaled models, whose loss carries the semantics instead).
    """

    auto_tol: float = AUTO_TOL
    exact_error: str | None = None
    error: tuple | None = None
    check_log_marginal: bool = True


def _quadrature_case(name, model, x, reference, num_points, *, tol=QUADRATURE_TOL, **settings):
    """A model ``conditionals="auto"`` scores by quadrature, checked under a rule of
    ``num_points`` nodes per latent dimension to ``QUADRATURE_TOL`` nats unless ``tol`` says
    otherwise."""
    return ZooCase(
        name,
        model,
        (x,),
        reference=reference,
        strategy=Quadrature,
        conditionals=lambda: Quadrature(num_points=num_points),
        tol=tol,
        **settings,
    )


def _gaussian_case(name, model, x, mean, cov, observed=None, **settings):
    """A model with Gaussian marginal ``N(mean, cov)`` per observation (of its ``observed``
    entries where given), which ``conditionals="auto"`` scores exactly."""

    def reference():
        if observed is None:
            return mvn_log_prob(x, mean, cov)
        return mvn_observed_log_prob(x, observed, mean, cov)

    return ZooCase(name, model, (x,), reference=reference, strategy=Exact, **settings)


def _linear_gaussian_data(seed, num_features, noise_var, sample_shape):
    """Loadings ``W (D, 2)``, bias ``b``, the implied covariance ``W W^T + noise_var I`` and
    data drawn from ``N(b, cov)``, all under one seed."""
    with _seeded(seed):
        weight, bias = torch.randn(num_features, 2), torch.randn(num_features)
        cov = weight @ weight.T + noise_var * torch.eye(num_features)
        x = torch.distributions.MultivariateNormal(bias, cov).sample(sample_shape)
    return weight, bias, cov, x


def _normal_data_1d(seed, num_obs, loc_fn, scale, latent=None):
    """``x_i ~ Normal(loc_fn(z_i), scale)`` at standard-normal (or given) scalar latents."""
    with _seeded(seed):
        z = torch.randn(num_obs) if latent is None else latent
        loc = loc_fn(z)
        return loc + scale * torch.randn(loc.shape)


def _grid_normal_1d(x, loc_fn, scale_fn, observed=None):
    """``log ∫ N(t) Π_j N(x_j; loc_fn(t)_j, scale_fn(t)_j) dt`` for a standard-normal ``t``,
    over the observed entries only."""

    def log_lik(t):
        loc, scale = loc_fn(t), scale_fn(t)  # (G, D) each
        ll = dist.Normal(loc.unsqueeze(1), scale.unsqueeze(1)).log_prob(x)  # (G, N, D)
        if observed is not None:
            ll = torch.where(observed, ll, 0.0)
        return ll.sum(-1)

    return grid_1d(log_lik)


# --------------------------------------------------------------------------------------
# Linear-Gaussian models: exact conditionals, closed-form references.
# --------------------------------------------------------------------------------------


def linear_gaussian():
    """PPCA: ``z ~ N(0, I_2)``, ``x ~ N(W z + b, 0.6^2 I)``, D=5."""
    weight, bias, cov, x = _linear_gaussian_data(1, 5, 0.36, (8,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, 0.6).to_event(1), obs=x)

    return _gaussian_case("linear_gaussian", model, x, bias, cov)


def correlated_prior_factor_analysis():
    """Factor analysis with a correlated ``MultivariateNormal`` prior and per-feature noise."""
    with _seeded(2):
        weight, bias = torch.randn(6, 2), torch.randn(6)
        noise = 0.3 + torch.rand(6)
        prior_loc = torch.tensor([0.5, -1.0])
        tril = torch.tensor([[1.2, 0.0], [0.9, 0.5]])
        mean = weight @ prior_loc + bias
        cov = weight @ tril @ tril.T @ weight.T + torch.diag(noise**2)
        x = torch.distributions.MultivariateNormal(mean, cov).sample((8,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.MultivariateNormal(prior_loc, scale_tril=tril))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, noise).to_event(1), obs=x)

    return _gaussian_case("correlated_prior_factor_analysis", model, x, mean, cov)


def hierarchical_linear():
    """``z1 ~ N(0, 1)``, ``z2 ~ N(0.8 z1 + 0.3, 0.5)``, ``x ~ N(w1 z1 + w2 z2 + b, 0.7)``:
    the prior of ``z2`` follows ``z1``; the marginal is Gaussian."""
    with _seeded(3):
        w1, w2, bias = torch.randn(5), torch.randn(5), torch.randn(5)
    loadings = torch.stack([w1, w2], -1)  # (D, 2)
    latent_mean = torch.tensor([0.0, 0.3])
    latent_cov = torch.tensor([[1.0, 0.8], [0.8, 0.64 + 0.25]])
    mean = loadings @ latent_mean + bias
    cov = loadings @ latent_cov @ loadings.T + 0.49 * torch.eye(5)
    with _seeded(4):
        x = torch.distributions.MultivariateNormal(mean, cov).sample((8,))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
            z2 = pyro.sample("z2", dist.Normal(0.8 * z1 + 0.3, 0.5))
            loc = z1.unsqueeze(-1) * w1 + z2.unsqueeze(-1) * w2 + bias
            pyro.sample("x", dist.Normal(loc, 0.7).to_event(1), obs=x)

    return _gaussian_case("hierarchical_linear", model, x, mean, cov)


def two_data_plates():
    """Observations indexed by two plates, groups (dim -2) by replicates (dim -1)."""
    weight, bias, cov, x = _linear_gaussian_data(5, 4, 0.5, (3, 4))  # x: (A, B, D)

    def model(x):
        with pyro.plate("groups", x.shape[-3], dim=-2), pyro.plate("reps", x.shape[-2], dim=-1):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, 0.5**0.5).to_event(1), obs=x)

    return _gaussian_case("two_data_plates", model, x, bias, cov)


def masked_observations():
    """``poutine.mask`` over whole observations: masked ones contribute exactly 0."""
    case = linear_gaussian()
    (x,) = case.args
    keep = torch.tensor([True, False, True, True, False, True, True, False])
    inner = case.model

    def model(x):
        with poutine.mask(mask=keep):
            inner(x)

    full = case.reference
    return ZooCase(
        "masked_observations",
        model,
        (x,),
        reference=lambda: torch.where(keep, full(), 0.0),
        strategy=Exact,
    )


def _missing_pattern(num_obs, num_features, seed):
    """Observed entries: random, with row 2 entirely missing and row 0 complete."""
    with _seeded(seed):
        observed = torch.rand(num_obs, num_features) > 0.35
    observed[0] = True
    observed[2] = False
    return observed


def missing_entries_site_mask():
    """Missing entries as a per-entry site mask (``.mask(observed)``) on a Gaussian model:
    the reference is the Gaussian marginal of the observed entries."""
    weight, bias, cov, x = _linear_gaussian_data(6, 6, 0.4, (8,))
    observed = _missing_pattern(8, 6, 7)
    x = torch.where(observed, x, 100.0)  # values at missing entries must not matter

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            likelihood = dist.Normal(z @ weight.T + bias, 0.4**0.5).mask(observed)
            pyro.sample("x", likelihood.to_event(1), obs=x)

    return _gaussian_case("missing_entries_site_mask", model, x, bias, cov, observed=observed)


def missing_entries_obs_mask():
    """Missing entries as ``obs_mask=`` (Pyro's imputation form) in a feature plate."""
    weight, bias, cov, x = _linear_gaussian_data(8, 5, 0.5, (8,))
    observed = _missing_pattern(8, 5, 9)
    x = torch.where(observed, x, 100.0)

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))  # (N, 1, 2)
            loc = (z @ weight.T).squeeze(-2) + bias  # (N, D)
            with pyro.plate("features", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Normal(loc, 0.5**0.5), obs=x, obs_mask=observed)

    return _gaussian_case("missing_entries_obs_mask", model, x, bias, cov, observed=observed)


def scaled_observations():
    """``poutine.scale`` with one scale per observation."""
    case = linear_gaussian()
    (x,) = case.args
    scale = torch.linspace(0.5, 2.0, x.shape[0])
    inner = case.model

    def model(x):
        with poutine.scale(scale=scale):
            inner(x)

    return ZooCase(
        "scaled_observations",
        model,
        (x,),
        reference=case.reference,
        strategy=Exact,
        check_log_marginal=False,
    )


def subsampled_plate():
    """A data plate of 12 observations subsampled 4 at a time (``subsample_size``)."""
    weight, bias, cov, x = _linear_gaussian_data(10, 5, 0.36, (12,))

    def model(x):
        with pyro.plate("data", x.shape[-2], subsample_size=4) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, 0.6).to_event(1), obs=x[..., idx, :])

    return _gaussian_case("subsampled_plate", model, x, bias, cov, check_log_marginal=False)


def deterministic_and_factor():
    """A Gaussian model with a ``pyro.deterministic`` site and a ``pyro.factor`` on a global
    parameter (no local latent in it)."""
    case = linear_gaussian()
    weight, bias, _, x = _linear_gaussian_data(1, 5, 0.36, (8,))

    def model(x):
        shift = pyro.param("shift", torch.tensor(0.25))
        pyro.factor("shift_penalty", -0.5 * shift**2 / 0.1)
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = pyro.deterministic("loc", z @ weight.T + bias + shift - 0.25)
            pyro.sample("x", dist.Normal(loc, 0.6).to_event(1), obs=x)

    return ZooCase(
        "deterministic_and_factor", model, (x,), reference=case.reference, strategy=Exact
    )


def locscale_reparam():
    """``poutine.reparam`` with ``LocScaleReparam(centered=0)`` of ``z ~ N(m, s)``."""
    with _seeded(11):
        weight, bias = torch.randn(5, 2), torch.randn(5)
    prior_loc, prior_scale = torch.tensor([0.7, -0.4]), torch.tensor([1.5, 0.6])
    mean = weight @ prior_loc + bias
    cov = weight @ torch.diag(prior_scale**2) @ weight.T + 0.3 * torch.eye(5)
    with _seeded(12):
        x = torch.distributions.MultivariateNormal(mean, cov).sample((8,))

    def centred(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(prior_loc, prior_scale).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + bias, 0.3**0.5).to_event(1), obs=x)

    model = poutine.reparam(centred, config={"z": LocScaleReparam(centered=0.0)})
    case = _gaussian_case("locscale_reparam", model, x, mean, cov)
    case.centred = centred
    return case


# --------------------------------------------------------------------------------------
# Models that exact conditionals must refuse: quadrature references on fine grids.
# --------------------------------------------------------------------------------------


def hierarchical_nonlinear_mean():
    """``z1 ~ N(0, 1)``, ``z2 ~ N(sin(z1), 0.5)``, ``x ~ N(w1 z1 + w2 z2 + b, 0.8)``.

    Given ``z1`` the observation is Gaussian with covariance ``0.25 w2 w2^T + 0.64 I``: the
    reference integrates ``z1`` on a grid."""
    with _seeded(13):
        w1, w2, bias = 0.6 * torch.randn(5), 0.6 * torch.randn(5), torch.randn(5)
        z1 = torch.randn(8)
        z2 = torch.sin(z1) + 0.5 * torch.randn(8)
        x = z1[:, None] * w1 + z2[:, None] * w2 + bias + 0.8 * torch.randn(8, 5)
    cond_cov = 0.25 * torch.outer(w2, w2) + 0.64 * torch.eye(5)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
            z2 = pyro.sample("z2", dist.Normal(torch.sin(z1), 0.5))
            loc = z1.unsqueeze(-1) * w1 + z2.unsqueeze(-1) * w2 + bias
            pyro.sample("x", dist.Normal(loc, 0.8).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            mean = t * w1 + torch.sin(t) * w2 + bias  # (G, D)
            return torch.distributions.MultivariateNormal(mean.unsqueeze(1), cond_cov).log_prob(x)

        return grid_1d(log_lik)

    return _quadrature_case(
        "hierarchical_nonlinear_mean",
        model,
        x,
        reference,
        QUADRATURE_2D,
        exact_error=r"affine|scale",
    )


def hierarchical_latent_scale():
    """``z1 ~ N(0, 1)``, ``z2 ~ N(0.5, exp(0.3 z1))``, ``x ~ N(w1 z1 + w2 z2 + b, 0.7)``: the
    scale of a latent depends on another latent."""
    with _seeded(14):
        w1, w2, bias = 0.6 * torch.randn(5), 0.4 * torch.randn(5), torch.randn(5)
        z1 = torch.randn(8)
        z2 = 0.5 + torch.exp(0.3 * z1) * torch.randn(8)
        x = z1[:, None] * w1 + z2[:, None] * w2 + bias + 0.7 * torch.randn(8, 5)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
            z2 = pyro.sample("z2", dist.Normal(0.5, torch.exp(0.3 * z1)))
            loc = z1.unsqueeze(-1) * w1 + z2.unsqueeze(-1) * w2 + bias
            pyro.sample("x", dist.Normal(loc, 0.7).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            mean = t * w1 + 0.5 * w2 + bias  # (G, D)
            s2 = torch.exp(0.6 * t).reshape(-1, 1, 1, 1)  # (G, 1, 1, 1): batch (G, 1)
            cov = s2 * torch.outer(w2, w2) + 0.49 * torch.eye(5)
            return torch.distributions.MultivariateNormal(mean.unsqueeze(1), cov).log_prob(x)

        return grid_1d(log_lik)

    return _quadrature_case(
        "hierarchical_latent_scale",
        model,
        x,
        reference,
        QUADRATURE_2D,
        exact_error=r"affine|scale",
    )


def kinked_mean():
    """``x ~ N(clamp(z, -1.5, 1.5) w + b, 0.8)``: affine near the origin, flat far away."""
    with _seeded(15):
        weight, bias = 0.5 * torch.randn(5), torch.randn(5)

    def loc_fn(z):
        return z.clamp(-1.5, 1.5).unsqueeze(-1) * weight + bias

    x = _normal_data_1d(16, 8, loc_fn, 0.8, latent=torch.linspace(-2.5, 2.5, 8))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(loc_fn(z), 0.8).to_event(1), obs=x)

    def reference():
        return _grid_normal_1d(x, lambda t: loc_fn(t[:, 0]), lambda t: torch.full_like(t, 0.8))

    return _quadrature_case(
        "kinked_mean",
        model,
        x,
        reference,
        QUADRATURE_1D,
        # The kink makes any polynomial rule converge slowly (80 Gauss-Hermite nodes under
        # the prior: 2e-3 nats).
        tol=1e-2,
        auto_tol=5e-2,
        exact_error=r"affine",
    )


def heteroscedastic_noise():
    """``x ~ N(w z + b, 0.3 + 0.5 exp(0.5 z))``: the noise scale depends on the latent."""
    with _seeded(17):
        weight, bias = 0.7 * torch.randn(5), torch.randn(5)

    def loc_fn(z):
        return z.unsqueeze(-1) * weight + bias

    def scale_fn(z):
        return (0.3 + 0.5 * torch.exp(0.5 * z)).unsqueeze(-1).expand(z.shape + (5,))

    with _seeded(18):
        z = torch.randn(8)
        x = loc_fn(z) + scale_fn(z) * torch.randn(8, 5)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(loc_fn(z), scale_fn(z)).to_event(1), obs=x)

    def reference():
        return _grid_normal_1d(x, lambda t: loc_fn(t[:, 0]), lambda t: scale_fn(t[:, 0]))

    return _quadrature_case(
        "heteroscedastic_noise",
        model,
        x,
        reference,
        QUADRATURE_1D,
        exact_error=r"scale",
    )


def lognormal_latent():
    """``z ~ LogNormal(0, 0.5)`` (a transformed normal), ``x ~ N(w z + b, 0.6)``."""
    with _seeded(19):
        weight, bias = torch.randn(5), torch.randn(5)
        z = torch.exp(0.5 * torch.randn(8))
        x = z[:, None] * weight + bias + 0.6 * torch.randn(8, 5)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.LogNormal(0.0, 0.5))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) * weight + bias, 0.6).to_event(1), obs=x)

    def reference():
        # z = exp(0.5 t) with t standard normal.
        return _grid_normal_1d(
            x,
            lambda t: torch.exp(0.5 * t) * weight + bias,
            lambda t: torch.full((t.shape[0], 5), 0.6),
        )

    return _quadrature_case(
        "lognormal_latent",
        model,
        x,
        reference,
        QUADRATURE_1D,
        exact_error=r"affine|scale|LogNormal|Normal",
    )


# --------------------------------------------------------------------------------------
# Non-Gaussian likelihoods: quadrature, grid references.
# --------------------------------------------------------------------------------------


def bernoulli_logistic():
    """``z ~ N(0, 1)``, ``x_j ~ Bernoulli(logits = w_j z + b_j)``, D=8."""
    with _seeded(20):
        weight, bias = torch.randn(8), 0.5 * torch.randn(8)
        z = torch.randn(10)
        x = torch.bernoulli(torch.sigmoid(z[:, None] * weight + bias))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = z.unsqueeze(-1) * weight + bias
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    def reference():
        return grid_1d(
            lambda t: dist.Bernoulli(logits=(t * weight + bias).unsqueeze(1)).log_prob(x).sum(-1)
        )

    return _quadrature_case(
        "bernoulli_logistic",
        model,
        x,
        reference,
        QUADRATURE_1D,
        exact_error=r"Bernoulli|Normal|Gaussian",
    )


def poisson_2d():
    """``z ~ N(0, I_2)``, ``x_j ~ Poisson(exp(W_j z + b_j))``, D=5."""
    with _seeded(21):
        weight, bias = 0.3 * torch.randn(5, 2), 0.3 + 0.3 * torch.randn(5)
        z = torch.randn(8, 2)
        x = torch.poisson(torch.exp(z @ weight.T + bias))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(z @ weight.T + bias)).to_event(1), obs=x)

    def reference():
        return grid_2d(
            lambda t: dist.Poisson(torch.exp(t @ weight.T + bias).unsqueeze(1)).log_prob(x).sum(-1)
        )

    return _quadrature_case(
        "poisson_2d",
        model,
        x,
        reference,
        QUADRATURE_2D,
        exact_error=r"Poisson|Normal|Gaussian",
    )


def correlated_prior_bernoulli():
    """``z ~ MVN(0, [[1, .8], [.8, 1]])``, ``x_j ~ Bernoulli(logits = W_j z + b_j)``, D=6."""
    tril = torch.linalg.cholesky(torch.tensor([[1.0, 0.8], [0.8, 1.0]]))
    with _seeded(22):
        weight, bias = 0.8 * torch.randn(6, 2), 0.3 * torch.randn(6)
        z = torch.randn(8, 2) @ tril.T
        x = torch.bernoulli(torch.sigmoid(z @ weight.T + bias))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.MultivariateNormal(torch.zeros(2), scale_tril=tril))
            pyro.sample("x", dist.Bernoulli(logits=z @ weight.T + bias).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            logits = (t @ tril.T @ weight.T + bias).unsqueeze(1)  # z = L t
            return dist.Bernoulli(logits=logits).log_prob(x).sum(-1)

        return grid_2d(log_lik)

    return _quadrature_case("correlated_prior_bernoulli", model, x, reference, QUADRATURE_2D)


def categorical_features():
    """``x_j ~ Categorical(logits = A_j z + c_j)`` over 3 classes, D=4, integer data."""
    with _seeded(23):
        slope, offset = torch.randn(4, 3), 0.5 * torch.randn(4, 3)
        z = torch.randn(10)
        x = torch.distributions.Categorical(logits=z[:, None, None] * slope + offset).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = z[..., None, None] * slope + offset
            pyro.sample("x", dist.Categorical(logits=logits).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            logits = (t[:, :, None] * slope + offset).unsqueeze(1)  # (G, 1, D, C)
            return dist.Categorical(logits=logits).log_prob(x).sum(-1)

        return grid_1d(log_lik)

    return _quadrature_case("categorical_features", model, x, reference, QUADRATURE_1D)


def binomial_counts():
    """``x_j ~ Binomial(5, logits = w_j z + b_j)``, D=6."""
    with _seeded(24):
        weight, bias = 0.6 * torch.randn(6), 0.3 * torch.randn(6)
        z = torch.randn(8)
        x = torch.distributions.Binomial(5, logits=z[:, None] * weight + bias).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = z.unsqueeze(-1) * weight + bias
            pyro.sample("x", dist.Binomial(5, logits=logits).to_event(1), obs=x)

    def reference():
        return grid_1d(
            lambda t: dist.Binomial(5, logits=(t * weight + bias).unsqueeze(1)).log_prob(x).sum(-1),
        )

    return _quadrature_case("binomial_counts", model, x, reference, QUADRATURE_1D)


def student_t_likelihood():
    """``x_j ~ StudentT(4, w_j z + b_j, 0.5)``: heavy tails, D=5."""
    with _seeded(25):
        weight, bias = 0.5 * torch.randn(5), torch.randn(5)
        z = torch.randn(8)
        x = dist.StudentT(4.0, z[:, None] * weight + bias, 0.5).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.unsqueeze(-1) * weight + bias
            pyro.sample("x", dist.StudentT(4.0, loc, 0.5).to_event(1), obs=x)

    def reference():
        return grid_1d(
            lambda t: dist.StudentT(4.0, (t * weight + bias).unsqueeze(1), 0.5).log_prob(x).sum(-1),
        )

    return _quadrature_case("student_t_likelihood", model, x, reference, QUADRATURE_1D)


def gumbel_feature_plate():
    """A feature plate at dim -1 inside a data plate at dim -2, Gumbel likelihood."""
    with _seeded(26):
        weight, bias = 0.5 * torch.randn(5), torch.randn(5)
        z = torch.randn(8)
        x = dist.Gumbel(z[:, None] * weight + bias, 0.9).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))  # (N, 1)
            with pyro.plate("features", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Gumbel(z * weight + bias, 0.9), obs=x)

    def reference():
        return grid_1d(
            lambda t: dist.Gumbel((t * weight + bias).unsqueeze(1), 0.9).log_prob(x).sum(-1)
        )

    return _quadrature_case("gumbel_feature_plate", model, x, reference, QUADRATURE_1D)


def gamma_likelihood():
    """``x_j ~ Gamma(3, 3 exp(-(w_j z + b_j)))`` (mean ``exp(w_j z + b_j)``), D=5."""
    with _seeded(27):
        weight, bias = 0.5 * torch.randn(5), 0.3 * torch.randn(5)
        z = torch.randn(8)
        x = dist.Gamma(3.0, 3.0 * torch.exp(-(z[:, None] * weight + bias))).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            rate = 3.0 * torch.exp(-(z.unsqueeze(-1) * weight + bias))
            pyro.sample("x", dist.Gamma(3.0, rate).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            rate = 3.0 * torch.exp(-(t * weight + bias)).unsqueeze(1)
            return dist.Gamma(3.0, rate).log_prob(x).sum(-1)

        return grid_1d(log_lik)

    return _quadrature_case("gamma_likelihood", model, x, reference, QUADRATURE_1D)


def mixture_likelihood():
    """Each feature a two-component mixture (``MixtureSameFamily``), no enumeration."""
    with _seeded(28):
        weight, bias = 0.6 * torch.randn(5), torch.randn(5)
        mix_logits = torch.randn(5, 2)

    def likelihood(z):  # z of shape batch + (1,)
        loc = torch.stack([z * weight + bias, -z * weight], -1)  # batch + (D, 2)
        components = dist.Normal(loc, torch.tensor([0.4, 1.0]))
        mixing = dist.Categorical(logits=mix_logits.expand(loc.shape))
        return dist.MixtureSameFamily(mixing, components)

    with _seeded(29):
        x = likelihood(torch.randn(8, 1)).sample()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", likelihood(z.unsqueeze(-1)).to_event(1), obs=x)

    def reference():
        return grid_1d(lambda t: likelihood(t.unsqueeze(1)).log_prob(x).sum(-1))

    return _quadrature_case(
        "mixture_likelihood",
        model,
        x,
        reference,
        QUADRATURE_1D,
        exact_error=r"MixtureSameFamily|Normal|Gaussian|affine",
    )


def missing_entries_poisson():
    """Per-entry ``poutine.mask`` (missing counts) in a feature plate, Poisson likelihood."""
    with _seeded(30):
        weight, bias = 0.6 * torch.randn(6), 0.5 + 0.3 * torch.randn(6)
        z = torch.randn(8)
        x = torch.poisson(torch.exp(z[:, None] * weight + bias))
    observed = _missing_pattern(8, 6, 31)
    x = torch.where(observed, x, 1000.0)

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("features", x.shape[-1], dim=-1), poutine.mask(mask=observed):
                pyro.sample("x", dist.Poisson(torch.exp(z * weight + bias)), obs=x)

    def reference():
        def log_lik(t):
            ll = dist.Poisson(torch.exp(t * weight + bias).unsqueeze(1)).log_prob(x)
            return torch.where(observed, ll, 0.0).sum(-1)

        return grid_1d(log_lik)

    return _quadrature_case("missing_entries_poisson", model, x, reference, QUADRATURE_1D)


# --------------------------------------------------------------------------------------
# A 5-dim latent: quadrature does not apply, ``auto`` needs a guide (importance).
# --------------------------------------------------------------------------------------


def broad_guide(latent_dim, name="z"):
    """A mean-field guide, amortized only in its plate size, that starts at the prior."""

    def guide(x):
        loc = pyro.param(f"{name}_q_loc", torch.zeros(latent_dim))
        scale = pyro.param(
            f"{name}_q_scale", torch.ones(latent_dim), constraint=dist.constraints.positive
        )
        with pyro.plate("data", x.shape[-2]):
            pyro.sample(name, dist.Normal(loc, scale).to_event(1))

    return guide


def five_dim_bernoulli():
    """``z ~ N(0, I_5)`` and ``x_j ~ Bernoulli(logits = c_j (a . z) + b_j)``: the likelihood
    sees ``z`` through ``s = a . z ~ N(0, |a|^2)`` only, so a 1-D grid is the reference."""
    with _seeded(32):
        direction = torch.randn(5)
        slope, bias = torch.randn(6), 0.3 * torch.randn(6)
        z = torch.randn(8, 5)
        x = torch.bernoulli(torch.sigmoid((z @ direction)[:, None] * slope + bias))
    norm = direction.norm()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([5]).to_event(1))
            logits = (z @ direction).unsqueeze(-1) * slope + bias
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    def reference():
        def log_lik(t):
            logits = (t * norm * slope + bias).unsqueeze(1)
            return dist.Bernoulli(logits=logits).log_prob(x).sum(-1)

        return grid_1d(log_lik)

    return ZooCase(
        "five_dim_bernoulli",
        model,
        (x,),
        guide=broad_guide(5),
        reference=reference,
        strategy=ImportanceSampling,
        conditionals=lambda: ImportanceSampling(num_samples=4000),
        # Self-normalised importance sampling is consistent, not exact: a seeded draw at
        # S=4000 with the prior as proposal is within a few hundredths of a nat.
        tol=0.1,
        auto_tol=0.1,
    )


# --------------------------------------------------------------------------------------
# Models every strategy must refuse, with a clear error.
# --------------------------------------------------------------------------------------


def _gaussian_data(num_obs=6, num_features=4, seed=40):
    with _seeded(seed):
        return torch.randn(num_obs, num_features)


def global_latent():
    """A latent weight matrix outside the data plate."""
    x = _gaussian_data()

    def model(x):
        w = pyro.sample("W", dist.Normal(torch.zeros(x.shape[-1], 2), 1.0).to_event(2))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ w.T, 1.0).to_event(1), obs=x)

    return ZooCase("global_latent", model, (x,), error=(ValueError, r"'W'"))


def feature_latent():
    """A latent per feature shared by all observations (in the feature plate only)."""
    x = _gaussian_data()

    def model(x):
        with pyro.plate("features", x.shape[-1], dim=-1):
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("features2", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Normal(z * u, 1.0), obs=x)

    return ZooCase("feature_latent", model, (x,), error=(ValueError, r"'u'"))


def unplated_batch_dim():
    """The features are a batch dim no plate covers (no ``.to_event``, no feature plate)."""
    x = _gaussian_data()
    weight = torch.linspace(-1.0, 1.0, x.shape[-1])

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))  # (N, 1)
            pyro.sample("x", dist.Normal(z * weight, 1.0), obs=x)  # log_prob (N, D)

    return ZooCase(
        "unplated_batch_dim",
        model,
        (x,),
        error=(ValueError, r"(?s)'x'.*(log_prob shape|plate)|(log_prob shape|plate).*'x'"),
    )


def integer_data():
    """Integer counts under a continuous (Normal) likelihood."""
    with _seeded(41):
        x = torch.randint(0, 5, (6, 4))

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = z @ torch.ones(x.shape[-1], 2).T
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    return ZooCase(
        "integer_data",
        model,
        (x,),
        error=((TypeError, ValueError), r"(?s)(int64|torch\.long|Long).*\.float\(\)"),
    )


def numpy_data():
    """A numpy array as the observation."""
    x = _gaussian_data().numpy()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            loc = z @ torch.ones(x.shape[-1], 2).T
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    return ZooCase("numpy_data", model, (x,), error=(TypeError, r"(?s)numpy.*torch\.as_tensor"))


def local_factor():
    """A ``pyro.factor`` that depends on a local latent."""
    x = _gaussian_data()

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.factor("z_penalty", -(z**2).sum(-1))
            loc = z @ torch.ones(x.shape[-1], 2).T
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    return ZooCase(
        "local_factor",
        model,
        (x,),
        error=(ValueError, r"(?s)'z_penalty'.*(local|latent)|(local|latent).*'z_penalty'"),
    )


#: Every factory of the zoo, in the order of the table.
ZOO = [
    linear_gaussian,
    correlated_prior_factor_analysis,
    hierarchical_linear,
    two_data_plates,
    masked_observations,
    missing_entries_site_mask,
    missing_entries_obs_mask,
    scaled_observations,
    subsampled_plate,
    deterministic_and_factor,
    locscale_reparam,
    hierarchical_nonlinear_mean,
    hierarchical_latent_scale,
    kinked_mean,
    heteroscedastic_noise,
    lognormal_latent,
    bernoulli_logistic,
    poisson_2d,
    correlated_prior_bernoulli,
    categorical_features,
    binomial_counts,
    student_t_likelihood,
    gumbel_feature_plate,
    gamma_likelihood,
    mixture_likelihood,
    missing_entries_poisson,
    five_dim_bernoulli,
    global_latent,
    feature_latent,
    unplated_batch_dim,
    integer_data,
    numpy_data,
    local_factor,
]
