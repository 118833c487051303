"""``conditionals="auto"`` remembers its choice, and searches again when it stops applying."""

import pyro
import pyro.distributions as dist
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.models import LinearVAE


class _Counting:
    """Counts the calls of a strategy class's ``prepare``."""

    def __init__(self, monkeypatch, cls):
        self.calls = 0
        prepare = cls.prepare

        def counted(strategy, *args, **kwargs):
            self.calls += 1
            return prepare(strategy, *args, **kwargs)

        monkeypatch.setattr(cls, "prepare", counted)


def test_auto_goes_straight_to_its_choice(monkeypatch):
    pyro.clear_param_store()
    vae = LinearVAE(6, latent_dim=2)
    x = torch.bernoulli(torch.full((10, 6), 0.5))
    exact, quadrature = _Counting(monkeypatch, Exact), _Counting(monkeypatch, Quadrature)
    loss = MPTLoss()
    loss.loss(vae.model, vae.guide, x)
    chosen = loss.conditionals.chosen
    # The search prepares the 20-node rule and a 30-node rule that confirms it converged.
    assert isinstance(chosen, Quadrature) and chosen.num_points == 20
    assert (exact.calls, quadrature.calls) == (1, 2)
    loss.loss(vae.model, vae.guide, x.flip(0))
    # The same Quadrature object, and no second try of the exact strategy; the 2nd call
    # measures the rule on its batch (the 30-node rule once more).
    assert loss.conditionals.chosen is chosen and (exact.calls, quadrature.calls) == (1, 4)
    loss.loss(vae.model, vae.guide, x)
    assert (exact.calls, quadrature.calls) == (1, 5)
    # Another batch shape: the search runs again.
    loss.loss(vae.model, vae.guide, x[:7])
    assert (exact.calls, quadrature.calls) == (2, 7)


def _switchable_model():
    """A linear model with 2 latents whose likelihood switches from normal (exact
    conditionals apply) to Bernoulli (they do not) when ``likelihood["kind"]`` is set to
    ``"bernoulli"``: ``(model, likelihood)``."""
    likelihood = {"kind": "normal"}

    def model(x):
        weight = torch.linspace(-1, 1, 2 * x.shape[-1]).reshape(-1, 2)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            loc = z @ weight.T
            if likelihood["kind"] == "normal":
                pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)
            else:
                pyro.sample("x", dist.Bernoulli(logits=loc).to_event(1), obs=x)

    return model, likelihood


def test_auto_searches_again_when_its_choice_stops_applying(monkeypatch):
    model, likelihood = _switchable_model()
    x = torch.bernoulli(torch.full((8, 5), 0.5))
    loss = MPTLoss()
    loss.loss(model, None, x)
    assert isinstance(loss.conditionals.chosen, Exact)
    likelihood["kind"] = "bernoulli"  # exact conditionals no longer apply
    masks = torch.rand(1, 8, 5) < 0.5
    prepared = loss.conditionals.prepare(model, None, (x,), {})
    assert isinstance(loss.conditionals.chosen, Quadrature)
    expected = Quadrature().prepare(model, None, (x,), {})
    torch.testing.assert_close(prepared.log_prob(masks), expected.log_prob(masks), rtol=0, atol=0)


def test_a_steady_step_searches_again_when_autos_choice_stops_applying(monkeypatch):
    model, likelihood = _switchable_model()
    x = torch.bernoulli(torch.full((8, 5), 0.5))
    loss = MPTLoss()
    loss.loss(model, None, x)
    loss.loss(model, None, x.flip(0))
    assert isinstance(loss.conditionals.chosen, Exact)
    likelihood["kind"] = "bernoulli"  # exact conditionals no longer apply
    loss.loss(model, None, x)  # a steady call: the loss goes to auto's choice, then searches
    chosen = loss.conditionals.chosen
    assert isinstance(chosen, Quadrature)
    quadrature = _Counting(monkeypatch, Quadrature)
    monkeypatch.setattr(Quadrature, "prepare_with", _counted(Quadrature.prepare_with))
    loss.loss(model, None, x.flip(0))
    # The next call goes straight to the new choice, with the structure it read.
    assert loss.conditionals.chosen is chosen and quadrature.calls == 0
    assert Quadrature.prepare_with.calls == 1


def _counted(method):
    """``method`` wrapped to count its calls (in its ``calls`` attribute)."""

    def counted(*args, **kwargs):
        counted.calls += 1
        return method(*args, **kwargs)

    counted.calls = 0
    return counted


def _one_sharp_observation():
    """A Poisson model with a 1-D latent: 19 observations of low counts, whose posteriors
    are broad, and one of high counts, whose posterior is sharp and far from the prior's
    centre, and its log p(x) per observation on a fine grid."""
    import math

    from experiments.zoo.references import grid_log_marginal_1d

    weight, bias = torch.ones(6, dtype=torch.float64), 0.5

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            rate = (z.unsqueeze(-1) * weight + bias).exp()
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)

    generator = torch.Generator().manual_seed(15)
    z = torch.full((20, 1), -2.0, dtype=torch.float64)
    z[0] = 2.8
    x = torch.poisson((z * weight + bias).exp(), generator=generator)

    def log_joint(nodes):  # (G, 1) -> (G, N)
        rate = (nodes.unsqueeze(-1) * weight + bias).exp()  # (G, 1, 1)
        prior = -0.5 * nodes**2 - 0.5 * math.log(2 * math.pi)
        return dist.Poisson(rate).log_prob(x).sum(-1) + prior

    return model, x, grid_log_marginal_1d(log_joint, num_points=200_001)


def test_auto_refines_until_every_observation_converges_or_says_how_far_one_is():
    """A rule that nine observations in ten agree on is 3.8 nats off for the sharp one; auto
    refines until every observation converges and, where the node budget stops it first,
    warns with the figure of the observation it fits worst, which bounds the error."""
    import warnings

    from pyro_mpt import log_marginal
    from pyro_mpt.errors import QuadratureAccuracyWarning

    model, x, reference = _one_sharp_observation()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = log_marginal(model, x, conditionals="auto")
    error = (value - reference).abs()
    assert float(error[1:].max()) < 1e-3  # the broad posteriors are right
    warned = [str(w.message) for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
    if float(error.max()) > 0.1:
        assert len(warned) == 1
        stated = float(warned[0].split("and by ")[1].split(" at the observation")[0])
        assert stated >= float(error.max())
    # The rule with 30 nodes, which nine in ten observations agree on, is far off for it.
    coarse = log_marginal(model, x, conditionals=Quadrature(30), check_rule=False)
    assert float((coarse - reference).abs()[0]) > 3.0
