"""``conditionals="auto"`` remembers its choice, and searches again when it stops applying."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch.distributions.constraints import positive

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.errors import QuadratureAccuracyWarning
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


def test_a_rule_chosen_at_the_node_limit_is_still_checked_as_training_goes_on():
    """A rule that auto chose with more than 133 nodes per dimension has no finer rule
    under MAX_POINTS: its checks compare it with a coarser one, and when the model has
    moved to where it is coarse, auto searches again and warns with the figure (the loss
    is then 1.1 nats off the grid, 0.83 at the worst observation, past auto's limits)."""
    import math
    import warnings

    import pytest

    from pyro_mpt.errors import QuadratureAccuracyWarning

    weight = torch.tensor([0.416, -0.103, 0.456, 0.304, 0.177, -0.322], dtype=torch.float64)
    bias = torch.tensor([0.459, 2.527, 0.208, -0.724, -0.646, 1.571], dtype=torch.float64)
    bend = torch.tensor([-0.25, -0.763, 0.583, 0.709, 0.601, -0.575], dtype=torch.float64)
    counts = [[1, 3, 1, 2, 1, 1], [1, 2, 4, 3, 7, 3], [3, 2, 16, 8, 4, 0], [1, 5, 3, 0, 0, 0],
              [1, 4, 1, 2, 1, 1], [3, 4, 5, 2, 0, 1], [2, 2, 7, 2, 2, 1], [2, 15, 0, 0, 0, 10],
              [1, 19, 0, 0, 0, 8], [0, 0, 3, 2, 3, 1], [0, 1, 9, 11, 5, 1], [1, 1, 1, 0, 1, 4],
              [0, 1, 25, 8, 6, 1], [2, 1, 31, 21, 9, 0], [0, 1, 6, 0, 3, 2], [0, 2, 8, 3, 6, 0],
              [0, 6, 3, 0, 0, 2], [1, 3, 0, 3, 0, 0], [1, 2, 23, 5, 4, 1], [1, 2, 8, 5, 6, 1],
              [2, 12, 1, 1, 0, 4], [2, 2, 8, 1, 3, 2], [0, 1, 7, 1, 4, 1], [4, 7, 0, 0, 0, 6],
              [0, 3, 3, 2, 1, 5], [0, 0, 2, 6, 3, 2], [0, 13, 1, 0, 1, 3], [2, 3, 3, 4, 1, 2],
              [0, 0, 5, 4, 6, 0], [2, 2, 5, 2, 0, 2]]  # fmt: skip
    x = torch.tensor(counts, dtype=torch.float64)
    strength = {"s": 0.15}  # how strongly the latent acts: moved by hand below

    def model(x):
        s = strength["s"]
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0)).unsqueeze(-1)
            rate = torch.exp(bias + s * weight * z + s * bend * z**2)
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)

    def grid_loss():
        s, z = strength["s"], torch.linspace(-12, 12, 40001, dtype=torch.float64)
        rate = torch.exp(bias + s * weight * z[:, None, None] + s * bend * z[:, None, None] ** 2)
        log_lik = dist.Poisson(rate).log_prob(x).sum(-1)
        log_prior = dist.Normal(0.0, 1.0).log_prob(z) + math.log(24 / 40000)
        return -float(torch.logsumexp(log_lik + log_prior[:, None], 0).sum())

    loss = MPTLoss(num_masks="all", conditionals="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuadratureAccuracyWarning)
        loss.loss(model, None, x)
    assert loss.conditionals.chosen.num_points > 133
    strength["s"] = 1.0
    with pytest.warns(QuadratureAccuracyWarning, match="two thirds of its nodes"):
        value = loss.loss(model, None, x)  # the 2nd call: a check
    assert loss.rule_check["compared_with"] == "coarser"
    assert loss.rule_check["worst_gap"] > 0.1
    assert abs(value - grid_loss()) > 0.5  # the rule is that far off: the warning is due


def test_a_fall_back_on_failing_weights_names_the_rule_it_passed_over():
    # Posteriors with two modes (z and -z give the same likelihood), a guide in one of them:
    # the finest rule moves by more than auto's limit under refinement, and importance
    # sampling's weights fail. The warning said importance sampling was "the only strategy
    # that applies"; it names the rule and its measured gap.
    import warnings

    from pyro_mpt import log_marginal
    from pyro_mpt.errors import ImportanceAccuracyWarning

    scales = torch.linspace(0.5, 1.5, 4)

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.unsqueeze(-1) ** 2 * scales, 0.4).to_event(1), obs=x)

    def one_mode_guide(x):
        loc = (x / scales).mean(-1).clamp(min=0.01).sqrt()
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(loc, 0.02))

    generator = torch.Generator().manual_seed(13)
    z = 1.5 + 0.3 * torch.randn(20, generator=generator)
    x = z[:, None] ** 2 * scales + 0.4 * torch.randn(20, 4, generator=generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_marginal(model, x, guide=one_mode_guide, conditionals="auto")
    messages = [str(w.message) for w in caught if w.category is ImportanceAccuracyWarning]
    (fallback,) = [m for m in messages if m.startswith("conditionals='auto'")]
    assert "the only strategy that applies" not in fallback
    assert "as Quadrature(num_points=" in fallback and "measured itself coarse" in fallback
    assert "past 0.5)" in fallback


def test_a_three_dimensional_rule_is_compared_with_a_coarser_one_and_chosen_when_it_agrees():
    # With three latent dimensions the first rule (20 nodes per dimension, 8000 nodes)
    # cannot be refined within the node budget, so its error went unmeasured and auto passed
    # it over for importance sampling. Compared with two thirds of its nodes, as a rule
    # refined once is, it is chosen; its log p(x) matches a grid.
    import math

    from pyro_mpt import log_marginal
    from pyro_mpt.conditionals.auto import Auto

    weight = torch.tensor(
        [[0.8, -0.3, 0.2], [0.1, 0.9, -0.4], [-0.5, 0.2, 0.7], [0.4, 0.4, 0.4], [0.3, -0.6, 0.1]],
        dtype=torch.float64,
    )

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ weight.T).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(x.new_zeros(3), 0.8).to_event(1))

    generator = torch.Generator().manual_seed(0)
    x = torch.bernoulli(torch.full((6, 5), 0.5, dtype=torch.float64), generator=generator)
    auto = Auto()
    value = log_marginal(model, x, guide=guide, conditionals=auto)
    assert isinstance(auto.chosen, Quadrature)
    # The grid: 81 points per dimension over +-8 prior standard deviations.
    axis = torch.linspace(-8, 8, 81, dtype=torch.float64)
    z = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    log_prior = dist.Normal(0.0, 1.0).log_prob(z).sum(-1) + 3 * math.log(16 / 80)
    log_lik = dist.Bernoulli(logits=z @ weight.T).log_prob(x[:, None, :]).sum(-1)
    reference = torch.logsumexp(log_lik + log_prior, -1)
    torch.testing.assert_close(value, reference, atol=1e-3, rtol=0)


