"""Pure tensor helpers of :class:`~pyro_mpt.transformers.MPTDataCollator`: grouping maskable
tokens into units (tokens or whole words), drawing a mask size per sequence from a rate
schedule, and choosing that many units uniformly at random or as spans.

Sequences in a batch have different numbers ``U_i`` of maskable units, so every helper works
on ragged rows: a row's units are the first ``U_i`` columns of a ``(B, U_max)`` tensor.
"""

import torch

from pyro_mpt.ops.masks import sort_rows

__all__ = ["geometric_spans", "sizes_for_rows", "uniform_subsets", "unit_index"]


def unit_index(maskable, continues_word=None):
    """The unit of every token: its rank among the row's maskable tokens, or, with
    ``continues_word``, the rank of its word (a maskable token that does not continue a word,
    or follows a non-maskable one, starts a new word).

    :param torch.Tensor maskable: boolean ``(B, L)``.
    :param torch.Tensor continues_word: optional boolean ``(B, L)``.
    :returns: ``(index, counts)``: long ``(B, L)`` with ``-1`` at non-maskable tokens, and the
        number of units per row, long ``(B,)``.
    """
    starts = maskable
    if continues_word is not None:
        previous = torch.zeros_like(maskable)
        previous[:, 1:] = maskable[:, :-1]
        starts = maskable & (~continues_word | ~previous)
    index = starts.long().cumsum(-1) - 1
    index = torch.where(maskable, index, torch.full_like(index, -1))
    return index, starts.sum(-1)


def sizes_for_rows(schedule, counts, generator=None):
    """One mask size per row from the shared rate schedule, for rows of different lengths.

    :param RateSchedule schedule: the schedule (``as_rate_schedule(rate)``).
    :param torch.Tensor counts: positive units per row, long ``(B,)``.
    :param torch.Generator generator: the random stream, on the device of ``counts``;
        ``None`` for torch's global generator (the same for every helper here).
    :returns: long ``(B,)`` sizes in ``1 ... counts[i]``.
    """
    shape, device = counts.shape, counts.device
    quantiles = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    lengths, inverse = torch.unique(counts, return_inverse=True)
    if lengths.numel() == 1:
        return schedule.sizes_from_quantiles(quantiles, int(lengths[0])).to(counts.device)
    sizes = torch.empty_like(counts)
    for k, length in enumerate(lengths.tolist()):
        rows = inverse == k
        sizes[rows] = schedule.sizes_from_quantiles(quantiles[rows], length).to(counts.device)
    return sizes


def uniform_subsets(counts, sizes, width, generator=None):
    """Row ``i`` gets ``sizes[i]`` of its first ``counts[i]`` columns, uniformly at random.

    :returns: boolean ``(B, width)``.
    """
    columns = torch.arange(width, device=counts.device)
    valid = columns < counts.unsqueeze(-1)
    # float32 keys whatever torch's default dtype, so that a seed gives the same masks in
    # float32 and float64 programs.
    shape, device = counts.shape + (width,), counts.device
    keys = torch.rand(shape, dtype=torch.float32, device=device, generator=generator)
    keys = keys.masked_fill(~valid, 2.0)  # never among the smallest ``sizes`` of a row
    threshold = sort_rows(keys).gather(-1, (sizes - 1).clamp(min=0).unsqueeze(-1))
    masks = (keys <= threshold) & valid & (sizes > 0).unsqueeze(-1)
    # A key tied with the row's threshold would mask one unit too many (float32 keys: about
    # 1 row in 60,000 of 512 tokens): those rows are drawn again with float64 keys, whose
    # ties are 2**29 times rarer.
    tied = masks.sum(-1) > sizes
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(-1)
        redrawn = torch.rand(
            (len(rows), width), dtype=torch.float64, device=device, generator=generator
        )
        redrawn = redrawn.masked_fill(~valid[rows], 2.0)
        index = (sizes[rows] - 1).clamp(min=0).unsqueeze(-1)
        threshold = redrawn.sort(-1).values.gather(-1, index)
        masks[rows] = (redrawn <= threshold) & valid[rows] & (sizes[rows] > 0).unsqueeze(-1)
    return masks


def geometric_spans(counts, sizes, width, p, max_length, generator=None):
    """Row ``i`` gets ``sizes[i]`` of its first ``counts[i]`` columns as non-overlapping spans
    (SpanBERT): span lengths are ``Geometric(p)`` clipped at ``max_length``, drawn until
    they cover ``sizes[i]`` (the last one cut to fit), and the spans are placed uniformly
    among all non-overlapping arrangements.

    :returns: boolean ``(B, width)``.
    """
    device = counts.device
    num_draws = max(int(sizes.max()), 1)  # every span covers at least one unit
    shape = sizes.shape + (num_draws,)
    uniform = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    lengths = torch.floor(torch.log1p(-uniform) / torch.log1p(torch.tensor(-p))).long() + 1
    lengths = lengths.clamp(1, max_length)
    covered = lengths.cumsum(-1)
    num_spans = (covered < sizes.unsqueeze(-1)).sum(-1) + 1
    before = torch.cat([torch.zeros_like(covered[:, :1]), covered[:, :-1]], -1)
    lengths = torch.minimum(lengths, sizes.unsqueeze(-1) - before).clamp(min=0)
    # Spans in random order, so the one cut to fit is not always the last.
    order_keys = torch.rand(lengths.shape, dtype=torch.float32, device=device, generator=generator)
    order_keys = order_keys.masked_fill(lengths == 0, 2.0)
    lengths = lengths.gather(-1, order_keys.argsort(-1))
    # An arrangement is a sequence of counts - sizes unmasked units and num_spans spans; the
    # spans' places in it form a uniform subset of its slots.
    slots = counts - sizes + num_spans
    chosen = uniform_subsets(slots, num_spans, int(slots.max()), generator)
    slot_of_span = torch.sort(
        torch.where(chosen, torch.arange(chosen.shape[-1], device=device), chosen.shape[-1]), -1
    ).values[:, :num_draws]
    if slot_of_span.shape[-1] < num_draws:
        pad = slot_of_span.new_full((slot_of_span.shape[0], num_draws - slot_of_span.shape[-1]), 0)
        slot_of_span = torch.cat([slot_of_span, pad], -1)
    shift = torch.cat([torch.zeros_like(lengths[:, :1]), (lengths - 1).cumsum(-1)[:, :-1]], -1)
    starts = slot_of_span + shift
    real = lengths > 0
    # Mark [start, start + length) through a difference array and a running sum.
    edges = torch.zeros(sizes.shape + (width + 1,), dtype=torch.long, device=device)
    edges.scatter_add_(-1, torch.where(real, starts, width), real.long())
    edges.scatter_add_(-1, torch.where(real, starts + lengths, width), -real.long())
    return edges.cumsum(-1)[:, :width] > 0
