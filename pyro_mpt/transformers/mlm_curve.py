"""The MPT curve of a Hugging Face masked language model: the mean log-probability of the
masked tokens at each masking rate, and its area, an estimate of log p(x)."""

import math
import numbers
import warnings
from collections.abc import Mapping

import torch

from pyro_mpt.diagnostics.curve import MPTCurve, check_rates, default_rates, rate_sizes
from pyro_mpt.errors import check_positive_int, user_stacklevel
from pyro_mpt.ops.masks import masks_of_sizes
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers._padding import read_encoding
from pyro_mpt.transformers.mlm_loss import masked_token_log_probs, token_logits

__all__ = ["mlm_mpt_curve"]


def _is_one_sequence(value):
    """True for one sequence of token ids (``(L,)`` tensor, list of ints) where a batch of
    sequences is expected."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 1
    first = next(iter(value), None) if hasattr(value, "__iter__") else None
    return isinstance(first, numbers.Integral) or (
        isinstance(first, torch.Tensor) and first.dim() == 0
    )


def _unpadded(tokenizer, texts):
    """A tokenizer's output (``input_ids`` and, if given, ``attention_mask``) as lists of
    ids with the positions the mask leaves out dropped; other inputs unchanged."""
    if not isinstance(texts, Mapping):
        return texts
    rows, attention = read_encoding(texts, None, "texts")
    if _is_one_sequence(rows):
        raise ValueError(
            "texts['input_ids'] is one sequence of token ids (a tokenizer's output for one "
            "string), not a batch; tokenize a list, tokenizer([text]), or pass [ids]."
        )
    out = []
    for index, row in enumerate(rows):
        row = row.tolist() if isinstance(row, torch.Tensor) else list(row)
        if attention is not None:
            keep = attention[index]
            keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
            row = [t for t, k in zip(row, keep) if k]
        out.append(row)
    return out


def _closing_ids(tokenizer):
    """The ids of the tokens that close a sequence (``[SEP]``, ``</s>``): truncation keeps
    them, as the tokenizer does when it truncates a string."""
    ids = (getattr(tokenizer, name, None) for name in ("sep_token_id", "eos_token_id"))
    return {i for i in ids if i is not None}


def _truncated(ids, max_length, closing):
    """``ids`` (a list) cut to ``max_length`` tokens; a closing token that ends them stays
    at the end, so that ids and strings truncate alike (the tokenizer keeps ``[SEP]``)."""
    if max_length is None or len(ids) <= max_length:
        return ids
    if max_length >= 2 and ids[-1] in closing:
        return ids[: max_length - 1] + ids[-1:]
    return ids[:max_length]


def _strip_padding(ids, pad_id):
    """``ids`` (a list) without the padding at either end: padding is no part of the
    sequence, and left in it would move the tokens' positions (left) or be attended to."""
    if pad_id is None:
        return ids
    start, stop = 0, len(ids)
    while start < stop and ids[start] == pad_id:
        start += 1
    while stop > start and ids[stop - 1] == pad_id:
        stop -= 1
    return ids[start:stop]


def _encode(tokenizer, texts, max_length):
    """The token ids of each sequence of ``texts`` (any accepted form) as a list of ints,
    without padding, truncated to ``max_length``."""
    texts = _unpadded(tokenizer, texts)
    if isinstance(texts, (str, bytes)) or not hasattr(texts, "__len__") or len(texts) == 0:
        raise ValueError(
            f"texts must be a non-empty list of strings or of lists of token ids, got {texts!r}."
        )
    if _is_one_sequence(texts):
        raise ValueError(
            f"texts must be a list of sequences, got one sequence of token ids "
            f"({type(texts).__name__} of {len(texts)} ints); pass [ids]."
        )
    if all(isinstance(t, str) for t in texts):
        kwargs = dict(truncation=max_length is not None, add_special_tokens=True)
        if max_length is not None:
            kwargs["max_length"] = max_length
        encoded = [list(ids) for ids in tokenizer(list(texts), **kwargs)["input_ids"]]
        _warn_if_unknown(tokenizer, encoded)
        return encoded
    if isinstance(texts, torch.Tensor) and (
        texts.dim() != 2 or texts.is_floating_point() or texts.dtype == torch.bool
    ):
        raise TypeError(
            f"texts is a tensor of shape {tuple(texts.shape)} and dtype {texts.dtype}; token "
            f"ids come as a 2-D integer tensor (batch, length), e.g. "
            f"tokenizer(texts, return_tensors='pt')['input_ids'], or a list of lists of ints."
        )
    closing = _closing_ids(tokenizer)
    encoded = []
    for index, ids in enumerate(texts):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, str) or not hasattr(ids, "__iter__"):
            raise TypeError(
                f"texts[{index}] must be a string or a list of token ids; texts mixes kinds or "
                f"holds {type(ids).__name__}. Pass all strings or all lists of ints."
            )
        ids = list(ids)
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise TypeError(
                f"texts[{index}] holds {type(bad[0]).__name__} {bad[0]!r} at position "
                f"{ids.index(bad[0])}, not a token id; token ids are ints (a torch.long "
                f"tensor). Pass all strings or all lists of ints."
            )
        # Padding (of a batch padded by a tokenizer, on either side) is not part of the
        # sequence: a padded row scores as the same row unpadded.
        ids = _strip_padding([int(t) for t in ids], tokenizer.pad_token_id)
        encoded.append(_truncated(ids, max_length, closing))
    _warn_if_unknown(tokenizer, encoded)
    return encoded