def _tanh_model(x):
    """Two latents through ``3 tanh(z W^T)``: sharp enough that an untrained guide's weights
    rest on single draws, and that the 48-node rule moves by about a nat per observation."""
    num_features = x.shape[-1]
    weight = pyro.param("tanh_weight", lambda: torch.randn(num_features, 2))
    noise = pyro.param("tanh_noise", lambda: torch.tensor(0.5), constraint=positive)
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(3 * torch.tanh(z @ weight.T), noise).to_event(1), obs=x)


def _grid_log_marginal(x, num_points=500, limit=7.0):
    """``log p(x)`` of :func:`_tanh_model` per observation, by a dense grid over the two
    latents."""
    weight, noise = pyro.param("tanh_weight").detach(), pyro.param("tanh_noise").detach()
    axis = torch.linspace(-limit, limit, num_points)
    z = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    log_prior = dist.Normal(0.0, 1.0).log_prob(z).sum(-1)
    log_lik = dist.Normal(3 * torch.tanh(z @ weight.T).unsqueeze(1), noise).log_prob(x).sum(-1)
    area = (axis[1] - axis[0]) ** 2
    return torch.logsumexp(log_lik + log_prior.unsqueeze(-1), 0) + area.log()


def test_auto_prefers_a_measured_coarse_rule_to_weights_that_rest_on_single_draws():
    # With the weights of an untrained guide resting on one draw for a third of the rows,
    # auto used to pick importance sampling, 14.6 nats per observation off, over the
    # 48-node rule, whose last refinement moved log p(x) by 1.2 and which is 0.02 off.
    generator = torch.Generator().manual_seed(0)
    truth = torch.randn(5, 2, generator=generator)
    codes = torch.randn(30, 2, generator=generator)
    x = 3 * torch.tanh(codes @ truth.T) + 0.4 * torch.randn(30, 5, generator=generator)
    pyro.param("tanh_weight", truth + 0.3 * torch.randn(5, 2, generator=generator))
    loss = MPTLoss(num_masks="all")
    with pytest.warns(QuadratureAccuracyWarning, match="may be coarse"):
        value = loss.loss(_tanh_model, AutoNormal(_tanh_model), x)
    assert isinstance(loss.conditionals.chosen, Quadrature)
    assert "importance weights rest on a few draws" in loss.conditionals.reason
    exact = _grid_log_marginal(x)
    # The grid itself is converged to 1e-8; the rule is 0.02 nats per observation off.
    assert abs(value + exact.sum().item()) / len(x) < 0.1
