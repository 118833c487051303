"""Diagnostics of sequences drawn from a masked language model: stutter (adjacent repeated
tokens), the model's pseudo-log-likelihood, the distance of token frequencies to a reference
set, and the time per sequence."""

import math
from typing import NamedTuple

import torch

from pyro_mpt.errors import check_positive_int
from pyro_mpt.progress import progress_bar
from pyro_mpt.transformers._padding import check_padding_only, left_aligned
from pyro_mpt.transformers.generation import (
    MLMSamples,
    check_mask_token,
    check_model,
    content_positions,
    default_attention,
)
from pyro_mpt.transformers.mlm_curve import _attended_rows, _check_token_ids

__all__ = [
    "GenerationDiagnostics",
    "generation_diagnostics",
    "pseudo_log_likelihood",
    "stutter_rate",
    "token_frequency_distance",
]


class GenerationDiagnostics(NamedTuple):
    """Diagnostics of ``B`` sampled sequences (:func:`generation_diagnostics`).

    :ivar torch.Tensor stutter_rate: ``(B,)``, fraction of adjacent token pairs that repeat.
    :ivar torch.Tensor pseudo_log_likelihood: ``(B,)``, :func:`pseudo_log_likelihood` (nats).
    :ivar torch.Tensor num_tokens: ``(B,)``, the ordinary (non-special) tokens of each.
    :ivar float token_distance: total variation between the samples' token frequencies and
        the reference's (NaN without a reference).
    :ivar float seconds_per_sequence: sampling time per sequence (NaN for bare ids).
    :ivar int num_passes: forward passes of the sampler (-1 for bare ids).
    """

    stutter_rate: torch.Tensor
    pseudo_log_likelihood: torch.Tensor
    num_tokens: torch.Tensor
    token_distance: float
    seconds_per_sequence: float
    num_passes: int


def _ids(sequences, attention_mask=None):
    """``(ids (B, L), attention (B, L) or None)`` from a tensor or :class:`MLMSamples`."""
    if isinstance(sequences, MLMSamples):
        return sequences.sequences, sequences.attention_mask
    if (
        not isinstance(sequences, torch.Tensor)
        or sequences.dim() != 2
        or sequences.is_floating_point()
        or sequences.is_complex()
    ):
        got = type(sequences).__name__
        if isinstance(sequences, torch.Tensor):
            got = f"a {sequences.dtype} tensor of shape {tuple(sequences.shape)}"
        raise TypeError(
            f"sequences must be a long (B, L) tensor of token ids or the MLMSamples of "
            f"sample_mlm, got {got}."
        )
    return sequences, attention_mask


def stutter_rate(sequences, tokenizer, attention_mask=None):
    """The fraction of adjacent pairs of ordinary tokens that repeat, ``x_i = x_{i+1}``, per
    sequence: parallel decoding of strongly dependent positions "stutters".

    :param sequences: long ``(B, L)`` token ids, or :class:`MLMSamples`.
    :param tokenizer: the tokenizer (its special tokens are not counted).
    :param attention_mask: ``(B, L)``, 0 at padding.
    :returns: float64 ``(B,)``, NaN for a sequence with fewer than two ordinary tokens.
    """
    ids, attention = _ids(sequences, attention_mask)
    content = content_positions(ids, tokenizer, attention)
    pairs = content[:, 1:] & content[:, :-1]
    repeats = pairs & (ids[:, 1:] == ids[:, :-1])
    return repeats.sum(1).double() / pairs.sum(1).double()