def _warn_if_unknown(tokenizer, encoded):
    """Warns when sequences hold the tokenizer's unknown token (``[UNK]``, what it makes of
    text its vocabulary lacks, e.g. lowercase letters for a cased vocabulary): like every
    special token it is never masked and the model sees it, so a sequence's score is that of
    its other tokens given it, not of the text."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    counts = [ids.count(unk) for ids in encoded]
    holding = [index for index, count in enumerate(counts) if count]
    if not holding:
        return
    warnings.warn(
        f"{len(holding)} of the {len(encoded)} sequences hold the unknown token "
        f"{tokenizer.unk_token!r} ({sum(counts)} in all; the first: texts[{holding[0]}]), "
        f"which the tokenizer makes of text its vocabulary lacks. Like every special token it "
        f"is never masked but stays visible, so each such sequence is scored as its other "
        f"tokens given it, not as the text. Write the text in the vocabulary's alphabet "
        f"(e.g. the case it expects) or drop what it cannot spell.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _model_limits(model):
    """``(max_length, vocab_size)``: the longest sequence the model's absolute position
    embeddings hold and the size of its input vocabulary, ``None`` where it does not say
    (e.g. rotary or relative positions, or a bare module)."""
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    positions = getattr(embeddings, "position_embeddings", None)
    max_length = None
    if isinstance(positions, torch.nn.Embedding):
        # RoBERTa-style embeddings number the tokens from padding_idx + 1 on.
        offset = 0 if positions.padding_idx is None else positions.padding_idx + 1
        max_length = positions.num_embeddings - offset
    vocab_size = None
    get_embeddings = getattr(model, "get_input_embeddings", None)
    words = get_embeddings() if callable(get_embeddings) else None
    if isinstance(words, torch.nn.Embedding):
        vocab_size = words.num_embeddings
    else:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return max_length, vocab_size


def _attended_rows(ids, attention):
    """The rows of a ``(B, L)`` batch as lists of ids, up to each one's last attended
    position: what the model reads of them."""
    columns = torch.arange(1, ids.shape[1] + 1, device=attention.device)
    widths = (attention.bool() * columns).amax(-1).tolist()
    return [row[:width] for row, width in zip(ids.tolist(), widths)]


def _check_token_ids(
    model, sequences, name="texts", fix="pass max_length={} to truncate it, or shorten it"
):
    """Refuses sequences (lists of ids) that the model cannot read: longer than its position
    embeddings, or with ids outside its vocabulary; the model's own errors (a shape
    mismatch, an index error) name neither the sequence nor the fix. ``fix`` (formatted
    with the longest length) says what to do about a long sequence."""
    max_length, vocab_size = _model_limits(model)
    config = getattr(model, "config", None)
    model_name = type(model).__name__
    for index, ids in enumerate(sequences):
        if max_length is not None and len(ids) > max_length:
            positions = getattr(config, "max_position_embeddings", "?")
            raise ValueError(
                f"{name}[{index}] is {len(ids)} tokens long (special tokens included), more "
                f"than the {max_length} positions of the model ({model_name}, "
                f"config.max_position_embeddings={positions}); {fix.format(max_length)}."
            )
        if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(
                f"{name}[{index}] holds token id {bad} at position {ids.index(bad)}, outside "
                f"the vocabulary of the model ({model_name}, ids 0 to {vocab_size - 1}); "
                "give ids from the model's own tokenizer (after adding tokens to it, call "
                "model.resize_token_embeddings(len(tokenizer)))."
            )


class _Plan:
    """The sequences, their maskable positions and the mask sizes of every rate."""

    def __init__(self, tokenizer, texts, rates, num_masks, max_length):
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no mask token (mask_token_id is "
                "None); the MPT curve needs a masked language model's tokenizer, e.g. BERT's."
            )
        pad_id = tokenizer.pad_token_id
        self.mask_id = mask_id
        self.pad_id = pad_id if pad_id is not None else mask_id
        # Padding left inside a sequence of ids is not attended to, as in
        # mlm_ordering_log_likelihoods; at its ends _encode has cut it off.
        self.unattended = pad_id
        self.rates = check_rates(rates)
        self.num_masks = check_positive_int("num_masks", num_masks)
        special = set(tokenizer.all_special_ids)
        self.ids = _encode(tokenizer, texts, max_length)
        self.positions = []
        for index, ids in enumerate(self.ids):
            positions = [j for j, t in enumerate(ids) if t not in special]
            if not positions:
                truncated = max_length is not None and len(ids) >= max_length
                cut = f" after truncation to max_length={max_length}" if truncated else ""
                raise ValueError(
                    f"texts[{index}] has no maskable token{cut} (only special tokens: {ids}); "
                    + ("raise max_length." if cut else "remove it or give it some content.")
                )
            self.positions.append(torch.tensor(positions))
        self.num_features = torch.tensor([len(p) for p in self.positions])
        cache = {}
        self.sizes = torch.stack(
            [cache.setdefault(d, rate_sizes(self.rates, d)) for d in self.num_features.tolist()]
        )
        # Longest first, so padding within a batch is small and memory peaks early.
        self.order = sorted(range(len(self.ids)), key=lambda i: -len(self.ids[i]))
        self.rows_per_sequence = len(self.rates) * self.num_masks

    @property
    def num_rows(self):
        return len(self.ids) * self.rows_per_sequence

    def sequence_rows(self, index, device):
        """Masked copies of sequence ``index``: ``(ids, masked)``, each ``(R P, L_i)``; row
        ``r P + p`` is mask ``p`` of rate ``r``."""
        positions = self.positions[index]
        sizes = self.sizes[index].repeat_interleave(self.num_masks)
        masks = masks_of_sizes(sizes, len(positions))
        masked = torch.zeros(len(sizes), len(self.ids[index]), dtype=torch.bool)
        masked[:, positions] = masks
        ids = torch.tensor(self.ids[index]).expand(len(sizes), -1)
        return ids.to(device), masked.to(device)

    def batches(self, batch_size, device):
        """Yields ``(input_ids, attention_mask, targets, owners)`` for consecutive rows
        of the sequences (longest first): ``owners`` holds each row's (sequence, row)."""
        pending, count = [], 0
        for index in self.order:
            ids, masked = self.sequence_rows(index, device)
            start = 0
            while start < len(ids):
                take = min(batch_size - count, len(ids) - start)
                pending.append((index, start, ids[start : start + take], masked[start:][:take]))
                count += take
                start += take
                if count == batch_size:
                    yield self._collate(pending, device)
                    pending, count = [], 0
        if pending:
            yield self._collate(pending, device)

    def _collate(self, pieces, device):
        width = max(piece[2].shape[1] for piece in pieces)
        rows = sum(piece[2].shape[0] for piece in pieces)
        labels = torch.full((rows, width), self.pad_id, dtype=torch.long, device=device)
        masked = torch.zeros(rows, width, dtype=torch.bool, device=device)
        attention = torch.zeros(rows, width, dtype=torch.long, device=device)
        owners, at = [], 0
        for index, start, ids, mask in pieces:
            n, length = ids.shape
            labels[at : at + n, :length] = ids
            masked[at : at + n, :length] = mask
            if self.unattended is None:
                attention[at : at + n, :length] = 1
            else:
                attention[at : at + n, :length] = ids != self.unattended
            owners.append(torch.stack([torch.full((n,), index), torch.arange(start, start + n)]))
            at += n
        input_ids = labels.masked_fill(masked, self.mask_id)
        targets = labels.masked_fill(~masked, -100)
        return input_ids, attention, targets, torch.cat(owners, 1).T


