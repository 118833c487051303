"""What writes each result file under ``docs/results/`` (:data:`SOURCES`), the manifest that
records each run, and :func:`rerun`, which runs the sources again and writes both."""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "DOCUMENTS",
    "MANIFEST",
    "RESULTS_DIR",
    "ResultsFileError",
    "SIZE_FLAGS",
    "SOURCES",
    "command",
    "read_json",
    "read_manifest",
    "record",
    "repository_root",
    "rerun",
    "write_text",
]

RESULTS_DIR = Path("docs") / "results"
MANIFEST = "manifest.json"
#: Files whose tables are rendered: the README and every page of the docs.
DOCUMENTS = ("README.md", "docs/*.rst")

#: Source name -> what writes its files. ``kind`` is ``"reproduce"`` (``pyro-mpt reproduce
#: NAME --threads 1 --no-progress``, plus ``--smoke`` or ``--full`` for those sizes),
#: ``"benchmarks"`` (``python benchmarks/run_all.py --threads 1 --json ...``) or
#: ``"benchmark"`` (one script, ``python benchmarks/SCRIPT --threads 1 --json ...``, its
#: one file); ``size`` is the
#: size that ``--rerun`` uses, the default size of every experiment (a rerun of everything
#: takes about three hours on two CPU cores); ``args`` further options of the command, if
#: any; ``files`` the JSON files it writes.
SOURCES = {
    "ppca-table1": dict(kind="reproduce", size="default", files=["ppca-table1.json"]),
    "ppca-training": dict(kind="reproduce", size="default", files=["ppca-training.json"]),
    "ppca-curve-training": dict(
        kind="reproduce", size="default", files=["ppca-curve-training.json"]
    ),
    # About 10 minutes on one core: 10 deep VAEs, LML per epoch on training and held-out images.
    # Under a minute each on one core (shared masks on PPCA; short chains on D=8 models).
    "ppca-convergence": dict(kind="reproduce", size="default", files=["ppca-convergence.json"]),
    "ppca-curve": dict(kind="reproduce", size="default", files=["ppca-curve.json"]),
    "gibbs-mixing": dict(kind="reproduce", size="default", files=["gibbs-mixing.json"]),
    "vae-deep": dict(kind="reproduce", size="default", files=["vae-deep.json"]),
    "vae-compare": dict(
        kind="reproduce", size="default", files=["vae-compare.json", "vae-linear.json"]
    ),
    "gp-decoder": dict(kind="reproduce", size="default", files=["gp-decoder.json"]),
    # 3-7 minutes on one core: 25 rates with 2 masks on 32 sequences, two models.
    "bert-curve": dict(kind="reproduce", size="default", files=["bert-curve.json"]),
    # 40 to 60 minutes each with three seeds on one busy CPU core; each run records whether
    # its training loss levelled off. The committed files are of the default size, which a
    # rerun keeps.
    "mae-curve": dict(
        kind="reproduce", size="default", args=["--seeds", "3"], files=["mae-curve.json"]
    ),
    "bert-rates": dict(
        kind="reproduce", size="default", args=["--seeds", "3"], files=["bert-rates.json"]
    ),
    # 4-9 minutes on one core, most of it the pseudo-log-likelihoods (a forward pass per
    # residue of every sample).
    "mlm-generation": dict(kind="reproduce", size="default", files=["mlm-generation.json"]),
    # 6-8 minutes on one core: 784 prefixes per ordering of each VAE image and one
    # AntiBERTy forward pass per residue and ordering.
    "coherence": dict(kind="reproduce", size="default", files=["coherence.json"]),
    "benchmarks": dict(kind="benchmarks", size="default", files=["benchmarks.json"]),
    # About 25 minutes on one core: a K=16 deep VAE trained by the ELBO, IWAE and MPT with
    # importance-sampled conditionals at several masks and draws per image, 2 seeds per row.
    "importance-masks-training": dict(
        kind="benchmark",
        script="bench_importance_masks_training.py",
        size="default",
        files=["importance-masks-training.json"],
    ),
    # About 12 minutes on one core: three of those rows trained for 100 epochs.
    "importance-masks-long": dict(
        kind="benchmark",
        script="bench_importance_masks_training.py",
        size="default",
        args=["--long"],
        files=["importance-masks-long.json"],
    ),
    # About 10 seconds: a linear VAE trained by the ELBO, its LML under quadrature rules of
    # 25 to 1600 nodes against a 6400-node rule, and the time of each rule's MPT step.
    "quadrature-nodes": dict(
        kind="benchmark",
        script="bench_quadrature_nodes.py",
        size="default",
        files=["quadrature-nodes.json"],
    ),
}

SIZE_FLAGS = {"default": [], "smoke": ["--smoke"], "full": ["--full"]}


def repository_root():
    """The checkout this module lives in (the folder holding ``README.md``, ``docs/`` and
    ``experiments/``)."""
    return Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Reruns


