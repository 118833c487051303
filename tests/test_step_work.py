"""How much a step does besides arithmetic. The first SVI step runs a model five times
for exact and quadrature conditionals when the guide draws nothing and the priors are
shared by every observation (docs/performance.rst, "The first step"), and the checks folded
into those runs still refuse the models they are there to refuse. A steady step finds what
the first step read by identity: it works out no call signature, compares none of its
parts, and, with Pyro's validation off, repeats none of the checks of data whose shape and
dtype the call's key already fixes."""

import contextlib
import sys

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

import pyro_mpt
from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, ImportanceSampling, Quadrature
from pyro_mpt.conditionals import exact as exact_module
from pyro_mpt.models import VAE
from tests.helpers import CountedCalls

PACKAGE = pyro_mpt.__path__[0]


def _linear_gaussian(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x)


def _bernoulli(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=3 * torch.tanh(z @ weight.T)).to_event(1), obs=x)


def _no_guide(*args):
    pass


def _first_step_runs(model, data, conditionals, guide=_no_guide):
    pyro.clear_param_store()
    counted = CountedCalls(model)
    guide = AutoNormal(counted) if guide is AutoNormal else guide
    svi = SVI(
        counted, guide, pyro.optim.Adam({"lr": 0.01}), loss=MPTLoss(conditionals=conditionals)
    )
    svi.step(data)
    first = counted.calls
    # A rule given by the user checks itself against a finer one on the 1st and 2nd step
    # (one more run each): the steady count is that of the 3rd.
    svi.step(data)
    counted.calls = 0
    svi.step(data)
    return first, counted.calls


@pytest.mark.parametrize(
    "model, data, conditionals",
    [
        (_linear_gaussian, torch.randn(32, 6), Exact()),
        (_linear_gaussian, torch.randn(32, 6), "auto"),
        (_bernoulli, torch.bernoulli(torch.full((32, 8), 0.3)), Quadrature(8)),
    ],
)
def test_a_first_step_runs_the_model_five_times(model, data, conditionals):
    # A quadrature rule given by the user runs once more: its check against a finer rule.
    torch.manual_seed(0)
    first, steady = _first_step_runs(model, data, conditionals)
    assert first == (6 if isinstance(conditionals, Quadrature) else 5)
    assert steady == 1


@pytest.mark.parametrize("rate", ["uniform", 0.15])
def test_a_batch_as_a_fresh_dict_of_tensors_takes_the_steady_route(rate):
    # Mini-batches as dicts (as data loaders give them): a new dict each step, with tensors
    # of the same shapes, is the same call as the last, as a new tensor would be.
    pyro.clear_param_store()
    counted = CountedCalls(_linear_gaussian)

    def model(batch):
        counted(batch["x"])

    loss = MPTLoss(rate=rate)
    svi = SVI(model, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    for _ in range(3):  # the first step, then the rule's check on the second
        svi.step({"x": torch.randn(32, 6)})
    counted.calls = 0
    svi.step({"x": torch.randn(32, 6)})
    assert counted.calls == 1
    # A dict whose tensors changed shape is a new call: its structure is read afresh.
    counted.calls = 0
    svi.step({"x": torch.randn(16, 6)})
    assert counted.calls > 1


def test_a_guide_that_draws_latents_adds_one_run():
    torch.manual_seed(0)
    first, steady = _first_step_runs(_linear_gaussian, torch.randn(32, 6), Exact(), AutoNormal)
    # One more for the model against the guide's draws, and one that AutoNormal makes itself
    # to build its sites.
    assert first == 5 + 1 + 1
    assert steady == 1


def test_a_prior_that_differs_between_observations_adds_one_run():
    def model(x, c):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(c, 1.0).to_event(1))
            loc = z.sum(-1, keepdim=True).expand(z.shape[:-1] + x.shape[-1:])
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    torch.manual_seed(0)
    x, c = torch.randn(16, 3), torch.randn(16, 2)
    pyro.clear_param_store()
    counted = CountedCalls(model)
    svi = SVI(counted, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=MPTLoss(conditionals=Exact()))
    svi.step(x, c)
    assert counted.calls == 6


def _dropout_model(x):
    layer = torch.nn.Dropout(0.5)
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        loc = layer(z).sum(-1, keepdim=True).expand(z.shape[:-1] + x.shape[-1:])
        pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)


