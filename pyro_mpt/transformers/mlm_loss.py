"""The MPT objective of a masked language model, from its logits, the collator's labels and
the per-sequence weights ``D_i / M_i``."""

import torch
import torch.nn.functional as F

__all__ = [
    "check_normalize",
    "count_items",
    "masked_token_log_probs",
    "mpt_sequence_estimates",
    "mpt_mlm_loss",
    "token_logits",
]


def check_normalize(normalize):
    """``normalize`` after checking that it is ``"sequences"`` or ``"tokens"``."""
    if normalize not in ("sequences", "tokens"):
        raise ValueError(
            f"normalize must be 'sequences' or 'tokens', got {normalize!r}: the loss is per "
            "sequence (an estimate of -log p(x)) or per maskable token."
        )
    return normalize


def _check_shapes(logits, labels, weights=None):
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits must have shape labels.shape + (vocab,), got logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}; pass the model output's .logits."
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must be integer token ids (-100 where a token is not scored), got dtype "
            f"{labels.dtype}; pass the collator's 'labels'."
        )
    if weights is not None and weights.shape != labels.shape[:1]:
        raise ValueError(
            f"weights must hold one value per sequence, shape ({labels.shape[0]},), got "
            f"{tuple(weights.shape)}; use the 'mpt_weights' of MPTDataCollator."
        )


def token_logits(model, input_ids, attention_mask):
    """The logits ``(B, L, V)`` of a masked language model's forward pass, after checking
    that it gives one row per token: a model with another head (a sequence classifier, a
    bare encoder) is refused by name rather than failing later on a shape."""
    output = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = getattr(output, "logits", None)
    if not torch.is_tensor(logits) or logits.shape[:-1] != input_ids.shape or logits.dim() != 3:
        got = tuple(logits.shape) if torch.is_tensor(logits) else "no .logits"
        raise ValueError(
            f"model must be a masked language model whose output's .logits has shape "
            f"(batch, length, vocab) = {tuple(input_ids.shape)} + (vocab,), got {got} from "
            f"{type(model).__name__}; load one with AutoModelForMaskedLM.from_pretrained."
        )
    return logits


def masked_token_log_probs(logits, labels):
    """``log q(x_j | x̃)`` of every scored token, with the sequence it belongs to: the one
    masked-token scorer of the MPT loss and of :func:`~pyro_mpt.transformers.mlm_mpt_curve`.

    Only the scored rows of the logits (``labels != -100``) go through ``log_softmax``, in
    float32 or wider, so half-precision logits of a large vocabulary cost little memory.

    :param torch.Tensor logits: ``(B, L, V)``.
    :param torch.Tensor labels: long ``(B, L)``, ``-100`` where a token is not scored.
    :returns: ``(log_probs, rows)``: float ``(K,)`` over the ``K`` scored tokens (in
        row-major order) and the long ``(K,)`` sequence index of each.
    """
    _check_shapes(logits, labels)
    scored = labels != -100
    rows = scored.nonzero()[:, 0]
    picked = logits[scored]
    if picked.dtype in (torch.float16, torch.bfloat16):
        picked = picked.float()
    try:
        log_probs = -F.cross_entropy(picked, labels[scored], reduction="none")
    except IndexError:  # raised on the CPU; a device asserts instead
        targets = labels[scored]
        outside = targets[(targets < 0) | (targets >= logits.shape[-1])]
        raise ValueError(
            f"labels must be token ids in [0, {logits.shape[-1]}) where a token is scored and "
            f"-100 elsewhere, got {outside.numel()} outside that range (e.g. "
            f"{int(outside[0])}); mark unscored positions with -100, as MPTDataCollator does."
        ) from None
    return log_probs, rows


def mpt_sequence_estimates(logits, labels, weights):
    """The MPT estimate of ``log p(x_i)`` of every sequence: the scored tokens'
    log-probabilities, summed and weighted by ``D_i / M_i``.

    .. math::

        \\widehat{\\log p}(x_i) = w_i \\sum_{j:\\, \\ell_{ij} \\ne -100}
            \\log q_\\theta(\\ell_{ij} \\mid \\tilde x_i), \\qquad w_i = \\frac{D_i}{M_i}.

    :param torch.Tensor logits: ``(B, L, V)``.
    :param torch.Tensor labels: long ``(B, L)`` with ``-100`` at unscored positions.
    :param torch.Tensor weights: ``(B,)``, the collator's ``mpt_weights``.
    :returns: a differentiable ``(B,)`` tensor.

    .. note:: Unbiased for the pseudo-joint only if every scored token was hidden from the
        model (``MPTDataCollator(mask_replace_prob=1.0, rate="uniform")``); with BERT's
        80/10/10 corruption some scored tokens are visible and it is not (see
        :class:`~pyro_mpt.transformers.MPTDataCollator`).
    """
    _check_shapes(logits, labels, weights)
    log_probs, rows = masked_token_log_probs(logits, labels)
    sums = log_probs.new_zeros(labels.shape[0]).index_add(0, rows, log_probs)
    return weights.to(sums.dtype) * sums


