"""``pyro-mpt reproduce ppca-training`` (paper Fig. 2): the ``--masks`` option, the reference
LMLs the runs are compared with, and the distances in standard errors. The mask conventions
themselves are tested in ``test_reproduce_ppca_curve_training.py``."""

import inspect
import math
import statistics

import pyro
import pytest
import torch

from experiments import ppca_training
from pyro_mpt import log_marginal
from pyro_mpt.cli import main
from pyro_mpt.models import PPCA


@pytest.fixture
def recorded_run(monkeypatch):
    """Replaces ``ppca_training.run`` by one with the same signature that records its
    keyword arguments, so that the command line's translation of its options is visible."""
    calls = []
    signature = inspect.signature(ppca_training.run)

    def fake(out_dir, **kwargs):
        signature.bind(out_dir, **kwargs)  # only arguments the real run accepts
        calls.append(kwargs)
        return {"outputs": {}}

    fake.__signature__ = signature
    monkeypatch.setattr(ppca_training, "run", fake)
    return calls


@pytest.mark.parametrize(
    "flag, expected",
    [
        (["--masks", "shared"], "shared"),
        (["--masks", "per-observation"], "per-observation"),
        (["--masks", "both"], ("per-observation", "shared")),
    ],
)
def test_masks_option_reaches_run(recorded_run, tmp_path, flag, expected):
    argv = ["reproduce", "ppca-training", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + flag) == 0
    (kwargs,) = recorded_run
    assert kwargs["masks"] == expected


def test_without_masks_option_run_keeps_its_default(recorded_run, tmp_path):
    argv = ["reproduce", "ppca-training", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    (kwargs,) = recorded_run
    assert "masks" not in kwargs
    default = inspect.signature(ppca_training.run).parameters["masks"].default
    assert tuple(default) == ppca_training.CONVENTIONS


def test_masks_option_is_refused_elsewhere_and_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        main(["reproduce", "ppca-table1", "--masks", "shared", "--out", str(tmp_path)])
    assert error.value.code == 2
    assert "--masks does not apply to ppca-table1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["reproduce", "ppca-training", "--masks", "paper", "--out", str(tmp_path)])
    assert "invalid choice: 'paper'" in capsys.readouterr().err


def test_maximum_log_marginal_is_the_maximum_likelihood_ppca():
    torch.manual_seed(0)
    num_obs, num_features, latent_dim = 400, 6, 2
    x = torch.randn(num_obs, latent_dim, dtype=torch.float64) @ torch.randn(
        latent_dim, num_features, dtype=torch.float64
    ) + 0.5 * torch.randn(num_obs, num_features, dtype=torch.float64)
    x = x + torch.arange(num_features, dtype=torch.float64)
    best = ppca_training.maximum_log_marginal(x, latent_dim)

    # The Tipping-Bishop estimate, built here from an eigendecomposition, scored by the
    # package's exact log p(x).
    mean = x.mean(0)
    values, vectors = torch.linalg.eigh((x - mean).T @ (x - mean) / num_obs)
    values, vectors = values.flip(0), vectors.flip(1)
    noise_var = values[latent_dim:].mean()
    weight = vectors[:, :latent_dim] * (values[:latent_dim] - noise_var).sqrt()

    def lml(weight, loc, noise_scale):
        pyro.clear_param_store()
        model = PPCA(num_features, latent_dim, init_scale=1.0).double()
        model.weight = weight
        model.loc = loc
        model.noise_scale = noise_scale
        with torch.no_grad():
            value = float(log_marginal(model.model, x).mean())
        pyro.clear_param_store()
        return value

    assert best == pytest.approx(lml(weight, mean, noise_var.sqrt()), abs=1e-9)
    # Any other parameters score lower.
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        noise = torch.randn(weight.shape, generator=generator, dtype=torch.float64)
        assert lml(weight + 0.05 * noise, mean, noise_var.sqrt()) < best
    assert lml(weight, mean + 0.05, noise_var.sqrt()) < best
    assert lml(weight, mean, 1.1 * noise_var.sqrt()) < best
    with pytest.raises(ValueError, match="latent_dim=6 must lie in 1..5"):
        ppca_training.maximum_log_marginal(x, num_features)


def test_standard_errors():
    values = [1.0, 2.0, 4.0]
    expected = (statistics.fmean(values) - 0.5) / (statistics.stdev(values) / math.sqrt(3))
    assert ppca_training.standard_errors(values, 0.5) == pytest.approx(expected)
    assert math.isnan(ppca_training.standard_errors([1.0], 0.0))
    assert math.isnan(ppca_training.standard_errors([1.0, 1.0], 0.0))


def test_summary_states_each_runs_distance_in_standard_errors(tmp_path):
    res = ppca_training.run(tmp_path, smoke=True, progress=False)
    truth, best = res["ground_truth_log_marginal"], res["maximum_log_marginal"]
    assert best > truth  # fitted to these data, the best PPCA beats the one that drew them
    window = res["config"]["final_window"]
    for name, s in res["summary"].items():
        group = res["shared_mask_runs"] if s["share_masks"] else res["runs"]
        final = [statistics.fmean(r["log_marginal"][-window:]) for r in group[s["schedule"]]]
        assert len(final) == res["config"]["inits"]
        distance = [v - truth for v in final]
        assert s["distance_to_truth"][0] == pytest.approx(statistics.fmean(distance))
        assert s["distance_to_truth"][1] == pytest.approx(statistics.stdev(distance))
        se = statistics.stdev(final) / math.sqrt(len(final))
        assert s["distance_to_truth_se"] == pytest.approx(statistics.fmean(distance) / se)
        assert s["distance_to_maximum"][0] == pytest.approx(statistics.fmean(final) - best)
        assert s["distance_to_maximum"][0] < 0, name
