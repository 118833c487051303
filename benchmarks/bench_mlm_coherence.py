"""Cost of ``pyro_mpt.transformers.mlm_ordering_log_likelihoods`` against a plain loop of the
same forward passes.

The model is a ``BertForMaskedLM`` built from a config (hidden size 256, 4 layers, 4 heads,
vocabulary 1000; random weights, nothing downloaded) on 8 sequences of random tokens with
24-48 tokens each. ``mlm_ordering_log_likelihoods`` sums the chain rule along 2 random
orderings per sequence, one masked copy of the sequence per prefix step, in batches of 32
copies: everything it does (drawing the orderings, building the prefix masks, packing and
padding batches, the forward passes, the log-softmax of the scored positions, the sums). The
baseline runs only ``model(input_ids, attention_mask)`` under ``torch.no_grad`` over the very
same batches, recorded from one run of the function. The two are timed in interleaved blocks;
the ratio is ``orderings / plain loop`` (1 means no overhead; target <= 1.2).

Usage::

    python benchmarks/bench_mlm_coherence.py [--device cuda] [--repeats 5] [--json out.json]
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

TARGET_RATIO = 1.2
NUM_SEQUENCES = 8
MIN_TOKENS, MAX_TOKENS = 24, 48
NUM_ORDERINGS = 2
BATCH_SIZE = 32
VOCAB = 1000


def _setup(device, seed):
    model, name = tiny_bert(device, seed, VOCAB, max_positions=64)
    texts = random_id_texts(seed, NUM_SEQUENCES, MIN_TOKENS, MAX_TOKENS, VOCAB)
    return model, name, texts


def run(device="cpu", steps=1, repeats=5, seed=0):
    """Times both; returns ``{"config", "environment", "results"}``."""
    from pyro_mpt.transformers import mlm_ordering_log_likelihoods

    device = torch.device(device)
    model, name, texts = _setup(device, seed)
    tokenizer = IdsTokenizer()

    def orderings():
        mlm_ordering_log_likelihoods(
            model, tokenizer, texts, NUM_ORDERINGS, batch_size=BATCH_SIZE, progress=False
        )

    # The baseline's batches are the very ones the function feeds the model, recorded once.
    batches = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(
            (kwargs["input_ids"], kwargs["attention_mask"])
        ),
        with_kwargs=True,
    )
    orderings()
    handle.remove()

    @torch.no_grad()
    def plain_loop():
        for ids, attention in batches:
            model(input_ids=ids, attention_mask=attention)

    times = time_calls(
        {"orderings": orderings, "plain_loop": plain_loop}, device, steps, repeats, 1
    )
    ms = medians(times)
    orderings_ms, loop_ms = ms["orderings"], ms["plain_loop"]
    rows = sum(ids.shape[0] for ids, _ in batches)
    result = {
        "orderings_ms": orderings_ms,
        "plain_loop_ms": loop_ms,
        "ratio_orderings_over_loop": orderings_ms / loop_ms,
        "orderings_ms_repeats": times["orderings"],
        "plain_loop_ms_repeats": times["plain_loop"],
        "masked_sequences": rows,
        "forward_passes": len(batches),
        "tokens": sum(int(attention.sum()) for _, attention in batches),
        "masked_sequences_per_s": rows / (orderings_ms / 1e3),
    }
    config = dict(model=name, num_sequences=NUM_SEQUENCES, tokens=[MIN_TOKENS, MAX_TOKENS])
    config.update(num_orderings=NUM_ORDERINGS, batch_size=BATCH_SIZE, target_ratio=TARGET_RATIO)
    return make_report(device, [result], config, steps=steps, repeats=repeats)


def print_report(report):
    """Prints the timing table."""
    r = report["results"][0]
    print_results(
        report,
        "orderings ms: {orderings_ms:.0f} | plain loop ms: {plain_loop_ms:.0f} | "
        "orderings/loop: {ratio_orderings_over_loop:.3f} | target: <= {target_ratio} | "
        "masked seq/s: {masked_sequences_per_s:.0f}",
        "mlm_ordering_log_likelihoods vs plain forward loop: {model}, {num_orderings} "
        "orderings, {masked} prefix copies in {passes} batches of <= {batch_size} ({device}, "
        "{threads} threads; median of {repeats})",
        masked=r["masked_sequences"],
        passes=r["forward_passes"],
    )


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report, steps=1, repeats=5)


if __name__ == "__main__":
    main()
