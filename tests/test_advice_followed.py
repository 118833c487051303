"""Refusals whose advice works: each test triggers a refusal, checks that the message names
the site or argument and the fix, follows the advice, and checks that the call then succeeds
(against a closed form where one exists)."""

import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from experiments.zoo.references import grid_log_marginal_1d, mvn_log_prob
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import ImportanceSampling, Quadrature
from pyro_mpt.errors import NotApplicableError


def _normal_marginals_loss(x, loc, variance):
    """Minus the sum of ``log N(x_nj; loc_j, variance_j)``: ``MPTLoss(rate=1.0)``'s loss for
    a linear-Gaussian model, whose every feature is masked so each is scored alone."""
    return -torch.distributions.Normal(loc, variance.sqrt()).log_prob(x).sum()


# 1. A global latent fixed by poutine.condition is not a second observation.


def test_a_conditioned_global_is_named_and_passing_its_value_works():
    torch.manual_seed(0)
    weight, noise = torch.tensor([1.0, -0.5, 2.0]), 0.6
    x = torch.randn(10, 3)

    def model(x):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        v = pyro.sample("v", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = w + v + weight * z.unsqueeze(-1)
            pyro.sample("x", dist.Normal(loc, noise).to_event(1), obs=x)

    conditioned = poutine.condition(model, data={"w": torch.tensor(0.5)})
    with pytest.raises(ValueError, match=r"\['w'\] sit outside the plates \['data'\]") as caught:
        MPTLoss().loss(conditioned, None, x)
    message = str(caught.value)
    assert "poutine.condition" in message and "pass the value to the model" in message
    assert "Latent sites ['v'] are global too" in message and "pyro.param" in message
    assert "Concatenate" not in message

    def fixed(x, w, v):  # the advice: the global values are arguments, not sample sites
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = w + v + weight * z.unsqueeze(-1)
            pyro.sample("x", dist.Normal(loc, noise).to_event(1), obs=x)

    w, v = torch.tensor(0.5), torch.tensor(-0.25)
    loss = MPTLoss(rate=1.0).loss(fixed, None, x, w, v)
    expected = _normal_marginals_loss(x, w + v, weight**2 + noise**2)
    assert loss == pytest.approx(float(expected), rel=1e-10)
    cov = torch.outer(weight, weight) + noise**2 * torch.eye(3)
    mean = (w + v).expand(3)
    torch.testing.assert_close(log_marginal(fixed, x, w, v), mvn_log_prob(x, mean, cov))


def test_two_observations_in_the_data_plate_still_get_the_concatenate_advice():
    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1), 1.0).to_event(1), obs=x)
            pyro.sample("y", dist.Normal(z.unsqueeze(-1), 1.0).to_event(1), obs=x)

    with pytest.raises(ValueError, match=r"2 observed sites \['x', 'y'\].*Concatenate"):
        MPTLoss().loss(model, None, torch.randn(4, 2))


# 2. Observations with no feature dim: only (N, 1) data observed with .to_event(1) work.


def test_data_without_a_feature_dim_are_told_to_take_shape_n_by_1():
    torch.manual_seed(0)
    num_latent, weight = 3, 0.5

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(weight * z.sum(-1), 1.0), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))

    x = torch.randn(20)
    with pytest.raises(ValueError) as caught:
        MPTLoss(conditionals=ImportanceSampling()).loss(model, guide, x)
    message = str(caught.value)
    assert "Observed site 'x' has no feature dim (data of shape (20,))" in message
    assert "pass the data as shape (20, 1)" in message and ".to_event(1)" in message
    assert "x.shape[-2]" in message

    def model_n1(x):  # the advice: (N, 1) data, .to_event(1), plates sized by x.shape[-2]
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))
            loc = weight * z.sum(-1, keepdim=True)
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    def guide_n1(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))

    num_samples = 4096
    x1 = x.unsqueeze(-1)
    loss = MPTLoss(conditionals=ImportanceSampling(num_samples)).loss(model_n1, guide_n1, x1)
    # One feature: the only mask hides it, so the estimate is log p(x) by importance sampling
    # from the prior (the guide), against the closed form N(0, K w^2 + 1). Its error: the
    # relative spread of p(x | z) under the prior over sqrt(S), estimated independently.
    variance = num_latent * weight**2 + 1.0
    expected = -torch.distributions.Normal(0.0, math.sqrt(variance)).log_prob(x).sum()
    z = torch.randn(num_samples, num_latent)
    likelihood = torch.distributions.Normal(weight * z.sum(-1, keepdim=True), 1.0).log_prob(x).exp()
    relative_sd = likelihood.std(0) / likelihood.mean(0)
    standard_error = float((relative_sd**2).sum().sqrt()) / math.sqrt(num_samples)
    assert abs(loss - float(expected)) < 4 * standard_error + 1e-3


