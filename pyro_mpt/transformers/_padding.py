"""Tokenized inputs: reading a tokenizer's output into its ids and attention mask, and padding
lists of tokenized examples into a batch of tensors without a tokenizer call per batch
(``tokenizer.pad`` converts every example one by one, which dominates a collator's cost)."""

import math
import numbers

import torch

__all__ = []

#: Feature -> value that pads it; features not listed pad with 0.
_PAD_VALUES = {"attention_mask": 0, "special_tokens_mask": 1, "word_ids": -1, "labels": -100}


def left_aligned(ids, attention):
    """Rows with leading padding (attention 0) rolled so that their tokens start at position
    0, the padding moved to the end: absolute position embeddings (BERT's) read a left-padded
    row at shifted positions, where it does not score as the row unpadded. Returns
    ``(ids, attention, first)``, ``first`` the shift of each row, which
    :func:`realigned` undoes."""
    first = attention.bool().long().argmax(-1)  # the first attended position
    columns = torch.arange(ids.shape[-1], device=ids.device)
    index = (columns + first[:, None]) % ids.shape[-1]
    return ids.gather(1, index), attention.gather(1, index), first


def realigned(tensor, first):
    """``tensor`` ``(B, L)`` rolled back to the layout :func:`left_aligned` took it from."""
    columns = torch.arange(tensor.shape[-1], device=tensor.device)
    return tensor.gather(1, (columns - first[:, None]) % tensor.shape[-1])


def read_encoding(value, attention_mask, name):
    """``(input_ids, attention_mask)`` of ``value`` when it is a tokenizer's output (a
    ``BatchEncoding`` or any mapping with ``input_ids``), else ``(value, attention_mask)``.

    A given ``attention_mask`` wins over the mapping's. The functions that take tokenized
    sequences read them here, so that they accept the same forms and refuse the same inputs
    with the same message, naming their own argument ``name``: a mapping without
    ``input_ids``; ``token_type_ids`` that mark a second segment (every sequence is scored
    and drawn as one segment, token type 0, so a pair's conditionals would be another
    input's); an attention mask that leaves out a position inside a sequence (only padding,
    at either end of a row, is left out).
    """
    if hasattr(value, "keys"):
        if "input_ids" not in value:
            raise ValueError(
                f"{name} is a mapping with keys {sorted(value.keys(), key=str)}, but {name} "
                "must hold 'input_ids'; pass a tokenizer's output, e.g. tokenizer(texts, "
                "padding=True, return_tensors='pt')."
            )
        types = value.get("token_type_ids")
        if types is not None and _has_nonzero(types):
            raise ValueError(
                f"{name}['token_type_ids'] marks a second segment (sentence pairs), but the "
                "sequences are read as one segment, with token type 0: a pair's conditionals "
                "would be those of another input. Pass single sequences, e.g. "
                "tokenizer(list_of_texts), or the ids with their [SEP] as one segment."
            )
        if attention_mask is None and "attention_mask" in value:
            attention_mask = value["attention_mask"]
        value = value["input_ids"]
    if attention_mask is not None:
        _check_one_entry_per_token(value, attention_mask, name)
        check_padding_only(attention_mask, name)
    return value, attention_mask


def _row_lengths(value):
    """The length of each row of ``value`` (a tensor, an array, or lists of numbers), or
    None for text (nothing to compare a mask with)."""
    if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
        shape = tuple(value.shape)
        return None if not shape else [shape[-1]] * math.prod(shape[:-1])
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        return None
    if not value or isinstance(value[0], numbers.Number):
        return [len(value)]
    if any(isinstance(row, str) for row in value):
        return None
    return [len(_as_list(row)) for row in value]


def _check_one_entry_per_token(ids, attention_mask, name):
    """Raises unless ``attention_mask`` has one entry per token of ``ids``, row by row: a
    shorter row would drop the tokens past its end without a word."""
    id_lengths, mask_lengths = _row_lengths(ids), _row_lengths(attention_mask)
    if id_lengths is None or mask_lengths is None or id_lengths == mask_lengths:
        return
    if len(id_lengths) != len(mask_lengths):
        raise ValueError(
            f"The attention mask of {name} has {len(mask_lengths)} rows for "
            f"{len(id_lengths)} sequences; pass one row per sequence, or leave the attention "
            "mask out (0 at padding)."
        )
    row = next(i for i, (a, b) in enumerate(zip(id_lengths, mask_lengths)) if a != b)
    raise ValueError(
        f"The attention mask of {name} has {mask_lengths[row]} entries in row {row}, whose "
        f"sequence has {id_lengths[row]} tokens; pass one entry per token, or leave the "
        "attention mask out (0 at padding)."
    )


def _has_nonzero(values):
    """Whether ``values`` (a tensor, an int, or lists of them, possibly ragged) holds a
    nonzero entry."""
    if isinstance(values, torch.Tensor):
        return bool(values.any())
    if isinstance(values, numbers.Integral):
        return values != 0
    return any(_has_nonzero(value) for value in values)


