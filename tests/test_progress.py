"""The progress bar of long calls: a widget only where ``ipywidgets`` can draw one, so a
notebook without it shows a text bar and no "IProgress not found" warning."""

import importlib
import sys
import types

import tqdm.auto
import tqdm.std

import pyro_mpt.progress


def _reloaded_with(monkeypatch, ipywidgets):
    monkeypatch.setitem(sys.modules, "ipywidgets", ipywidgets)
    try:
        return importlib.reload(pyro_mpt.progress).progress_bar
    finally:
        monkeypatch.undo()
        importlib.reload(pyro_mpt.progress)


def test_text_bar_without_ipywidgets(monkeypatch):
    # None in sys.modules makes `import ipywidgets` raise ImportError.
    assert _reloaded_with(monkeypatch, None) is tqdm.std.tqdm


def test_auto_bar_with_ipywidgets(monkeypatch):
    assert _reloaded_with(monkeypatch, types.ModuleType("ipywidgets")) is tqdm.auto.tqdm