# 3. A HalfCauchy prior is named as such, and importance sampling with a guide applies.


def test_a_half_cauchy_prior_is_named_and_importance_with_a_guide_works():
    torch.manual_seed(0)
    x = 2.0 * torch.randn(8, 3)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            s = pyro.sample("s", dist.HalfCauchy(1.0))
            scale = s.unsqueeze(-1).expand(s.shape + x.shape[-1:])
            pyro.sample("x", dist.Normal(0.0, scale).to_event(1), obs=x)

    for conditionals in ["quadrature", "auto"]:
        with pytest.raises(NotApplicableError) as caught:
            MPTLoss(conditionals=conditionals).loss(model, None, x)
        message = str(caught.value)
        assert "Latent site 's' has a HalfCauchy prior (a transform of Cauchy)" in message
        assert "has a Cauchy prior" not in message
        assert "conditionals='importance' with a guide that samples 's'" in message

    def guide(x):  # the advice: importance sampling, proposing s from a LogNormal
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("s", dist.LogNormal(torch.zeros(x.shape[:-1]), 1.5))

    MPTLoss(conditionals="importance").loss(model, guide, x)
    # Its log p(x) against a grid over log s, repeated to measure its own spread.
    estimates = torch.stack(
        [
            log_marginal(model, x, conditionals=ImportanceSampling(2048), guide=guide)
            for _ in range(6)
        ]
    )

    def log_joint(t):  # t = log s on the grid, (G, 1)
        s = t.exp()
        prior = dist.HalfCauchy(1.0).log_prob(s) + t  # the Jacobian of s = exp(t)
        return prior + torch.distributions.Normal(0.0, s.unsqueeze(-1)).log_prob(x).sum(-1)

    reference = grid_log_marginal_1d(log_joint, lo=-12.0, hi=12.0)
    standard_error = estimates.std(0) / math.sqrt(len(estimates))
    assert bool(((estimates.mean(0) - reference).abs() < 4 * standard_error + 1e-3).all())


# 4. BatchNorm on the extra leading dims: eval mode on 2-D features.


@pytest.mark.parametrize("num_data", [4, 9], ids=["N_equals_C", "N_differs_from_C"])
def test_batch_norm_on_3d_input_gets_specific_advice_that_works(num_data):
    torch.manual_seed(0)
    num_features, noise = 4, 0.7
    linear, norm = torch.nn.Linear(1, num_features), torch.nn.BatchNorm1d(num_features)
    with torch.no_grad():  # running statistics of some earlier training
        norm.running_mean.copy_(torch.randn(num_features))
        norm.running_var.copy_(torch.rand(num_features) + 0.5)
    norm.eval()
    x = torch.randn(num_data, num_features)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(norm(linear(z)), noise).to_event(1), obs=x)

    state = {k: v.clone() for k, v in norm.state_dict().items()}
    for conditionals in ["auto", Quadrature(20)]:
        with pytest.raises(ValueError) as caught:
            MPTLoss(conditionals=conditionals).loss(model, None, x)
        message = str(caught.value)
        assert "The model calls BatchNorm1d(4) in eval mode" in message
        assert "norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)" in message
        assert "LayerNorm" in message and ".eval()" in message
    # The check runs the model once more and leaves the layer's statistics as they were.
    for key, value in norm.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)

    def fixed(x):  # the advice: eval mode, on the features in 2-D
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            h = linear(z)
            loc = norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)
            pyro.sample("x", dist.Normal(loc, noise).to_event(1), obs=x)

    # In eval mode the decoder is affine: loc = b + a z, in closed form.
    scale = (norm.weight / (norm.running_var + norm.eps).sqrt()).detach()
    a = (linear.weight.squeeze(-1) * scale).detach()
    b = ((linear.bias - norm.running_mean) * scale + norm.bias).detach()
    with torch.no_grad():
        loss = MPTLoss(rate=1.0).loss(fixed, None, x)
        cov = torch.outer(a, a) + noise**2 * torch.eye(num_features)
        torch.testing.assert_close(log_marginal(fixed, x), mvn_log_prob(x, b, cov))
    assert loss == pytest.approx(float(_normal_marginals_loss(x, b, a**2 + noise**2)), rel=1e-8)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_under_importance_gets_the_same_advice(training):
    """Importance sampling runs the model on (samples, masks) + batch: a BatchNorm1d then sees
    4-D input, which torch refuses with a ValueError of its own; the advice replaces it."""
    torch.manual_seed(0)
    decoder = torch.nn.Sequential(
        torch.nn.Linear(2, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 5)
    )
    decoder.train(training)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(decoder(z), 0.5).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))

    x = torch.randn(16, 5)
    with pytest.raises(ValueError) as caught:
        MPTLoss(conditionals=ImportanceSampling(16)).loss(model, guide, x)
    message = str(caught.value)
    mode = "training" if training else "eval"
    assert message.startswith("The model failed when run at the guide's samples (expected 2D")
    assert f"The model calls BatchNorm1d(8) in {mode} mode" in message
    assert "Trace Shapes" not in message


