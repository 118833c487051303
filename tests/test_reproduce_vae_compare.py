"""``pyro-mpt reproduce vae-compare``: the table gathers each reproduction's final figures,
checked on reproductions that return known values, with no training."""

import json

import pytest

from experiments import vae_compare
from pyro_mpt.cli import main

LINEAR = dict(
    config=dict(N=40),
    summary={
        "ELBO": dict(
            final_log_marginal_train=-101.5,
            final_log_marginal_held_out=-103.25,
            seconds_per_epoch=0.5,
        ),
        "MPT uniform": dict(
            final_log_marginal_train=-99.0,
            final_log_marginal_held_out=-100.75,
            seconds_per_epoch=1.5,
        ),
    },
    outputs=dict(json="vae-linear.json", png="vae-linear.png"),
)
DEEP = dict(
    config=dict(N=60, eval_samples=7, iterations=3),  # encode-decode rows, before seeds
    runs={
        "ELBO": dict(
            log_marginal=[-300.0, -250.0, -210.5],
            test_log_marginal=-215.25,
            seconds_per_epoch=[2.0, 4.0, 6.0],
        ),
        "MPT 33%": dict(
            log_marginal=[-300.0, -240.0, -205.0],
            test_log_marginal=-209.5,
            seconds_per_epoch=[3.0, 3.0, 6.0],
        ),
    },
    outputs=dict(json="vae-deep.json", png="vae-deep.png"),
)
EXPECTED = [
    ("linear VAE (quadrature)", "ELBO", -101.5, -103.25, 0.5),
    ("linear VAE (quadrature)", "MPT uniform", -99.0, -100.75, 1.5),
    ("deep VAE (encode-decode)", "ELBO", -210.5, -215.25, 4.0),
    ("deep VAE (encode-decode)", "MPT 33%", -205.0, -209.5, 4.0),
]
KEYS = ("model", "objective", "log_marginal", "held_out_log_marginal", "seconds_per_epoch")


def test_rows_take_the_final_figures_and_the_mean_epoch_time():
    rows = vae_compare.comparison_rows(LINEAR, DEEP)
    assert [tuple(row[k] for k in KEYS) for row in rows] == EXPECTED


def test_seeded_deep_rows_take_vae_deeps_step_time_times_the_steps_of_an_epoch():
    runs = {
        name: dict(r, step_seconds=step) for (name, r), step in zip(DEEP["runs"].items(), (0.5, 2))
    }
    seeded = dict(DEEP, config=dict(N=60, batch=25, eval_samples=7), runs=runs)
    rows = vae_compare.comparison_rows(LINEAR, seeded)
    # ceil(60 / 25) = 3 steps per epoch, by hand.
    assert [row["seconds_per_epoch"] for row in rows[2:]] == [1.5, 6.0]
    assert [row["timing"] for row in rows] == [vae_compare.EPOCH_WALL_TIME] * 2 + [
        vae_compare.STEP_TIMES_STEPS
    ] * 2


def test_deep_rows_of_the_seeded_layout_are_named_for_importance_sampling():
    seeded = dict(DEEP, config=dict(N=60, eval_samples=7))
    models = [row["model"] for row in vae_compare.comparison_rows(LINEAR, seeded)]
    assert models[2:] == ["deep VAE (importance)"] * 2


def test_run_passes_its_options_on_and_writes_the_table(tmp_path, monkeypatch, capsys):
    calls = {}

    def fake(name, result):
        def run(out_dir, **options):
            calls[name] = (out_dir, options)
            return result

        return run

    monkeypatch.setattr(vae_compare.vae_linear, "run", fake("linear", LINEAR))
    monkeypatch.setattr(vae_compare.vae_deep, "run", fake("deep", DEEP))
    argv = ["reproduce", "vae-compare", "--smoke", "--no-progress", "--seed", "3"]
    assert main(argv + ["--out", str(tmp_path)]) == 0
    common = dict(device="cpu", smoke=True, full=False, seed=3, progress=False)
    assert calls["linear"] == (str(tmp_path), common)
    deep_options = dict(common, methods=list(vae_compare.vae_deep.METHODS))
    assert calls["deep"] == (str(tmp_path), deep_options)
    saved = json.loads((tmp_path / "vae-compare.json").read_text())
    assert [tuple(row[k] for k in KEYS) for row in saved["rows"]] == EXPECTED
    # The result files only: no figure is committed beside them.
    assert saved["sources"] == dict(linear="vae-linear.json", deep="vae-deep.json")
    assert (tmp_path / "vae-compare.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "linear VAE N=40, deep VAE N=60" in out and "S=7" in out
    for row in EXPECTED:
        assert f"{row[2]:.2f}" in out and f"{row[3]:.2f}" in out and f"{row[4]:.2f}" in out


@pytest.mark.parametrize("flag", ["--smoke", "--full"])
def test_run_forwards_the_size(tmp_path, monkeypatch, flag):
    sizes = []
    monkeypatch.setattr(
        vae_compare.vae_linear, "run", lambda out, **o: sizes.append(o["full"]) or LINEAR
    )
    monkeypatch.setattr(vae_compare.vae_deep, "run", lambda out, **o: DEEP)
    assert main(["reproduce", "vae-compare", flag, "--no-progress", "--out", str(tmp_path)]) == 0
    assert sizes == [flag == "--full"]
