"""Sampling from the conditionals of a masked language model, and diagnostics of the samples.

Three samplers share one state, a batch of token ids in which some positions are free:

* ``"sequential"``: a ``k``-block Gibbs step masks ``k`` random free positions and unmasks
  them one at a time, each drawn from the model's conditional given everything unmasked so
  far, in ``k`` forward passes: an exact draw from the block conditional where the model's
  conditionals are those of one joint. An MLM's seldom are (its orderings' chain rules give
  different joints, :func:`~pyro_mpt.transformers.mlm_ordering_log_likelihoods` measures
  by how much): the draw is then from the mixture, over the random order, of those chain
  rules' block conditionals.
* ``"parallel"``: the same block, one forward pass, each position drawn from its own
  conditional given the rest. Not a draw from the block conditional: with the whole
  sequence masked it draws every position independently of the others.
* ``"mask-predict"`` (Ghazvininejad et al., 2019): predict every masked position, then
  re-mask the least confident ones, a linearly decaying number, for ``T`` passes.
"""

import numbers
import time
from typing import NamedTuple

import torch

from pyro_mpt.errors import check_positive_int
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers._padding import (
    left_aligned,
    pad_examples,
    read_encoding,
    realigned,
)
from pyro_mpt.transformers.mlm_curve import _attended_rows, _check_token_ids, _model_limits
from pyro_mpt.transformers.mlm_sampling_steps import (
    TokenConditionals,
    fill_start,
    gibbs_step,
    mask_predict,
)

__all__ = [
    "MLMSamples",
    "check_mask_token",
    "check_model",
    "content_positions",
    "default_attention",
    "sample_mlm",
]

METHODS = ("sequential", "parallel", "mask-predict")
MASK_PREDICT_STEPS = 10


class MLMSamples(NamedTuple):
    """Sequences drawn by :func:`sample_mlm`.

    :ivar torch.Tensor sequences: long ``(B, L)`` token ids, special tokens where the start
        had them.
    :ivar torch.Tensor attention_mask: ``(B, L)``, 0 at padding.
    :ivar int num_passes: forward passes of the model (each over the whole batch, or over
        the sequences that still had positions to fill).
    :ivar float seconds: wall-clock time of the sampling.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    num_passes: int
    seconds: float

    @property
    def seconds_per_sequence(self):
        return self.seconds / self.sequences.shape[0]


def check_model(model):
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    names = set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values())
    if not any(cls.__name__ in names for cls in type(model).__mro__):
        raise TypeError(
            f"model must be a masked language model (a transformers *ForMaskedLM, e.g. "
            f"BertForMaskedLM), got {type(model).__name__}; load one with "
            "AutoModelForMaskedLM.from_pretrained."
        )


def check_mask_token(tokenizer):
    if getattr(tokenizer, "mask_token_id", None) is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no mask token (mask_token_id is None); "
            "sampling needs a masked language model's tokenizer, e.g. BERT's."
        )
    return tokenizer.mask_token_id


def _special_ids(tokenizer, device):
    return torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long, device=device)


def _banned_ids(model, tokenizer, device):
    """The ids never drawn: the tokenizer's special ones, and those of the model's
    vocabulary past the tokenizer's (an embedding matrix padded to a round size), which
    decode to no token."""
    special = _special_ids(tokenizer, device)
    vocab_size = _model_limits(model)[1]
    if vocab_size is None or vocab_size <= len(tokenizer):
        return special
    beyond = torch.arange(len(tokenizer), vocab_size, dtype=torch.long, device=device)
    return torch.cat([special, beyond])


def content_positions(sequences, tokenizer, attention_mask=None):
    """Positions holding ordinary tokens: not special (mask included), not padding."""
    content = ~torch.isin(sequences, _special_ids(tokenizer, sequences.device))
    if attention_mask is not None:
        content &= attention_mask.bool()
    return content


def default_attention(ids, tokenizer):
    """1 except at the tokenizer's padding token."""
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return torch.ones_like(ids) if pad_id is None else (ids != pad_id).long()


