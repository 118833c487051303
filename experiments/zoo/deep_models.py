"""Models beyond quadrature's reach for ``tests/test_models_beyond_quadrature.py`` and
``benchmarks/beyond_quadrature_table.py``, written
as Pyro's examples write them (data first, plates sized by ``x.shape[-2]``, networks through
``pyro.module``), each trained briefly and paired with an independent reference of
``log p(x)`` per observation computed here in plain torch, float64.

References: a closed form or a trapezoid grid where the latent allows, exact enumeration for
a discrete latent, otherwise a large-sample importance estimate with a widened proposal,
returned with its standard error and the Pareto k-hat of its own weights (ArviZ), so a test
can check that the reference itself is trustworthy. Long because each model, its training
and its reference is written out in full.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import arviz
import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal
from torch import nn

from experiments.zoo.cases import seeded
from experiments.zoo.references import trapezoid_log_weights

__all__ = [
    "DeepCase",
    "Reference",
    "bernoulli_vae",
    "eight_schools",
    "gaussian_mixture",
    "log_mean_exp",
    "prodlda",
    "semi_supervised_vae",
    "sparse_gamma_def",
]

#: Observations scored per model: few, so a test takes seconds.
NUM_OBS = 8


@dataclass
class Reference:
    """``log p(x)`` per observation from an independent computation.

    :ivar value: the estimate, shape ``(N,)``.
    :ivar se: its standard error, ``(N,)`` (zeros for closed forms, grids, enumeration).
    :ivar khat: the Pareto k-hat of the reference's own importance weights, ``(N,)``, or
        None where no sampling is involved.
    """

    value: torch.Tensor
    se: torch.Tensor
    khat: torch.Tensor | None = None


@dataclass
class DeepCase:
    """A trained model, its guide, its data and its reference.

    :ivar name: a short name (the test id).
    :ivar model: the Pyro model; ``model(*args)``.
    :ivar guide: its guide.
    :ivar args: the model's arguments, the data first.
    :ivar state: the param store's state after training (restore it before scoring).
    :ivar reference: the independent ``log p(x)`` per observation, or None for a model that
        must be refused.
    :ivar iwae: the IWAE bound with the guide's own proposal and many samples (a sanity
        check on the reference: it must not exceed it), or None.
    """

    name: str
    model: Callable
    guide: Callable
    args: tuple
    state: dict
    reference: Reference | None
    iwae: Reference | None = None

    @property
    def data(self):
        return self.args[0]

    def restore(self):
        """Puts the trained parameters back in the (cleared) param store."""
        pyro.clear_param_store()
        pyro.get_param_store().set_state(self.state)


def log_mean_exp(log_w):
    """``log mean_s exp(log_w_s)`` over dim 0, its delta-method standard error
    ``std(w) / (mean(w) sqrt(S))``, and the Pareto k-hat of the weights (ArviZ's PSIS).

    :param torch.Tensor log_w: ``(S, N)`` log importance weights.
    :returns: a :class:`Reference`.
    """
    num = log_w.shape[0]
    top = log_w.amax(0)
    w = torch.exp(log_w - top)
    value = torch.log(w.mean(0)) + top
    se = w.std(0) / (w.mean(0) * math.sqrt(num))
    _, khat = arviz.psislw(log_w.T.detach().cpu().numpy())
    return Reference(value, se, torch.as_tensor(khat, dtype=log_w.dtype))


def _train(model, guide, args, loss, num_steps, lr):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss)
    for _ in range(num_steps):
        svi.step(*args)


def _batched(num_samples, chunk, fn):
    """``fn(n)`` for chunks of ``n`` samples, concatenated along dim 0."""
    sizes = [chunk] * (num_samples // chunk) + (
        [num_samples % chunk] if num_samples % chunk else []
    )
    return torch.cat([fn(n) for n in sizes], 0)


def _widened(loc, scale, factor=1.5, df=5.0):
    """A heavy-tailed, wider copy of a Gaussian proposal: Student-t with ``df`` degrees of
    freedom and ``factor`` times the scale, so the reference's weights stay bounded where the
    guide is too narrow."""
    return torch.distributions.StudentT(df, loc, factor * scale)


def _cat(*tensors):
    """Concatenates along the last dim after broadcasting the leading dims."""
    shape = torch.broadcast_shapes(*(t.shape[:-1] for t in tensors))
    return torch.cat([t.expand(shape + t.shape[-1:]) for t in tensors], -1)


def _bernoulli_ll(logits, x):
    """``sum_d log Bernoulli(x_d; logits_d)``."""
    return -F.binary_cross_entropy_with_logits(logits, x.expand_as(logits), reduction="none").sum(
        -1
    )


# --------------------------------------------------------------------------------------
# 1. A deep Bernoulli VAE with its amortized encoder as guide.
# --------------------------------------------------------------------------------------


class _Decoder(nn.Module):
    def __init__(self, z_dim, hidden_dim, x_dim):
        super().__init__()
        self.fc1 = nn.Linear(z_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, x_dim)

    def forward(self, z):
        return self.fc2(F.softplus(self.fc1(z)))  # logits


class _Encoder(nn.Module):
    def __init__(self, x_dim, hidden_dim, z_dim):
        super().__init__()
        self.fc1 = nn.Linear(x_dim, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, z_dim)
        self.fc22 = nn.Linear(hidden_dim, z_dim)

    def forward(self, x):
        hidden = F.softplus(self.fc1(x))
        return self.fc21(hidden), torch.exp(self.fc22(hidden))


class BernoulliVAE(nn.Module):
    """A VAE with a one-hidden-layer decoder to Bernoulli logits and a one-hidden-layer
    Gaussian encoder, as in Pyro's VAE tutorial."""

    def __init__(self, x_dim=12, z_dim=6, hidden_dim=32):
        super().__init__()
        self.z_dim = z_dim
        self.decoder = _Decoder(z_dim, hidden_dim, x_dim)
        self.encoder = _Encoder(x_dim, hidden_dim, z_dim)

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[-2]):
            z_loc = x.new_zeros(x.shape[:-1] + (self.z_dim,))
            z_scale = x.new_ones(x.shape[:-1] + (self.z_dim,))
            z = pyro.sample("z", dist.Normal(z_loc, z_scale).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=self.decoder(z)).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[-2]):
            z_loc, z_scale = self.encoder(x)
            pyro.sample("z", dist.Normal(z_loc, z_scale).to_event(1))


