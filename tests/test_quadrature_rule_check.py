"""A quadrature rule chosen at the first step is checked again as training goes on: its
posterior may narrow until the rule is coarse. The references are brute-force grids."""

import math
import re
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.conditionals.auto import ACCURACY_TOL
from pyro_mpt.conditionals.quadrature import MAX_POINTS
from pyro_mpt.errors import QuadratureAccuracyWarning

NUM_FEATURES = 20


def _model(x):
    weight = pyro.param("weight", lambda: torch.linspace(-1, 1, NUM_FEATURES).reshape(-1, 1))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=z @ weight.T).to_event(1), obs=x)


def _no_guide(x):
    pass


def _grid_log_marginal(x, weight):
    """log p(x) of every row by a trapezoid-free Riemann sum on 40001 points of [-8, 8]."""
    z = torch.linspace(-8, 8, 40001)
    log_joint = dist.Bernoulli(logits=z[:, None, None] * weight[:, 0]).log_prob(x).sum(-1)
    log_joint = log_joint + dist.Normal(0.0, 1.0).log_prob(z)[:, None]
    return torch.logsumexp(log_joint, 0) + math.log(float(z[1] - z[0]))


def _train(conditionals, sharpen, num_steps):
    """One step on a broad posterior, then ``num_steps`` more after the loading is scaled
    by ``sharpen`` (as training would sharpen it); the learning rate is 0, so the model
    stays where it was put."""
    data = torch.bernoulli(torch.full((200, NUM_FEATURES), 0.5))
    loss = MPTLoss(conditionals=conditionals)
    svi = SVI(_model, _no_guide, pyro.optim.Adam({"lr": 0.0}), loss=loss)
    svi.step(data[:50])
    first = loss.conditionals.in_use
    weight = sharpen * torch.linspace(-1, 1, NUM_FEATURES).reshape(-1, 1)
    pyro.get_param_store()["weight"] = weight
    batches = torch.randint(200, (num_steps, 50))
    for batch in batches:
        svi.step(data[batch])
    return loss, first, data[batches[-1]], weight


