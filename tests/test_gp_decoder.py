"""``GPDecoder`` trained by ``MPTLoss``: data points are the masked tokens."""

import math

import gpytorch
import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact
from pyro_mpt.diagnostics import log_marginal
from pyro_mpt.models import GPDecoder
from pyro_mpt.ops.masks import masks_of_sizes
from tests.helpers import dense_schur_log_conditionals


def _data(num_data=12, num_outputs=3):
    z = torch.linspace(-2, 2, num_data).unsqueeze(-1)
    y = torch.cat([torch.sin(2 * z), torch.cos(z), 0.5 * z], -1)[:, :num_outputs]
    return z, y + 0.1 * torch.randn(num_data, num_outputs)


def _decoder(z, y, **kwargs):
    init = kwargs.pop("init_codes", z + 0.3 * torch.randn_like(z))
    return GPDecoder(y.shape[0], y.shape[1], latent_dim=z.shape[1], init_codes=init, **kwargs)


def test_masks_hide_data_points_and_match_a_dense_schur_complement():
    z, y = _data()
    decoder = _decoder(z, y, noise_scale=0.3)
    prepared = Exact().prepare(decoder.model, decoder.guide, (y,), {})
    assert prepared.num_features == 12 and prepared.batch_shape == (3,)
    masks = masks_of_sizes(torch.tensor([[1, 5, 12], [11, 3, 7]]), 12)  # (P, D, N)
    log_p = prepared.log_prob(masks)
    cov = decoder.covariance(decoder.codes)
    for p in range(2):
        for d in range(3):
            loc = decoder.loc[d].expand(12)
            expected = dense_schur_log_conditionals(y[:, d], loc, cov, masks[p, d])
            for j, value in expected.items():
                assert log_p[p, d, j].item() == pytest.approx(value.item(), abs=1e-10)


def test_log_marginal_matches_the_trace_and_a_dense_multivariate_normal():
    z, y = _data()
    decoder = _decoder(z, y)
    dense = torch.distributions.MultivariateNormal(
        decoder.loc.unsqueeze(-1).expand(3, 12), decoder.covariance(decoder.codes)
    ).log_prob(y.T)
    torch.testing.assert_close(decoder.log_marginal(y), dense.sum())
    torch.testing.assert_close(log_marginal(decoder.model, y), dense)
    elbo = Trace_ELBO().differentiable_loss(decoder.model, decoder.guide, y)
    torch.testing.assert_close(-elbo, dense.sum())


@pytest.mark.parametrize("share_masks", [True, False])
def test_uniform_rate_is_unbiased_for_the_exact_lml(share_masks):
    z, y = _data(num_data=10)
    decoder = _decoder(z, y)
    exact = decoder.log_marginal(y).item()
    loss = MPTLoss(rate="uniform", share_masks=share_masks)
    with torch.no_grad():
        draws = torch.stack(
            [loss.estimate(decoder.model, decoder.guide, y).sum() for _ in range(500)]
        )
    assert abs(draws.mean().item() - exact) < 4 * draws.std().item() / math.sqrt(500)


def test_predict_matches_an_exact_gp_fitted_on_the_codes():
    z, y = _data()
    decoder = _decoder(z, y, noise_scale=0.2)
    new_codes = torch.tensor([[-1.5], [0.1], [2.5]])
    mean, var = decoder.predict(y, new_codes)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    likelihood.noise = decoder.noise_scale.detach() ** 2 + decoder.jitter

    class _GP(gpytorch.models.ExactGP):
        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                decoder.loc[1].expand(x.shape[:-1]), decoder.kernel(x)
            )

    gp = _GP(decoder.codes.detach(), y[:, 1], likelihood)
    gp.eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        predictive = likelihood(gp(new_codes))
    torch.testing.assert_close(mean[:, 1].detach(), predictive.mean)
    # The decoder's noise excludes the jitter; the refit counts it as noise.
    torch.testing.assert_close(var[:, 0].detach() + decoder.jitter, predictive.variance)