def _binary_data(num, x_dim, seed):
    """Binary data from a 2-D latent through a random nonlinear map: structure a VAE can
    learn, with correlations across features."""
    with seeded(seed):
        mixing = 2.0 * torch.randn(2, x_dim)
        offset = torch.randn(x_dim)
        z = torch.randn(num, 2)
        logits = 4.0 * torch.tanh(z @ mixing + offset)
        return torch.bernoulli(torch.sigmoid(logits))


def _gaussian_encoder_reference(log_joint, loc, scale, num_samples, chunk=5000):
    """``log p(x)`` by importance sampling from a widened Student-t copy of a Gaussian
    encoder ``N(loc, scale)`` (``(N, K)`` each), and the IWAE bound with the encoder itself.

    :param log_joint: maps latents ``(S, N, K)`` to ``log p(x, z)``, ``(S, N)``.
    """
    proposal = _widened(loc, scale)
    encoder = torch.distributions.Normal(loc, scale)

    def weights(q):
        def draw(n):
            z = q.sample((n,))
            return log_joint(z) - q.log_prob(z).sum(-1)

        return _batched(num_samples, chunk, draw)

    return log_mean_exp(weights(proposal)), log_mean_exp(weights(encoder))


@functools.cache
def bernoulli_vae(num_samples=30_000):
    """The Bernoulli VAE (12 binary features, a 6-D latent, 32 hidden units), trained for
    400 steps of ``Trace_ELBO`` on 256 synthetic observations; scored on 8 of them."""
    with seeded(1):
        pyro.clear_param_store()
        vae = BernoulliVAE()
        train = _binary_data(256, 12, seed=11)
        _train(vae.model, vae.guide, (train,), Trace_ELBO(), 400, 0.02)
        x = train[:NUM_OBS]
        state = pyro.get_param_store().get_state()
        with torch.no_grad():
            loc, scale = vae.encoder(x)

            def log_joint(z):
                prior = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
                return prior + _bernoulli_ll(vae.decoder(z), x)

            reference, iwae = _gaussian_encoder_reference(log_joint, loc, scale, num_samples)
    return DeepCase("bernoulli_vae", vae.model, vae.guide, (x,), state, reference, iwae)