def _checked_steps(batches):
    """SVI steps of a user's 20-node rule on a sharp model over ``batches`` (rows of the
    data): the steps whose rule check ran, and how many times it warned."""
    data = torch.bernoulli(torch.full((70, NUM_FEATURES), 0.5))
    loss = MPTLoss(conditionals=Quadrature(20))
    svi = SVI(_model, _no_guide, pyro.optim.Adam({"lr": 0.0}), loss=loss)
    pyro.param("weight", 3.0 * torch.linspace(-1, 1, NUM_FEATURES).reshape(-1, 1))
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            svi.step(data[batch])
            if loss.rule_check is not None and loss.rule_check["step"] not in steps:
                steps.append(loss.rule_check["step"])
    warned = [w for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
    return steps, len(warned)


def test_ragged_batches_are_checked_too():
    # Every epoch ends with a smaller batch, a call of another shape: the check still runs on
    # the 1st, 2nd, the 16th and the 64th call, whatever their shapes (warned each time).
    epoch = torch.arange(70).split(8)  # 8 batches of 8, then one of 6
    assert _checked_steps(10 * epoch) == ([1, 2, 16, 64], 4)


def test_auto_refines_a_rule_that_became_coarse():
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        loss, first, batch, weight = _train("auto", sharpen=3.0, num_steps=15)
    chosen = loss.conditionals.in_use
    assert isinstance(first, Quadrature) and isinstance(chosen, Quadrature)
    # The 2nd step measured the first rule past the threshold and searched again; the
    # rule it chose then is within it on the 16th.
    assert chosen.num_points > first.num_points
    assert loss.rule_check["step"] == 16 and loss.rule_check["mean_gap"] <= ACCURACY_TOL
    reference = _grid_log_marginal(batch, weight)
    with torch.no_grad():
        before = log_marginal(_model, batch, conditionals=first).detach()
        after = log_marginal(_model, batch, conditionals=chosen).detach()
    # The first rule was off by more than auto accepts; the new one is within it.
    assert float((before - reference).abs().mean()) > ACCURACY_TOL
    assert float((after - reference).abs().mean()) < ACCURACY_TOL


def test_auto_measures_its_choice_on_the_second_batch():
    # auto chose on the first batch; the second is other data (here a sharper model), and
    # its rule is measured there, not only from the 16th step on.
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        loss, first, _, _ = _train("auto", sharpen=3.0, num_steps=1)
    assert loss.rule_check["step"] == 2 and loss.rule_check["mean_gap"] > ACCURACY_TOL
    assert loss.conditionals.in_use.num_points > first.num_points


def test_a_rule_given_by_the_user_checks_itself_when_every_call_has_new_shapes():
    # Batches of 8 and 9 rows in turn: no call is like the one before, and the rule still
    # measures itself on the 1st, 2nd and 16th call (it never did: every call was a first
    # one).
    assert _checked_steps([torch.arange(8 + step % 2) for step in range(20)]) == ([1, 2, 16], 3)


def test_a_rule_given_by_the_user_warns_with_its_figure():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, first, batch, weight = _train(Quadrature(20), sharpen=3.0, num_steps=15)
    warned = [str(w.message) for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
    # On the first steady call (the model sharpened since the first) and on the 16th.
    assert len(warned) == 2
    for message, step in zip(warned, (2, 16)):
        pattern = rf"changes log p\(x\) by [0-9.]+ nats .* and by [0-9.]+ at .*\(step {step};"
        assert re.search(pattern, message)
    assert loss.conditionals.in_use is first
    gap = loss.rule_check["mean_gap"]
    # The figure is the change of log p(x) under the finer rule, on the step's batch...
    with torch.no_grad():
        coarse = log_marginal(_model, batch, conditionals=Quadrature(20))
        finer = log_marginal(_model, batch, conditionals=Quadrature(31))
    assert math.isclose(gap, float((finer - coarse).abs().mean()), rel_tol=1e-6)
    worst = loss.rule_check["worst_gap"]
    assert math.isclose(worst, float((finer - coarse).abs().max()), rel_tol=1e-6)
    # ... and the rule's own error against the grid is past the threshold too.
    assert float((coarse - _grid_log_marginal(batch, weight)).abs().mean()) > ACCURACY_TOL


def test_an_accurate_rule_stays_and_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        loss, first, _, _ = _train(Quadrature(20), sharpen=1.0, num_steps=15)
    assert loss.conditionals.in_use is first
    assert loss.rule_check["step"] == 16 and loss.rule_check["mean_gap"] < 1e-4


def test_a_rule_too_fine_to_refine_is_compared_with_a_coarser_one():
    # 150 nodes: the finer rule would pass MAX_POINTS, so the rule is compared with one of
    # 100 nodes; on this smooth model the two agree and nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuadratureAccuracyWarning)
        loss, _, batch, _ = _train(Quadrature(150), sharpen=1.0, num_steps=15)
    check = loss.rule_check
    assert check["step"] == 16 and check["compared_with"] == "coarser"
    with torch.no_grad():
        rule = log_marginal(_model, batch, conditionals=Quadrature(150), check_rule=False)
        coarser = log_marginal(_model, batch, conditionals=Quadrature(100), check_rule=False)
    assert math.isclose(check["mean_gap"], float((rule - coarser).abs().mean()), abs_tol=1e-12)


def test_a_rule_at_the_limit_that_is_still_moving_warns():
    # The scale mixture of test_function_rule_check, on data where 200 nodes are 0.037 nats
    # per observation off: MPTLoss says so on its 1st and 2nd step, as log_marginal does.
    from tests.test_function_rule_check import (
        _data,
        _scale_mixture,
        _scale_mixture_reference,
    )

    x = _data(12)
    loss = MPTLoss(conditionals=Quadrature(MAX_POINTS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.loss(_scale_mixture, None, x)
        loss.loss(_scale_mixture, None, x)
    warned = [str(w.message) for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
    assert len(warned) == 2 and all("cannot be refined" in message for message in warned)
    assert loss.rule_check["compared_with"] == "coarser"
    with torch.no_grad():
        rule = Quadrature(MAX_POINTS)
        value = log_marginal(_scale_mixture, x, conditionals=rule, check_rule=False)
    assert float((value - _scale_mixture_reference(x)).abs().mean()) > ACCURACY_TOL


def test_a_rule_given_by_the_user_is_checked_on_the_first_and_second_step():
    # A rule coarse from the start is flagged on the first call (a one-off loss or estimate
    # is never left unmeasured) and on the first steady one, not after 15 steps; the figure
    # is the rule's own change under refinement on that step's batch.
    data = torch.bernoulli(torch.full((100, NUM_FEATURES), 0.5))
    pyro.param("weight", 3.0 * torch.linspace(-1, 1, NUM_FEATURES).reshape(-1, 1))
    weight = pyro.param("weight").detach()
    loss = MPTLoss(conditionals=Quadrature(8))
    svi = SVI(_model, _no_guide, pyro.optim.Adam({"lr": 0.0}), loss=loss)
    for step, batch in enumerate((data[:50], data[50:]), 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            svi.step(batch)
        warned = [w for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
        assert len(warned) == 1 and loss.rule_check["step"] == step
        with torch.no_grad():
            coarse = log_marginal(_model, batch, conditionals=Quadrature(8), check_rule=False)
        error = float((coarse - _grid_log_marginal(batch, weight)).abs().mean())
        assert error > ACCURACY_TOL and loss.rule_check["mean_gap"] > ACCURACY_TOL


def test_a_one_off_estimate_with_a_coarse_rule_warns():
    # MPTLoss.estimate called once, as an evaluation would: the rule's error against the
    # grid is past the threshold, and the call says so with its figure.
    pyro.set_rng_seed(0)
    data = torch.bernoulli(torch.full((50, NUM_FEATURES), 0.5))
    pyro.param("weight", 3.0 * torch.linspace(-1, 1, NUM_FEATURES).reshape(-1, 1))
    weight = pyro.param("weight").detach()
    loss = MPTLoss(conditionals=Quadrature(8), num_masks="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate = loss.estimate(_model, _no_guide, data).detach()
    warned = [str(w.message) for w in caught if issubclass(w.category, QuadratureAccuracyWarning)]
    assert len(warned) == 1 and "(step 1;" in warned[0]
    error = float((estimate - _grid_log_marginal(data, weight)).abs().mean())
    assert error > ACCURACY_TOL and loss.rule_check["mean_gap"] > ACCURACY_TOL


def test_compared_rules_alternate_parity():
    from pyro_mpt.conditionals.quadrature import compared_num_points

    # 1.5 times as many nodes, or one more, so that one rule of each pair has a node at 0.
    assert [compared_num_points(n, 1.5) for n in (20, 31, 48, 73, 110)] == [31, 48, 73, 110, 165]
    # Coarser: two thirds, or one fewer; never more nodes than the rule itself.
    assert [compared_num_points(n, 2 / 3) for n in (20, 31, 3, 2, 1)] == [13, 20, 2, 1, 1]


def _step_model(x):
    # Every feature's likelihood steps at z = 0, the centre of every Gauss-Hermite rule.
    weight = torch.tensor([0.59, -0.34, -0.48, -1.81], dtype=x.dtype)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
        logits = 10 * torch.tanh(50 * z @ weight[None])
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def test_a_step_at_the_centre_of_the_rules_is_not_mistaken_for_convergence():
    """Rules of 20 and 30 nodes (both even, no node at 0) agree to 1e-6 on these data while
    both are off by 3 nats at the observation whose bits match no side of the steps; every
    result here must be within 0.1 nats of the grid at every observation or warn."""
    torch.manual_seed(0)
    x = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    z = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    weight = torch.tensor([0.59, -0.34, -0.48, -1.81], dtype=torch.float64)
    logits = 10 * torch.tanh(50 * z[:, None] * weight)
    log_joint = dist.Bernoulli(logits=logits[:, None]).log_prob(x).sum(-1)
    log_joint = log_joint + dist.Normal(0.0, 1.0).log_prob(z)[:, None]
    reference = torch.logsumexp(log_joint, 0) + math.log(float(z[1] - z[0]))
    for conditionals in ("auto", Quadrature(20), Quadrature(30)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = log_marginal(_step_model, x, conditionals=conditionals)
        warned = any(issubclass(w.category, QuadratureAccuracyWarning) for w in caught)
        error = float((value - reference).abs().max())
        assert warned or error < 0.1, (conditionals, error)
    # The rules are indeed off: a check that passed them would be silently wrong.
    coarse = log_marginal(_step_model, x, conditionals=Quadrature(20), check_rule=False)
    assert float((coarse - reference).abs().max()) > 1.0