def _model_device(model):
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _mean_masked_log_probs(logits, targets):
    """Mean log-probability of the scored tokens (``targets != -100``) of each row, ``(B,)``."""
    log_probs, rows = masked_token_log_probs(logits, targets)
    totals = log_probs.new_zeros(targets.shape[0]).index_add_(0, rows, log_probs)
    return totals / (targets != -100).sum(1).to(totals.dtype)


@torch.no_grad()
def mlm_mpt_curve(
    model,
    tokenizer,
    texts,
    rates=None,
    num_masks=4,
    batch_size=64,
    max_length=None,
    progress=True,
):
    """The MPT curve of a masked language model (any ``*ForMaskedLM``) on ``texts``.

    For each rate ``r`` and sequence ``x`` with ``D`` maskable (non-special) tokens,
    ``num_masks`` masks of ``M = max(1, floor(r D + 1/2))`` tokens each are drawn uniformly
    (:func:`~pyro_mpt.ops.masks.masks_of_sizes`), replaced by the mask token, and scored by
    one forward pass:

    .. math::

        \\mathcal{S}(x; r) = \\mathbb{E}_{|\\mathcal{M}| = M}\\Big[\\frac{1}{M}
            \\sum_{j \\in \\mathcal{M}} \\log q(x_j \\mid x_\\mathcal{R})\\Big],
        \\qquad \\text{area} = \\sum_{M=1}^{D} \\mathcal{S}(x; M) = \\log p(x),

    where sizes that no rate gives are interpolated between the nearest given ones
    (:func:`~pyro_mpt.diagnostics.curve.area_weights`; ``D`` times the mean over the rates
    would weigh each size by how many rates round to it).

    Masked copies of all sequences are packed into batches of ``batch_size`` rows (longest
    sequences first, padded within a batch) and run under :func:`torch.no_grad` on the
    model's device, in its dtype; the log-softmax of the masked positions runs in float32.

    :param model: a masked language model, e.g. :class:`transformers.BertForMaskedLM`; run
        in ``eval()`` mode, restored afterwards.
    :param tokenizer: its tokenizer; needs a mask token.
    :param texts: a list of strings (tokenized with special tokens), of lists of token ids
        or a ``(B, L)`` tensor (used as given; the padding token at either end is dropped
        and elsewhere not attended to, so a padded row scores as unpadded; special tokens
        are never masked, the unknown token ``[UNK]`` among them, which is warned of), or a
        tokenizer's output (its ``input_ids`` where its
        ``attention_mask`` keeps them; one segment each: sentence pairs, whose
        ``token_type_ids`` mark a second segment, are refused).
    :param rates: masking rates in ``(0, 1]`` (default: 1%, 2%, ..., 99%, the paper's). For
        a sequence of more than 50 maskable tokens 99% masks fewer than all of them, and the
        area holds ``S(x; D)`` at the score of the largest size given: add the rate ``1.0``
        to measure every term of the sum.
    :param int num_masks: random masks per sequence and rate.
    :param int batch_size: masked sequences per forward pass.
    :param int max_length: truncate sequences to this many tokens; a closing special token
        (``[SEP]``) stays at the end of ids, as the tokenizer keeps it for strings.
    :param bool progress: show a progress bar over forward passes.
    :returns: an :class:`~pyro_mpt.MPTCurve`.
    :raises ValueError: for a sequence longer than the model's position embeddings or with
        ids outside its vocabulary (before the model's own, less telling, error).

    Example::

        >>> from pyro_mpt.transformers.antiberty import load_antiberty, spaced
        >>> model, tokenizer = load_antiberty()
        >>> texts = [spaced("EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIH")]
        >>> curve = mlm_mpt_curve(model, tokenizer, texts, rates=[0.15, 0.5], progress=False)
        >>> curve.scores.shape
        torch.Size([2])
    """
    rates = default_rates() if rates is None else rates
    batch_size = check_positive_int("batch_size", batch_size)
    if max_length is not None:
        max_length = check_positive_int("max_length", max_length)
    plan = _Plan(tokenizer, texts, rates, num_masks, max_length)
    _check_token_ids(model, plan.ids)
    device = _model_device(model)
    scores = torch.zeros(len(plan.ids), plan.rows_per_sequence, dtype=torch.float64)
    total = math.ceil(plan.num_rows / batch_size)
    training = model.training
    model.eval()
    try:
        for input_ids, attention, targets, owners in progress_bar(
            plan.batches(batch_size, device), total=total, desc="MPT curve", disable=not progress
        ):
            logits = token_logits(model, input_ids, attention)
            row_scores = _mean_masked_log_probs(logits, targets).double().cpu()
            scores[owners[:, 0], owners[:, 1]] = row_scores
    finally:
        model.train(training)
    scores = scores.reshape(len(plan.ids), len(plan.rates), plan.num_masks)
    return MPTCurve.from_scores(scores, plan.rates, plan.sizes, plan.num_features)
