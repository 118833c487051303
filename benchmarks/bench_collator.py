"""The cost per batch of ``pyro_mpt.transformers.MPTDataCollator`` against
``transformers.DataCollatorForLanguageModeling``.

Both collate the same 32 tokenized examples per batch (lengths uniform in 64..128, random
ids of a 5000-token WordPiece vocabulary of letters and ``##`` pieces, built offline), as a
``datasets`` map would hand them over: dicts of lists with ``input_ids``,
``token_type_ids`` and ``attention_mask``; the ``+stm`` rows add ``special_tokens_mask``,
which ``DataCollatorForLanguageModeling`` recommends, and the whole-word rows add
``offset_mapping``, which its ``whole_word_mask=True`` needs (on examples of 128 tokens
each, as ``tokenizer.pad`` cannot pad offsets). Each row times padding,
masking and corruption of one batch, the two collators in interleaved blocks.

Usage::

    python benchmarks/bench_collator.py [--batch 32] [--steps 20] [--repeats 7] [--json out.json]
"""

import os
import random
import tempfile
import warnings

from _common import benchmark_main, make_report, medians, print_results, time_calls

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from pyro_mpt.transformers import MPTDataCollator  # noqa: E402

__all__ = ["TARGET_RATIO", "main", "print_report", "run"]

#: MPTDataCollator / DataCollatorForLanguageModeling per batch.
TARGET_RATIO = 1.5
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer(folder, vocab_size=5000, seed=0):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = set()
    while len(words) < vocab_size - len(SPECIAL):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))
        words.add(word if rng.random() < 0.7 else "##" + word)
    with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(SPECIAL + sorted(words)) + "\n")
    return transformers.BertTokenizerFast.from_pretrained(folder)


def _examples(tokenizer, batch, seed=0, equal=False):
    """Texts of random vocabulary words, tokenized, 64..128 tokens each (128 if ``equal``)."""
    rng = random.Random(seed)
    vocab = [t for t in tokenizer.get_vocab() if t not in SPECIAL]
    out = []
    for _ in range(batch):
        length = (128 if equal else rng.randint(64, 128)) - 2
        pieces = [rng.choice(vocab) for _ in range(length)]
        text = " ".join(p[2:] if p.startswith("##") else p for p in pieces)
        encoded = tokenizer(
            text,
            truncation=True,
            max_length=length + 2,
            return_special_tokens_mask=True,
            return_offsets_mapping=True,
        )
        out.append({k: list(v) for k, v in encoded.items()})
    return out


def _keep(examples, *keys):
    base = ("input_ids", "token_type_ids", "attention_mask")
    return [{k: e[k] for k in base + keys} for e in examples]


def run(device, batch=32, steps=20, repeats=7):
    """Times the collators; returns a report dict."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = _tokenizer(folder)
    examples = _examples(tokenizer, batch)
    plain, with_stm = _keep(examples), _keep(examples, "special_tokens_mask")
    # tokenizer.pad cannot pad offset_mapping: HF's whole-word masking needs equal lengths.
    offsets = _keep(_examples(tokenizer, batch, equal=True), "offset_mapping")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whole_word_mask=True warns that it drops 10% random
        hf = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
        hf_wwm = transformers.DataCollatorForLanguageModeling(tokenizer, whole_word_mask=True)
    cases = [
        ("rate 0.15", hf, plain, MPTDataCollator(tokenizer, rate=0.15), plain),
        ("rate 0.15 +stm", hf, with_stm, MPTDataCollator(tokenizer, rate=0.15), with_stm),
        ("uniform +stm", hf, with_stm, MPTDataCollator(tokenizer, rate="uniform"), with_stm),
        ("(0.15, 0.5) +stm", hf, with_stm, MPTDataCollator(tokenizer, rate=(0.15, 0.5)), with_stm),
        (
            "whole words (128)",
            hf_wwm,
            offsets,
            MPTDataCollator(tokenizer, rate=0.15, whole_word_mask=True),
            offsets,
        ),
        (
            "spans +stm",
            hf,
            with_stm,
            MPTDataCollator(tokenizer, rate=0.15, span_masking=True),
            with_stm,
        ),
    ]
    results = []
    for name, baseline, base_examples, ours, our_examples in cases:
        calls = {
            "hf": lambda f=baseline, x=base_examples: f(x),
            "mpt": lambda f=ours, x=our_examples: f(x),
        }
        times = time_calls(calls, device, steps, repeats)
        ms = medians(times)
        results.append(
            dict(
                case=name,
                hf_ms=ms["hf"],
                mpt_ms=ms["mpt"],
                ratio=ms["mpt"] / ms["hf"],
                hf_all=times["hf"],
                mpt_all=times["mpt"],
            )
        )
    config = dict(target_ratio=TARGET_RATIO, vocab_size=len(tokenizer), lengths="64..128")
    return make_report(device, results, config, batch=batch, steps=steps, repeats=repeats)


def print_report(report):
    print_results(
        report,
        "features / rate: {case} | HF ms: {hf_ms:.3f} | MPT ms: {mpt_ms:.3f} | "
        "MPT/HF: {ratio:.2f}x",
        "Collator cost per batch ({batch} examples of {lengths} tokens, vocab {vocab_size}; median "
        "of {repeats} x {steps} batches; target MPT/HF <= {target_ratio})",
    )


def main(argv=None):
    batch = ("--batch", {"type": int, "default": 32, "help": "examples per batch"})
    return benchmark_main(__doc__, argv, run, print_report, steps=20, repeats=7, options=[batch])


if __name__ == "__main__":
    main()