def _start(tokenizer, input_ids, attention_mask, length, num_sequences, device):
    """``(ids, attention_mask)`` on ``device`` from the accepted forms of the start."""
    mask_id = tokenizer.mask_token_id
    if (input_ids is None) == (length is None):
        raise ValueError(
            "give exactly one of input_ids (start sequences) and length (fully masked "
            f"sequences), got input_ids={'None' if input_ids is None else '...'} and "
            f"length={length!r}."
        )
    if length is not None:
        length = check_positive_int("length", length)
        num_sequences = check_positive_int("num_sequences", num_sequences)
        # The tokenizer adds its own special tokens ([CLS] ... [SEP], <s> ... </s>).
        row = tokenizer(" ".join([tokenizer.mask_token] * length))["input_ids"]
        if sum(t == mask_id for t in row) != length:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} did not read {length} space-separated "
                "mask tokens as as many tokens; pass input_ids with the mask tokens instead."
            )
        ids = torch.tensor([row] * num_sequences, dtype=torch.long)
        return ids.to(device), torch.ones_like(ids).to(device)
    input_ids, attention_mask = read_encoding(input_ids, attention_mask, "input_ids")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be (L,) or (B, L), got {tuple(input_ids.shape)}.")
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError(
                f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor (a cast "
                f"would turn 4.7 into 4, another token); pass the tokenizer's ids, e.g. "
                f"tokenizer(texts, return_tensors='pt')['input_ids']."
            )
        ids = input_ids.long().reshape(-1, input_ids.shape[-1])
        if attention_mask is None:
            attention_mask = default_attention(ids, tokenizer)
        # One entry per token (read_encoding checked it).
        attention_mask = torch.as_tensor(attention_mask).reshape(ids.shape)
        return ids.clone().to(device), attention_mask.long().to(device)
    rows = _id_lists(input_ids)
    examples = [{"input_ids": row} for row in rows]
    if attention_mask is not None:  # one entry per token (read_encoding checked it)
        for example, keep in zip(examples, attention_mask):
            example["attention_mask"] = keep.tolist() if hasattr(keep, "tolist") else list(keep)
    padding_side = getattr(tokenizer, "padding_side", "right")
    batch = pad_examples(examples, tokenizer.pad_token_id, padding_side=padding_side)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    if attention_mask is None:  # padding already in the lists is not attended to either
        attention = attention * default_attention(ids, tokenizer)
    return ids.to(device), attention.long().to(device)


def _id_lists(input_ids):
    """``input_ids`` given as lists (or 1-d tensors) of token ids, as lists of ints."""
    if (
        isinstance(input_ids, (str, bytes))
        or not hasattr(input_ids, "__len__")
        or len(input_ids) == 0
    ):
        raise ValueError(
            "input_ids must be a long (B, L) tensor, a non-empty list of lists of token ids or "
            f"a tokenizer's output, got {input_ids!r}; tokenize texts first, tokenizer(texts)."
        )
    rows = []
    for index, row in enumerate(input_ids):
        row = row.tolist() if isinstance(row, torch.Tensor) else row
        is_ids = hasattr(row, "__iter__") and not isinstance(row, (str, bytes))
        if not is_ids or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in row
        ):
            raise TypeError(
                f"input_ids[{index}] must be a list of token ids, got {type(row).__name__} "
                f"{row!r}; tokenize texts first, tokenizer(texts)['input_ids'], and pass a "
                "list of such lists (one per sequence)."
            )
        rows.append([int(t) for t in row])
    return rows


