"""Off the CPU, a call of ``exact_where`` with more entries near the floors than
``MAX_EXACT_OFF_CPU`` keeps the rest floored: they are counted on the device in the open
ledger, and warned of by ``MPTLoss`` in the one read a step makes anyway, and by the
package's functions at the end of a call. CI has no GPU: the off-CPU route is forced by
replacing ``exact_where``'s device check, with a limit of two entries; the number left
floored is counted here by brute force, from the margins and the entries recomputed. The
models compute in float32, whose floors outlying values reach."""

import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

import pyro_mpt.loss
from experiments.zoo.host_reads import host_reads
from pyro_mpt import MPTLoss, mpt_curve
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.errors import QuadratureAccuracyWarning
from pyro_mpt.ops import floored_exp, quadrature_bernoulli, quadrature_conditionals
from pyro_mpt.ops.floored_exp import exact_where, floored_ledger

#: ``MAX_EXACT_OFF_CPU`` in the tests that run a model.
LIMIT = 2
WEIGHTS = torch.tensor([1.0, 0.8, 1.2, -0.9, 1.1, 0.7], dtype=torch.float32)


def _off_the_cpu(monkeypatch, limit=LIMIT):
    """``exact_where`` takes its route for devices it may not read, with ``limit``."""
    monkeypatch.setattr(floored_exp, "host_readable", lambda tensor: False)
    monkeypatch.setattr(pyro_mpt.loss, "_READ_BACK_ON", "no device")
    monkeypatch.setattr(floored_exp, "MAX_EXACT_OFF_CPU", limit)


class LeftFloored:
    """Wraps ``module.exact_where`` and appends, for each call, the number of entries whose
    margin is below 0 and that ``exact`` was not asked to compute again."""

    def __init__(self, monkeypatch, module):
        self.counts = []
        original = module.exact_where

        def counted(margin, result, exact, read=None):
            asked = []

            def recorded(index):
                asked.append([i.tolist() for i in index])
                return exact(index)

            out = original(margin, result, recorded, read)
            below = {tuple(p) for p in (margin.expand(result.shape) < 0).nonzero().tolist()}
            recomputed = {p for index in asked for p in zip(*index)}
            self.counts.append(len(below - recomputed))
            return out

        monkeypatch.setattr(module, "exact_where", counted)


def _floor_warnings(record):
    return [str(w.message) for w in record if "conditionals floored" in str(w.message)]


