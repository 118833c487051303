"""Every bad input gets a clear error, and a failing call changes nothing."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroParam

from pyro_mpt import MPTLoss, gibbs, impute, log_marginal, mpt_curve
from pyro_mpt.conditionals import Conditionals, Exact
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.models import LinearVAE


def _model_factory(kind):
    def model(x):
        w = pyro.param("w_new", torch.ones(x.shape[-1], 2))
        if kind == "global_latent":
            w = pyro.sample("W", dist.Normal(torch.zeros(x.shape[-1], 2), 1.0).to_event(2))
        with pyro.plate("data", x.shape[0]):
            if kind == "gamma_latent":
                z = pyro.sample("z", dist.Gamma(torch.ones(2), 1.0).to_event(1))
            else:
                z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            loc = z @ w.T
            if kind == "nonlinear":
                loc = torch.tanh(loc)
            if kind == "heteroscedastic":
                scale = z.exp().sum(-1, keepdim=True).expand_as(loc)
            else:
                scale = torch.ones_like(loc)
            if kind == "bernoulli":
                pyro.sample("x", dist.Bernoulli(logits=loc).to_event(1), obs=x)
            elif kind == "no_obs":
                pyro.sample("x", dist.Normal(loc, scale).to_event(1))
            elif kind == "two_obs":
                pyro.sample("x", dist.Normal(loc, scale).to_event(1), obs=x)
                pyro.sample("y", dist.Normal(loc, scale).to_event(1), obs=x)
            else:
                pyro.sample("x", dist.Normal(loc, scale).to_event(1), obs=x)

    return model


BAD_MODELS = [
    ("nonlinear", NotApplicableError, r"loc of observed site 'x' is not affine in .*'z'"),
    ("heteroscedastic", NotApplicableError, r"scale of observed site 'x' depends on"),
    ("gamma_latent", NotApplicableError, r"Latent site 'z' has a Gamma prior"),
    ("bernoulli", NotApplicableError, r"Observed site 'x' has a Bernoulli likelihood"),
    ("global_latent", ValueError, r"Latent site 'W' is outside the data plate \['data'\]"),
    ("no_obs", ValueError, r"no observed sample site.*obs=x"),
    ("two_obs", ValueError, r"found 2 observed sites \['x', 'y'\].*Concatenate"),
]


# Models that no strategy can score, or that are invalid for every strategy.
INVALID_FOR_ALL = {"gamma_latent", "global_latent", "no_obs", "two_obs"}


@pytest.mark.parametrize("kind, error, match", BAD_MODELS)
@pytest.mark.parametrize("conditionals", ["exact", "auto"])
def test_invalid_models_raise_and_leave_the_param_store_untouched(kind, error, match, conditionals):
    if conditionals == "auto" and kind not in INVALID_FOR_ALL:
        pytest.skip("quadrature applies to this model under conditionals='auto'")
    x = torch.randn(5, 3) if kind != "bernoulli" else torch.bernoulli(torch.full((5, 3), 0.5))
    pyro.param("existing", torch.zeros(2))
    loss = MPTLoss(conditionals=conditionals)
    for call in (loss.loss, loss.differentiable_loss, loss.loss_and_grads):
        with pytest.raises(error, match=match):
            call(_model_factory(kind), None, x)
        assert set(pyro.get_param_store().keys()) == {"existing"}


def test_auto_names_the_strategies_when_none_applies():
    match = r"(?s)conditionals='auto'.*'exact', 'quadrature'.*exact: Latent site 'z' has a Gamma"
    with pytest.raises(NotApplicableError, match=match + r".*quadrature: Latent site 'z'"):
        MPTLoss().loss(_model_factory("gamma_latent"), None, torch.randn(4, 3))


def test_nan_observations_raise_and_change_no_parameter():
    class Model(PyroModule):
        def __init__(self):
            super().__init__()
            self.w = PyroParam(torch.ones(3, 2))

        def forward(self, x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
                pyro.sample("x", dist.Normal(z @ self.w.T, 1.0).to_event(1), obs=x)

    model = Model()
    x = torch.randn(6, 3)
    x[2, 1] = float("nan")
    svi = pyro.infer.SVI(model, lambda x: None, pyro.optim.Adam({"lr": 0.1}), MPTLoss())
    before = model.w.detach().clone()
    with pytest.raises(ValueError, match=r"Observed site 'x' contains 1 NaN values out of 18"):
        svi.step(x)
    assert torch.equal(model.w.detach(), before)
    assert len(pyro.get_param_store()) == 0
    # An infinite value gave a NaN loss and wrote NaN into every parameter.
    x[2, 1] = -float("inf")
    with pytest.raises(ValueError, match=r"contains 1 infinite values out of 18.*obs_mask"):
        svi.step(x)
    assert torch.equal(model.w.detach(), before)
    assert len(pyro.get_param_store()) == 0


@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
def test_bernoulli_data_that_are_not_floats_are_refused_by_name(dtype):
    # Bernoulli's log-density does float arithmetic on the value: torch failed with a
    # casting error of its own in impute, gibbs and MPTLoss.
    x = torch.bernoulli(torch.full((5, 3), 0.5)).to(dtype)
    missing = torch.zeros(5, 3, dtype=torch.bool)
    missing[:, 0] = True
    match = rf"Observed site 'x' holds {dtype} data under a Bernoulli likelihood.*x.float\(\)"
    model = _model_factory("bernoulli")
    with pytest.raises(TypeError, match=match):
        impute(model, x, missing=missing, conditionals="quadrature")
    with pytest.raises(TypeError, match=match):
        MPTLoss().loss(model, None, x)


def test_a_model_without_a_data_plate_is_told_to_add_one():
    def single(x):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z.sum(-1, keepdim=True).expand(3), 1.0).to_event(1), obs=x)

    missing = torch.tensor([True, False, False])
    with pytest.raises(ValueError, match=r"Observed site 'x' is in no plate.*x\[None\]"):
        impute(single, torch.randn(3), missing=missing)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_masks": 0}, ValueError, r"num_masks must be at least 1, got 0"),
        ({"num_masks": 2.5}, TypeError, r"num_masks must be a positive integer, got 2.5"),
        ({"rate": 0}, ValueError, r"rate must lie in \(0, 1\], got 0"),
        ({"rate": 1.01}, ValueError, r"rate must lie in \(0, 1\], got 1.01"),
        ({"rate": (0.9, 0.1)}, ValueError, r"lo > hi"),
        ({"conditionals": "magic"}, ValueError, r"'magic'.*'auto', 'exact', 'quadrature'"),
        ({"conditionals": 3}, TypeError, r"conditionals must be a strategy name.*got 3"),
        ({"share_masks": "yes"}, TypeError, r"share_masks must be True or False, got 'yes'"),
        ({"max_plate_nesting": 1.5}, ValueError, r"max_plate_nesting must be a non-negative"),
        ({"max_plate_nesting": -1}, ValueError, r"integer \(a bound .*got -1; leave it unset"),
    ],
)
def test_bad_loss_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MPTLoss(**kwargs)


def test_conditionals_instances_are_accepted():
    loss = MPTLoss(conditionals=Exact())
    assert isinstance(loss.conditionals, Exact) and isinstance(loss.conditionals, Conditionals)


def test_log_marginal_rejects_models_without_closed_form():
    with pytest.raises(NotApplicableError, match="not affine"):
        log_marginal(_model_factory("nonlinear"), torch.randn(4, 3))


def test_mpt_curve_argument_errors():
    model = _model_factory("ok")
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"sizes=\[1\] and rates=\[0.5\]; pass one of them"):
        mpt_curve(model, x, sizes=[1], rates=[0.5])
    with pytest.raises(ValueError, match=r"sizes must be .* mask sizes in 1..3, got"):
        mpt_curve(model, x, sizes=[0, 4])
    with pytest.raises(ValueError, match=r"rates must be a non-empty sequence .* in \(0, 1\]"):
        mpt_curve(model, x, rates=[0.0, 0.5])
    with pytest.raises(TypeError, match=r"rates must be a sequence of floats in \(0, 1\], got"):
        mpt_curve(model, x, rates=["a"])


@pytest.mark.parametrize("conditionals", ["quadrature", "importance"])
def test_observations_outside_the_likelihood_support_raise(conditionals):
    # Grey values under a Bernoulli likelihood: log_prob would reject them under validation.
    pyro.clear_param_store()
    vae = LinearVAE(4, latent_dim=1)
    loss = MPTLoss(conditionals=conditionals)
    binary = torch.bernoulli(torch.full((6, 4), 0.5))
    loss.loss(vae.model, vae.guide, binary)  # a valid first call
    grey = binary.clone()
    grey[1, 2] = 0.5
    names = set(pyro.get_param_store().keys())
    with pytest.raises(ValueError, match=r"site 'x' has 1 values outside the support .*Bernoulli"):
        loss.loss(vae.model, vae.guide, grey)
    assert set(pyro.get_param_store().keys()) == names
    with pyro.validation_enabled(False):
        assert math.isfinite(loss.loss(vae.model, vae.guide, grey))


def test_mpt_curve_refuses_observations_with_missing_entries():
    weight = torch.randn(4, 2)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            keep = torch.ones(x.shape, dtype=torch.bool)
            keep[0, 1] = False
            pyro.sample("x", dist.Normal(z @ weight.T, 1.0).mask(keep).to_event(1), obs=x)

    with pytest.raises(ValueError, match="Observed site 'x' has missing entries; the MPT curve"):
        mpt_curve(model, torch.randn(5, 4), num_masks=2)


def test_log_marginal_names_the_strategy_that_gives_none():
    vae = LinearVAE(6, latent_dim=2)
    x = torch.bernoulli(torch.full((5, 6), 0.5))
    with pytest.raises(ValueError, match=r"EncodeDecode.*gives no log-marginal likelihood"):
        log_marginal(vae.model, x, conditionals="encode-decode", guide=vae.guide)


def test_a_latent_scale_that_changes_after_the_first_call_is_refused():
    weight = torch.randn(4, 2)
    beta = {"value": 1.0}

    def model(x):
        with pyro.plate("data", x.shape[0]):
            with pyro.poutine.scale(scale=beta["value"]):
                z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 1.0).to_event(1), obs=x)

    x = torch.randn(5, 4)
    loss = MPTLoss(conditionals="exact")
    assert math.isfinite(loss.loss(model, None, x))
    beta["value"] = 0.5  # annealing the latent's term only: a tempered model
    with pytest.raises(ValueError, match="Latent site 'z' and observed site 'x' have different"):
        loss.loss(model, None, x)


def test_a_latent_per_feature_over_an_inner_data_plate_is_named_as_global_too():
    # Read from its latents, 'feat' is the plate over observations and 'data' a feature
    # plate in the wrong place; read as the user wrote it, 'mu' is global. The error says
    # both, each with its fix.
    def model(x):
        with pyro.plate("feat", 3, dim=-1):
            mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
            with pyro.plate("data", x.shape[0], dim=-2):
                pyro.sample("x", dist.Normal(mu, 0.5), obs=x)

    with pytest.raises(ValueError) as caught:
        MPTLoss(conditionals="exact").loss(model, None, torch.randn(4, 3))
    message = str(caught.value)
    assert "Plate 'data' (dim -2)" in message and "sits left of the data plate" in message
    assert "If 'data' is the plate over observations" in message
    assert "global latents" in message and "pyro.param" in message


@pytest.mark.parametrize("conditionals", ["auto", "importance"])
def test_a_latent_plate_left_of_the_data_plate_is_named_with_its_fix(conditionals):
    # z holds 3 components per observation in a plate left of the data plate: read as
    # observation dims, it was a 1-dim latent over a (3, N) batch, and the runs at points
    # failed with a reshape error blaming the model's broadcasting.
    def model(x):
        with pyro.plate("data", x.shape[0], dim=-1):
            with pyro.plate("groups", 3, dim=-2):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.sum(-2).unsqueeze(-1).expand(z.shape[:-2] + x.shape)
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0], dim=-1):
            with pyro.plate("groups", 3, dim=-2):
                pyro.sample("z", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError) as caught:
        MPTLoss(conditionals=conditionals).loss(model, guide, torch.randn(5, 4))
    message = str(caught.value)
    assert "Latent site 'z' sits in plate 'groups' (dim -2), left of the data plate" in message
    assert "data plate at dim=-2 and 'groups' at dim=-1" in message


def test_the_advised_layout_of_a_latent_plate_gives_the_closed_form():
    # The fix the error above gives: the data plate at dim=-2, the latent's plate at dim=-1.
    # Three unit latents summed into every feature: x ~ N(0, I + 3 11^T).
    def model(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            with pyro.plate("groups", 3, dim=-1):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.sum(-1, keepdim=True).unsqueeze(-1).expand(z.shape[:-1] + (1, 4))
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x.unsqueeze(-2))

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    covariance = torch.eye(4) + 3.0 * torch.ones(4, 4)
    expected = dist.MultivariateNormal(torch.zeros(4), covariance).log_prob(x)
    actual = log_marginal(model, x, conditionals="auto").reshape(-1)
    assert torch.allclose(actual, expected, atol=1e-5)


def test_one_hot_features_are_pointed_to_categorical_integers():
    from pyro_mpt.conditionals import Quadrature

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            logits = z[..., None, None] * torch.ones(3, 4)
            pyro.sample("x", dist.OneHotCategorical(logits=logits).to_event(1), obs=x)

    x = torch.nn.functional.one_hot(torch.randint(4, (5, 3)), 4).float()
    with pytest.raises(ValueError, match=r"Categorical\(logits=\.\.\.\)\.to_event\(1\) instead"):
        log_marginal(model, x, conditionals=Quadrature(10))


def test_a_dense_normal_observation_with_latents_is_told_why_exact_refuses_it():
    from pyro_mpt.conditionals.exact import NotGaussianError

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
            loc = z.unsqueeze(-1) * torch.ones(3)
            pyro.sample("x", dist.MultivariateNormal(loc, torch.eye(3)), obs=x)

    with pytest.raises(NotGaussianError, match="exact only in a model with no local latents"):
        log_marginal(model, torch.randn(4, 3))


def _impute_last(model, x, *args, **kwargs):
    missing = torch.zeros_like(x, dtype=torch.bool)
    missing[:, -1] = True
    return impute(model, x, *args, missing=missing, num_samples=2, **kwargs)


def _gibbs_two_steps(model, x, *args, **kwargs):
    return gibbs(model, x, *args, block_size=2, num_steps=2, progress=False, **kwargs)


@pytest.mark.parametrize(
    "function",
    [log_marginal, mpt_curve, _impute_last, _gibbs_two_steps],
    ids=["log_marginal", "curve", "impute", "gibbs"],
)
def test_a_subsampling_data_plate_is_refused_where_every_observation_is_returned(function):
    # Under subsample_size each run scores a random tenth of the data: log_marginal returned
    # its ten values as if they were the data's (a sum a tenth of the data's).
    weight = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))

    def model(x, subsample_size=None, subsample=None):
        plate = pyro.plate("data", x.shape[0], subsample_size=subsample_size, subsample=subsample)
        with plate as index:
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ weight.T, 0.5).to_event(1), obs=x[index])

    x = torch.randn(100, 4, generator=torch.Generator().manual_seed(1))
    message = r"plate 'data' subsamples 10 of its 100 members on each run of the model"
    with pytest.raises(ValueError, match=message):
        function(model, x, 10, conditionals="exact")
    with pytest.raises(ValueError, match=message):
        function(model, x, None, torch.arange(10), conditionals="exact")
    # The whole plate, in either form, is evaluated.
    covariance = weight @ weight.T + 0.25 * torch.eye(4)
    expected = dist.MultivariateNormal(torch.zeros(4), covariance).log_prob(x)
    if function is log_marginal:
        for size in (None, 100):
            actual = log_marginal(model, x, size, conditionals="exact")
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)
    elif function is mpt_curve:
        curve = mpt_curve(model, x, 100, conditionals="exact", num_masks=20)
        assert curve.sizes.shape == (100, 4)  # every observation, every size
        assert abs(curve.area - expected.mean().item()) < 4 * curve.area_stderr
    else:
        assert function(model, x, 100, conditionals="exact").shape[-2:] == x.shape


def test_a_mask_over_event_entries_is_refused_with_the_masks_that_work():
    # poutine.mask with an (N, D) mask around a .to_event(1) site: Pyro counts whole events
    # with such a mask; the library failed with a bare reshape error.
    weight = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    observed = torch.rand(20, 5, generator=torch.Generator().manual_seed(2)) > 0.3

    def masked_events(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            with pyro.poutine.mask(mask=observed):
                pyro.sample("x", dist.Normal(z @ weight.T, 1.0).to_event(1), obs=x)

    message = (
        r"Observed site 'x' has a mask of shape \(20, 5\) .*does not broadcast to its batch "
        r"shape \(20,\).*dist.Normal\(loc, scale\).mask\(observed\).to_event\(1\)"
    )
    with pytest.raises(ValueError, match=message):
        log_marginal(masked_events, x)

    def masked_entries(x):  # the fix the message gives
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            likelihood = dist.Normal(z @ weight.T, 1.0).mask(observed).to_event(1)
            pyro.sample("x", likelihood, obs=x)

    covariance = weight @ weight.T + torch.eye(5)
    values = log_marginal(masked_entries, x)
    for value, row, entries in zip(values, x, observed):
        seen = dist.MultivariateNormal(torch.zeros(5)[entries], covariance[entries][:, entries])
        torch.testing.assert_close(value, seen.log_prob(row[entries]), rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32])
def test_the_ready_models_name_data_of_another_dtype_than_their_parameters(dtype):
    # Their priors are built like their data (x.new_zeros): integer data failed inside
    # torch ("normal_kernel_cpu" not implemented for 'Long'), float32 data in a float64
    # model with a bare matmul dtype error.
    from pyro_mpt.models import PPCA, VAE, LinearVAE

    x = torch.bernoulli(torch.full((8, 6), 0.5)).to(dtype)  # parameters: float64 here
    for model in (PPCA(6, 2), LinearVAE(6, latent_dim=2), VAE(6, latent_dim=2, hidden_dim=4)):
        name = type(model).__name__
        if dtype.is_floating_point:
            match = rf"x is torch.float32 but the parameters of {name} are torch.float64"
        else:
            match = rf"{name} takes floating data, got x of dtype {dtype}; convert it"
        with pytest.raises(TypeError, match=match):
            MPTLoss().loss(model.model, model.guide, x)
        assert len(pyro.get_param_store()) == 0


def test_a_guide_that_requires_hidden_is_told_to_give_it_a_default():
    # Pyro calls guides with the model's arguments only; MPTLoss's first call does too, and
    # failed with the guide's own TypeError.
    model = _model_factory("normal")

    def guide(x, hidden):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    with pytest.raises(TypeError, match=r"give it a default, guide\(x, hidden=None\)"):
        MPTLoss().loss(model, guide, torch.randn(5, 3))


def test_a_guide_site_of_another_event_shape_than_the_model_s_is_named():
    # The model, replayed at a value of the wrong shape, failed inside its own matrix
    # product with a trace dump, or with advice about broadcasting.
    from pyro_mpt.conditionals import ImportanceSampling

    model = _model_factory("normal")

    def narrow_guide(x):
        with pyro.plate("data", x.shape[-2]):
            pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))

    x = torch.randn(5, 3)
    match = r"guide samples site 'z' with event shape \(1,\), but the model's 'z' has .*\(2,\)"
    with pytest.raises(ValueError, match=match):
        MPTLoss(conditionals=ImportanceSampling(8)).loss(model, narrow_guide, x)
    with pytest.raises(ValueError, match=match):
        log_marginal(model, x, guide=narrow_guide, conditionals=ImportanceSampling(8))
