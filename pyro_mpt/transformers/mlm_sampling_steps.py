"""The steps of the masked-language-model samplers of
:func:`~pyro_mpt.transformers.generation.sample_mlm`: forward passes with the sampling
settings, unmasking in order or together, a block-Gibbs step and mask-predict."""

import math

import torch

__all__ = [
    "TokenConditionals",
    "fill_start",
    "gibbs_step",
    "mask_predict",
    "mask_predict_schedule",
    "unmask_in_order",
    "unmask_together",
]


class TokenConditionals:
    """Forward passes of the model and draws from its conditionals with the sampling
    settings; counts the passes and advances the progress bar."""

    def __init__(self, model, banned, temperature, top_k, generator, bar):
        self.model, self.banned = model, banned
        self.temperature, self.top_k = temperature, top_k
        self.generator, self.bar = generator, bar
        self.passes = 0

    def draw(self, ids, attention, rows, cols):
        """One forward pass over the sequences in ``rows``; draws a token at each
        ``(rows[i], cols[i])``. Returns the tokens and their probabilities."""
        seqs = rows.unique()
        logits = self.model(input_ids=ids[seqs], attention_mask=attention[seqs]).logits
        logits = logits[torch.searchsorted(seqs, rows), cols].double() / self.temperature
        logits[:, self.banned] = -math.inf  # special tokens are never sampled
        if self.top_k is not None:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = logits.softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        self.passes += 1
        self.bar.update()
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)


def _rand(shape, generator, device):
    """Uniform keys from the sampler's generator."""
    return torch.rand(shape, generator=generator, device=device)


def unmask_in_order(cond, ids, attention, order, counts):
    """Unmasks ``order[b, :counts[b]]`` of each sequence one position per pass."""
    for j in range(order.shape[1]):
        rows = (counts > j).nonzero().squeeze(-1)
        cols = order[rows, j]
        ids[rows, cols], _ = cond.draw(ids, attention, rows, cols)


def unmask_together(cond, ids, attention, masked):
    """Unmasks every masked position in one pass."""
    rows, cols = masked.nonzero(as_tuple=True)
    if rows.numel():
        ids[rows, cols], _ = cond.draw(ids, attention, rows, cols)


def fill_start(cond, ids, attention, masked, sequential):
    """Fills the start's masked positions: one at a time in a random order, or together."""
    if not sequential:
        return unmask_together(cond, ids, attention, masked)
    counts = masked.sum(1)
    keys = _rand(ids.shape, cond.generator, ids.device).masked_fill(~masked, 2.0)
    order = keys.argsort(dim=1)[:, : int(counts.max())]
    unmask_in_order(cond, ids, attention, order, counts)


def gibbs_step(cond, ids, attention, free, block_size, mask_id, sequential):
    """Masks ``block_size`` random free positions per sequence and resamples them."""
    keys = _rand(ids.shape, cond.generator, ids.device).masked_fill(~free, -1.0)
    block = keys.topk(block_size, dim=1).indices  # (B, k), in a uniformly random order
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(block)
    ids[rows, block] = mask_id
    if sequential:
        counts = torch.full((ids.shape[0],), block_size, device=ids.device)
        unmask_in_order(cond, ids, attention, block, counts)
    else:
        masked = torch.zeros_like(free).scatter(1, block, True)
        unmask_together(cond, ids, attention, masked)


def mask_predict_schedule(num_masked, num_steps):
    """Masked positions predicted at each of the ``T`` mask-predict iterations:
    ``n_t = floor(N (T - t) / T)`` for ``t = 0, ..., T - 1``, all ``N`` first, decaying
    linearly towards 0 (Ghazvininejad et al., 2019, eq. 1)."""
    return [num_masked * (num_steps - t) // num_steps for t in range(num_steps)]


def mask_predict(cond, ids, attention, masked, num_steps, mask_id):
    """Mask-predict: ``T`` passes, each predicting the masked positions and re-masking the
    least confident of them (:func:`mask_predict_schedule`)."""
    num_masked = masked.sum(1)
    confidence = torch.full(ids.shape, math.inf, dtype=torch.float64, device=ids.device)
    for t in range(num_steps):
        if t > 0:  # re-mask the n_t least confident of the start's masked positions
            count = num_masked * (num_steps - t) // num_steps
            order = confidence.masked_fill(~masked, math.inf).argsort(dim=1)
            first = torch.arange(ids.shape[1], device=ids.device) < count[:, None]
            remask = torch.zeros_like(masked).scatter(1, order, first)
            ids[remask] = mask_id
        rows, cols = (masked & (ids == mask_id)).nonzero(as_tuple=True)
        if rows.numel():
            ids[rows, cols], confidence[rows, cols] = cond.draw(ids, attention, rows, cols)