@pytest.mark.parametrize("seed", [0, 1])
def test_dropout_is_refused_whatever_the_callers_seed(seed):
    # The plain run draws from the caller's random state, the vectorised run from one
    # draw further on: their dropout masks differ whatever the caller seeded.
    pyro.clear_param_store()
    x = torch.randn(16, 4)
    torch.manual_seed(seed)
    loss = MPTLoss(conditionals=Quadrature(8))
    with pytest.raises(ValueError, match=r"same latent values.*dropout"):
        loss.differentiable_loss(_dropout_model, _no_guide, x)


@contextlib.contextmanager
def _visited():
    """The ``(file, function)`` pairs of the package whose code runs in the block."""
    visited = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            visited.add((code.co_filename, code.co_qualname))

    sys.setprofile(profile)
    try:
        yield visited
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("validation", [True, False])
def test_a_steady_step_reaches_the_maths_in_a_few_calls(validation):
    # A steady step of MPTLoss(conditionals="auto") on a small linear-Gaussian model, which
    # auto prepares with exact conditionals: at most 8 files and 30 functions of the package
    # (benchmarks/step_footprint.py --list names them), with Pyro's validation on or off.
    pyro.clear_param_store()
    torch.manual_seed(0)
    data = torch.randn(64, 6)
    loss = MPTLoss(conditionals="auto")
    svi = SVI(_linear_gaussian, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    with pyro.validation_enabled(validation):
        for batch in data[:48].split(16):
            svi.step(batch)
        with _visited() as visited:
            svi.step(data[48:])
    assert isinstance(loss.conditionals.chosen, Exact)
    files = {file for file, _ in visited}
    assert len(files) <= 8, sorted(files)
    assert len(visited) <= 30, sorted(name for _, name in visited)


@contextlib.contextmanager
def _called():
    """The names of the package's functions called in the block."""
    names = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            names.add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        yield names
    finally:
        sys.setprofile(None)


def _case(name):
    torch.manual_seed(0)
    if name == "exact":
        return _linear_gaussian, _no_guide, MPTLoss(), torch.randn(64, 6)
    data = torch.bernoulli(torch.full((64, 10), 0.3))
    if name == "quadrature":
        return _bernoulli, _no_guide, MPTLoss(), data
    vae = VAE(10, latent_dim=8, hidden_dim=16)
    return vae.model, vae.guide, MPTLoss(conditionals=ImportanceSampling(4)), data


@pytest.mark.filterwarnings("ignore::pyro_mpt.errors.ImportanceAccuracyWarning")
@pytest.mark.parametrize("name", ["exact", "quadrature", "importance"])
@pytest.mark.parametrize("validation", [True, False])
def test_a_steady_step_finds_its_structure_by_identity(name, validation, monkeypatch):
    pyro.clear_param_store()
    model, guide, loss, data = _case(name)
    # Whether each step's check of the linear-Gaussian form was read (verified) or left
    # pending on the device.
    form_checks = []
    build = exact_module.GaussianSelfPredictive.__init__

    def spied_build(self, form, *args):
        form_checks.append(form.pending_check is None)
        build(self, form, *args)

    monkeypatch.setattr(exact_module.GaussianSelfPredictive, "__init__", spied_build)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    with pyro.validation_enabled(validation):
        with _called() as first:
            svi.step(data[:16])
        first_checks, form_checks[:] = list(form_checks), []
        svi.step(data[16:32])
        form_checks.clear()
        with _called() as names:
            svi.step(data[32:48])
    assert {"call_signature", "read_structure", "_check_observed"} <= first
    assert "call_signature" not in names
    assert "_Same.__eq__" not in names
    assert "read_structure" not in names
    # Data whose shape and dtype the key fixes is checked again only under validation.
    assert ("_check_observed" in names) == validation
    if name == "exact":
        # The first step verified the affine form; later ones again only under validation,
        # and leave the check on the device otherwise.
        assert True in first_checks
        assert form_checks == [validation]
    else:
        assert first_checks == form_checks == []


def test_the_first_step_still_checks_the_dtype_with_validation_off():
    def model(x):
        weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x)

    pyro.clear_param_store()
    svi = SVI(model, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=MPTLoss())
    with pyro.validation_enabled(False), pytest.raises(TypeError, match="integer data"):
        svi.step(torch.randint(3, (16, 6)))


