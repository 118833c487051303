"""Throughput of ``pyro_mpt.transformers.mlm_mpt_curve`` against a plain loop of forward
passes over the same batches.

The model is a ``BertForMaskedLM`` built from a config (hidden size 256, 4 layers, 4 heads,
vocabulary 1000; random weights, nothing downloaded) on 16 sequences of random tokens with
48-128 tokens each. ``mlm_mpt_curve`` evaluates 4 rates with 2 masks per sequence and rate,
in batches of 32 masked sequences: everything it does (drawing masks, packing and padding
batches, the forward passes, the log-softmax of the masked positions, the bookkeeping). The
baseline runs only ``model(input_ids, attention_mask)`` under ``torch.no_grad`` over the very
same batches, recorded from one run of the curve. The two are timed in interleaved blocks;
the ratio is ``baseline / mlm_mpt_curve`` (1 means no overhead; target >= 0.9).

Usage::

    python benchmarks/bench_mlm_curve.py [--device cuda] [--repeats 5] [--json out.json]
"""

import torch
from _common import (
    IdsTokenizer,
    benchmark_main,
    make_report,
    medians,
    print_results,
    random_id_texts,
    time_calls,
    tiny_bert,
)

__all__ = ["main", "print_report", "run"]

TARGET_RATIO = 0.9
NUM_SEQUENCES = 16
RATES = [0.15, 0.4, 0.6, 0.85]
NUM_MASKS = 2
BATCH_SIZE = 32
VOCAB = 1000


def _setup(device, seed):
    model, name = tiny_bert(device, seed, VOCAB, max_positions=256)
    texts = random_id_texts(seed, NUM_SEQUENCES, 48, 128, VOCAB)
    return model, name, texts


def run(device="cpu", steps=1, repeats=5, seed=0):
    """Times both; returns ``{"config", "environment", "results"}``."""
    from pyro_mpt.transformers import mlm_mpt_curve

    device = torch.device(device)
    model, name, texts = _setup(device, seed)
    tokenizer = IdsTokenizer()

    def curve():
        mlm_mpt_curve(
            model,
            tokenizer,
            texts,
            rates=RATES,
            num_masks=NUM_MASKS,
            batch_size=BATCH_SIZE,
            progress=False,
        )

    # The baseline's batches are the very ones the curve feeds the model, recorded once.
    batches = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(
            (kwargs["input_ids"], kwargs["attention_mask"])
        ),
        with_kwargs=True,
    )
    curve()
    handle.remove()

    @torch.no_grad()
    def plain_loop():
        for ids, attention in batches:
            model(input_ids=ids, attention_mask=attention)

    times = time_calls({"mpt_curve": curve, "plain_loop": plain_loop}, device, steps, repeats, 1)
    ms = medians(times)
    curve_ms, loop_ms = ms["mpt_curve"], ms["plain_loop"]
    rows = sum(ids.shape[0] for ids, _ in batches)
    tokens = sum(int(attention.sum()) for _, attention in batches)
    result = {
        "mpt_curve_ms": curve_ms,
        "plain_loop_ms": loop_ms,
        "ratio_loop_over_curve": loop_ms / curve_ms,
        "mpt_curve_ms_repeats": times["mpt_curve"],
        "plain_loop_ms_repeats": times["plain_loop"],
        "masked_sequences": rows,
        "forward_passes": len(batches),
        "tokens": tokens,
        "masked_sequences_per_s": rows / (curve_ms / 1e3),
    }
    config = dict(model=name, num_sequences=NUM_SEQUENCES, rates=RATES, num_masks=NUM_MASKS)
    config.update(batch_size=BATCH_SIZE, target_ratio=TARGET_RATIO)
    return make_report(device, [result], config, steps=steps, repeats=repeats)


def print_report(report):
    """Prints the timing table."""
    r = report["results"][0]
    print_results(
        report,
        "mlm_mpt_curve ms: {mpt_curve_ms:.0f} | plain loop ms: {plain_loop_ms:.0f} | "
        "loop/curve: {ratio_loop_over_curve:.3f} | target: >= {target_ratio} | "
        "masked seq/s: {masked_sequences_per_s:.0f}",
        "mlm_mpt_curve vs plain forward loop: {model}, {masked} masked sequences in {passes} "
        "batches of <= {batch_size} ({device}, {threads} threads; median of {repeats})",
        masked=r["masked_sequences"],
        passes=r["forward_passes"],
    )


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report, steps=1, repeats=5)


if __name__ == "__main__":
    main()
