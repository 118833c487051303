"""EncodeDecode's own per-call accuracy figures against exact conditionals on a
linear-Gaussian model, the warnings that state them, and the refills that a
guide told which entries are hidden never reads."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import EncodeDecode, Exact
from pyro_mpt.conditionals.encode_decode_diagnostics import (
    BENCHMARK_ERROR_PER_DRAW_BIAS,
    BENCHMARK_ERRORS,
    MAX_DRAW_BIAS,
    EncodeDecodeDiagnostics,
)
from pyro_mpt.errors import UnmeasuredAccuracyWarning
from pyro_mpt.models import LinearVAE
from pyro_mpt.ops.masks import masks_of_sizes, mpt_estimate


class _Gaussian:
    """``z ~ N(0, I_K)``, ``x ~ N(W z + b, s^2 I_D)`` with fixed ``W``, ``b`` (no parameter),
    and an amortized linear guide: the exact posterior, or random weights (untrained)."""

    def __init__(self, noise, trained, num_features=12, latent_dim=2):
        self.K, self.s = latent_dim, noise
        self.W = torch.randn(num_features, latent_dim)
        self.b = 0.5 * torch.randn(num_features)
        precision = self.W.T @ self.W + noise**2 * torch.eye(latent_dim)
        if trained:
            encoder = torch.linalg.solve(precision, self.W.T)
            self.scale_tril = torch.linalg.cholesky(noise**2 * torch.linalg.inv(precision))
        else:
            encoder = 0.1 * torch.randn(latent_dim, num_features)
            self.scale_tril = torch.eye(latent_dim)
        self.encoder = encoder.requires_grad_(True)

    def model(self, x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(self.K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ self.W.T + self.b, self.s).to_event(1), obs=x)

    def guide(self, x):
        with pyro.plate("data", x.shape[-2]):
            loc = (x - self.b) @ self.encoder.T
            pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=self.scale_tril))

    def sample(self, num):
        z = torch.randn(num, self.K)
        return z @ self.W.T + self.b + self.s * torch.randn(num, self.W.shape[0])


def _error_and_figure(gauss, x, num_samples, reps=4):
    """The bias per observation of the uniform-rate MPT estimate against Exact() on the same
    masks (``reps`` of each size), and the call's ``draw_bias``."""
    num_features = x.shape[-1]
    sizes = torch.arange(1, num_features + 1).repeat_interleave(reps)
    masks = masks_of_sizes(sizes[:, None].expand(-1, x.shape[0]), num_features)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first use's warning
        prepared = EncodeDecode(num_samples=num_samples).prepare(gauss.model, gauss.guide, (x,), {})
        estimate = prepared.log_prob(masks)
        exact = Exact().prepare(gauss.model, gauss.guide, (x,), {}).log_prob(masks)
    error = float(mpt_estimate(estimate - exact, masks).mean())
    return error, prepared.diagnostics.summary()["draw_bias"]


@pytest.mark.parametrize(
    "noise, trained, num_samples, low",
    [(0.3, False, 4, 0.5), (0.3, False, 16, 0.3), (0.7, False, 16, 0.15), (0.7, True, 16, 0.1)],
)
def test_the_draw_bias_tracks_the_error_against_exact_conditionals(
    noise, trained, num_samples, low
):
    """The figure tracks how far below the exact conditionals' estimate encode-decode's
    falls: between ``low`` times the error (a bias every draw shares is unseen, most of
    the error for the exact posterior) and 1.6 times it (measured up to 1.44 in
    ``benchmarks/bench_encode_decode_accuracy.py``)."""
    pyro.set_rng_seed(0)
    gauss = _Gaussian(noise, trained)
    x = gauss.sample(40)
    pyro.set_rng_seed(1)
    error, figure = _error_and_figure(gauss, x, num_samples)
    assert error < -2.0  # nats per observation: far off
    assert low * -error <= figure <= 1.6 * -error, (error, figure)


def test_more_draws_lower_the_error_and_the_figure():
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.3, trained=False)
    x = gauss.sample(40)
    pyro.set_rng_seed(1)
    (error_4, figure_4), (error_64, figure_64) = (
        _error_and_figure(gauss, x, num_samples) for num_samples in (4, 64)
    )
    assert -error_64 < -error_4 / 3 and figure_64 < figure_4 / 3