def check_padding_only(attention_mask, name):
    """Raises when a row of ``attention_mask`` (a tensor, or lists of 0/1) has a 0 between
    two attended positions: only padding is left out, or the functions would disagree on
    whether such a token is dropped or kept unattended."""
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() == 0:
            return
        rows = attention_mask.bool().reshape(-1, attention_mask.shape[-1])
        columns = torch.arange(rows.shape[-1], device=rows.device)
        first = torch.where(rows, columns, rows.shape[-1]).amin(-1)
        last = torch.where(rows, columns, -1).amax(-1)
        counts = rows.sum(-1)
        holed = (counts > 0) & (counts != last - first + 1)
        if not bool(holed.any()):
            return
        rows = rows.tolist()
    else:
        rows = attention_mask
        if rows and isinstance(rows[0], numbers.Number):
            rows = [rows]
    for index, row in enumerate(rows):
        row = row.tolist() if hasattr(row, "tolist") else list(row)
        attended = [position for position, keep in enumerate(row) if keep]
        if attended and len(attended) != attended[-1] - attended[0] + 1:
            inside = next(p for p in range(attended[0], attended[-1]) if not row[p])
            raise ValueError(
                f"The attention mask of {name} leaves out position {inside} of row {index}, "
                f"inside the sequence (attended from {attended[0]} to {attended[-1]}); only "
                "padding, at either end of a row, may be left out. Drop the tokens that are "
                "not to be read from the ids instead."
            )


def _describe(value):
    """A short description of an ``input_ids`` value, for errors."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"


def _as_list(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):  # NumPy arrays
        return value.tolist()
    return list(value)


def _pad_rows(rows, width, value, left):
    out = []
    for row in rows:
        fill = [value] * (width - len(row))
        out.append(fill + row if left else row + fill)
    return out


def pad_examples(examples, pad_token_id, padding_side="right", pad_to_multiple_of=None):
    """Stacks ``examples`` into ``(B, L)`` tensors, padding each sequence feature to the
    longest one (rounded up to ``pad_to_multiple_of``).

    :param examples: dicts with ``input_ids`` (and any per-token features such as
        ``attention_mask``, ``token_type_ids``, ``special_tokens_mask``, ``word_ids``,
        ``offset_mapping``; per-example scalars such as ``label`` are stacked), or sequences
        of token ids.
    :returns: a dict of tensors that always holds ``input_ids`` and ``attention_mask``.
    """
    if isinstance(examples, (str, bytes)) or len(examples) == 0:
        raise ValueError("examples must be a non-empty list of tokenized examples.")
    if hasattr(examples, "keys"):
        raise ValueError(
            f"examples is one mapping with keys {sorted(examples.keys(), key=str)} (a "
            "tokenizer's output for a whole batch?), but a list of examples is expected, one "
            "per sequence: e.g. a datasets.Dataset tokenized with dataset.map, or "
            "[{'input_ids': ids} for ids in encoding['input_ids']]."
        )
    first = examples[0]
    if not hasattr(first, "keys"):
        examples = [{"input_ids": example} for example in examples]
        first = examples[0]
    elif "input_ids" not in first:
        raise ValueError(
            f"examples must hold 'input_ids', got keys {sorted(first.keys())}; tokenize the "
            "texts first, e.g. dataset.map(lambda b: tokenizer(b['text']), batched=True)."
        )
    ids = [_as_list(example["input_ids"]) for example in examples]
    for index, row in enumerate(ids):
        # The first token tells a sequence of ids from a string or a (1, L) tensor.
        if isinstance(examples[index]["input_ids"], (str, bytes)) or (
            row and not isinstance(row[0], numbers.Number)
        ):
            raise ValueError(
                f"examples[{index}]['input_ids'] must be one sequence of token ids, got "
                f"{_describe(examples[index]['input_ids'])}. Tokenize the texts first, one "
                "sequence per example and without return_tensors='pt' (whose (1, L) tensors "
                "would stack into a 3-d batch), e.g. dataset.map(lambda b: tokenizer(b['text'])"
                ", batched=True)."
            )
    lengths = [len(row) for row in ids]
    width = max(lengths)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    if width > min(lengths) and pad_token_id is None:
        raise ValueError(
            "the examples differ in length but the tokenizer has no pad token; set one, e.g. "
            "tokenizer.pad_token = tokenizer.eos_token, or give sequences of equal length."
        )
    left = padding_side == "left"
    batch = {"input_ids": torch.tensor(_pad_rows(ids, width, pad_token_id, left))}
    for key in first.keys():
        if key == "input_ids":
            continue
        values = [example[key] for example in examples]
        if isinstance(values[0], torch.Tensor) and values[0].dim() == 0:
            batch[key] = torch.stack(values)
        elif isinstance(values[0], numbers.Number):
            batch[key] = torch.tensor(values)
        elif key == "offset_mapping":
            rows = [[list(pair) for pair in _as_list(v)] for v in values]
            batch[key] = torch.tensor(_pad_rows(rows, width, [0, 0], left))
        elif key == "word_ids":
            rows = [[-1 if w is None else w for w in _as_list(v)] for v in values]
            batch[key] = torch.tensor(_pad_rows(rows, width, -1, left))
        else:
            rows = [_as_list(v) for v in values]
            batch[key] = torch.tensor(_pad_rows(rows, width, _PAD_VALUES.get(key, 0), left))
    if "attention_mask" not in batch:
        ones = [[1] * n for n in lengths]
        batch["attention_mask"] = torch.tensor(_pad_rows(ones, width, 0, left))
    return batch