# --------------------------------------------------------------------------------------
# 2. The semi-supervised VAE (M2) on an unlabelled batch.
# --------------------------------------------------------------------------------------


class SemiSupervisedVAE(nn.Module):
    """M2 (Kingma et al., 2014) as in Pyro's SS-VAE example: ``y ~ Categorical``,
    ``z ~ N(0, I)``, ``x | y, z ~ Bernoulli(decoder(z, y))``; guide ``q(y | x) q(z | x, y)``.
    Scored on an unlabelled batch, so ``y`` is a local discrete latent."""

    def __init__(self, x_dim=12, num_classes=3, z_dim=4, hidden_dim=32):
        super().__init__()
        self.num_classes, self.z_dim = num_classes, z_dim
        self.decoder = nn.Sequential(
            nn.Linear(z_dim + num_classes, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, x_dim)
        )
        self.encoder_y = nn.Sequential(
            nn.Linear(x_dim, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, num_classes)
        )
        self.encoder_z = nn.Sequential(
            nn.Linear(x_dim + num_classes, hidden_dim),
            nn.Softplus(),
            nn.Linear(hidden_dim, 2 * z_dim),
        )

    def _one_hot(self, y):
        return F.one_hot(y, self.num_classes).to(torch.get_default_dtype())

    def decode(self, z, y):
        return self.decoder(_cat(z, self._one_hot(y)))

    def encode_z(self, x, y):
        loc, log_scale = self.encoder_z(_cat(x, self._one_hot(y))).chunk(2, -1)
        return loc, log_scale.exp()

    def model(self, x):
        pyro.module("ss_vae", self)
        with pyro.plate("data", x.shape[-2]):
            alpha_prior = x.new_ones(x.shape[:-1] + (self.num_classes,)) / self.num_classes
            y = pyro.sample("y", dist.Categorical(alpha_prior))
            z_loc = x.new_zeros(x.shape[:-1] + (self.z_dim,))
            z = pyro.sample("z", dist.Normal(z_loc, 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=self.decode(z, y)).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("ss_vae", self)
        with pyro.plate("data", x.shape[-2]):
            y = pyro.sample("y", dist.Categorical(logits=self.encoder_y(x)))
            z_loc, z_scale = self.encode_z(x, y)
            pyro.sample("z", dist.Normal(z_loc, z_scale).to_event(1))


def _class_data(num, x_dim, num_classes, seed):
    """Binary data from three class prototypes with a 2-D continuous style on top."""
    with seeded(seed):
        prototypes = 3.0 * torch.randn(num_classes, x_dim)
        mixing = 1.5 * torch.randn(2, x_dim)
        y = torch.randint(num_classes, (num,))
        logits = prototypes[y] + torch.tanh(torch.randn(num, 2) @ mixing)
        return torch.bernoulli(torch.sigmoid(logits))


@functools.cache
def semi_supervised_vae(num_samples=20_000):
    """M2 with 12 binary features, 3 classes and a 4-D ``z``, trained for 300 steps of
    ``TraceEnum_ELBO`` (``y`` enumerated in the guide) on 256 unlabelled observations.

    Reference: ``log p(x) = LSE_y(log p(y) + log p(x | y))``, each ``p(x | y)`` by importance
    sampling from a widened copy of ``q(z | x, y)``; its standard error combines the
    classes' by the delta method. The IWAE bound draws ``y`` and ``z`` from the guide.
    """
    with seeded(2):
        pyro.clear_param_store()
        m2 = SemiSupervisedVAE()
        train = _class_data(256, 12, 3, seed=12)
        loss = TraceEnum_ELBO(max_plate_nesting=1)
        _train(m2.model, config_enumerate(m2.guide, "parallel"), (train,), loss, 300, 0.02)
        x = train[:NUM_OBS]
        state = pyro.get_param_store().get_state()
        with torch.no_grad():
            reference = _m2_reference(m2, x, num_samples)
            iwae = _m2_iwae(m2, x, num_samples)
    return DeepCase("semi_supervised_vae", m2.model, m2.guide, (x,), state, reference, iwae)


def _m2_reference(m2, x, num_samples):
    log_prior_y = -math.log(m2.num_classes)
    values, variances = [], []
    for label in range(m2.num_classes):
        y = torch.full(x.shape[:-1], label, dtype=torch.long)
        loc, scale = m2.encode_z(x, y)
        proposal = _widened(loc, scale)

        def draw(n, y=y, proposal=proposal):
            z = proposal.sample((n,))
            prior = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
            return prior + _bernoulli_ll(m2.decode(z, y), x) - proposal.log_prob(z).sum(-1)

        class_ref = log_mean_exp(_batched(num_samples, 5000, draw))
        values.append(log_prior_y + class_ref.value)
        variances.append(class_ref.se**2)
    values = torch.stack(values)
    total = torch.logsumexp(values, 0)
    # d log sum_y exp(v_y) / d v_y = softmax(v)_y: the classes' errors are independent.
    share = torch.softmax(values, 0)
    se = ((share**2) * torch.stack(variances)).sum(0).sqrt()
    return Reference(total, se)


def _m2_iwae(m2, x, num_samples):
    def draw(n):
        q_y = torch.distributions.Categorical(logits=m2.encoder_y(x))
        y = q_y.sample((n,))
        loc, scale = m2.encode_z(x, y)
        q_z = torch.distributions.Normal(loc, scale)
        z = q_z.sample()
        log_p = -math.log(m2.num_classes) + torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
        log_p = log_p + _bernoulli_ll(m2.decode(z, y), x)
        return log_p - q_y.log_prob(y) - q_z.log_prob(z).sum(-1)

    return log_mean_exp(_batched(num_samples, 5000, draw))


# --------------------------------------------------------------------------------------
# 3. A two-layer sparse-gamma deep exponential family with AutoNormal.
# --------------------------------------------------------------------------------------

#: The Gamma shape and rate of the latents, as in Pyro's examples/sparse_gamma_def.py.
DEF_ALPHA_Z, DEF_BETA_Z = 0.1, 0.1


class SparseGammaDEF:
    """Two layers of Pyro's sparse-gamma DEF: ``z_top ~ Gamma(a, b)``,
    ``z_bottom ~ Gamma(a, b / (z_top @ w_top))``, ``x ~ Poisson(z_bottom @ w_bottom)``; the
    weights are positive parameters (point estimates), the latents local to each row."""

    def __init__(self, top_width=2, bottom_width=4, x_dim=10):
        self.top_width, self.bottom_width, self.x_dim = top_width, bottom_width, x_dim

    def model(self, x):
        w_top = pyro.param(
            "w_top",
            lambda: torch.full((self.top_width, self.bottom_width), 1.0),
            constraint=dist.constraints.positive,
        )
        w_bottom = pyro.param(
            "w_bottom",
            lambda: torch.full((self.bottom_width, self.x_dim), 1.0),
            constraint=dist.constraints.positive,
        )
        with pyro.plate("data", x.shape[-2]):
            z_top = pyro.sample(
                "z_top",
                dist.Gamma(x.new_tensor(DEF_ALPHA_Z), DEF_BETA_Z)
                .expand([self.top_width])
                .to_event(1),
            )
            mean_bottom = z_top @ w_top
            z_bottom = pyro.sample(
                "z_bottom", dist.Gamma(DEF_ALPHA_Z, DEF_BETA_Z / mean_bottom).to_event(1)
            )
            pyro.sample("x", dist.Poisson(z_bottom @ w_bottom).to_event(1), obs=x)

    @staticmethod
    def log_prior(z_top, z_bottom, w_top):
        """``log p(z_top) + log p(z_bottom | z_top)`` in plain torch: ``(S, N)``."""

        def gamma(rate):
            return torch.distributions.Gamma(DEF_ALPHA_Z, rate, validate_args=False)

        log_p = gamma(DEF_BETA_Z).log_prob(z_top).sum(-1)
        return log_p + gamma(DEF_BETA_Z / (z_top @ w_top)).log_prob(z_bottom).sum(-1)

    def log_joint(self, z_top, z_bottom, x, w_top, w_bottom):
        """``log p(x, z)`` in plain torch: ``(S, N)``."""
        likelihood = torch.distributions.Poisson(z_bottom @ w_bottom, validate_args=False)
        return self.log_prior(z_top, z_bottom, w_top) + likelihood.log_prob(x).sum(-1)


def _def_data(num, model, seed):
    with seeded(seed):
        w_top = torch.distributions.Gamma(1.0, 1.0).sample((model.top_width, model.bottom_width))
        w_bottom = torch.distributions.Gamma(1.0, 0.3).sample((model.bottom_width, model.x_dim))
        z_top = torch.distributions.Gamma(DEF_ALPHA_Z, DEF_BETA_Z).sample((num, model.top_width))
        z_top = z_top.clamp(min=1e-3)
        z_bottom = torch.distributions.Gamma(DEF_ALPHA_Z, DEF_BETA_Z / (z_top @ w_top)).sample()
        return torch.poisson(z_bottom @ w_bottom), w_top, w_bottom


@functools.cache
def sparse_gamma_def(num_samples=80_000):
    """The two-layer DEF (10 count features, 2 + 4 latents per row) with an ``AutoNormal``
    guide, trained for 600 steps of ``Trace_ELBO`` (weights and guide) on 8 rows.

    Reference: importance sampling in log space from :class:`_DefensiveProposal` (the
    Jacobian of ``exp`` included). No IWAE check: the AutoNormal's own weights have k-hat
    near 1 even on the full data, so its bound is no sanity check here.
    """
    with seeded(3):
        pyro.clear_param_store()
        sgdef = SparseGammaDEF()
        x, w_top, w_bottom = _def_data(NUM_OBS, sgdef, seed=13)
        pyro.param("w_top", w_top, constraint=dist.constraints.positive)
        pyro.param("w_bottom", w_bottom, constraint=dist.constraints.positive)
        guide = AutoNormal(sgdef.model)
        _train(sgdef.model, guide, (x,), Trace_ELBO(), 600, 0.05)
        state = pyro.get_param_store().get_state()
        with torch.no_grad():
            reference = _def_reference(sgdef, x, num_samples)
    return DeepCase("sparse_gamma_def", sgdef.model, guide, (x,), state, reference)


class _DefensiveProposal:
    """A proposal for ``u = log z`` of the DEF: with probability 1/2 the prior (so every
    weight is at most twice the likelihood, and a row the data barely constrain is
    proposed well), else, per coordinate, an equal mixture of a widened Student-t copy of
    the guide and a Cauchy of scale 10 around it (a Gamma(0.1, .) latent has a left tail
    ``exp(0.1 u)`` in log space, which the Cauchy outlasts)."""

    def __init__(self, sgdef, loc, scale, w_top):
        self.sgdef, self.w_top = sgdef, w_top
        wide = torch.distributions.Cauchy(loc, torch.full_like(scale, 10.0))
        self.parts = (_widened(loc, scale), wide)

    def _prior_sample(self, shape):
        gamma = torch.distributions.Gamma
        batch = shape + self.parts[0].loc.shape[:-1]
        z_top = gamma(DEF_ALPHA_Z, DEF_BETA_Z).sample(batch + (self.sgdef.top_width,))
        z_top = z_top.clamp(min=1e-300)
        z_bottom = gamma(DEF_ALPHA_Z, DEF_BETA_Z / (z_top @ self.w_top), validate_args=False)
        z = torch.cat([z_top, z_bottom.sample().clamp(min=1e-300)], -1)
        return z.log()

    def _prior_log_prob(self, u):
        z = u.exp()
        z_top, z_bottom = z[..., : self.sgdef.top_width], z[..., self.sgdef.top_width :]
        return self.sgdef.log_prior(z_top, z_bottom, self.w_top) + u.sum(-1)

    def sample(self, shape):
        draws = [part.sample(shape) for part in self.parts]
        pick = torch.rand(draws[0].shape) < 0.5
        guided = torch.where(pick, draws[0], draws[1])
        from_prior = torch.rand(guided.shape[:-1] + (1,)) < 0.5
        return torch.where(from_prior, self._prior_sample(shape), guided)

    def log_prob(self, u):
        """``log q(u)``, summed over coordinates: shape ``u.shape[:-1]``."""
        per_coordinate = torch.stack([part.log_prob(u) for part in self.parts])
        guided = (torch.logsumexp(per_coordinate, 0) - math.log(2.0)).sum(-1)
        both = torch.stack([guided, self._prior_log_prob(u)])
        return torch.logsumexp(both, 0) - math.log(2.0)


def _def_reference(sgdef, x, num_samples):
    store = pyro.get_param_store()
    w_top, w_bottom = store["w_top"], store["w_bottom"]
    loc = torch.cat([store["AutoNormal.locs.z_top"], store["AutoNormal.locs.z_bottom"]], -1)
    scale = torch.cat([store["AutoNormal.scales.z_top"], store["AutoNormal.scales.z_bottom"]], -1)
    proposal = _DefensiveProposal(sgdef, loc, scale, w_top)

    def draw(n):
        u = proposal.sample((n,))
        # Beyond |u| = 300 the prior holds under exp(-30) of its mass: weight 0 there (exp
        # would overflow).
        inside = (u.abs() <= 300.0).all(-1)
        z = u.clamp(-300.0, 300.0).exp()
        z_top, z_bottom = z[..., : sgdef.top_width], z[..., sgdef.top_width :]
        log_joint = sgdef.log_joint(z_top, z_bottom, x, w_top, w_bottom)
        log_w = log_joint + u.sum(-1) - proposal.log_prob(u)  # + log |dz/du|
        return torch.where(inside, log_w, -math.inf)

    return log_mean_exp(_batched(num_samples, 20_000, draw))


# --------------------------------------------------------------------------------------
# 4. A Gaussian mixture with fixed components and an amortized categorical guide.
# --------------------------------------------------------------------------------------


class GaussianMixture(nn.Module):
    """``c ~ Categorical(weights)``, ``x ~ N(locs[c], scales[c])`` over ``D`` features, with
    the mixture's weights, locations and scales fixed; guide ``q(c | x)`` a small MLP."""

    def __init__(self, weights, locs, scales, hidden_dim=16):
        super().__init__()
        self.weights, self.locs, self.scales = weights, locs, scales
        num_components, x_dim = locs.shape
        self.classifier = nn.Sequential(
            nn.Linear(x_dim, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, num_components)
        )

    def model(self, x):
        with pyro.plate("data", x.shape[-2]):
            c = pyro.sample("c", dist.Categorical(self.weights))
            pyro.sample("x", dist.Normal(self.locs[c], self.scales[c]).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("classifier", self.classifier)
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("c", dist.Categorical(logits=self.classifier(x)))

    def sample(self, num):
        c = torch.distributions.Categorical(self.weights).sample((num,))
        return torch.normal(self.locs[c], self.scales[c])

    def log_marginal(self, x):
        """Exact: ``LSE_c(log w_c + sum_d log N(x_d; loc_cd, scale_cd))``."""
        components = torch.distributions.Normal(self.locs, self.scales)
        log_joint = self.weights.log() + components.log_prob(x.unsqueeze(-2)).sum(-1)
        return torch.logsumexp(log_joint, -1)


@functools.cache
def gaussian_mixture(x_dim):
    """Three fixed, well-separated components in ``x_dim`` features; the classifier guide
    trained for 300 steps of ``TraceEnum_ELBO`` on 256 draws. Reference: enumeration."""
    with seeded(4):
        pyro.clear_param_store()
        weights = torch.tensor([0.5, 0.3, 0.2])
        locs = 2.5 * torch.randn(3, x_dim)
        scales = 0.5 + torch.rand(3, x_dim)
        mixture = GaussianMixture(weights, locs, scales)
        train = mixture.sample(256)
        loss = TraceEnum_ELBO(max_plate_nesting=1)
        guide = config_enumerate(mixture.guide, "parallel")
        _train(mixture.model, guide, (train,), loss, 300, 0.02)
        x = train[:NUM_OBS]
        state = pyro.get_param_store().get_state()
        with torch.no_grad():
            value = mixture.log_marginal(x)
    reference = Reference(value, torch.zeros_like(value))
    name = f"gaussian_mixture_d{x_dim}"
    return DeepCase(name, mixture.model, mixture.guide, (x,), state, reference)


# --------------------------------------------------------------------------------------
# 5. Eight schools with several observations per school.
# --------------------------------------------------------------------------------------

#: The classic eight-schools standard errors; each school here has four observations of
#: twice that noise, so their mean has the classic standard error.
EIGHT_SCHOOLS_SIGMA = (15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0)
#: The population mean and spread of the school effects (fixed, as type-II point values).
EIGHT_SCHOOLS_MU, EIGHT_SCHOOLS_TAU = 4.4, 3.6
STUDENT_T_DF = 4.0


def eight_schools_model(likelihood):
    """``theta_j ~ N(mu, tau)`` per school (the data plate), ``y_jk ~ N(theta_j, sigma_j)``
    (or Student-t) for the school's ``k = 1..4`` observations (the features)."""

    def model(y, sigma):
        with pyro.plate("schools", y.shape[-2]):
            theta = pyro.sample("theta", dist.Normal(EIGHT_SCHOOLS_MU, EIGHT_SCHOOLS_TAU))
            loc = theta.unsqueeze(-1)
            scale = sigma.unsqueeze(-1)
            if likelihood == "normal":
                fn = dist.Normal(loc, scale)
            else:
                fn = dist.StudentT(STUDENT_T_DF, loc, scale)
            pyro.sample("y", fn.expand(loc.shape[:-1] + y.shape[-1:]).to_event(1), obs=y)

    model.__name__ = model.__qualname__ = f"eight_schools_{likelihood}"
    return model


def _eight_schools_data(seed):
    with seeded(seed):
        sigma = 2.0 * torch.tensor(EIGHT_SCHOOLS_SIGMA)
        theta = EIGHT_SCHOOLS_MU + EIGHT_SCHOOLS_TAU * torch.randn(8)
        y = theta.unsqueeze(-1) + sigma.unsqueeze(-1) * torch.randn(8, 4)
        return y, sigma


def eight_schools_closed_form(y, sigma):
    """``y_j ~ N(mu 1, tau^2 1 1^T + sigma_j^2 I)``: the Gaussian marginal of each school."""
    num = y.shape[-1]
    cov = EIGHT_SCHOOLS_TAU**2 * torch.ones(num, num) + torch.diag_embed(
        (sigma**2).unsqueeze(-1).expand(y.shape)
    )
    mean = torch.full_like(y, EIGHT_SCHOOLS_MU)
    return torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(y)


def eight_schools_grid(y, sigma, num_points=20_001):
    """``log ∫ N(theta; mu, tau) prod_k t_4(y_k; theta, sigma) dtheta`` by the trapezoid rule
    over ``mu +- 14 tau``: the Student-t variant's reference."""
    nodes, log_w = trapezoid_log_weights(
        EIGHT_SCHOOLS_MU - 14 * EIGHT_SCHOOLS_TAU,
        EIGHT_SCHOOLS_MU + 14 * EIGHT_SCHOOLS_TAU,
        num_points,
    )
    theta = nodes[:, None, None]
    prior = torch.distributions.Normal(EIGHT_SCHOOLS_MU, EIGHT_SCHOOLS_TAU).log_prob(nodes)
    lik = torch.distributions.StudentT(STUDENT_T_DF, theta, sigma[:, None]).log_prob(y).sum(-1)
    return torch.logsumexp(log_w[:, None] + prior[:, None] + lik, 0)


@functools.cache
def eight_schools(likelihood):
    """Eight schools, four observations each, with a Normal or Student-t likelihood; an
    ``AutoNormal`` guide trained for 500 steps of ``Trace_ELBO``. Reference: the Gaussian
    closed form, or a 1-D grid."""
    with seeded(5):
        pyro.clear_param_store()
        y, sigma = _eight_schools_data(seed=15)
        model = eight_schools_model(likelihood)
        guide = AutoNormal(model)
        _train(model, guide, (y, sigma), Trace_ELBO(), 500, 0.1)
        state = pyro.get_param_store().get_state()
    if likelihood == "normal":
        value = eight_schools_closed_form(y, sigma)
    else:
        value = eight_schools_grid(y, sigma)
    reference = Reference(value, torch.zeros_like(value))
    return DeepCase(f"eight_schools_{likelihood}", model, guide, (y, sigma), state, reference)


# --------------------------------------------------------------------------------------
# 6. ProdLDA's decoder: a softmax over dim=1.
# --------------------------------------------------------------------------------------


class ProdLDA(nn.Module):
    """ProdLDA as in Pyro's tutorial (Srivastava & Sutton, 2017), with the word counts of a
    document scored by a Poisson per word (rate: the document's length times the decoder's
    word probabilities) so the likelihood factorises over words. The decoder normalises
    with ``softmax(..., dim=1)`` as the tutorial's does: right for a ``(documents, topics)``
    input, wrong when extra batch dims sit left of the documents (``softmax_dim=-1`` is the
    broadcasting spelling)."""

    def __init__(self, vocab_size=10, num_topics=4, hidden_dim=16, softmax_dim=1):
        super().__init__()
        self.num_topics, self.softmax_dim = num_topics, softmax_dim
        self.beta = nn.Linear(num_topics, vocab_size, bias=False)
        self.encoder = nn.Sequential(
            nn.Linear(vocab_size, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, 2 * num_topics)
        )

    def decode(self, theta):
        return F.softmax(self.beta(theta), dim=self.softmax_dim)

    def model(self, docs):
        pyro.module("decoder", self.beta)
        with pyro.plate("documents", docs.shape[-2]):
            logtheta_loc = docs.new_zeros(docs.shape[:-1] + (self.num_topics,))
            logtheta = pyro.sample("logtheta", dist.Normal(logtheta_loc, 1.0).to_event(1))
            theta = F.softmax(logtheta, -1)
            rate = docs.sum(-1, keepdim=True) * self.decode(theta)
            pyro.sample("obs", dist.Poisson(rate).to_event(1), obs=docs)

    def guide(self, docs):
        pyro.module("encoder", self.encoder)
        with pyro.plate("documents", docs.shape[-2]):
            loc, log_scale = self.encoder(docs).chunk(2, -1)
            pyro.sample("logtheta", dist.Normal(loc, log_scale.exp()).to_event(1))


@functools.cache
def prodlda(softmax_dim=1):
    """ProdLDA with 10 words and 4 topics on 8 random documents, untrained (what is tested
    is the decoder's normalisation, not its fit); no reference."""
    with seeded(6):
        pyro.clear_param_store()
        lda = ProdLDA(softmax_dim=softmax_dim)
        docs = torch.poisson(torch.full((NUM_OBS, 10), 2.0))
    state = pyro.get_param_store().get_state()
    name = f"prodlda_softmax_dim{softmax_dim}"
    return DeepCase(name, lda.model, lda.guide, (docs,), state, None)
