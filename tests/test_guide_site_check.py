"""A guide whose sites do not match the model's latents is reported as ``Trace_ELBO`` reports
it (``pyro.util.check_model_guide_match``), whether or not the chosen conditionals run the
guide; the error of conditionals that need the guide names the misspelled site."""

import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import ImportanceSampling, Quadrature
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.trace.guide_site_check import check_guide_sites

NUM_FEATURES = 6
GUIDE_WARNINGS = ("Found non-auxiliary vars in guide but not model", "Found vars in model but")


def _bernoulli_vae(latent_dim, guide_site="latent", extra_site=None):
    """A Bernoulli VAE with a linear decoder and encoder; the guide samples ``guide_site``
    (and an auxiliary ``extra_site`` when given)."""
    decoder = torch.nn.Linear(latent_dim, NUM_FEATURES)
    encoder = torch.nn.Linear(NUM_FEATURES, 2 * latent_dim)

    def model(x):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("latent", dist.Normal(torch.zeros(latent_dim), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x)

    def guide(x):
        pyro.module("encoder", encoder)
        with pyro.plate("data", x.shape[-2]):
            h = encoder(x)
            loc, scale = h[..., :latent_dim], h[..., latent_dim:].exp()
            pyro.sample(guide_site, dist.Normal(loc, scale).to_event(1))
            if extra_site is not None:
                pyro.sample(extra_site, dist.Normal(0.0, 1.0), infer={"is_auxiliary": True})

    return model, guide


def _data(num_data=20):
    return torch.bernoulli(torch.full((num_data, NUM_FEATURES), 0.5))


def _site_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith(GUIDE_WARNINGS)]