@pytest.mark.parametrize(
    "model, data, chosen",
    [
        (_linear_gaussian, torch.randn(48, 6), Exact),
        (_bernoulli, torch.bernoulli(torch.full((48, 8), 0.3)), Quadrature),
    ],
)
def test_a_steady_step_calls_autos_choice_with_the_structure_the_loss_holds(model, data, chosen):
    # Auto decides once per structure; later steps go to its choice directly, which takes
    # the structure the loss holds instead of looking it up.
    pyro.clear_param_store()
    torch.manual_seed(0)
    loss = MPTLoss(conditionals="auto")
    svi = SVI(model, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    svi.step(data[:16])
    auto = loss.conditionals
    assert isinstance(auto.chosen, chosen)
    auto.prepare = CountedCalls(auto.prepare)
    auto.search = CountedCalls(auto.search)
    auto.chosen._structure.get = CountedCalls(auto.chosen._structure.get)
    auto.chosen.prepare_with = CountedCalls(auto.chosen.prepare_with)
    svi.step(data[16:32])
    svi.step(data[32:48])
    assert auto.prepare.calls == 0
    assert auto.search.calls == 0
    assert auto.chosen._structure.get.calls == 0
    assert auto.chosen.prepare_with.calls == 2


def test_a_steady_step_computes_in_the_dtype_its_run_gives_the_parameters():
    # Float64 data near 1e4 with a noise scale of 1e-3: rounded to float32 (spacing 1e-3
    # there) they would be off by nats. The parameters are made float64 after the first call
    # of the same shapes; the steady step must score the data in float64, as a fresh loss
    # does, and give the closed-form log-density.
    dtype = [torch.float32]

    def model(x):
        weight = pyro.param("weight", lambda: torch.ones(x.shape[-1], 2, dtype=dtype[0]))
        loc = pyro.param("loc", lambda: torch.full((x.shape[-1],), 1e4, dtype=dtype[0]))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype[0]), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T + loc, 1e-3).to_event(1), obs=x)

    def batch(seed):
        generator = torch.Generator().manual_seed(seed)
        z = torch.randn(40, 2, generator=generator, dtype=torch.float64)
        noise = 1e-3 * torch.randn(40, 5, generator=generator, dtype=torch.float64)
        return z @ torch.ones(5, 2, dtype=torch.float64).T + 1e4 + noise

    pyro.clear_param_store()
    loss = MPTLoss(num_masks="all")
    loss.differentiable_loss(model, _no_guide, batch(0))
    pyro.clear_param_store()
    dtype[0] = torch.float64
    x = batch(1)
    got = loss.differentiable_loss(model, _no_guide, x)
    # W W^T + s^2 I with W all ones (K = 2) and s = 1e-3.
    covariance = torch.full((5, 5), 2.0, dtype=torch.float64) + 1e-6 * torch.eye(5)
    marginal = dist.MultivariateNormal(torch.full((5,), 1e4, dtype=torch.float64), covariance)
    expected = -marginal.log_prob(x).sum()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.detach(), expected, rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("conditionals", ["exact", "quadrature"])
def test_a_steady_step_fits_points_to_parameters_made_float32_since_the_first_call(conditionals):
    # The first call reads the model in float64 and makes its points in float64; the
    # parameters are then made float32 under the same call shapes. The latents at those
    # points take their prior's dtype, as a draw would, so the steady step runs (it raised a
    # dtype error inside the model) and gives the closed-form log-density.
    dtype = [torch.float64]

    def model(x):
        weight = pyro.param("weight", lambda: torch.full((x.shape[-1], 1), 0.8, dtype=dtype[0]))
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1, dtype=dtype[0]), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 1.0).to_event(1), obs=x)

    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    pyro.clear_param_store()
    loss = MPTLoss(num_masks="all", conditionals=conditionals)
    loss.differentiable_loss(model, _no_guide, x.double())
    pyro.clear_param_store()
    dtype[0] = torch.float32
    got = loss.differentiable_loss(model, _no_guide, x.double())
    covariance = torch.full((3, 3), 0.64) + torch.eye(3)
    expected = -dist.MultivariateNormal(torch.zeros(3), covariance).log_prob(x).sum()
    # Quadrature's 20 nodes per dimension integrate this one-dimensional latent to within
    # 1e-5 nats in all; float32 arithmetic over 12 rows adds about as much.
    torch.testing.assert_close(got.detach().double(), expected.double(), rtol=0, atol=1e-3)
