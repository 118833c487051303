"""The Python code blocks of the documentation pages run as written, each page's blocks in
order in one namespace, as a reader pastes them: float32, a fresh param store, a fixed seed.

The deep-VAE page trains two VAEs on 1,000 MNIST images for 12 epochs; it runs here in a
smoke size, through substitutions of its sizes that are each checked to be on the page (a
page that changes them fails here until the test follows). The scaling page's block is a
fragment of ``examples/lightning_ddp.py``, which ``tests/test_lightning_ddp.py`` runs."""

import contextlib
import importlib.util
import io
import pathlib
import re
import warnings

import pyro
import pytest
import torch

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"

#: The deep-VAE page's sizes, and the smoke sizes they become here.
_DEEP_VAE_SMOKE = [
    ("load_mnist(num_samples=1200, seed=0)", "load_mnist(num_samples=240, seed=0)"),
    ("images[:1000], images[1000:]", "images[:200], images[200:]"),
    ("LATENT_DIM, HIDDEN_DIM = 8, 128", "LATENT_DIM, HIDDEN_DIM = 2, 16"),
    ("epochs=12", "epochs=1"),
    ("steps=500", "steps=3"),
    ("held_out_log_marginal(vae, num_samples=1000", "held_out_log_marginal(vae, num_samples=64"),
    ("ImportanceSampling(num_samples=1000)", "ImportanceSampling(num_samples=64)"),
    ("Quadrature(num_points=48", "Quadrature(num_points=8"),
    ("x_test.split(20)", "x_test[:20].split(20)"),
]


def _python_blocks(page):
    """The page's ``.. code-block:: python`` blocks, dedented, in order."""
    text = (DOCS / page).read_text()
    blocks = []
    for match in re.finditer(r"\.\. code-block:: python\n((?:[ \t]*\n|[ \t]+.*\n)+)", text):
        lines = match.group(1).splitlines()
        body = [line for line in lines if line.strip()]
        indent = min(len(line) - len(line.lstrip()) for line in body)
        blocks.append("\n".join(line[indent:] for line in lines).strip("\n") + "\n")
    return blocks


def _run(page, blocks):
    """Runs ``blocks`` in one namespace; returns what they printed."""
    namespace = {"__name__": f"docs/{page}"}
    out = io.StringIO()
    dtype, local = torch.get_default_dtype(), pyro.settings.get("module_local_params")
    torch.set_default_dtype(torch.float32)  # as a reader runs it
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            for number, block in enumerate(blocks):
                exec(compile(block, f"docs/{page} block {number + 1}", "exec"), namespace)
    finally:
        torch.set_default_dtype(dtype)
        pyro.settings.set(module_local_params=local)  # the deep-VAE page sets it
        pyro.clear_param_store()
    return out.getvalue(), namespace


def test_quickstart_page_runs_and_learns():
    blocks = _python_blocks("quickstart.rst")
    assert len(blocks) == 1
    printed, namespace = _run("quickstart.rst", blocks)
    # Trained on standard-normal data, the exact log-likelihood per observation nears that
    # of the truth, D/2 log(2 pi e) = 14.19 nats below 0 for D = 10.
    lml = float(re.findall(r"-?\d+\.\d+", printed)[-1])
    truth = -10 / 2 * (1 + torch.log(torch.tensor(2 * torch.pi))).item()
    assert abs(lml - truth) < 0.5, printed


def test_accuracy_page_runs():
    blocks = _python_blocks("accuracy.rst")
    assert len(blocks) == 3
    printed, namespace = _run("accuracy.rst", blocks)
    assert namespace["diagnostics"].pareto_k.shape[-1] == 100
    assert namespace["lml"].shape == (50,) and bool(torch.isfinite(namespace["lml"]).all())
    assert "effective sample size" in printed


def test_coherence_page_pyro_block_runs():
    blocks = _python_blocks("coherence.rst")
    assert len(blocks) == 2
    printed, namespace = _run("coherence.rst", blocks[:1])
    assert namespace["result"].values.shape == (8, 100)
    assert printed.strip()


@pytest.mark.skipif(importlib.util.find_spec("antiberty") is None, reason="needs antiberty")
def test_coherence_page_antiberty_block_runs():
    block = _python_blocks("coherence.rst")[1]
    printed, namespace = _run("coherence.rst", [block])
    assert namespace["result"].values.shape == (4, 2)
    assert printed.strip()


def test_deep_vae_page_runs_in_smoke_size():
    blocks = _python_blocks("deep_vae.rst")
    assert len(blocks) == 6
    text = "\0".join(blocks)
    for written, smoke in _DEEP_VAE_SMOKE:
        assert written in text, f"the deep-VAE page no longer says {written!r}"
        text = text.replace(written, smoke)
    printed, namespace = _run("deep_vae.rst", text.split("\0"))
    held_out = re.findall(r"(ELBO|MPT): held-out log p\(x\) >= (-?\d+\.\d+)", printed)
    assert [name for name, _ in held_out] == ["ELBO", "MPT"], printed
    assert namespace["exact"].shape == (20,) and bool(torch.isfinite(namespace["exact"]).all())