def test_a_guide_with_batch_norm_is_told_about_it():
    torch.manual_seed(0)
    num_latent = 5
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 2 * num_latent), torch.nn.BatchNorm1d(10))
    encoder.eval()
    decoder = torch.nn.Linear(num_latent, 4)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            h = encoder(x)
            pyro.sample("z", dist.Normal(h[..., :num_latent], 1.0).to_event(1))

    x = torch.bernoulli(torch.full((6, 4), 0.5))
    with pytest.raises(NotApplicableError, match=r"The guide calls BatchNorm1d\(10\) in eval"):
        MPTLoss(conditionals="importance").loss(model, guide, x)

    def fixed_guide(x):
        with pyro.plate("data", x.shape[-2]):
            h = encoder[0](x)
            h = encoder[1](h.reshape(-1, h.shape[-1])).reshape(h.shape)
            pyro.sample("z", dist.Normal(h[..., :num_latent], 1.0).to_event(1))

    assert math.isfinite(MPTLoss(conditionals="importance").loss(model, fixed_guide, x))


# 5. auto's own error does not advise conditionals='auto'.


def _bernoulli_model(num_latent, num_features=4):
    decoder = torch.nn.Linear(num_latent, num_features)

    def model(x):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(num_latent), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x)

    return model


def test_auto_advises_what_gets_past_it():
    model = _bernoulli_model(num_latent=5)
    x = torch.bernoulli(torch.full((6, 4), 0.5))
    loss = MPTLoss()
    with pytest.raises(NotApplicableError, match="found no strategy") as caught:
        loss.loss(model, None, x)
    message = str(caught.value)
    assert "Use conditionals='auto'" not in message
    assert "Observed site 'x' has a Bernoulli likelihood" in message  # the reasons stay
    assert "needs a guide that samples every local latent" in message
    assert "AutoNormal(model)" in message
    # The advice: a guide that samples every latent.
    with pytest.warns(UserWarning):  # AutoNormal's first, narrow proposal may be flagged
        value = loss.loss(model, AutoNormal(model), x)
    assert math.isfinite(value)
    assert isinstance(loss.conditionals.chosen, ImportanceSampling)


# 6. A guide that flattens with x.reshape(-1, D) is told to keep the leading dims.


def test_a_flattening_guide_is_told_to_keep_the_leading_dims():
    torch.manual_seed(0)
    num_latent, num_features = 5, 4
    model = _bernoulli_model(num_latent, num_features)
    encoder = torch.nn.Linear(num_features, 2 * num_latent)

    def guide(x):
        pyro.module("encoder", encoder)
        h = encoder(x.reshape(-1, num_features))
        with pyro.plate("data", x.shape[-2]):
            loc, scale = h[..., :num_latent], h[..., num_latent:].exp()
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    x = torch.bernoulli(torch.full((6, num_features), 0.5))
    for conditionals in ["auto", "importance"]:
        with pytest.raises(NotApplicableError) as caught:
            MPTLoss(conditionals=conditionals).loss(model, guide, x)
        message = str(caught.value)
        assert "guide flattens its input with reshape(-1, num_features)" in message
        assert "x.reshape(x.shape[:-1] + (-1,))" in message

    def fixed_guide(x):  # the advice: flatten the feature dims only
        pyro.module("encoder", encoder)
        h = encoder(x.reshape(x.shape[:-1] + (-1,)))
        with pyro.plate("data", x.shape[-2]):
            loc, scale = h[..., :num_latent], h[..., num_latent:].exp()
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    loss = MPTLoss(conditionals="importance")
    assert math.isfinite(loss.loss(model, fixed_guide, x))