def _call(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, _site_warnings(caught)


def test_a_misspelled_guide_site_warns_like_trace_elbo_when_quadrature_ignores_the_guide():
    model, guide = _bernoulli_vae(latent_dim=2, guide_site="latnet")
    x = _data()
    _, elbo_messages = _call(lambda: Trace_ELBO().loss(model, guide, x))
    loss = MPTLoss()
    _, messages = _call(lambda: loss.loss(model, guide, x))
    assert isinstance(loss.conditionals.chosen, Quadrature)  # the guide is never run by it
    # Pyro's own first line, then both sets of sites and the rename.
    assert [m.split("\n(")[0] for m in messages] == elbo_messages
    assert len(messages) == 2
    assert "the model's latent sites are ['latent'], the guide's ['latnet']" in messages[0]
    assert "rename 'latnet' to 'latent'" in messages[0]
    assert "the guide's ['latnet']" in messages[1]
    # Once per call signature, not every step; again for other argument shapes.
    assert _call(lambda: loss.loss(model, guide, x))[1] == []
    assert len(_call(lambda: loss.loss(model, guide, _data(7)))[1]) == 2


def test_a_matching_guide_and_an_auxiliary_site_do_not_warn():
    model, guide = _bernoulli_vae(latent_dim=2, extra_site="helper")
    _, messages = _call(lambda: MPTLoss().loss(model, guide, _data()))
    assert messages == []


def test_no_check_without_a_guide_or_with_validation_off():
    model, guide = _bernoulli_vae(latent_dim=2, guide_site="latnet")
    assert _call(lambda: MPTLoss().loss(model, None, _data()))[1] == []
    pyro.enable_validation(False)
    assert _call(lambda: MPTLoss().loss(model, guide, _data()))[1] == []


def test_the_check_leaves_the_random_state_and_the_estimate_as_they_were():
    model, guide = _bernoulli_vae(latent_dim=2, guide_site="latnet")
    x = _data()
    loss = MPTLoss(conditionals=Quadrature(20))
    pyro.set_rng_seed(3)
    first, messages = _call(lambda: loss.loss(model, guide, x))  # checks the sites
    assert len(messages) == 2
    pyro.set_rng_seed(3)
    again, messages = _call(lambda: loss.loss(model, guide, x))  # already checked
    assert messages == []
    assert first == again


def test_check_guide_sites_compares_the_replayed_model_with_the_guide():
    model, guide = _bernoulli_vae(latent_dim=3, guide_site="z")
    x = _data()
    with pytest.warns(UserWarning, match=r"(?s)in guide but not model.*\{'z'\}.*rename 'z' to"):
        check_guide_sites(model, guide, (x,), {}, 1)
    # The same call is not checked twice.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_guide_sites(model, guide, (x,), {}, 1)


def test_a_larger_latent_names_the_misspelled_site_and_runs_once_renamed():
    x = _data()
    model, guide = _bernoulli_vae(latent_dim=8, guide_site="latnet")
    with pytest.warns(UserWarning, match="Found vars in model but not guide"):
        with pytest.raises(
            NotApplicableError,
            match=r"the guide samples 'latnet'; the model's latent is 'latent'; rename the guide "
            r"site",
        ):
            MPTLoss().loss(model, guide, x)
    model, guide = _bernoulli_vae(latent_dim=8, guide_site="latent")
    loss = MPTLoss()
    value, messages = _call(lambda: loss.loss(model, guide, x))
    assert messages == []
    assert isinstance(loss.conditionals.chosen, ImportanceSampling)
    assert torch.isfinite(torch.tensor(value))


def test_the_missing_part_of_an_observation_sampled_by_an_autoguide_is_no_extra_site():
    x = torch.randn(10, 3)
    observed = torch.rand(10, 3) > 0.3

    def model(x):
        with pyro.plate("data", x.shape[-2], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("features", x.shape[-1], dim=-1):
                pyro.sample("x", dist.Normal(z, 1.0), obs=x, obs_mask=observed)

    guide = AutoNormal(model)
    _, elbo_messages = _call(lambda: Trace_ELBO().loss(model, guide, x))
    assert elbo_messages == []  # the guide samples z and x_unobserved, as the model does
    assert "x_unobserved" in poutine.trace(guide).get_trace(x).nodes
    _, messages = _call(lambda: MPTLoss().loss(model, guide, x))
    assert messages == []
    # Checked directly: the guide's x_unobserved is a site of the model, not an extra one.
    _, messages = _call(lambda: check_guide_sites(model, AutoNormal(model), (x,), {}, 1))
    assert messages == []


def test_a_guide_that_fails_is_left_to_the_conditionals_that_run_it():
    model, _ = _bernoulli_vae(latent_dim=2)

    def broken_guide(x):
        raise RuntimeError("not this one")

    _, messages = _call(lambda: check_guide_sites(model, broken_guide, (_data(),), {}, 1))
    assert messages == []


def test_a_no_op_guide_is_not_reported():
    model, _ = _bernoulli_vae(latent_dim=2)
    _, messages = _call(lambda: check_guide_sites(model, lambda x: None, (_data(),), {}, 1))
    assert messages == []
    # One site is enough to compare: the other latent is reported missing.
    model, guide = _bernoulli_vae(latent_dim=2, guide_site="latent")

    def model_two(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("latent", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            other = pyro.sample("other", dist.Normal(0.0, 1.0))
            logits = z.sum(-1, keepdim=True) + other.unsqueeze(-1)
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    _, messages = _call(lambda: check_guide_sites(model_two, guide, (_data(),), {}, 1))
    assert len(messages) == 1 and messages[0].startswith("Found vars in model but not guide")
    assert "{'other'}" in messages[0]


def test_a_guide_that_sizes_its_plate_from_the_left_is_named_not_the_model():
    """On copies of the data a guide with plate size x.shape[0] reads the copies as the
    observations (7 copies of 6 here: the shapes even collided with the check's own
    layout, which raised an IndexError). The error names the guide, the site and the fix."""

    def model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ torch.ones(2, 3), 0.5).to_event(1), obs=x)

    def left_sized_guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x.new_zeros(2), 1.0).to_event(1))

    x = torch.randn(6, 3)
    pattern = r"The guide 'test_a_guide.*left_sized_guide' samples site 'z' with shape"
    with pytest.raises(ValueError, match=pattern) as caught:
        MPTLoss(conditionals=ImportanceSampling(8)).loss(model, left_sized_guide, x)
    assert "x.shape[-2], not x.shape[0]" in str(caught.value)


def test_a_discrete_latent_hidden_from_an_autoguide_gets_advice_about_enumeration():
    # The usual TraceEnum_ELBO set-up: the model's discrete latent is summed out, the guide
    # is built on the model with it hidden. AutoNormal's auxiliary "z_unconstrained" is no
    # misnamed site, so the advice must not be to rename it.
    def model(x):
        with pyro.plate("data", x.shape[-2]):
            c = pyro.sample("c", dist.Categorical(torch.tensor([0.5, 0.5])))
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            loc = torch.tensor([-1.0, 1.0])[c].unsqueeze(-1) + z.sum(-1, keepdim=True)
            pyro.sample("x", dist.Normal(loc, 1.0).expand(loc.shape[:-1] + (3,)).to_event(1), obs=x)

    guide = AutoNormal(poutine.block(model, hide=["c"]))
    loss = MPTLoss(conditionals=ImportanceSampling(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pyro's own "Found vars in model but not guide"
        with pytest.raises(NotApplicableError) as raised:
            loss.loss(model, guide, torch.randn(5, 3))
    message = str(raised.value)
    assert "Discrete latents ['c']" in message and "config_enumerate" in message
    assert "z_unconstrained" not in message.split("samples no site")[1]