def test_a_badly_off_configuration_warns_with_its_figure_at_the_1st_and_10th_call():
    """Little noise and an untrained guide: hundreds of nats per observation below the
    exact conditionals' estimate. Every call measures it, in ``MPTLoss.diagnostics`` (steady
    calls read it with the loss); the warning states that call's figure at the 1st, 10th,
    100th, ... failing call, as importance sampling's does, and how many calls failed."""
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.3, trained=False)
    x = gauss.sample(40)
    loss = MPTLoss(num_masks=12, conditionals=EncodeDecode())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures = []
        for call in range(11):
            (loss.loss if call % 2 else loss.loss_and_grads)(gauss.model, gauss.guide, x)
            assert isinstance(loss.diagnostics, EncodeDecodeDiagnostics)
            figures.append(loss.diagnostics.summary()["draw_bias"])
    said = [
        str(w.message)
        for w in caught
        if issubclass(w.category, UnmeasuredAccuracyWarning) and "halving its" in str(w.message)
    ]
    assert len(said) == 2 and all(w.filename == __file__ for w in caught)
    assert all(figure > 5.0 for figure in figures)
    for message, figure in zip(said, (figures[0], figures[9])):
        assert f"by {figure:.3g} nats per observation" in message
        assert "raise num_samples" in message and "'exact'" in message
    assert "(10 of the 10 calls so far failed)" in said[-1]


def test_an_accurate_configuration_does_not_warn_per_call():
    """Much noise and the exact posterior with many draws: the figure stays below the limit
    and no call warns after the first use's."""
    pyro.set_rng_seed(0)
    gauss = _Gaussian(3.0, trained=True, num_features=4, latent_dim=1)
    x = gauss.sample(20)
    loss = MPTLoss(num_masks=4, conditionals=EncodeDecode(num_samples=256))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss.loss(gauss.model, gauss.guide, x)
    assert loss.diagnostics.summary()["draw_bias"] < MAX_DRAW_BIAS
    assert not [w for w in caught if "halving its" in str(w.message)]


def _unmeasured(caught):
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, UnmeasuredAccuracyWarning)
        and "unmeasured error" in str(w.message)
    ]