@pytest.mark.parametrize("codes", ["points", "encoder"])
def test_mpt_training_raises_the_exact_lml(codes):
    z, y = _data(num_data=30)
    if codes == "encoder":
        encoder = torch.nn.Sequential(
            torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        decoder = GPDecoder(30, 3, latent_dim=1, encoder=encoder)
    else:
        decoder = _decoder(z, y)
    before = decoder.log_marginal(y).item()
    # Codes from an encoder of y read the masked values themselves: a fixed rate, whose
    # objective is made of masked conditionals, refuses such a model; the uniform rate's
    # estimate of the whole log p(y) stays exact.
    rate = 0.5 if codes == "points" else "uniform"
    svi = SVI(
        decoder.model,
        decoder.guide,
        pyro.optim.Adam({"lr": 0.02}),
        loss=MPTLoss(rate=rate, num_masks=2, share_masks=True),
    )
    for _ in range(150):
        svi.step(y)
    assert decoder.log_marginal(y).item() > before + 10
    names = set(pyro.get_param_store().keys())
    assert "kernel$$$base_kernel.raw_lengthscale" in names
    assert ("encoder$$$0.weight" in names) == (codes == "encoder")


def test_the_exact_objective_trains_every_parameter():
    """``log_marginal`` as a plain SVI loss reaches the codes, mean and noise, not only the
    kernel that ``pyro.module`` registers."""
    z, y = _data(num_data=20)
    decoder = _decoder(z, y, noise_scale=0.5)
    before = {name: value.detach().clone() for name, value in decoder.named_parameters()}
    lml_before = decoder.log_marginal(y).item()

    def exact_loss(model, guide, y):
        return -decoder.log_marginal(y)

    svi = SVI(decoder.model, decoder.guide, pyro.optim.Adam({"lr": 0.02}), loss=exact_loss)
    for _ in range(50):
        svi.step(y)
    names = set(pyro.get_param_store().keys())
    assert {"codes", "loc", "noise_scale"} <= names
    assert "kernel$$$base_kernel.raw_lengthscale" in names
    after = dict(decoder.named_parameters())
    assert all(not torch.equal(before[name], after[name].detach()) for name in before)
    assert decoder.log_marginal(y).item() > lml_before + 5


def test_codes_and_data_of_different_sizes_are_rejected():
    z, y = _data(num_data=12)
    decoder = _decoder(z, y)
    with pytest.raises(
        ValueError, match="y has 11 rows but the decoder holds codes for num_data=12"
    ):
        decoder.model(y[:11])
    with pytest.raises(ValueError, match="y has 2 columns but the decoder has num_outputs=3"):
        decoder.model(y[:, :2])
    with pytest.raises(ValueError, match=r"y must be a tensor of shape \(num_data, num_outputs\)"):
        decoder.model(y[0])
    with pytest.raises(ValueError, match=r"init_codes has shape \(12, 2\) but the decoder"):
        GPDecoder(12, 3, latent_dim=1, init_codes=torch.zeros(12, 2))
    bad_encoder = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"the encoder returned codes of shape \(12, 2\)"):
        GPDecoder(12, 3, latent_dim=1, encoder=bad_encoder).model(y)


def test_bad_constructor_arguments_are_rejected():
    with pytest.raises(TypeError, match="kernel must be a gpytorch.kernels.Kernel, got Linear"):
        GPDecoder(5, 2, kernel=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="encoder must be a torch.nn.Module"):
        GPDecoder(5, 2, encoder=lambda y: y)
    with pytest.raises(ValueError, match="num_data must be at least 1, got 0"):
        GPDecoder(0, 2)
    with pytest.raises(ValueError, match="noise_scale must be a positive number, got -1"):
        GPDecoder(5, 2, noise_scale=-1)
    # A kernel per output: log_marginal gave +inf, predict failed on shapes.
    per_output = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([3]))
    with pytest.raises(ValueError, match=r"kernel has batch_shape \(3,\); GPDecoder shares"):
        GPDecoder(5, 3, kernel=per_output)


def test_a_rate_out_of_range_is_rejected_before_training():
    with pytest.raises(ValueError, match=r"rate must lie in \(0, 1\], got 1.5"):
        MPTLoss(rate=1.5, share_masks=True)


def test_follows_the_dtype_of_the_data():
    z, y = _data()
    decoder = _decoder(z.float(), y.float(), init_codes=z.float()).float()
    loss = MPTLoss(rate=0.5).differentiable_loss(decoder.model, decoder.guide, y.float())
    assert loss.dtype == torch.float32 and loss.device == y.device
