"""The chain-rule coherence of a Hugging Face masked language model: ``log q(x)`` summed along
random orderings of each sequence's tokens, one forward pass per prefix (:doc:`/coherence`)."""

import math

import torch

from pyro_mpt.diagnostics.coherence import OrderingLogLikelihoods
from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.orderings import prefix_masks, random_orderings
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers._padding import left_aligned, pad_examples, read_encoding
from pyro_mpt.transformers.generation import content_positions, default_attention
from pyro_mpt.transformers.mlm_curve import (
    _attended_rows,
    _check_token_ids,
    _closing_ids,
    _encode,
    _model_device,
)
from pyro_mpt.transformers.mlm_loss import masked_token_log_probs, token_logits

__all__ = ["mlm_ordering_log_likelihoods"]


def _mask_id(tokenizer):
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no mask token (mask_token_id is None); "
            "the chain rule of a masked language model needs its tokenizer, e.g. BERT's."
        )
    return mask_id


def _truncated_rows(tokenizer, ids, attention, max_length):
    """The rows cut to ``max_length`` positions, each keeping its closing token (``[SEP]``)
    as the lists of ids and the strings do (:func:`~.mlm_curve._truncated`)."""
    if max_length is None or ids.shape[1] <= max_length:
        return ids, attention
    columns = torch.arange(1, ids.shape[1] + 1)
    lengths = (attention.bool() * columns).amax(-1).tolist()
    closing = _closing_ids(tokenizer)
    cut_ids, cut_attention = ids[:, :max_length].clone(), attention[:, :max_length].clone()
    for b, length in enumerate(lengths):
        if length > max_length >= 2 and int(ids[b, length - 1]) in closing:
            cut_ids[b, -1], cut_attention[b, -1] = ids[b, length - 1], 1
    return cut_ids, cut_attention


def _batch(tokenizer, sequences, attention_mask, max_length, mask_id):
    """``(input_ids, attention_mask)``, long ``(B, L)`` on the CPU, from the accepted forms;
    padding (attention 0, or the padding token) at the start of a row is moved to its end."""
    sequences, attention_mask = read_encoding(sequences, attention_mask, "sequences")
    if isinstance(sequences, torch.Tensor):
        if (
            sequences.dim() not in (1, 2)
            or sequences.is_floating_point()
            or sequences.dtype == torch.bool
        ):
            raise ValueError(
                "sequences must be token ids, a long (B, L) or (L,) tensor, got a "
                f"{sequences.dtype} tensor of shape {tuple(sequences.shape)}."
            )
        ids = sequences.long().reshape(-1, sequences.shape[-1]).cpu()
        if attention_mask is None:
            attention = default_attention(ids, tokenizer)
        else:
            # One entry per token (read_encoding checked it).
            attention = torch.as_tensor(attention_mask).long().cpu().reshape(ids.shape)
        ids, attention, _ = left_aligned(ids, attention)
        return _truncated_rows(tokenizer, ids, attention, max_length)
    if attention_mask is not None:  # lists of ids: drop what the mask leaves out
        sequences = {"input_ids": sequences, "attention_mask": attention_mask}
    try:
        encoded = _encode(tokenizer, sequences, max_length)
    except (TypeError, ValueError) as error:  # the shared encoder calls its argument "texts"
        raise type(error)(str(error).replace("texts", "sequences")) from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else mask_id
    batch = pad_examples(encoded, pad_id)
    # Padding tokens left inside a sequence are not attended to, as in a tensor.
    attention = batch["attention_mask"] * default_attention(batch["input_ids"], tokenizer)
    return batch["input_ids"], attention


def _check_orderings(orderings, num_orderings, maskable):
    """``orderings`` after checking that they are the permutations :func:`random_orderings`
    would give: ``(O, B, L)``, each sequence's maskable positions first."""
    shape = (num_orderings,) + tuple(maskable.shape)
    orderings = torch.as_tensor(orderings).cpu()
    if orderings.shape != shape or orderings.is_floating_point():
        raise ValueError(
            f"orderings must be long permutations of shape (num_orderings, B, L) = {shape}, "
            f"got a {orderings.dtype} tensor of shape {tuple(orderings.shape)}; draw them with "
            "ops.orderings.random_orderings(num_orderings, (B,), L, entries=maskable)."
        )
    orderings = orderings.long()
    positions = torch.arange(shape[-1]).expand(shape)
    if not torch.equal(orderings.sort(-1).values, positions):
        raise ValueError(
            "orderings must permute the positions 0 .. L-1 of every sequence; some row repeats "
            "or omits a position."
        )
    counts = maskable.sum(-1, keepdim=True)
    if not torch.equal(maskable.expand(shape).gather(-1, orderings), positions < counts):
        raise ValueError(
            "orderings must list each sequence's maskable positions (ordinary tokens, not "
            "special tokens or padding) first, then the others; draw them with "
            "ops.orderings.random_orderings(num_orderings, (B,), L, entries=maskable)."
        )
    return orderings


