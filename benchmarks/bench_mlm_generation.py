"""Cost of one step of ``pyro_mpt.transformers.sample_mlm`` against one plain forward pass.

The model is a ``BertForMaskedLM`` built from a config (hidden size 256, 4 layers, 4 heads,
vocabulary 1000; random weights, nothing downloaded) on a batch of 16 sequences of 64
tokens. One Gibbs step resamples a random block of ``k`` positions per sequence:
``"parallel"`` in one forward pass (target: at most 1.2 times a plain
``model(input_ids, attention_mask)`` under ``torch.no_grad``), ``"sequential"`` in ``k``
passes, counted by a forward hook (target: exactly ``k``, and at most 1.2 times ``k`` plain
passes). All are timed in interleaved blocks in one run.

Usage::

    python benchmarks/bench_mlm_generation.py [--device cuda] [--repeats 5] [--json out.json]
"""

import os
import tempfile

import torch
from _common import benchmark_main, make_report, medians, print_results, time_calls, tiny_bert

__all__ = ["main", "print_report", "run"]

TARGET_RATIO = 1.2
NUM_SEQUENCES = 16
LENGTH = 64
VOCAB = 1000
BLOCK_SIZES = (1, 4, 16)


def _tokenizer(folder):
    """A BERT tokenizer over a made-up vocabulary of ``VOCAB`` tokens, built offline."""
    from transformers import BertTokenizer

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range(VOCAB - len(special))]
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as handle:
        handle.write("\n".join(special + words) + "\n")
    return BertTokenizer.from_pretrained(folder, do_lower_case=False)


def run(device="cpu", steps=3, repeats=5, seed=0):
    """Times a forward pass and one step of each sampler; returns ``{"config",
    "environment", "results"}``."""
    from pyro_mpt.transformers import sample_mlm

    device = torch.device(device)
    model, model_name = tiny_bert(device, seed, VOCAB, max_positions=128)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = _tokenizer(folder)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(5, VOCAB, (NUM_SEQUENCES, LENGTH), generator=gen, device=device)
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    attention = torch.ones_like(ids)

    @torch.no_grad()
    def forward():
        model(input_ids=ids, attention_mask=attention)

    def step(method, k):
        return lambda: sample_mlm(
            model,
            tokenizer,
            ids,
            attention_mask=attention,
            method=method,
            num_steps=1,
            block_size=k,
            generator=gen,
        )

    calls = {"forward": forward}
    for k in BLOCK_SIZES:
        calls[f"parallel k={k}"] = step("parallel", k)
        calls[f"sequential k={k}"] = step("sequential", k)
    passes, seen = {}, []
    handle = model.register_forward_pre_hook(lambda *args: seen.append(1))
    try:
        for name, fn in calls.items():  # count the forward passes of one call
            seen.clear()
            fn()
            passes[name] = len(seen)
    finally:
        handle.remove()
    times = time_calls(calls, device, steps, repeats, warmup=1)
    ms_of = medians(times)
    forward_ms = ms_of["forward"]
    results = []
    for name in calls:
        method, _, k = name.partition(" k=")
        k = int(k) if k else 1
        ms = ms_of[name]
        expected = 1 if method in ("forward", "parallel") else k
        results.append(
            {
                "call": name,
                "method": method,
                "block_size": k,
                "passes": passes[name],
                "expected_passes": expected,
                "ms": ms,
                "ms_repeats": times[name],
                "ratio_to_forward": ms / forward_ms,
                "ratio_per_pass": ms / (forward_ms * expected),
            }
        )
    config = dict(model=model_name, num_sequences=NUM_SEQUENCES, length=LENGTH)
    config.update(block_sizes=list(BLOCK_SIZES), target_ratio=TARGET_RATIO)
    return make_report(device, results, config, steps=steps, repeats=repeats)


def print_report(report):
    """Prints the timing table."""
    print_results(
        report,
        "call: {call} | forward passes: {passes} (expected {expected_passes}) | ms: {ms:.1f} | "
        "/forward: {ratio_to_forward:.2f} | /(passes x forward): {ratio_per_pass:.2f} | "
        "target: <= {target_ratio}",
        "sample_mlm, one Gibbs step vs one forward pass: {model}, {num_sequences} sequences of "
        "{length} tokens ({device}, {threads} threads; median of {repeats})",
    )


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report, steps=3, repeats=5)


if __name__ == "__main__":
    main()