def _normal_model(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        pyro.sample("x", dist.Normal(z.unsqueeze(-1) * WEIGHTS, 0.5).to_event(1), obs=x)


def _normal_data():
    """Data of the model, and the same with a fourth feature far from what the others
    say: its conditionals given them lie past the float32 floors."""
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(16, 1, generator=generator, dtype=torch.float32)
    clean = z * WEIGHTS + 0.5 * torch.randn(16, 6, generator=generator, dtype=torch.float32)
    outlying = clean.clone()
    outlying[:, 3] = 9.0
    return clean, outlying


def test_the_ledger_counts_the_entries_left_floored_off_the_cpu():
    generator = torch.Generator().manual_seed(0)
    margin = torch.randn(1, 3000, generator=generator)  # broadcast over both rows
    result = torch.zeros(2, 3000)

    def exact(index):
        return torch.ones(index[0].shape)  # marks the entries computed again

    with floored_ledger() as ledger:
        out = exact_where(margin, result, exact, read=False)
        first = int(ledger.total())
        exact_where(margin, result, exact, read=False)
    margins, values = margin.expand(2, 3000).flatten().tolist(), out.flatten().tolist()
    left = sum(1 for m, v in zip(margins, values) if m < 0 and v == 0)
    assert left > 0 and first == left
    assert int(ledger.total()) == 2 * left  # every call in the block adds
    # An inner ledger counts its own block; with none open nothing is counted.
    with floored_ledger() as outer:
        with floored_ledger() as inner:
            exact_where(margin, result, exact, read=False)
        assert int(inner.total()) == left and outer.total() is None
    exact_where(margin, result, exact, read=False)
    assert int(ledger.total()) == 2 * left


def test_nothing_is_counted_where_nothing_is_left_floored():
    generator = torch.Generator().manual_seed(1)
    margin = torch.randn(40, 40, generator=generator)
    result = torch.zeros(40, 40)

    def exact(index):
        return torch.ones(index[0].shape)

    with floored_ledger() as ledger:
        # On the CPU one read finds every entry below margin.
        out = exact_where(margin, result, exact)
        assert torch.equal(out, (margin < 0).float())
        # Off it, a call of at most MAX_EXACT_OFF_CPU entries recomputes them all.
        exact_where(margin[:30, :30], result[:30, :30], exact, read=False)
    assert ledger.total() is None
    with floored_ledger() as ledger:
        exact_where(margin.abs().index_fill(0, torch.arange(5), -1.0), result, exact, read=False)
    assert int(ledger.total()) == 0  # 200 entries below margin, all recomputed


def test_mpt_loss_warns_of_the_conditionals_it_kept_floored(monkeypatch):
    _off_the_cpu(monkeypatch)
    spy = LeftFloored(monkeypatch, quadrature_conditionals)
    clean, outlying = _normal_data()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        MPTLoss(conditionals=Quadrature(40), num_masks=4).loss(_normal_model, None, clean)
    assert spy.counts == [0] and _floor_warnings(record) == []
    spy.counts.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        MPTLoss(conditionals=Quadrature(40), num_masks=4).loss(_normal_model, None, outlying)
    (left,) = spy.counts
    assert left > LIMIT
    (message,) = _floor_warnings(record)
    assert message.startswith(f"MPTLoss kept {left} conditionals floored:")
    assert "too high" in message and "float64" in message
    (warning,) = [w for w in record if str(w.message) == message]
    assert warning.category is QuadratureAccuracyWarning and warning.filename == __file__


def test_a_loss_computed_on_its_own_warns_at_the_next_call(monkeypatch):
    # The module form reads the count left on the device at the next call.
    _off_the_cpu(monkeypatch)
    spy = LeftFloored(monkeypatch, quadrature_conditionals)
    clean, outlying = _normal_data()
    loss = MPTLoss(conditionals=Quadrature(40), num_masks=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss.differentiable_loss(_normal_model, None, outlying)
        assert _floor_warnings(record) == []
        left = spy.counts[0]
        loss.differentiable_loss(_normal_model, None, clean)
    assert left > LIMIT
    assert [m.split(":")[0] for m in _floor_warnings(record)] == [
        f"MPTLoss kept {left} conditionals floored"
    ]


def test_mpt_curve_warns_once_of_the_conditionals_it_kept_floored(monkeypatch):
    _off_the_cpu(monkeypatch)
    spy = LeftFloored(monkeypatch, quadrature_conditionals)
    _, outlying = _normal_data()
    with pytest.warns(QuadratureAccuracyWarning) as record:
        mpt_curve(_normal_model, outlying, conditionals=Quadrature(40), num_masks=2)
    left = sum(spy.counts)
    assert left > LIMIT
    assert [m.split(":")[0] for m in _floor_warnings(record)] == [
        f"mpt_curve kept {left} conditionals floored"
    ]
    assert {w.filename for w in record} == {__file__}  # the user's line


D = 12
SHIFTS = torch.linspace(-1.5, 1.5, D, dtype=torch.float32)


def _bernoulli_thresholds(x):
    # Pixel j is on for z above its shift, confidently: a pixel that contradicts the others
    # has conditionals past the float32 floors.
    shifts = pyro.param("shifts", lambda: SHIFTS.clone())
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=60.0 * (z - shifts)).to_event(1), obs=x)


def _no_guide(x):
    pass


def test_a_steady_step_reads_the_count_with_the_loss(monkeypatch):
    # Three steps on data the model predicts, then a steady one on data whose first and
    # last pixels contradict each other: its count is read in the step's one read (the
    # loss's), and it warns with the number the floors kept.
    _off_the_cpu(monkeypatch)
    spy = LeftFloored(monkeypatch, quadrature_bernoulli)
    generator = torch.Generator().manual_seed(0)
    clean = (torch.randn(64, 1, generator=generator) > SHIFTS).to(torch.float32)
    contradicting = clean.clone()
    contradicting[:, 0], contradicting[:, -1] = 0.0, 1.0
    loss = MPTLoss(conditionals=Quadrature(64))
    svi = SVI(_bernoulli_thresholds, _no_guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pyro.enable_validation(False)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(3):
                svi.step(clean[torch.randint(64, (16,))])
            assert _floor_warnings(record) == [] and set(spy.counts) == {0}
            spy.counts.clear()
            with host_reads() as counted:
                svi.step(contradicting[torch.randint(64, (16,))])
    finally:
        pyro.enable_validation(True)
    reads = {(file, function, what): n for (file, function, what, _), n in counted.items()}
    assert reads == {("loss.py", "MPTLoss._read", "tolist"): 1}
    left = sum(spy.counts)
    assert left > LIMIT
    (message,) = _floor_warnings(record)
    assert re.match(rf"MPTLoss kept {left} conditionals floored:", message)
