"""Timing, report, table and command-line helpers shared by the benchmark scripts.

Each script is its configuration (module constants), ``run`` (measures, returns a JSON-able
report made by :func:`make_report`), ``print_report`` (mostly :func:`print_results`) and a
``main`` that is :func:`benchmark_main`. The scripts print figures; they never assert
timings. Every timing is a median over repeats of :func:`time.perf_counter` intervals, with
the device synchronised around each interval when it is a GPU.
"""

import argparse
import contextlib
import json
import platform
import statistics
import time

import torch

__all__ = [
    "DTYPES",
    "IdsTokenizer",
    "TINY_BERT",
    "add_common_args",
    "benchmark_main",
    "configure",
    "constants",
    "dtype_name",
    "environment",
    "format_table",
    "forward_backward_ms",
    "make_report",
    "median_ms",
    "medians",
    "random_id_texts",
    "print_results",
    "set_default_dtype",
    "svis",
    "synchronize",
    "time_block",
    "time_calls",
    "time_svi_steps",
    "tiny_bert",
    "write_json",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64}

#: The shape of the small ``BertForMaskedLM`` the transformers benchmarks time.
TINY_BERT = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
)


def add_common_args(parser, steps=None, repeats=None):
    """Adds ``--device``, ``--threads``, ``--json`` and, when defaults are given, ``--steps``
    and ``--repeats`` to an :class:`argparse.ArgumentParser`."""
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    threads_help = "torch.set_num_threads for the CPU (default: leave torch's choice)"
    parser.add_argument("--threads", type=int, help=threads_help)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the figures here")
    if steps is not None:
        parser.add_argument(
            "--steps", type=int, default=steps, help="timed calls per repeat (default %(default)s)"
        )
    if repeats is not None:
        parser.add_argument(
            "--repeats", type=int, default=repeats, help="repeats; the median is reported"
        )
    return parser


@contextlib.contextmanager
def set_default_dtype(dtype):
    """Makes ``dtype`` torch's default dtype inside the block (models create their parameters
    in it), restoring the previous default afterwards, also on an error."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def configure(device, threads=None):
    """Validates the device and applies the thread count; returns a :class:`torch.device`."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device} was requested but torch.cuda.is_available() is False.")
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads must be at least 1, got {threads}.")
        torch.set_num_threads(threads)
    return device


def synchronize(device):
    """Waits for queued GPU work, so that wall-clock intervals cover it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_block(fn, device, calls):
    """Milliseconds per call of ``fn`` over ``calls`` back-to-back calls."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start) / calls


def time_calls(fns, device, steps, repeats, warmup=3):
    """Times several callables in interleaved blocks, so that slow drifts of the machine's
    load hit all of them alike.

    :param dict fns: name -> zero-argument callable.
    :returns: name -> list of ``repeats`` figures in milliseconds per call.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_block(fn, device, steps))
    return times


def svis(module, losses, lr=1e-3):
    """name -> an :class:`~pyro.infer.SVI` of ``module.model`` and ``module.guide`` under
    that name's loss, each with its own Adam optimiser."""
    import pyro
    from pyro.infer import SVI

    return {
        name: SVI(module.model, module.guide, pyro.optim.Adam({"lr": lr}), loss=loss)
        for name, loss in losses.items()
    }


def forward_backward_ms(loss_fn, module, data, device, calls):
    """Median milliseconds of ``loss_fn.differentiable_loss(module.model, module.guide,
    data)`` and of its ``backward()``, over ``calls`` calls; gradients are cleared after
    each."""
    forward, backward = [], []
    for _ in range(calls):
        synchronize(device)
        t0 = time.perf_counter()
        loss = loss_fn.differentiable_loss(module.model, module.guide, data)
        synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(device)
        forward.append(1e3 * (t1 - t0))
        backward.append(1e3 * (time.perf_counter() - t1))
        for p in module.parameters():
            p.grad = None
    return statistics.median(forward), statistics.median(backward)


def time_svi_steps(module, losses, batches, device, steps, repeats, warmup, split_calls):
    """Times one SVI step of ``module`` under each loss (each with its own Adam optimiser) in
    interleaved blocks, every step on the next of ``batches``; then splits each loss's
    ``differentiable_loss`` on one batch into forward and backward, over ``split_calls``.

    :returns: ``(times, splits)``: name -> :func:`time_calls` figures, and name ->
        ``(forward ms, backward ms)``.
    """
    fns = {name: (lambda s=s: s.step(next(batches))) for name, s in svis(module, losses).items()}
    times = time_calls(fns, device, steps, repeats, warmup)
    batch = next(batches)
    splits = {
        name: forward_backward_ms(loss, module, batch, device, split_calls)
        for name, loss in losses.items()
    }
    return times, splits