class _Rows:
    """The prefix steps of every ordering of every sequence, packed into forward passes: row
    ``(o, b, i)`` is sequence ``b`` with ``s(i), s(i+1), ...`` of ordering ``o`` masked, and
    scores the token at ``s(i)``."""

    def __init__(self, ids, attention, maskable, orderings, mask_id, device):
        self.ids = ids.to(device)
        self.attention = attention.to(device)
        self.maskable = maskable.to(device)
        self.orderings = orderings.to(device)
        self.mask_id = mask_id
        self.counts = maskable.sum(-1).tolist()
        # Trailing padding of the longest sequence in a pass is cut off.
        columns = torch.arange(1, ids.shape[-1] + 1)
        self.widths = (attention.bool() * columns).amax(-1).clamp(min=1).tolist()
        # Longest first, so padding within a pass is small and memory peaks early.
        self.order = sorted(range(ids.shape[0]), key=lambda b: -self.widths[b])

    @property
    def num_rows(self):
        return self.orderings.shape[0] * sum(self.counts)

    def _sequence(self, b):
        """``(masked (O D, L), scored (O D,), owners (O D,))`` of sequence ``b``: rows in the
        order (ordering, step); ``owners`` index the flattened ``(O, B)`` sums."""
        num_orderings, batch = self.orderings.shape[:2]
        steps = self.counts[b]
        orderings = self.orderings[:, b]  # (O, L)
        masked = prefix_masks(orderings, range(steps)) & self.maskable[b]  # (O, D, L)
        scored = orderings[:, :steps]
        owners = torch.arange(num_orderings, device=orderings.device) * batch + b
        return masked.flatten(0, 1), scored.flatten(), owners.repeat_interleave(steps)

    def batches(self, batch_size):
        """Yields ``(input_ids, attention_mask, labels, owners)`` of ``batch_size`` rows
        (fewer in the last): ``labels`` holds the scored token, ``-100`` elsewhere."""
        pending, count = [], 0
        for b in self.order:
            rows = self._sequence(b)
            start, num = 0, rows[0].shape[0]
            while start < num:
                take = min(batch_size - count, num - start)
                pending.append((b, tuple(part[start : start + take] for part in rows)))
                count, start = count + take, start + take
                if count == batch_size:
                    yield self._collate(pending)
                    pending, count = [], 0
        if pending:
            yield self._collate(pending)

    def _collate(self, pieces):
        width = max(self.widths[b] for b, _ in pieces)
        device = self.ids.device
        sequence = torch.cat(
            [torch.full((part[0].shape[0],), b, device=device) for b, part in pieces]
        )
        masked, scored, owners = (torch.cat(parts) for parts in zip(*(p for _, p in pieces)))
        ids = self.ids[sequence, :width]
        here = torch.arange(ids.shape[0], device=device)
        labels = torch.full_like(ids, -100)
        labels[here, scored] = ids[here, scored]
        input_ids = ids.masked_fill(masked[:, :width], self.mask_id)
        return input_ids, self.attention[sequence, :width], labels, owners


