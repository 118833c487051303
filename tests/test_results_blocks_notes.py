"""Rendered sentences and captions that quote figures of a result file: the figures and the
gaps they state, from small hand-made result files."""

import json

from experiments.results_blocks_notes import gp_decoder_summary_block
from experiments.results_blocks_sampling import ppca_curve_block
from experiments.results_blocks_transformers import _comparison_text, _convergence_text
from experiments.results_format import Context

MANIFEST = dict(
    command="pyro-mpt reproduce NAME --threads 1",
    size="default",
    seconds=12.0,
    date="2026-01-01",
    torch="x",
    cpu_count=2,
)


def _context(tmp_path, source, file_name, result):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / file_name).write_text(json.dumps(result))
    manifest = {source: dict(MANIFEST, files=[file_name])}
    (results / "manifest.json").write_text(json.dumps(manifest))
    return Context(tmp_path, "md")


def test_gp_decoder_summary_states_the_figures_and_gaps_of_one_seed(tmp_path):
    quality = {
        "MPT |R|=128": dict(lml_per_image=200.0, held_out_lpd=0.25),
        "MPT uniform": dict(lml_per_image=210.5, held_out_lpd=0.3),
        "exact LML": dict(lml_per_image=250.0, held_out_lpd=0.2),
    }
    timing = {"MPT |R|=128": [0.1, 0.2], "MPT uniform": [0.1, 0.5], "exact LML": [0.1, 1.0]}
    result = dict(config=dict(context=128, sizes=[256, 512]), quality=quality, timing=timing)
    text = gp_decoder_summary_block(_context(tmp_path, "gp-decoder", "gp-decoder.json", result))
    assert text.startswith("From one seed")
    # Gaps by hand: 250.0 - 210.5 = 39.5 and 250.0 - 200.0 = 50.0.
    assert "reaches 210.5, 39.5 nats per image below it" in text
    assert "(|R|=128) reaches 200.0, 50.0 nats per image below it" in text
    assert "At N=512" in text and "0.500 s (uniform, 0.50×)" in text and "1.000 s" in text
    assert "0.300 and 0.250 nats per pixel against its 0.200" in text


def test_ppca_curve_block_gives_area_minus_exact_lml(tmp_path):
    panels = [
        dict(latent_dim=5, num_masks=1, log_marginal=-10.0, area=-10.75, seconds=0.5),
        dict(latent_dim=5, num_masks=100, log_marginal=-10.0, area=-9.875, seconds=4.0),
    ]
    result = dict(config=dict(N=20, D=8, noise_var=0.2), panels=panels)
    text = ppca_curve_block(_context(tmp_path, "ppca-curve", "ppca-curve.json", result))
    assert "| 5 | 1 | −10.750 | −10.000 | −0.750 | 0.5 |" in text
    assert "| 5 | 100 | −9.875 | −10.000 | +0.125 | 4.0 |" in text


def test_rates_note_states_convergence_and_paired_differences_against_the_seed_spread():
    runs = {"fixed": [{}] * 3, "slow": [{}] * 3, "fast": [{}] * 3}
    summary = {
        "fixed": dict(converged=3),
        # Paired 95% half-width by hand: 4.303 * sd / sqrt(3) = 2.484 sd.
        "slow": dict(converged=2, area_minus_fixed=[2.0, 1.0]),  # 2.0 < 2.484: unresolved
        "fast": dict(converged=3, area_minus_fixed=[-5.0, 1.0]),  # 5.0 > 2.484: resolved
    }
    res = dict(summary=summary, runs=runs)
    text = _convergence_text(res, {})
    assert "Only 8 of 9 trained runs had levelled off" in text and "slow (1)" in text
    text = _comparison_text(res, "fixed", [("area_minus_fixed", "nats", 1, 1.0)], 3)
    assert "slow − fixed: 2.0 ± 1.0 nats (± 2.5; within the seed spread" in text
    assert "fast − fixed: −5.0 ± 1.0 nats (± 2.5; resolved" in text
    # With the runs' own records, the note says how far the lagging ones were from level.
    record = dict(relative_change=0.01, threshold=0.02, converged=True)
    runs["slow"] = [dict(convergence=record)] * 2 + [
        dict(convergence=dict(record, relative_change=-0.0278, converged=False))
    ]
    assert "changed their loss by at most 2.8% (the measure's threshold: 2%)" in _convergence_text(
        res, {}
    )
    summary["slow"]["converged"] = 3
    assert "Every trained run (9 of 9) had levelled off" in _convergence_text(res, {})
    one = _comparison_text(res, "fixed", [("area_minus_fixed", "nats", 1, 1.0)], 1)
    assert one.startswith("One seed")


def test_long_training_note_says_from_which_epoch_the_elbo_stays_ahead():
    from experiments.results_blocks_benchmarks import _standing_text

    epochs = [5, 10, 15, 20, 25]
    elbo = [-150.0, -120.0, -110.0, -112.0, -105.0]
    # -111 at epoch 25: the ELBO's -112 at epoch 20 is below it, so the ELBO stays ahead
    # only from epoch 25 on; by hand, the last fifth (one evaluation back) moved it by
    # -111 - (-115) = +4 and the ELBO by -105 - (-112) = +7.
    text = _standing_text("MPT", [-160.0, -130.0, -120.0, -115.0, -111.0], elbo, epochs)
    assert "−111.00 at epoch 25" in text
    assert "from epoch 25 on" in text
    assert "moved by +4.00 from epoch 20 (the ELBO by +7.00)" in text
    low = _standing_text("low", [-200.0] * 5, elbo, epochs)
    assert "below the ELBO's at every evaluation;" in low
    assert "at or above" in _standing_text("high", [-100.0] * 5, elbo, epochs)