def test_one_draw_is_unmeasured_and_says_so_at_the_1st_and_10th_call():
    """With ``num_samples=1`` no call has a figure: MPTLoss says that its error is
    unmeasured, naming the fix, at the 1st, 10th, 100th, ... call, each time with how many
    calls so far were unmeasured (so that Python's filter, which shows an identical message
    once per line, hides none of them)."""
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.3, trained=False)
    x = gauss.sample(8)
    loss = MPTLoss(num_masks=12, conditionals=EncodeDecode(num_samples=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for call in range(12):
            (loss.loss if call % 2 else loss.loss_and_grads)(gauss.model, gauss.guide, x)
            assert not loss.diagnostics.measured() and loss.diagnostics.failing() is None
    first = [str(w.message) for w in caught if "approximates the conditionals" in str(w.message)]
    assert len(first) == 1 and "num_samples=1 no call measures its error" in first[0]
    assert "126" not in first[0]
    said = _unmeasured(caught)
    assert len(said) == 2
    assert all(w.filename == __file__ for w in caught)
    assert "(10 of the 10 calls so far failed)" in said[1]
    assert "so far" not in said[0]
    for message in said:
        assert "num_samples=1" in message
        assert "raise num_samples" in message and "'importance'" in message
        assert "2.2 to 3527 nats per observation" in message


def test_one_draw_in_the_package_functions_says_so_on_each_call():
    """Each ``mpt_curve`` call is an evaluation of its own (as with importance sampling's
    failing weights): each says once that its error is unmeasured."""
    from pyro_mpt import mpt_curve

    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.3, trained=False)
    x = gauss.sample(8)
    strategy = EncodeDecode(num_samples=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            mpt_curve(gauss.model, x, guide=gauss.guide, sizes=[3, 5], conditionals=strategy)
    said = _unmeasured(caught)
    assert len(said) == 2 and all(w.filename == __file__ for w in caught)


def test_measured_calls_do_not_say_they_are_unmeasured():
    pyro.set_rng_seed(0)
    gauss = _Gaussian(3.0, trained=True, num_features=4, latent_dim=1)
    x = gauss.sample(8)
    loss = MPTLoss(num_masks=4, conditionals=EncodeDecode(num_samples=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss.loss(gauss.model, gauss.guide, x)
    assert not _unmeasured(caught)


def test_the_quoted_figures_are_those_of_the_committed_benchmark():
    """The warnings' figures are the least and most errors (and error per figure) of
    ``benchmarks/results/encode_decode_accuracy.json``, to the digits they are quoted to, and
    ``docs/accuracy.rst`` quotes the same."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows = json.loads((root / "benchmarks/results/encode_decode_accuracy.json").read_text())
    rows = rows["results"]
    assert len(rows) == 75 and all(row["error"] < 0 for row in rows)
    for num_samples, (low, high) in BENCHMARK_ERRORS.items():
        errors = [-row["error"] for row in rows if row["S"] == num_samples]
        assert min(errors) == pytest.approx(low, rel=0.02)
        assert max(errors) == pytest.approx(high, rel=0.02)
    ratios = [-row["error"] / row["figure"] for row in rows if row["figure"] is not None]
    low, high = BENCHMARK_ERROR_PER_DRAW_BIAS
    assert min(ratios) == pytest.approx(low, rel=0.02)
    assert max(ratios) == pytest.approx(high, rel=0.02)
    docs = " ".join((root / "docs/accuracy.rst").read_text().split())
    for figure in (*BENCHMARK_ERRORS[1], *BENCHMARK_ERRORS[16], low, high):
        assert f"{figure:g}" in docs, figure
    assert "126 nats" not in docs
    # What 16 draws cut the error by against one, and cost, per configuration.
    by_samples = {
        num_samples: {(r["K"], r["s"], r["guide"]): r for r in rows if r["S"] == num_samples}
        for num_samples in (1, 16)
    }
    cut, cost = [], []
    for key, one in by_samples[1].items():
        many = by_samples[16][key]
        cut.append(one["error"] / many["error"])
        cost.append(many["ms"] / one["ms"])
    assert f"cut it {min(cut):.2g} to {max(cut):.2g} times" in docs
    assert f"at {min(cost):.2g} to {max(cost):.2g} times the cost" in docs


def test_the_per_call_warning_says_how_far_the_error_may_exceed_the_figure():
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.3, trained=False)
    x = gauss.sample(20)
    loss = MPTLoss(num_masks=12, conditionals=EncodeDecode())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.loss(gauss.model, gauss.guide, x)
    said = [str(w.message) for w in caught if "halving its" in str(w.message)]
    assert len(said) == 1
    assert "the error was 0.69 to 37 times this figure" in said[0]


def test_the_first_use_quotes_measured_figures():
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.7, trained=True)
    x = gauss.sample(4)
    with pytest.warns(UnmeasuredAccuracyWarning, match="approximates") as caught:
        EncodeDecode().prepare(gauss.model, gauss.guide, (x,), {})
    message = str(caught[0].message)
    assert "0.31 to 269 nats per observation" in message and "2.2 to 3527 with 1" in message


def test_refills_that_a_hidden_aware_guide_never_reads_are_skipped():
    """LinearVAE's guide zeroes the hidden entries: T refills change nothing it computes,
    so none are run, and the conditionals match those of the T-iteration chain."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    vae = LinearVAE(6, latent_dim=2)
    x = vae.sample(4)
    masks = masks_of_sizes(torch.tensor([[1, 3, 5, 6]]).expand(3, -1), 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = EncodeDecode(num_iterations=5, num_samples=4000).prepare(
            vae.model, vae.guide, (x,), {}
        )
    assert prepared.num_iterations == 0
    with torch.no_grad():
        skipped = prepared.log_prob(masks)
        prepared.num_iterations = 5  # the chain it stands for
        chained = prepared.log_prob(masks)
    assert (skipped - chained)[masks].abs().max() < 0.02


def test_refills_that_a_hidden_aware_guide_reads_are_kept():
    """A guide that takes ``hidden`` but encodes the hidden entries' values too."""
    pyro.set_rng_seed(0)
    gauss = _Gaussian(0.7, trained=True)
    x = gauss.sample(8)

    def guide(x, hidden=None):
        gauss.guide(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = EncodeDecode(num_iterations=3).prepare(gauss.model, guide, (x,), {})
    assert prepared.num_iterations == 3