@torch.no_grad()
def pseudo_log_likelihood(
    model, tokenizer, sequences, attention_mask=None, batch_size=64, progress=False
):
    """The model's pseudo-log-likelihood of each sequence,

    .. math::

        \\mathrm{PLL}(x) = \\sum_{i} \\log p(x_i \\mid x_{\\setminus i}),

    over its ordinary (non-special) tokens: one copy of the sequence per position with that
    position masked, ``batch_size`` copies per forward pass; the log-softmax is over the
    whole vocabulary, in float64.

    :param model: a ``*ForMaskedLM``; run in ``eval()`` mode, restored afterwards.
    :param tokenizer: its tokenizer.
    :param sequences: long ``(B, L)`` token ids, or :class:`MLMSamples`.
    :param attention_mask: ``(B, L)``, 0 at padding (default: 0 at the padding token).
    :param int batch_size: masked copies per forward pass.
    :param bool progress: show a progress bar over forward passes.
    :returns: float64 ``(B,)`` on the CPU.
    """
    check_model(model)
    mask_id = check_mask_token(tokenizer)
    batch_size = check_positive_int("batch_size", batch_size)
    ids, attention = _ids(sequences, attention_mask)
    device = next(model.parameters()).device
    ids = ids.to(device)
    if attention is None:
        attention = default_attention(ids, tokenizer)
    else:
        attention = torch.as_tensor(attention, device=device)
        if attention.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention.shape)} for sequences of shape "
                f"{tuple(ids.shape)}; give one entry per token, or leave it out (0 at the "
                f"padding token)."
            )
        check_padding_only(attention, "sequences")
    fix = "cut the sequence to at most {} tokens, special tokens included"
    _check_token_ids(model, _attended_rows(ids, attention), "sequences", fix)
    # Left-padded rows are scored with their tokens from position 0, as unpadded.
    ids, attention, _ = left_aligned(ids, attention)
    rows, cols = content_positions(ids, tokenizer, attention).nonzero(as_tuple=True)
    total = torch.zeros(ids.shape[0], dtype=torch.float64)
    training = model.training
    model.eval()
    try:
        starts = range(0, rows.numel(), batch_size)
        for start in progress_bar(starts, desc="pseudo-log-likelihood", disable=not progress):
            r, c = rows[start : start + batch_size], cols[start : start + batch_size]
            copies = ids[r].clone()
            here = torch.arange(r.numel(), device=device)
            copies[here, c] = mask_id
            logits = model(input_ids=copies, attention_mask=attention[r]).logits[here, c]
            log_probs = logits.double().log_softmax(-1).gather(-1, ids[r, c][:, None])
            total.index_add_(0, r.cpu(), log_probs.squeeze(-1).cpu())
    finally:
        model.train(training)
    return total


def _token_counts(sequences, tokenizer, attention_mask=None):
    if isinstance(sequences, (MLMSamples, torch.Tensor)):
        ids, attention = _ids(sequences, attention_mask)
        tokens = ids[content_positions(ids, tokenizer, attention)].cpu()
    else:  # lists of token ids of any lengths
        flat = torch.tensor([int(t) for row in sequences for t in row], dtype=torch.long)
        tokens = flat[content_positions(flat[None], tokenizer)[0]]
    if tokens.numel() == 0:
        raise ValueError("the sequences hold no ordinary (non-special) tokens to count.")
    return torch.bincount(tokens, minlength=len(tokenizer)).double()


def token_frequency_distance(sequences, reference, tokenizer, attention_mask=None):
    """Total variation between the frequencies of ordinary tokens in ``sequences`` and in
    ``reference``: ``0.5 sum_v |f_v - g_v|``, 0 for equal frequencies, 1 for disjoint ones.

    :param sequences: long ``(B, L)`` token ids, or :class:`MLMSamples`.
    :param reference: a ``(N, L')`` tensor or lists of token ids (any lengths).
    :param tokenizer: the tokenizer (special tokens are not counted).
    :param attention_mask: of ``sequences``.
    :returns: a float.
    """
    f = _token_counts(sequences, tokenizer, attention_mask)
    g = _token_counts(reference, tokenizer)
    return 0.5 * float((f / f.sum() - g / g.sum()).abs().sum())


def generation_diagnostics(model, tokenizer, samples, reference=None, batch_size=64):
    """:func:`stutter_rate`, :func:`pseudo_log_likelihood`, :func:`token_frequency_distance`
    to ``reference`` and the time per sequence of samples drawn by
    :func:`~pyro_mpt.transformers.sample_mlm`.

    :param model: the masked language model that scores the samples.
    :param tokenizer: its tokenizer.
    :param samples: :class:`MLMSamples`, or a long ``(B, L)`` tensor.
    :param reference: token ids of reference sequences, e.g. the training data.
    :param int batch_size: masked copies per forward pass of the pseudo-log-likelihood.
    :returns: :class:`GenerationDiagnostics`.
    """
    ids, attention = _ids(samples)
    distance = math.nan
    if reference is not None:
        distance = token_frequency_distance(ids, reference, tokenizer, attention)
    timed = isinstance(samples, MLMSamples)
    return GenerationDiagnostics(
        stutter_rate=stutter_rate(ids, tokenizer, attention),
        pseudo_log_likelihood=pseudo_log_likelihood(
            model, tokenizer, ids, attention, batch_size=batch_size
        ),
        num_tokens=content_positions(ids, tokenizer, attention).sum(1).cpu(),
        token_distance=distance,
        seconds_per_sequence=samples.seconds_per_sequence if timed else math.nan,
        num_passes=samples.num_passes if timed else -1,
    )