def median_ms(samples):
    """The median of a list of timings."""
    return statistics.median(samples)


def medians(times):
    """name -> the median of that name's timings, for the output of :func:`time_calls`."""
    return {name: median_ms(samples) for name, samples in times.items()}


def dtype_name(dtype):
    """``"float32"`` for ``torch.float32``, as the reports name dtypes."""
    return str(dtype).replace("torch.", "")


def tiny_bert(device, seed, vocab_size, max_positions):
    """A ``BertForMaskedLM`` of shape :data:`TINY_BERT` with random weights drawn from
    ``seed`` (nothing downloaded), in eval mode on ``device``, and how reports describe it."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, **TINY_BERT)
    hidden, layers = TINY_BERT["hidden_size"], TINY_BERT["num_hidden_layers"]
    name = f"BertForMaskedLM hidden {hidden}, {layers} layers, vocab {vocab_size} (random weights)"
    return BertForMaskedLM(config).to(device).eval(), name


class IdsTokenizer:
    """The parts of a tokenizer that the masked-LM readers use, for texts given as lists of
    token ids: 0 pads, 1 to 3 are other special tokens (2 and 3 open and close a text), and
    4 masks."""

    mask_token_id = 4
    pad_token_id = 0
    all_special_ids = [0, 1, 2, 3, 4]


def random_id_texts(seed, num, low, high, vocab_size):
    """``num`` texts of random ordinary ids below ``vocab_size``, each opened by 2 and closed
    by 3, of lengths drawn between ``low`` and ``high`` (both included) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [
        [2] + torch.randint(5, vocab_size, (n - 2,), generator=gen).tolist() + [3] for n in lengths
    ]


def constants(namespace, *names):
    """The module constants ``names`` of ``namespace`` (a module's ``globals()``), keyed by
    their names in lower case: the configuration a report records."""
    return {name.lower(): namespace[name] for name in names}


def make_report(device, results, config, **settings):
    """A benchmark's report: ``{"config": config and the run's settings (steps, repeats,
    ...), "environment": environment(device), "results": results}``."""
    config = {**config, **settings}
    return {"config": config, "environment": environment(device), "results": results}


def format_table(headers, rows):
    """A plain-text table with right-aligned columns (the first left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        first = row[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join([first] + rest)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def print_results(report, columns, title=None, **context):
    """Prints ``title``, then a :func:`format_table` with one row per result of ``report``.

    :param str columns: ``"header: cell"`` per column, separated by ``" | "``; each cell a
        format string of the result's keys, the report's config and ``context`` (e.g.
        ``"speed-up: {ratio:.2f}x"``); a function in ``context`` stands for its value at the
        result.
    :param str title: a format string of the config, the environment and ``context``.
    """
    shared = {**report.get("environment", {}), **report["config"]}
    if title is not None:
        print(title.format_map({**shared, **context}))
    headers, cells = zip(*(column.split(": ", 1) for column in columns.split(" | ")))

    def row(result):
        values = {k: v(result) if callable(v) else v for k, v in context.items()}
        return [cell.format_map({**shared, **values, **result}) for cell in cells]

    print(format_table(headers, [row(r) for r in report["results"]]))


def environment(device):
    """Versions and machine facts recorded beside the figures."""
    import pyro

    device = torch.device(device)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_json(path, payload):
    """Writes ``payload`` as indented JSON."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"figures written to {path}")


def benchmark_main(doc, argv, run, print_report, steps=None, repeats=None, options=()):
    """The command line of a benchmark: parses the common options and ``options``, runs
    ``run(device, steps=..., repeats=..., **those options)``, prints the report and writes
    it as JSON when ``--json`` is given (and ``run`` returned a report, not None).

    :param str doc: the module docstring; its first paragraph describes the command.
    :param options: ``(flag, add_argument kwargs)`` pairs, e.g.
        ``("--batch", {"type": int, "default": 32, "help": "..."})``; each reaches ``run``
        as the keyword of its ``dest``.
    :returns: the report.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_common_args(parser, steps, repeats)
    dests = [parser.add_argument(flag, **kwargs).dest for flag, kwargs in options]
    args = parser.parse_args(argv)
    device = configure(args.device, args.threads)
    kwargs = {dest: getattr(args, dest) for dest in dests}
    if steps is not None:
        kwargs["steps"] = args.steps
    if repeats is not None:
        kwargs["repeats"] = args.repeats
    report = run(device, **kwargs)
    print_report(report)
    if args.json and report is not None:
        write_json(args.json, report)
    return report
