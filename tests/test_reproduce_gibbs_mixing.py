"""pyro-mpt reproduce gibbs-mixing at smoke size: the properties its table reports."""

import json
import os

from experiments import EXPERIMENTS, get_experiment


def _row(results, model, k, update):
    (row,) = [
        r
        for r in results["mixing"]
        if r["model"] == model and r["k"] == k and r["update"] == update
    ]
    return row


def test_gibbs_mixing_smoke(tmp_path, capsys):
    assert "gibbs-mixing" in EXPERIMENTS
    results = get_experiment("gibbs-mixing").run(str(tmp_path), smoke=True, progress=False)
    assert "ESS/step" in capsys.readouterr().out
    with open(os.path.join(tmp_path, "gibbs-mixing.json")) as handle:
        assert json.load(handle)["experiment"] == "gibbs-mixing"
    assert os.path.getsize(os.path.join(tmp_path, "gibbs-mixing.png")) > 0
    d = results["config"]["num_features"]
    for model in ("ppca", "bimodal"):
        # A joint step of all D features is an independent draw of the model.
        assert 0.6 < _row(results, model, d, "joint")["ess_per_step"] < 1.5
    # Product steps of all features draw the marginals: no correlation left, as predicted.
    joint, product = _row(results, "ppca", d, "joint"), _row(results, "ppca", d, "product")
    assert joint["stationary_error"] < 0.15 < 0.5 < product["stationary_error"]
    assert abs(product["stationary_error"] - product["predicted_error"]) < 0.1
    assert _row(results, "bimodal", d, "product")["stationary_error"] > 0.2
    assert _row(results, "bimodal", d, "joint")["stationary_error"] < 0.05
    # Joint mixing improves with the block size.
    for model in ("ppca", "bimodal"):
        assert _row(results, model, 1, "joint")["ess_per_step"] < 0.2
    training = {t["k"]: t["mean"] for t in results["training"]}
    assert training[7] < training[1]
