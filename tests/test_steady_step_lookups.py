"""A steady SVI step finds what the first step read by identity: it works out no call
signature, compares none of its parts, and, with Pyro's validation off, repeats none of the
checks of data whose shape and dtype the call's key already fixes."""

import contextlib
import sys

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

import pyro_mpt
from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.models import VAE

PACKAGE = pyro_mpt.__path__[0]


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


def _linear_gaussian(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x)


def _bernoulli(x):
    weight = pyro.param("weight", lambda: 0.3 * torch.randn(x.shape[-1], 2))
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=z @ weight.T).to_event(1), obs=x)


def _no_guide(x):
    pass


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
def test_a_steady_step_finds_its_structure_by_identity(name, validation):
    pyro.clear_param_store()
    model, guide, loss, data = _case(name)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    with pyro.validation_enabled(validation):
        with _called() as first:
            svi.step(data[:16])
        svi.step(data[16:32])
        with _called() as names:
            svi.step(data[32:48])
    assert {"call_signature", "read_structure", "_check_dtype"} <= first
    assert "call_signature" not in names
    assert "_Same.__eq__" not in names
    assert "read_structure" not in names
    # Data whose shape and dtype the key fixes is checked again only under validation.
    assert ("_check_dtype" in names) == validation


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
