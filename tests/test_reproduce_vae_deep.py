"""``pyro-mpt reproduce vae-deep`` at smoke size."""

import json
import math
import os

from pyro_mpt.cli import main
from pyro_mpt.reproduce.vae_deep import METHODS, NAME

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")


def test_vae_deep_smoke(tmp_path, capsys):
    argv = ["reproduce", NAME, "--smoke", "--no-progress", "--out", str(tmp_path)]
    assert main(argv + ["--device", DEVICE]) == 0
    assert "held-out LML" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{NAME}.json", f"{NAME}.png"]
    png = tmp_path / f"{NAME}.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    res = json.loads((tmp_path / f"{NAME}.json").read_text())
    epochs = res["config"]["epochs"]
    assert set(res["runs"]) == set(METHODS)
    for run in res["runs"].values():
        for key in ("objective", "log_marginal", "seconds_per_epoch"):
            assert len(run[key]) == epochs
            assert all(v is not None and math.isfinite(v) for v in run[key])
        # log p(x) of binary images is a log-probability: at most 0.
        assert all(v < 0 for v in run["log_marginal"])
        assert run["test_log_marginal"] is not None and run["test_log_marginal"] < 0
