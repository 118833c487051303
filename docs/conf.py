"""Sphinx configuration for the pyro_mpt documentation.

The build needs no network: MathJax is served from the built pages themselves
(``sphinx-mathjax-offline``) and intersphinx is not enabled. The tutorial notebooks in
``../tutorials`` are committed without outputs; :func:`_stage_tutorials` copies them into
``tutorials/`` here, taking the executed copies that ``.ci/run_notebooks.py`` leaves in
``_build/executed`` when their code is the committed code; myst-nb executes the others (at
smoke-test sizes) during the build.
"""

import os
import shutil
import sys
from pathlib import Path

import nbformat

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

project = "pyro_mpt"
author = "pyro_mpt developers"
copyright = "2025, pyro_mpt developers"
release = "0.1.0"
version = "0.1"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx-mathjax-offline",  # sets mathjax_path to a local copy of MathJax 3
    "myst_nb",
]

# Docstrings use Sphinx-style ``:param:`` fields, so napoleon is not needed.
# intersphinx is deliberately not enabled: the docs must build without network.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {
    "show-inheritance": True,
}

templates_path = []
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
master_doc = "index"
source_suffix = {".rst": "restructuredtext", ".ipynb": "myst-nb"}

html_theme = "alabaster"
html_static_path = []
html_theme_options = {
    "description": "Masked pre-training for Bayesian latent-variable models in Pyro",
}

# Notebooks (myst-nb). Markdown cells use $...$ maths.
myst_enable_extensions = ["dollarmath", "amsmath"]
# Notebooks staged from an executed copy are not executed again (see _stage_tutorials).
nb_execution_mode = "force"
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
nb_ipywidgets_js = {}  # no widget scripts from a CDN
# A notebook executed here runs at its smoke-test sizes, as in CI.
os.environ.setdefault("CI", "true")
os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend keeps figures as outputs


def _code(notebook):
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def _stage_tutorials():
    """Copies ``../tutorials/*.ipynb`` into ``tutorials/``, preferring the executed copy in
    ``_build/executed`` when its code cells are the committed ones; a file is rewritten only
    when its content changes, so that incremental builds stay incremental.

    :returns: the names of the notebooks staged from an executed copy.
    """
    target = DOCS / "tutorials"
    executed_names = []
    target.mkdir(exist_ok=True)
    sources = sorted((DOCS.parent / "tutorials").glob("*.ipynb"))
    for source in sources:
        chosen = source
        executed = DOCS / "_build" / "executed" / source.name
        if executed.exists():
            ran = nbformat.read(executed, as_version=4)
            if _code(ran) == _code(nbformat.read(source, as_version=4)):
                chosen = executed
                executed_names.append(source.name)
        staged = target / source.name
        if not staged.exists() or staged.read_bytes() != chosen.read_bytes():
            shutil.copyfile(chosen, staged)
    names = {source.name for source in sources}
    for stale in target.glob("*.ipynb"):
        if stale.name not in names:
            stale.unlink()
    return executed_names


nb_execution_excludepatterns = [f"tutorials/{name}" for name in _stage_tutorials()]
