"""LinearVAE and VAE: shapes, broadcasting over outer plates, and training with Trace_ELBO."""

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import Adam

from pyro_mpt.models import VAE, LinearVAE

N, D = 12, 8


def _make(cls, likelihood="bernoulli", **kwargs):
    if cls is VAE:
        return VAE(D, latent_dim=3, hidden_dim=16, likelihood=likelihood, **kwargs)
    return LinearVAE(D, latent_dim=2, likelihood=likelihood, **kwargs)


def _binary_data(num_obs=N):
    # Two prototypes with flipped bits: structure a latent code can explain.
    protos = torch.tensor(
        [[1.0] * (D // 2) + [0.0] * (D // 2), [0.0] * (D // 2) + [1.0] * (D // 2)]
    )
    x = protos[torch.arange(num_obs) % 2]
    flips = torch.rand(num_obs, D) < 0.1
    return torch.where(flips, 1.0 - x, x)


CASES = [(cls, lik) for cls in (LinearVAE, VAE) for lik in ("bernoulli", "normal")]


@pytest.mark.parametrize("cls,likelihood", CASES)
def test_encode_decode_and_sample_shapes(cls, likelihood):
    vae = _make(cls, likelihood)
    K = vae.latent_dim
    x = _binary_data()
    loc, scale = vae.encode(x)
    assert loc.shape == scale.shape == (N, K)
    assert (scale > 0).all()
    assert vae.decode(torch.randn(N, K)).shape == (N, D)
    assert vae.decode(torch.randn(4, 1, N, K)).shape == (4, 1, N, D)
    loc, scale = vae.encode(x.expand(5, N, D))
    assert loc.shape == scale.shape == (5, N, K)
    sample = vae.sample(7)
    assert sample.shape == (7, D)
    assert sample.dtype == torch.get_default_dtype()
    if likelihood == "bernoulli":
        assert ((sample == 0) | (sample == 1)).all()


@pytest.mark.parametrize("cls,likelihood", CASES)
def test_model_and_guide_sites(cls, likelihood):
    vae = _make(cls, likelihood)
    x = _binary_data()
    guide_tr = poutine.trace(vae.guide).get_trace(x)
    model_tr = poutine.trace(poutine.replay(vae.model, trace=guide_tr)).get_trace(x)
    assert guide_tr.nodes["z"]["value"].shape == (N, vae.latent_dim)
    assert model_tr.nodes["x"]["is_observed"]
    assert torch.equal(model_tr.nodes["x"]["value"], x)
    model_tr.compute_log_prob()
    assert model_tr.nodes["x"]["log_prob"].shape == (N,)
    assert model_tr.nodes["z"]["log_prob"].shape == (N,)
    assert {f.name for f in model_tr.nodes["z"]["cond_indep_stack"]} == {"data"}


@pytest.mark.parametrize("cls,likelihood", CASES)
def test_model_broadcasts_inside_an_outer_plate(cls, likelihood):
    vae = _make(cls, likelihood)
    K = vae.latent_dim
    x = _binary_data()
    with pyro.plate("particles", 3, dim=-2):
        tr = poutine.trace(vae.model).get_trace(x)
    tr.compute_log_prob()
    assert tr.nodes["z"]["value"].shape == (3, N, K)
    assert tr.nodes["x"]["log_prob"].shape == (3, N)

    # Latent values with an extra singleton dimension, (S, 1, N, K).
    z = torch.randn(4, 1, N, K)
    with pyro.plate("particles", 4, dim=-3):
        tr = poutine.trace(poutine.condition(vae.model, data={"z": z})).get_trace(x)
    tr.compute_log_prob()
    assert tr.nodes["x"]["log_prob"].shape == (4, 1, N)
    expected = vae.observation_dist(z).log_prob(x).sum(-1)
    assert torch.allclose(tr.nodes["x"]["log_prob"], expected)


@pytest.mark.parametrize("cls", [LinearVAE, VAE])
def test_guide_encodes_the_x_it_is_given(cls):
    vae = _make(cls)
    with torch.no_grad():  # the linear encoder starts at zero; move it off
        for p in vae.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = _binary_data()
    filled = x.clone()
    filled[:, : D // 2] = 0.5
    batch = torch.stack([x, filled])  # (2, N, D): one copy per mask
    with pyro.plate("particles", 2, dim=-2):
        tr = poutine.trace(vae.guide).get_trace(batch)
    tr.compute_log_prob()
    z = tr.nodes["z"]["fn"].base_dist.loc
    assert z.shape == (2, N, vae.latent_dim)
    assert torch.allclose(z[0], vae.encode(x)[0])
    assert torch.allclose(z[1], vae.encode(filled)[0])
    assert not torch.allclose(z[0], z[1])
    assert tr.nodes["z"]["log_prob"].shape == (2, N)


@pytest.mark.parametrize("cls,likelihood", CASES)
def test_svi_reduces_the_loss(cls, likelihood):
    vae = _make(cls, likelihood)
    x = _binary_data(40)
    svi = SVI(vae.model, vae.guide, Adam({"lr": 0.05}), Trace_ELBO(num_particles=4))
    first = sum(svi.step(x) for _ in range(5)) / 5
    for _ in range(150):
        svi.step(x)
    last = sum(svi.step(x) for _ in range(5)) / 5
    assert last < 0.8 * first


def test_subsampling_scales_the_elbo():
    vae = LinearVAE(D, subsample_size=5)
    x = _binary_data(40)
    tr = poutine.trace(vae.guide).get_trace(x)
    assert tr.nodes["z"]["value"].shape == (5, 2)
    model_tr = poutine.trace(poutine.replay(vae.model, trace=tr)).get_trace(x)
    idx = tr.nodes["data"]["value"]
    assert torch.equal(model_tr.nodes["x"]["value"], x[idx])
    assert model_tr.nodes["x"]["scale"] == pytest.approx(8.0)


def test_noise_options():
    assert LinearVAE(D, likelihood="normal").noise_scale.shape == ()
    assert VAE(D, hidden_dim=4, likelihood="normal").noise_scale.shape == ()
    assert VAE(D, hidden_dim=4, likelihood="normal", noise="feature").noise_scale.shape == (D,)
    assert not hasattr(LinearVAE(D), "noise_scale")


def test_num_layers_and_activation():
    vae = VAE(D, latent_dim=2, hidden_dim=5, num_layers=3, activation="relu")
    linears = [m for m in vae.decoder if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4
    assert isinstance(vae.encoder[1], torch.nn.ReLU)
    assert vae.encode(torch.zeros(2, D))[0].shape == (2, 2)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            {"likelihood": "poisson"},
            ValueError,
            "likelihood must be 'bernoulli' or 'normal', got 'poisson'",
        ),
        ({"latent_dim": 0}, ValueError, "latent_dim must be at least 1, got 0"),
        ({"num_layers": 0}, ValueError, "num_layers must be at least 1, got 0"),
        ({"hidden_dim": 2.5}, TypeError, "hidden_dim must be a positive integer, got 2.5"),
        ({"activation": "gelu"}, ValueError, "activation must be 'tanh' or 'relu', got 'gelu'"),
        ({"noise": "full"}, ValueError, "noise must be 'scalar' or 'feature', got 'full'"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        VAE(D, **kwargs)


def test_wrong_data_width_is_reported():
    vae = LinearVAE(D)
    with pytest.raises(ValueError, match=r"x must have shape \(N, 8\).*got \(12, 5\)"):
        vae.model(torch.zeros(12, 5))
    with pytest.raises(ValueError, match=r"likelihood must be .*got 'gaussian'"):
        LinearVAE(D, likelihood="gaussian")