def command(name, size, out_dir):
    """``(argv to run, the command as documented)`` of source ``name``."""
    source = SOURCES[name]
    if source["kind"] == "benchmarks":
        shown = ["python", "benchmarks/run_all.py", "--threads", "1"]
        argv = [sys.executable, "benchmarks/run_all.py", "--threads", "1"]
        json_path = str(Path(out_dir) / "benchmarks.json")
        return argv + ["--json", json_path], shown
    if source["kind"] == "benchmark":
        script = f"benchmarks/{source['script']}"
        options = ["--threads", "1", *source.get("args", [])]
        shown = ["python", script, *options]
        json_path = str(Path(out_dir) / source["files"][0])
        return [sys.executable, script, *options, "--json", json_path], shown
    flags = ["--threads", "1", *SIZE_FLAGS[size], *source.get("args", [])]
    shown = ["pyro-mpt", "reproduce", name, *flags]
    argv = [sys.executable, "-m", "pyro_mpt.cli", "reproduce", name, *flags]
    return argv + ["--no-progress", "--out", str(out_dir)], shown


def _machine():
    return dict(
        python=platform.python_version(),
        torch=_torch_version(),
        machine=platform.machine(),
        processor=_cpu_name(),
        cpu_count=os.cpu_count(),
    )


def _commit(root):
    """The checkout's commit (short hash), with ``-dirty`` when the package, the experiments or
    the benchmarks differ from it; ``None`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "pyro_mpt", "experiments", "benchmarks"],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def _torch_version():
    import torch

    return torch.__version__


def _cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


class ResultsFileError(ValueError):
    """A file under ``docs/results/`` is missing or not valid JSON; the message names it and
    the command that writes it, so that the command line prints one line, not a traceback."""


def read_json(path, fix):
    """The JSON in ``path``; a :class:`ResultsFileError` naming ``path`` and ``fix`` (what
    writes it again) if it cannot be decoded, rather than a decoder error without the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ResultsFileError(f"{path} is not valid JSON ({error}); {fix}.") from error


def read_manifest(root):
    path = Path(root) / RESULTS_DIR / MANIFEST
    if not path.exists():
        return {}
    fix = (
        "write it again with `pyro-mpt render-results --rerun` (each source records its "
        "entry), or restore the committed copy"
    )
    return read_json(path, fix)


def write_text(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def rerun(names=None, root=None, size=None, log=print):
    """Reruns the sources ``names`` (default: all) one after another and copies the JSON files
    they write into ``docs/results/``, recording each command in the manifest.

    :param list names: source names, keys of :data:`SOURCES`.
    :param root: the repository checkout (default: the one this module lives in).
    :param str size: ``"smoke"``, ``"default"`` or ``"full"`` for every reproduction named,
        instead of each source's own size (the benchmarks have one size).
    :returns: the manifest.
    """
    root = Path(root or repository_root())
    names = list(SOURCES) if not names else list(names)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown result source(s) {unknown}; choose from {list(SOURCES)}.")
    results_dir = root / RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = SOURCES[name]
        run_size = source["size"] if size is None or source["kind"] != "reproduce" else size
        with tempfile.TemporaryDirectory(prefix=f"pyro-mpt-{name}-") as out_dir:
            argv, shown = command(name, run_size, out_dir)
            log(f"[{name}] {shlex.join(shown)}", flush=True)
            start = time.perf_counter()
            proc = subprocess.run(argv, cwd=root, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{shlex.join(shown)} failed with status {proc.returncode}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
            manifest = record(name, out_dir, shlex.join(shown), run_size, seconds, root)
        log(f"[{name}] {seconds:.0f} s; wrote {', '.join(source['files'])}", flush=True)
    return manifest


def record(name, out_dir, shown, size, seconds, root=None, commit=None):
    """Copies the files that source ``name``'s command wrote into ``out_dir`` to
    ``docs/results/`` and records the run in the manifest: what :func:`rerun` does after
    each command, usable for a run of the same command started by hand (``shown``, the
    command as documented, and its wall time ``seconds``).

    :param str commit: the commit the run used (default: the checkout's, now).
    :returns: the manifest.
    """
    root = Path(root or repository_root())
    results_dir = root / RESULTS_DIR
    for file_name in SOURCES[name]["files"]:
        text = (Path(out_dir) / file_name).read_text(encoding="utf-8")
        # Paths of the output folder (vae-compare names its sources) read as the folder the
        # files are committed to.
        text = text.replace(str(out_dir), RESULTS_DIR.as_posix())
        write_text(results_dir / file_name, text)
    # Read just before writing, so that reruns of other sources running meanwhile keep
    # their entries.
    manifest = read_manifest(root)
    manifest[name] = dict(
        command=shown,
        size=size,
        files=SOURCES[name]["files"],
        seconds=round(seconds, 1),
        date=datetime.date.today().isoformat(),
        commit=commit or _commit(root),
        **_machine(),
    )
    ordered = {key: manifest[key] for key in SOURCES if key in manifest}
    write_text(results_dir / MANIFEST, json.dumps(ordered, indent=2) + "\n")
    return manifest
