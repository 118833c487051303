"""Sphinx configuration for the pyro_mpt documentation."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "pyro_mpt"
author = "pyro_mpt developers"
copyright = "2025, pyro_mpt developers"
release = "0.1.0"
version = "0.1"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
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

html_theme = "alabaster"
html_static_path = []
html_theme_options = {
    "description": "Masked pre-training for Bayesian latent-variable models in Pyro",
}
