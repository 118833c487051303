"""``log_marginal`` and ``mpt_curve`` with a quadrature rule given by the user measure the
rule on the data and warn with the figure when it is coarse. References: trapezoid grids of
40001 points."""

import warnings

import pyro
import pyro.distributions as dist
import torch

from experiments.zoo.references import grid_log_marginal_1d
from pyro_mpt import MPTLoss, log_marginal, mpt_curve
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.conditionals.auto import ACCURACY_TOL
from pyro_mpt.conditionals.quadrature import MAX_POINTS
from pyro_mpt.errors import QuadratureAccuracyWarning
from tests.helpers import CountedCalls

BIAS = torch.tensor([0.5, -1.0, 2.0, 0.0])


def _scale_mixture(x):
    """``s ~ HalfNormal(1)``, ``x_j ~ N(b_j, 0.3 + s)``: the likelihood has a kink at
    ``s = 0`` in the whitened coordinate, where Gauss-Hermite converges slowly."""
    with pyro.plate("data", x.shape[-2]):
        s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0)))
        scale = (0.3 + s).unsqueeze(-1).expand(s.shape + BIAS.shape)
        pyro.sample("x", dist.Normal(BIAS, scale).to_event(1), obs=x)


def _scale_mixture_reference(x):
    def log_joint(t):  # s = |t| with t standard normal
        scale = (0.3 + t.abs()).unsqueeze(-1)
        return dist.Normal(BIAS, scale).log_prob(x).sum(-1) + dist.Normal(0.0, 1.0).log_prob(t)

    return grid_log_marginal_1d(log_joint, num_points=40001)


def _data(seed, num_obs=12):
    generator = torch.Generator().manual_seed(seed)
    s = torch.randn(num_obs, generator=generator).abs()
    return BIAS + (0.3 + s[:, None]) * torch.randn(num_obs, 4, generator=generator)


def _quadrature_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    return value, [w for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]


def test_a_coarse_rule_warns_with_a_figure_and_the_error_is_real():
    x = _data(0)
    value, found = _quadrature_warnings(
        lambda: log_marginal(_scale_mixture, x, conditionals=Quadrature(10))
    )
    error = (value - _scale_mixture_reference(x)).abs().mean()
    assert error > ACCURACY_TOL  # the warning is warranted
    assert len(found) == 1
    assert found[0].filename == __file__  # it points at the caller's line
    message = str(found[0].message)
    assert message.startswith("log_marginal with Quadrature(num_points=10")
    assert "refined to 1.5 times" in message
    figure = float(message.split("log p(x) by ")[1].split(" nats")[0])
    assert ACCURACY_TOL < figure <= 3 * float(error)
    assert "more nodes" in message


def test_a_rule_at_the_limit_is_compared_with_a_coarser_one():
    # Data on which 200 nodes are still 0.037 nats per observation off on average.
    x = _data(12)
    value, found = _quadrature_warnings(
        lambda: log_marginal(_scale_mixture, x, conditionals=Quadrature(MAX_POINTS))
    )
    error = (value - _scale_mixture_reference(x)).abs().mean()
    assert error > ACCURACY_TOL
    assert len(found) == 1
    message = str(found[0].message)
    assert "two thirds of its nodes" in message
    # The figure is that of the coarser rule (of the other parity, 133 nodes), whose own
    # error it mostly is: above the rule's, within a few times it.
    figure = float(message.split("differs from it by ")[1].split(" nats")[0])
    assert ACCURACY_TOL < figure <= 5 * float(error)


def test_an_accurate_rule_is_silent():
    # A normal latent entering a normal likelihood's loc: Gauss-Hermite is exact to rounding.
    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0), 1.0))
            pyro.sample("x", dist.Normal(BIAS + z.unsqueeze(-1), 2.0).to_event(1), obs=x)

    x = _data(3)
    value, found = _quadrature_warnings(lambda: log_marginal(model, x, conditionals=Quadrature(20)))
    exact = dist.MultivariateNormal(BIAS, torch.ones(4, 4) + 4.0 * torch.eye(4)).log_prob(x)
    torch.testing.assert_close(value, exact, atol=1e-6, rtol=0)
    assert found == []


def test_check_rule_false_skips_the_check_and_its_run():
    x = _data(0)
    runs = {}
    for check in (True, False):
        model = CountedCalls(_scale_mixture)
        value, found = _quadrature_warnings(
            lambda model=model, check=check: log_marginal(
                model, x, conditionals=Quadrature(10), check_rule=check
            )
        )
        runs[check] = model.calls
        assert len(found) == int(check)
    assert runs[True] == runs[False] + 1  # the finer rule's one run


def test_the_finer_rule_of_a_loss_sees_the_same_subsample():
    # A subsampled plate (which MPTLoss scales, as Trace_ELBO does): the check must compare
    # the rules on one subsample, else its figure would measure the difference between two
    # subsamples. 20 nodes are exact to 1e-6 here.
    def model(x):
        with pyro.plate("data", x.shape[-2], subsample_size=5) as idx:
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0), 1.0))
            loc = BIAS + z.unsqueeze(-1)
            pyro.sample("x", dist.Normal(loc, 2.0).to_event(1), obs=x[idx])

    x = _data(4, num_obs=40)
    pyro.set_rng_seed(5)
    loss = MPTLoss(conditionals=Quadrature(20))
    _, found = _quadrature_warnings(lambda: [loss.loss(model, None, x) for _ in range(2)])
    assert found == []
    assert loss.rule_check["step"] == 2 and loss.rule_check["mean_gap"] < 1e-4


def test_mpt_curve_checks_its_rule_and_draws_the_same_masks():
    x = _data(0)
    curves = {}
    for check in (True, False):
        pyro.set_rng_seed(7)
        curve, found = _quadrature_warnings(
            lambda check=check: mpt_curve(
                _scale_mixture, x, conditionals=Quadrature(10), num_masks=3, check_rule=check
            )
        )
        curves[check] = curve.scores
        assert len(found) == int(check)
    assert str(found_message(x)).startswith("mpt_curve with Quadrature(num_points=10")
    # The check leaves the random state as it found it: the same masks, the same curve.
    assert torch.equal(curves[True], curves[False])


def found_message(x):
    _, found = _quadrature_warnings(
        lambda: mpt_curve(_scale_mixture, x, conditionals=Quadrature(10), num_masks=1)
    )
    return found[0].message