def mpt_mlm_loss(logits, labels, weights, num_items=None, normalize="tokens"):
    """Minus the MPT estimate of ``log p(x)``, summed over the batch and divided by
    ``num_items``: the loss that :class:`~pyro_mpt.transformers.MPTTrainer` minimises.

    .. math::

        \\mathcal{L} = -\\frac{1}{N} \\sum_i \\frac{D_i}{M_i}
            \\sum_{j \\in \\mathcal{M}_i} \\log q_\\theta(x_{ij} \\mid \\tilde x_i),

    with ``N`` either ``Σ_i w_i K_i`` over the ``K_i`` scored tokens of sequence ``i``
    (``normalize="tokens"``, the default: nats per token) or the number of sequences
    (``normalize="sequences"``: nats per sequence). With token masking ``w_i K_i = D_i``, the
    sequence's maskable tokens; with whole words it estimates them. Pass ``num_items`` to
    divide by a count over more than this batch, e.g. every micro-batch of an accumulated
    step on every process.

    Within a batch the two differ by a constant factor (with token masking, the batch's
    maskable tokens per sequence), so their gradients point the same way; they differ in
    scale. Per token, the loss reads like the cross-entropy that a plain ``Trainer`` reports
    with ``DataCollatorForLanguageModeling`` (``log V`` at random initialisation, whatever the
    sequence length), and its gradients have that loss's size, which ``TrainingArguments``'
    defaults (``max_grad_norm=1.0``, learning rates of BERT recipes) are set for. Per
    sequence, the loss is minus the estimate of ``log p(x)`` itself, about ``D`` times larger
    (hundreds of nats for sequences of a hundred tokens), and so are its gradients, which
    ``max_grad_norm=1.0`` then cuts down at every step. Use ``normalize="sequences"``, or
    :func:`mpt_sequence_estimates`, to read the estimate of ``log p(x)``.

    :param torch.Tensor logits: ``(B, L, V)``.
    :param torch.Tensor labels: long ``(B, L)`` with ``-100`` at unscored positions.
    :param torch.Tensor weights: ``(B,)``, the collator's ``mpt_weights``.
    :param num_items: the divisor ``N``; by default counted on this batch.
    :param str normalize: ``"tokens"`` (default) or ``"sequences"``; what the default ``N``
        counts.
    :returns: a differentiable scalar.

    Example::

        >>> import torch
        >>> from pyro_mpt.transformers import mpt_mlm_loss
        >>> logits = torch.zeros(2, 4, 10)       # uniform predictions over 10 tokens
        >>> labels = torch.tensor([[-100, 3, -100, -100], [-100, 5, 6, -100]])
        >>> weights = torch.tensor([2.0, 1.0])   # D/M = 2/1 and 2/2
        >>> round(mpt_mlm_loss(logits, labels, weights).item(), 4)   # log(10) per token
        2.3026
        >>> round(mpt_mlm_loss(logits, labels, weights, normalize="sequences").item(), 4)
        4.6052
    """
    check_normalize(normalize)
    estimates = mpt_sequence_estimates(logits, labels, weights)
    if num_items is None:
        # At least 1: a batch with no scored token has a loss of 0, not 0/0 (a sequence
        # with any scored token counts D_i >= 1).
        num_items = count_items(labels, weights, normalize).clamp(min=1.0)
    return -estimates.sum() / num_items


def count_items(labels, weights, normalize="tokens"):
    """The default divisor of :func:`mpt_mlm_loss`: ``Σ_i w_i K_i`` over a batch's ``K_i``
    scored tokens per sequence (``normalize="tokens"``, the default), or its number of
    sequences (``normalize="sequences"``)."""
    if normalize == "sequences":
        return labels.new_tensor(labels.shape[0], dtype=torch.float32)
    return sequence_items(labels, weights, normalize).sum()


def sequence_items(labels, weights, normalize="tokens"):
    """What each sequence adds to :func:`count_items`: ``w_i K_i``, or 1 per sequence;
    float32 ``(B,)``."""
    if normalize == "sequences":
        return torch.ones(labels.shape[0], dtype=torch.float32, device=labels.device)
    return weights.to(torch.float32) * (labels != -100).sum(-1).to(torch.float32)