@torch.no_grad()
def mlm_ordering_log_likelihoods(
    model,
    tokenizer,
    sequences,
    num_orderings=None,
    *,
    attention_mask=None,
    orderings=None,
    batch_size=64,
    max_length=None,
    progress=True,
):
    """Chain-rule sums of a masked language model's conditionals along random orderings of
    each sequence's tokens: their mean is the any-order autoregressive log-likelihood, their
    spread across orderings the model's incoherence.

    For a sequence with ``D`` maskable tokens (not special tokens, not padding) and an
    ordering :math:`\\sigma` of them,

    .. math::

        \\ell_\\sigma(x) = \\sum_{i=1}^{D} \\log q\\big(x_{\\sigma(i)} \\mid
            x_{\\sigma(1)}, \\dots, x_{\\sigma(i-1)}\\big),

    where term ``i`` is the model's log-softmax at position :math:`\\sigma(i)`, of the true
    token, with :math:`\\sigma(i), \\dots, \\sigma(D)` replaced by the mask token. If the
    conditionals came from one joint distribution every ordering would give its
    :math:`\\log q(x)`; a masked language model's do not, and the standard deviation of
    :math:`\\ell_\\sigma(x)` across orderings measures by how much.

    Each step is one masked copy of the sequence: ``num_orderings * D`` copies per sequence,
    packed (longest sequences first, padded within a pass) into forward passes of
    ``batch_size`` copies under :func:`torch.no_grad` on the model's device. The scored
    tokens go through :func:`~pyro_mpt.transformers.masked_token_log_probs` (in float32 or
    wider) and are summed in float64; the sums are returned in the dtype of those
    log-probabilities, so that :meth:`~pyro_mpt.OrderingLogLikelihoods.describe` judges
    rounding by the precision the model computed in.

    :param model: a masked language model (any ``*ForMaskedLM``, or a module called as
        ``model(input_ids=..., attention_mask=...)`` that returns an object with ``.logits``);
        run in ``eval()`` mode, its mode restored afterwards.
    :param tokenizer: its tokenizer: the mask token, the special tokens (never ordered) and
        the padding token.
    :param sequences: a list of strings (tokenized with special tokens), a list of lists of
        token ids (used as given, the padding token at either end dropped), a long
        ``(B, L)`` tensor of token ids, or a dict such as a tokenizer's output with
        ``input_ids`` and ``attention_mask``. Padding is never attended to, and a row's
        leading padding is moved to its end, so that a padded row scores as unpadded.
    :param int num_orderings: random orderings per sequence (at least 2 for a spread);
        None: 8, or with ``orderings`` their leading size.
    :param attention_mask: with ``sequences`` of ids, ``(B, L)`` or one list per sequence,
        0 at padding (default: 0 at the tokenizer's padding token).
    :param torch.Tensor orderings: explicit orderings instead of random ones: long
        ``(num_orderings, B, L)`` (``L`` the padded length; the positions of the rows with
        any leading padding moved to their end, as given for right padding), each row a
        permutation of the positions that lists the sequence's maskable positions first, in
        the order they are revealed, then the rest (as
        :func:`~pyro_mpt.ops.orderings.random_orderings` ``(num_orderings, (B,), L,
        entries=maskable)`` draws them). By default they are drawn from torch's global
        random state, on the CPU.
    :param int batch_size: masked copies per forward pass.
    :param int max_length: truncate sequences to this many tokens, keeping a closing
        special token (``[SEP]``) at the end, as the tokenizer does for strings.
    :param bool progress: show a progress bar over forward passes.
    :returns: an :class:`~pyro_mpt.OrderingLogLikelihoods` with ``values`` of shape
        ``(num_orderings, B)`` (on the CPU; float32 for half- and single-precision models)
        and ``log_marginal=None``.
    :raises ValueError: if a sequence has no maskable token, is longer than the model's
        position embeddings or holds ids outside its vocabulary, or for malformed arguments.

    .. note:: The special tokens of the tokenizer, ``[UNK]`` and ``[MASK]`` included, are
        context only: they are never masked or scored, as in
        :func:`~pyro_mpt.transformers.mlm_mpt_curve`.

    Example::

        >>> from pyro_mpt.transformers.antiberty import load_antiberty, spaced
        >>> model, tokenizer = load_antiberty()
        >>> texts = [spaced("EVQLVESGGGLVQPGGSLRLSCAAS")]
        >>> result = mlm_ordering_log_likelihoods(
        ...     model, tokenizer, texts, num_orderings=4, progress=False)
        >>> result.values.shape
        torch.Size([4, 1])
    """
    if num_orderings is None:
        given = None if orderings is None else torch.as_tensor(orderings)
        num_orderings = 8 if given is None or given.dim() != 3 else given.shape[0]
    num_orderings = check_positive_int(
        "num_orderings",
        num_orderings,
        "It is the number of random orderings of each sequence's tokens, e.g. num_orderings=8.",
    )
    batch_size = check_positive_int("batch_size", batch_size)
    if max_length is not None:
        max_length = check_positive_int("max_length", max_length)
    mask_id = _mask_id(tokenizer)
    ids, attention = _batch(tokenizer, sequences, attention_mask, max_length, mask_id)
    _check_token_ids(model, _attended_rows(ids, attention), "sequences")
    maskable = content_positions(ids, tokenizer, attention)
    empty = (~maskable.any(-1)).nonzero().flatten().tolist()
    if empty:
        truncated = max_length is not None and int(attention[empty[0]].sum()) >= max_length
        cut = f" after truncation to max_length={max_length}" if truncated else ""
        raise ValueError(
            f"sequences[{empty[0]}] has no maskable token{cut} (only special tokens or padding: "
            f"{ids[empty[0]].tolist()}); "
            + ("raise max_length." if cut else "remove it or give it some content.")
        )
    if orderings is None:
        orderings = random_orderings(num_orderings, ids.shape[:1], ids.shape[1], entries=maskable)
    else:
        orderings = _check_orderings(orderings, num_orderings, maskable)
    device = _model_device(model)
    rows = _Rows(ids, attention, maskable, orderings, mask_id, device)
    values = torch.zeros(num_orderings * ids.shape[0], dtype=torch.float64, device=device)
    dtype = torch.float64
    training = getattr(model, "training", False)
    model.eval()
    try:
        for input_ids, attention_rows, labels, owners in progress_bar(
            rows.batches(batch_size),
            total=math.ceil(rows.num_rows / batch_size),
            desc="orderings",
            disable=not progress,
        ):
            logits = token_logits(model, input_ids, attention_rows)
            log_probs, scored_rows = masked_token_log_probs(logits, labels)
            values.index_add_(0, owners[scored_rows], log_probs.double())
            dtype = log_probs.dtype
    finally:
        model.train(training)
    values = values.reshape(num_orderings, ids.shape[0]).to(device="cpu", dtype=dtype)
    return OrderingLogLikelihoods.from_values(values)
