"""ppca-table1's progress bars reach their totals, each phase on a bar of its own, so that no
bar sits near its end while slow work remains."""

import contextlib

import torch

from experiments import _common as common
from experiments import ppca_table1


class _Bar:
    def __init__(self, total, desc):
        self.total, self.desc, self.count = total, desc, 0

    def update(self, n=1):
        self.count += n


def test_every_bar_reaches_its_total(monkeypatch):
    bars = []

    @contextlib.contextmanager
    def progress_bar(iterable=None, enabled=True, total=None, desc=None, **kwargs):
        bars.append(_Bar(total, desc))
        yield bars[-1]

    monkeypatch.setattr(common, "progress_bar", progress_bar)
    cfg = dict(N=20, D=6, K=2, shared_P=(1, 3), per_obs_P=(1, 2), seeds=2)
    with common.float64():
        ppca_table1._measure(cfg, torch.device("cpu"), 0, True, "paper")
    assert [bar.desc.split(" ")[1] for bar in bars] == ["shared", "per-observation"]
    # Totals by hand: seeds * D * sum(P) = 2 * 6 * 4 and 2 * 6 * 3 masks.
    assert [bar.total for bar in bars] == [48, 36]
    assert [bar.count for bar in bars] == [48, 36]