def _check_start(model, ids, attention, length):
    """Refuses starts the model cannot read (too long for its positions, ids outside its
    vocabulary) with the start named and the fix, before the model's own error."""
    if length is None:
        fix = "shorten the start sequence to at most {} tokens, special tokens included"
        return _check_token_ids(model, _attended_rows(ids, attention), "input_ids", fix)
    max_length = _model_limits(model)[0]
    if max_length is not None and ids.shape[1] > max_length:
        extra = ids.shape[1] - length
        raise ValueError(
            f"length={length} makes sequences of {ids.shape[1]} tokens with the special tokens, "
            f"more than the {max_length} positions of the model ({type(model).__name__}); use "
            f"length={max_length - extra} or less."
        )


def _check_settings(method, temperature, top_k, num_allowed, num_steps):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not temperature > 0
    ):
        raise ValueError(
            f"temperature must be a positive number, got {temperature!r}; use 1.0 to sample "
            "from the model's conditionals, below 1 to sharpen them."
        )
    if top_k is not None:
        top_k = check_positive_int("top_k", top_k)
        if top_k > num_allowed:
            raise ValueError(
                f"top_k must be at most {num_allowed} (the vocabulary without special "
                f"tokens), got {top_k}; use None to keep every token."
            )
    if num_steps is None:
        return MASK_PREDICT_STEPS if method == "mask-predict" else 0
    if method == "mask-predict":
        return check_positive_int("num_steps", num_steps, "Mask-predict needs T >= 1 passes.")
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}.")
    return int(num_steps)


