"""The built-in models and Pyro's global param store: a model built after another of the
same names (a notebook cell run twice) or after ``pyro.get_param_store().load(...)``
computes with the stored parameters that ``SVI``'s optimiser updates, so it trains; one
whose names are stored with other shapes is refused as it is built, naming the parameter.

Before, a ``VAE``'s layers and a ``GPDecoder``'s kernel computed with their own tensors
while the optimiser updated the stored ones: the second model never trained, silently."""

import re

import gpytorch
import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.models import PPCA, VAE, FactorAnalysis, GPDecoder, LinearVAE

NUM_DATA = 32


def _data(binary):
    generator = torch.Generator().manual_seed(0)
    if binary:
        return torch.bernoulli(torch.full((NUM_DATA, 6), 0.3), generator=generator)
    return 2.0 * torch.randn(NUM_DATA, 6, generator=generator)


CASES = {
    "PPCA": (lambda: PPCA(6, 2), False, Trace_ELBO),
    "FactorAnalysis": (lambda: FactorAnalysis(6, 2), False, Trace_ELBO),
    "LinearVAE": (lambda: LinearVAE(6, 2), True, Trace_ELBO),
    "VAE": (lambda: VAE(6, 2, hidden_dim=8), True, Trace_ELBO),
    "GPDecoder": (
        lambda: GPDecoder(num_data=NUM_DATA, num_outputs=6, latent_dim=2),
        False,
        MPTLoss,
    ),
}


def _scaled_rbf():
    """One lengthscale for every latent dim, where the default kernel has one per dim."""
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())


def _train(model, x, loss, steps=5):
    svi = SVI(model.model, model.guide, pyro.optim.Adam({"lr": 0.05}), loss=loss())
    for _ in range(steps):
        svi.step(x)


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_built_after_another_of_the_same_names_trains(name):
    make, binary, loss = CASES[name]
    x = _data(binary)
    _train(make(), x, loss)
    second = make()
    _train(second, x, loss, steps=1)  # its parameters are now those it computes with
    before = {k: v.detach().clone() for k, v in second.named_parameters()}
    _train(second, x, loss)
    for key, value in second.named_parameters():
        assert not torch.equal(value.detach(), before[key]), f"{key} did not train"
    # And they are the stored ones, which the optimiser updates.
    stored = {id(value.unconstrained()) for value in pyro.get_param_store().values()}
    assert all(id(value) in stored for _, value in second.named_parameters())


def test_a_vae_built_after_loading_the_param_store_computes_with_the_loaded_parameters(
    tmp_path,
):
    x = _data(binary=True)
    trained = VAE(6, 2, hidden_dim=8)
    _train(trained, x, Trace_ELBO, steps=20)
    pyro.set_rng_seed(1)
    expected = Trace_ELBO().loss(trained.model, trained.guide, x)
    path = tmp_path / "params.pt"
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    for order in ("load, then build", "build, then load"):
        pyro.clear_param_store()
        if order == "build, then load":
            resumed = VAE(6, 2, hidden_dim=8)
            pyro.get_param_store().load(path)
        else:
            pyro.get_param_store().load(path)
            resumed = VAE(6, 2, hidden_dim=8)
        pyro.set_rng_seed(1)
        assert Trace_ELBO().loss(resumed.model, resumed.guide, x) == pytest.approx(expected), order


@pytest.mark.parametrize(
    "first, second, parameter",
    [
        (lambda: VAE(6, 2, hidden_dim=8), lambda: VAE(7, 2, hidden_dim=8), "decoder.2.weight"),
        (lambda: PPCA(6, 2), lambda: PPCA(5, 2), "weight"),
        (
            lambda: GPDecoder(num_data=8, num_outputs=3, latent_dim=2),
            lambda: GPDecoder(num_data=8, num_outputs=3, latent_dim=2, kernel=_scaled_rbf()),
            "kernel$$$base_kernel.raw_lengthscale",
        ),
    ],
    ids=["VAE", "PPCA", "GPDecoder"],
)
def test_a_model_whose_names_are_stored_with_other_shapes_is_refused_as_it_is_built(
    first, second, parameter
):
    model = first()
    x = torch.randn(8, 6) if isinstance(model, (VAE, PPCA)) else torch.randn(8, 3)
    if isinstance(model, VAE):
        x = torch.bernoulli(torch.full((8, 6), 0.5))
    _train(model, x, MPTLoss if isinstance(model, GPDecoder) else Trace_ELBO, steps=1)
    store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=rf"{re.escape(parameter)}.*clear_param_store"):
        second()
    assert {k: v for k, v in pyro.get_param_store().items()}.keys() == store.keys()
    for key, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), store[key])
    with pyro.settings.context(module_local_params=True):
        second()  # each model keeps its own: nothing to refuse


def test_module_local_parameters_stay_each_models_own():
    x = _data(binary=False)
    with pyro.settings.context(module_local_params=True):
        for _ in range(2):
            decoder = GPDecoder(num_data=NUM_DATA, num_outputs=6, latent_dim=2)
            before = {k: v.detach().clone() for k, v in decoder.named_parameters()}
            optimizer = torch.optim.Adam(decoder.parameters(), lr=0.05)
            loss = MPTLoss()
            for _ in range(3):
                optimizer.zero_grad()
                loss.loss_and_grads(decoder.model, decoder.guide, x)
                optimizer.step()
            for key, value in decoder.named_parameters():
                assert not torch.equal(value.detach(), before[key]), f"{key} did not train"
