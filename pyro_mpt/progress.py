"""The progress bar of long calls (curves, Gibbs sweeps, coherence, MLM sampling).

``tqdm.auto`` draws a widget in a Jupyter kernel, but only with ``ipywidgets`` installed;
without it, it warns "IProgress not found" and falls back to text. This module takes the
text bar directly in that case, so that the bars of ``pyro_mpt`` add no such warning (Pyro's
own import of ``tqdm.auto`` still gives one; the tutorials filter it).
"""

try:
    import ipywidgets  # noqa: F401
except ImportError:
    from tqdm.std import tqdm as progress_bar
else:
    from tqdm.auto import tqdm as progress_bar

__all__ = ["progress_bar"]