@torch.no_grad()
def sample_mlm(
    model,
    tokenizer,
    input_ids=None,
    *,
    length=None,
    num_sequences=1,
    attention_mask=None,
    method="sequential",
    num_steps=None,
    block_size=1,
    keep_unmasked=False,
    temperature=1.0,
    top_k=None,
    generator=None,
    progress=False,
):
    """Draws sequences from the conditionals of a masked language model.

    The start's mask tokens are filled first, one per pass in a random order
    (``"sequential"``: each from its conditional given those filled before it, the chain
    rule of one ordering; an exact draw from the model's joint where its conditionals are
    those of one joint, and otherwise from the mixture over orderings of the joints their
    chain rules give, which need not be the law the Gibbs steps converge to), or all in one
    pass (``"parallel"``). Then ``num_steps`` block Gibbs steps each resample
    a uniformly random block of ``k = block_size`` free positions:

    .. math::

        x_S \\sim \\prod_{j=1}^{k} p(x_{s_j} \\mid x_{s_1}, \\dots, x_{s_{j-1}},
            x_{\\setminus S}) \\quad \\text{(sequential, } k \\text{ passes)}, \\qquad
        x_S \\sim \\prod_{s \\in S} p(x_s \\mid x_{\\setminus S}) \\quad
            \\text{(parallel, one pass)}.

    ``"mask-predict"`` instead runs up to ``T = num_steps`` passes (default 10) over the
    start's masked positions: each predicts every masked position, then the
    :func:`mask_predict_schedule` count of least confident ones (lowest probability of
    their drawn token) is masked again; it stops early when that count reaches 0 (fewer
    masked positions than ``T``), and :attr:`MLMSamples.num_passes` says how many ran.

    :param model: a ``*ForMaskedLM`` (e.g. :class:`transformers.BertForMaskedLM`); run in
        ``eval()`` mode, restored afterwards.
    :param tokenizer: its tokenizer (mask token, special tokens, padding).
    :param input_ids: start sequences: long ``(B, L)`` or ``(L,)``, lists of token ids
        (padded on the tokenizer's side), or a tokenizer's output (its ``input_ids`` and
        ``attention_mask``); mask tokens mark the positions to fill.
    :param int length: instead of ``input_ids``, start from ``num_sequences`` fully masked
        sequences of ``length`` tokens between the tokenizer's special tokens.
    :param attention_mask: ``(B, L)`` or one list per sequence, 0 at padding (default: 0 at
        the tokenizer's padding token, 1 elsewhere; the model never attends to padding).
    :param str method: ``"sequential"``, ``"parallel"`` or ``"mask-predict"``.
    :param int num_steps: Gibbs steps after the fill (default 0), or mask-predict's ``T``.
    :param int block_size: ``k``, positions per Gibbs step, at most the free positions of
        the shortest sequence.
    :param bool keep_unmasked: Gibbs steps resample only the start's masked positions,
        conditioned on the rest (imputation); mask-predict always does.
    :param float temperature: the logits are divided by it; must be positive.
    :param int top_k: draw only among the ``top_k`` most probable tokens.
    :param torch.Generator generator: source of randomness, on the model's device.
    :param bool progress: show a progress bar over forward passes.
    :returns: :class:`MLMSamples`.

    .. note:: Special tokens (``[CLS]``, ``[SEP]``, padding, ``[MASK]``, ``[UNK]``) are
        never drawn and the start's special tokens never change.

    Example::

        >>> from pyro_mpt.transformers.antiberty import load_antiberty
        >>> model, tokenizer = load_antiberty()
        >>> out = sample_mlm(model, tokenizer, length=20, num_sequences=2)
        >>> out.sequences.shape, out.num_passes
        (torch.Size([2, 22]), 20)
    """
    check_model(model)
    mask_id = check_mask_token(tokenizer)
    device = next(model.parameters()).device
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {generator!r}; seed one, e.g. "
            f"generator=torch.Generator(device={str(device)!r}).manual_seed(0)."
        )
    banned = _banned_ids(model, tokenizer, device)
    num_allowed = len(tokenizer) - len(_special_ids(tokenizer, device))
    num_steps = _check_settings(method, temperature, top_k, num_allowed, num_steps)
    block_size = check_positive_int("block_size", block_size)
    ids, attention = _start(tokenizer, input_ids, attention_mask, length, num_sequences, device)
    _check_start(model, ids, attention, length)
    # Left-padded rows are drawn with their tokens from position 0, as unpadded, and
    # returned in the layout they came in.
    ids, attention, shift = left_aligned(ids, attention)
    masked = (ids == mask_id) & attention.bool()
    free = (
        masked
        if keep_unmasked or method == "mask-predict"
        else masked | content_positions(ids, tokenizer, attention)
    )
    sequential = method == "sequential"
    if method == "mask-predict" and not masked.any():
        raise ValueError(
            "mask-predict fills masked positions, and the start has none; put the tokenizer's "
            "mask token where tokens are to be drawn, or pass length= for fully masked starts."
        )
    if method != "mask-predict" and num_steps > 0:
        fewest = int(free.sum(1).min())
        if fewest == 0:
            what = "mask tokens" if keep_unmasked else "ordinary tokens or mask tokens"
            raise ValueError(
                f"num_steps={num_steps} resamples free positions, but a start sequence has "
                f"none: with keep_unmasked={keep_unmasked} only its {what} are resampled. Put "
                f"the tokenizer's mask token where tokens are to be drawn, or pass num_steps=0."
            )
        if block_size > fewest:
            raise ValueError(
                f"block_size must be between 1 and {fewest} (the free positions of the "
                f"shortest start sequence), got {block_size}; use a smaller block."
            )
    if method == "mask-predict":
        total = num_steps
    elif sequential:
        total = int(masked.sum(1).max()) + num_steps * block_size
    else:
        total = int(masked.any()) + num_steps
    training = model.training
    model.eval()
    start = time.perf_counter()
    with progress_bar(total=total, desc=f"sample_mlm ({method})", disable=not progress) as bar:
        cond = TokenConditionals(model, banned, float(temperature), top_k, generator, bar)
        try:
            if method == "mask-predict":
                mask_predict(cond, ids, attention, masked, num_steps, mask_id)
            else:
                fill_start(cond, ids, attention, masked, sequential)
                for _ in range(num_steps):
                    gibbs_step(cond, ids, attention, free, block_size, mask_id, sequential)
        finally:
            model.train(training)
    ids, attention = realigned(ids, shift), realigned(attention, shift)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return MLMSamples(ids, attention, cond.passes, time.perf_counter() - start)
