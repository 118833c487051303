"""The ``pyro-mpt`` command line and the paper reproductions it runs (smoke sizes)."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from experiments import EXPERIMENTS
from experiments._common import save_outputs
from experiments._ppca import (
    per_observation_scores,
    random_subsets,
    shared_mask_scores,
)
from pyro_mpt.cli import main
from pyro_mpt.ops.estimators import mask_scores
from pyro_mpt.ops.gaussian import (
    latent_gaussian_conditionals,
    latent_gaussian_log_marginal,
    normal_log_prob,
)

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def _reproduce(name, out_dir, *extra):
    argv = ["reproduce", name, "--smoke", "--no-progress", "--out", str(out_dir)]
    assert main(argv + ["--device", DEVICE, *extra]) == 0
    png = out_dir / f"{name}.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out_dir.iterdir()) == [f"{name}.json", f"{name}.png"]
    return json.loads((out_dir / f"{name}.json").read_text())


def _close_to(value, target, std, count, num_se=4.0):
    """``value`` lies within ``num_se`` standard errors (``std / sqrt(count)``) of ``target``."""
    return abs(value - target) <= num_se * std / math.sqrt(count) + 1e-9


def test_list(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPERIMENTS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["reproduce", "ppca-nope"], "unknown experiment 'ppca-nope'; choose one of: "),
        (["reproduce"], "give an experiment NAME or --list"),
        (["reproduce", "ppca-curve", "--smoke", "--full"], "not allowed with argument"),
        (["reproduce", "ppca-curve", "--seed", "-3"], "expected a non-negative integer"),
        (["reproduce", "ppca-curve", "--threads", "-2"], "expected a positive integer, got -2"),
        (["reproduce", "ppca-curve", "--threads", "0"], "expected a positive integer, got 0"),
        (["reproduce", "ppca-curve", "--data-noise", "model"], "does not apply to ppca-curve"),
        (["reproduce", "ppca-curve", "--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown experiment" in message:
        assert all(name in err for name in EXPERIMENTS)


def test_table1_smoke(tmp_path):
    res = _reproduce("ppca-table1", tmp_path)
    true, seeds = res["true_lml"], res["config"]["seeds"]
    assert res["config"]["noise"] == "paper" and math.isfinite(true)
    shared, per_obs = res["shared"], res["per_observation"]
    largest = shared[str(max(res["config"]["shared_P"]))]
    assert len(largest["estimates"]) == seeds
    assert _close_to(largest["mean"], true, largest["std"], seeds)
    assert _close_to(per_obs["10"]["mean"], true, per_obs["10"]["std"], seeds)
    # Masks drawn per observation average out over N: a far smaller spread at equal P.
    assert per_obs["1"]["std"] < 0.5 * shared["1"]["std"]
    assert res["p100_seconds"] > 0


def test_table1_model_noise(tmp_path):
    paper = _reproduce("ppca-table1", tmp_path / "paper")["true_lml"]
    model = _reproduce("ppca-table1", tmp_path / "model", "--data-noise", "model")
    assert model["config"]["noise"] == "model"
    # Independent noise per feature is what the model expects, but far more of it: lower LML.
    assert model["true_lml"] < paper - 5


def test_convergence_smoke(tmp_path):
    res = _reproduce("ppca-convergence", tmp_path)
    uniform, fixed = res["panels"][:2], res["panels"][2]
    for panel in uniform:  # unbiased: the many-mask limit is the LML
        assert abs(panel["limit_relative_error"]) <= 4 * panel["limit_relative_error_se"] + 1e-9
    # The fixed rate converges to a bias, many standard errors away from zero.
    assert abs(fixed["limit_relative_error"]) > 10 * fixed["limit_relative_error_se"]
    errors = fixed["relative_error"][str(max(res["config"]["P"]))]
    assert all(abs(e - abs(fixed["limit_relative_error"])) < 0.1 for e in errors)


def test_training_smoke(tmp_path):
    res = _reproduce("ppca-training", tmp_path)
    assert set(res["runs"]) == {"uniform", "fixed 20%"}
    for runs in res["runs"].values():
        assert len(runs) == res["config"]["inits"]
        for run in runs:
            assert len(run["log_marginal"]) == res["config"]["epochs"]
            assert run["log_marginal"][-1] > run["log_marginal"][0] + 0.5


def test_curve_smoke_subprocess(tmp_path):
    """Each panel's area lies within 4 standard errors of the exact LML of its data. The
    standard error of a sum of independent per-size means adds in quadrature; the panel with
    one mask per size has none of its own, and takes that of the panel with the same model
    and data and P = 5 masks, times sqrt(5)."""
    cmd = [sys.executable, "-m", "pyro_mpt.cli", "reproduce", "ppca-curve", "--smoke"]
    cmd += ["--no-progress", "--out", str(tmp_path), "--device", DEVICE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "area" in proc.stdout and "ppca-curve.json" in proc.stdout
    res = json.loads((tmp_path / "ppca-curve.json").read_text())
    num_features = res["config"]["D"]
    panels = {(p["latent_dim"], p["num_masks"]): p for p in res["panels"]}
    assert sorted(panels) == [(2, 1), (2, 5), (8, 2)]
    for panel in panels.values():
        assert panel["sizes"] == list(range(1, num_features + 1))
    # Panels with the same K share the ground truth and the data, so their LML.
    assert panels[2, 1]["log_marginal"] == panels[2, 5]["log_marginal"]
    se = {key: math.sqrt(sum(s**2 for s in p["stderr"])) for key, p in panels.items() if key[1] > 1}
    se[2, 1] = se[2, 5] * math.sqrt(5)
    for key, panel in panels.items():
        assert se[key] > 0
        assert abs(panel["area"] - panel["log_marginal"]) <= 4 * se[key], (key, se[key])
    assert (tmp_path / "ppca-curve.png").stat().st_size > 1000


def _problem(num_obs=40, num_features=7, latent_dim=2):
    weight = torch.randn(num_features, latent_dim)
    bias = torch.randn(num_features)
    noise_var = torch.rand(num_features) + 0.1
    x = (
        torch.randn(num_obs, latent_dim) @ weight.T
        + bias
        + noise_var.sqrt() * torch.randn(num_obs, num_features)
    )
    return x, weight, bias, noise_var


def test_fast_scores_match_conditionals():
    x, weight, bias, noise_var = _problem()
    num_obs, num_features = x.shape
    residual = x - bias
    for size in range(1, num_features + 1):
        perm = random_subsets(num_obs, num_features, size)
        masks = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, perm[:, :size], True)
        assert (masks.sum(-1) == size).all()
        mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~masks)
        expected = mask_scores(normal_log_prob(x, mean, var), masks)
        got = per_observation_scores(residual, weight, noise_var, perm, size)
        assert torch.allclose(got, expected, atol=1e-10)
        # The same masks, each shared by all observations.
        mean, var = latent_gaussian_conditionals(x, weight, bias, noise_var, ~masks.unsqueeze(1))
        expected = mask_scores(normal_log_prob(x, mean, var), masks.unsqueeze(1)).mean(-1)
        second_moment = residual.T @ residual / num_obs
        got = shared_mask_scores(second_moment, weight, noise_var, masks)
        assert torch.allclose(got, expected, atol=1e-10)


def test_shared_scores_over_all_masks_sum_to_log_marginal():
    x, weight, bias, noise_var = _problem(num_features=6)
    residual = x - bias
    second_moment = residual.T @ residual / x.shape[0]
    total = 0.0
    for size in range(1, 7):
        masks = torch.tensor(
            [[j in subset for j in range(6)] for subset in itertools.combinations(range(6), size)]
        )
        total += shared_mask_scores(second_moment, weight, noise_var, masks).mean()
    exact = latent_gaussian_log_marginal(x, weight, bias, noise_var).mean()
    assert torch.allclose(total, exact, atol=1e-10)


def test_random_subsets_are_uniform():
    for size in (2, 7):  # shuffles the masked side, then the context side
        perm = random_subsets(40000, 9, size)
        assert (perm.sort(-1).values == torch.arange(9)).all()
        freq = torch.bincount(perm[:, :size].flatten(), minlength=9) / (40000 * size)
        assert torch.allclose(freq, torch.full((9,), 1 / 9), atol=0.01)


def test_outputs_replaced_atomically(tmp_path):
    from matplotlib.figure import Figure

    results = save_outputs(tmp_path, "exp", {"value": float("nan"), "t": torch.ones(2)}, Figure())
    assert json.loads((tmp_path / "exp.json").read_text()) == {"value": None, "t": [1.0, 1.0]}
    assert results["outputs"] == {
        "json": str(tmp_path / "exp.json"),
        "png": str(tmp_path / "exp.png"),
    }
    before = (tmp_path / "exp.png").read_bytes()

    class Broken(Figure):
        def savefig(self, *args, **kwargs):
            raise RuntimeError("disk full")

    failed = {"value": 1.0}
    with pytest.raises(RuntimeError, match="disk full"):
        save_outputs(tmp_path, "exp", failed, Broken())
    assert failed == {"value": 1.0}
    assert (tmp_path / "exp.png").read_bytes() == before
    # The JSON written before the figure failed is not put in place either: the outputs stay
    # a pair from one run.
    assert json.loads((tmp_path / "exp.json").read_text()) == {"value": None, "t": [1.0, 1.0]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.json", "exp.png"]


def test_an_output_path_that_is_a_folder_is_named_and_nothing_is_written(tmp_path):
    from matplotlib.figure import Figure

    (tmp_path / "exp.json").write_text("earlier")
    (tmp_path / "exp.png").mkdir()
    with pytest.raises(IsADirectoryError, match=r"exp.png is a folder.*nothing was written"):
        save_outputs(tmp_path, "exp", {"value": 1.0}, Figure())
    assert (tmp_path / "exp.json").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.json", "exp.png"]
