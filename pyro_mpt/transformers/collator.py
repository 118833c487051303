"""``MPTDataCollator``: masked-language-model batches whose masking rate follows an MPT rate
schedule, with the per-sequence weights that turn the masked log-likelihood into the MPT
estimate of ``log p(x)``."""

import numbers
import os
import sys

import torch

from pyro_mpt.errors import check_positive_int
from pyro_mpt.ops.masks import as_rate_schedule
from pyro_mpt.transformers import mask_units
from pyro_mpt.transformers._collator_context import RankStream, calling_trainer, trainer_ignores
from pyro_mpt.transformers._padding import pad_examples

__all__ = ["MPTDataCollator"]

#: Markers that open a word in byte-level BPE (RoBERTa, GPT-2) and SentencePiece vocabularies.
_WORD_START_MARKERS = ("Ġ", "▁")
#: The batch feature that carries the weights D_i / M_i.
_WEIGHTS = "mpt_weights"


def _check_probability(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {value!r}.")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}.")
    return float(value)


def _rate_schedule(rate, mlm_probability):
    """The schedule of ``rate``, or of ``mlm_probability``, the name of a fixed rate in
    ``DataCollatorForLanguageModeling``; ``"uniform"`` when neither is given."""
    if mlm_probability is None:
        return as_rate_schedule("uniform" if rate is None else rate)
    if rate is not None:
        raise ValueError(
            f"give the masking rate once: rate={rate!r} and mlm_probability={mlm_probability!r} "
            "were both given. mlm_probability is DataCollatorForLanguageModeling's name for a "
            f"fixed rate, the same as rate={mlm_probability!r}; drop one of them."
        )
    if isinstance(mlm_probability, bool) or not isinstance(mlm_probability, numbers.Real):
        raise TypeError(
            f"mlm_probability must be a float in (0, 1], a fixed masking rate as in "
            f"DataCollatorForLanguageModeling, got {mlm_probability!r}; for the uniform "
            "schedule or a random ratio (lo, hi) pass rate= instead."
        )
    if not 0.0 < mlm_probability <= 1.0:
        raise ValueError(
            f"mlm_probability must lie in (0, 1], got {mlm_probability!r}; BERT uses 0.15."
        )
    return as_rate_schedule(float(mlm_probability))


def _check_ids(input_ids, vocab_size):
    """Refuses token ids that are not integers of the tokenizer's vocabulary: they would
    index the special-token table out of range, or be masked and scored as another token."""
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be integer token ids, got dtype {input_ids.dtype}; pass the ids "
            f"the tokenizer returned."
        )
    outside = (input_ids < 0) | (input_ids >= vocab_size)
    if bool(outside.any()):
        bad = input_ids[outside][0].item()
        raise ValueError(
            f"input_ids holds id {bad}, outside the tokenizer's vocabulary of {vocab_size} "
            f"ids; tokenize the examples with the tokenizer given to the collator."
        )


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative integer or None, got {seed!r}.")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}; e.g. seed=0.")
    return int(seed)


class MPTDataCollator:
    """Masked-language-model batches with an MPT mask-size schedule: a drop-in replacement for
    ``transformers.DataCollatorForLanguageModeling`` that also emits MPT weights.

    For each sequence ``i`` the collator counts its ``D_i`` maskable units (tokens that are
    neither special nor padding; whole words with ``whole_word_mask=True``), draws a mask size
    ``M_i`` from the rate schedule (the same schedules as :class:`pyro_mpt.MPTLoss`, through
    :func:`pyro_mpt.ops.masks.as_rate_schedule`), and masks ``M_i`` units uniformly at random,
    or as SpanBERT spans with ``span_masking=True``. Masked tokens are corrupted as in BERT
    (``[MASK]`` with probability ``mask_replace_prob``, a random non-special token with
    probability ``random_replace_prob``, else kept; one draw per unit) and scored: ``labels``
    holds the original token there and ``-100`` elsewhere. ``mpt_weights`` holds
    ``D_i / M_i``, so that

    .. math::

        \\widehat{\\log p}(x_i) = \\frac{D_i}{M_i} \\sum_{j \\in \\mathcal{M}_i}
            \\log q_\\theta(x_{ij} \\mid \\tilde x_i)

    is weighted like the MPT estimate of ``log p(x_i)``;
    :func:`pyro_mpt.transformers.mpt_mlm_loss` computes it from the logits. With whole words
    a word's log-probability is the sum over its tokens, and ``D`` and ``M`` count words.

    .. note:: The estimate is unbiased for the model's pseudo-joint
        :math:`\\sum_{M=1}^{D} \\mathcal{S}(x; M)` only when every scored unit is hidden:
        ``mask_replace_prob=1.0`` with ``rate="uniform"`` and no span masking. Under the
        default 80/10/10 corruption about a fifth of the scored units do not become the
        mask token: the model sees the unit itself, or a random token in its place, so their
        terms are not the conditionals :math:`q_\\theta(x_j \\mid x_\\mathcal{R})` of the
        identity and the ``D/M``-weighted sum is not an unbiased estimate of the
        pseudo-joint; it is BERT's training signal on the MPT scale. A span mask is not
        uniform given its size either, so with ``span_masking=True`` the weight keeps the
        estimate's scale but not its unbiasedness.

    :param tokenizer: a ``transformers`` tokenizer with a mask token (and a pad token when
        sequences differ in length).
    :param rate: ``"uniform"`` (the default), a fixed rate ``r`` such as ``0.15``, or a pair
        ``(lo, hi)`` (a random rate per sequence, R2MAE); see
        :func:`pyro_mpt.ops.masks.as_rate_schedule`. A fixed rate masks exactly
        ``M = max(1, floor(r D + 1/2))`` units: halves round up, so ``D = 30`` at ``0.15``
        masks 5 (Python's ``round`` would give 4).
    :param float mask_replace_prob: chance that a masked unit becomes the mask token.
    :param float random_replace_prob: chance that it becomes random non-special tokens.
    :param bool whole_word_mask: mask whole words. Word boundaries come from a ``word_ids``
        feature (``encoding.word_ids()``), an ``offset_mapping`` feature, or the vocabulary
        (WordPiece ``##`` continuations, ``Ġ``/``▁`` word starts).
    :param bool span_masking: mask contiguous spans of units (SpanBERT).
    :param float span_geometric_p: the parameter ``p`` of the geometric span lengths.
    :param int max_span_length: span lengths are clipped at this many units.
    :param int pad_to_multiple_of: pad each batch to a multiple of this length.
    :param int seed: seeds the collator's own random stream, mixed with the process's rank
        (see below); ``None`` (the default) draws from torch's global generator.
    :param float mlm_probability: ``DataCollatorForLanguageModeling``'s name for a fixed rate,
        accepted for scripts written for it: ``mlm_probability=0.15`` is ``rate=0.15``. Where
        that collator masks each token with probability ``0.15`` (a binomial number of
        tokens), this one masks exactly ``M`` of them. Give ``rate`` or ``mlm_probability``,
        not both.

    Example::

        >>> from pyro_mpt.transformers import MPTDataCollator
        >>> from pyro_mpt.transformers.antiberty import load_antiberty
        >>> _, tokenizer = load_antiberty()
        >>> collator = MPTDataCollator(tokenizer, rate="uniform")
        >>> batch = collator([tokenizer("E V Q L V E S"), tokenizer("Q V Q L")])
        >>> sorted(batch)
        ['attention_mask', 'input_ids', 'labels', 'mpt_weights', 'token_type_ids']

    **Random streams and data parallelism.** Under ``torchrun`` or ``accelerate launch`` every
    process is usually seeded alike (``Trainer`` seeds each with ``TrainingArguments.seed``),
    so a collator that drew from torch's global generator would draw the same masks on every
    process. This one mixes the process's rank into its stream (``torch.distributed.get_rank()``
    once a process group is initialised, else the ``RANK`` environment variable the
    launchers set):

    * ``seed=s``: the collator's own generator, seeded from ``(s, rank)``; each rank draws its
      own masks, independent of the other ranks' and of torch's global generator, and ``s``
      reproduces every rank's. In a ``DataLoader`` worker the worker's seed (which the loader
      draws from torch's global generator for each epoch) is mixed in too, so that workers
      and epochs do not repeat one another.
    * no seed, one process: torch's global generator, as ``torch.manual_seed`` leaves it.
    * no seed, several processes (an initialised process group, or ``WORLD_SIZE > 1``): every
      batch comes from a fresh generator seeded from one draw of torch's global generator and
      the rank, so processes seeded alike still draw different masks, and reseeding torch
      reproduces them.

    Resuming from a checkpoint (``trainer.train(resume_from_checkpoint=...)``), ``Trainer``
    restores torch's global generator, so the masks without a seed go on where they stopped.
    The generator of ``seed=s`` is not in the checkpoint: it starts again from ``s``, so a
    resumed run repeats the masks of the first steps. Leave ``seed=None`` for runs that may
    be resumed.

    The weights ``mpt_weights`` mean nothing to a model: a plain ``transformers.Trainer``
    passes them to the model's ``forward``, whose ``**kwargs`` swallow them, and trains plain
    cross-entropy. The collator therefore raises ``TypeError`` when the ``Trainer`` whose
    ``data_collator`` it is asks for a batch while keeping ``Trainer.compute_loss``, with a
    model whose ``forward`` has no ``mpt_weights`` parameter: use
    :class:`~pyro_mpt.transformers.MPTTrainer`. It finds that ``Trainer`` on the call stack,
    in its process or in a ``DataLoader`` worker forked from it, and when the collator is
    pickled for a worker started otherwise. Calls from elsewhere (a training loop of your
    own, a callback) are not checked.
    """

    def __init__(
        self,
        tokenizer,
        rate=None,
        mask_replace_prob=0.8,
        random_replace_prob=0.1,
        whole_word_mask=False,
        span_masking=False,
        span_geometric_p=0.2,
        max_span_length=10,
        pad_to_multiple_of=None,
        *,
        seed=None,
        mlm_probability=None,
    ):
        if getattr(tokenizer, "mask_token_id", None) is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no mask token, which masked "
                "pre-training needs; add one, e.g. tokenizer.add_special_tokens("
                "{'mask_token': '[MASK]'}) and resize the model's embeddings."
            )
        self.schedule = _rate_schedule(rate, mlm_probability)
        self.seed = _check_seed(seed)
        self._stream = RankStream(self.seed)
        self._checked_trainer = None  # (process id, id of a Trainer known to read the weights)
        self.mask_replace_prob = _check_probability(mask_replace_prob, "mask_replace_prob")
        self.random_replace_prob = _check_probability(random_replace_prob, "random_replace_prob")
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise ValueError(
                f"mask_replace_prob + random_replace_prob must not exceed 1, got "
                f"{mask_replace_prob!r} + {random_replace_prob!r}; the rest is the chance of "
                "keeping a masked token unchanged."
            )
        p = _check_probability(span_geometric_p, "span_geometric_p")
        if p == 0.0:
            raise ValueError("span_geometric_p must be positive, got 0.0; SpanBERT uses 0.2.")
        self.span_geometric_p = p
        self.max_span_length = check_positive_int("max_span_length", max_span_length)
        if pad_to_multiple_of is not None:
            pad_to_multiple_of = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.whole_word_mask = bool(whole_word_mask)
        self.span_masking = bool(span_masking)
        self.tokenizer = tokenizer
        self.mask_token_id = int(tokenizer.mask_token_id)
        self.pad_token_id = tokenizer.pad_token_id
        vocab_size = len(tokenizer)
        special = torch.zeros(vocab_size, dtype=torch.bool)
        special[[i for i in tokenizer.all_special_ids if 0 <= i < vocab_size]] = True
        self._special_ids = special
        self._replacement_ids = torch.nonzero(~special).squeeze(-1)
        self._continues_word = None  # vocabulary table, built on first need

    def __repr__(self):
        return (
            f"MPTDataCollator(rate={self.schedule!r}, mask_replace_prob={self.mask_replace_prob},"
            f" random_replace_prob={self.random_replace_prob}, whole_word_mask="
            f"{self.whole_word_mask}, span_masking={self.span_masking}, seed={self.seed})"
        )

    def __call__(self, examples):
        """Pads ``examples`` (dicts with ``input_ids``, or lists of token ids) into a batch and
        masks it.

        :returns: a dict of tensors: the padded features, ``input_ids`` corrupted, ``labels``
            and ``mpt_weights``.
        :raises TypeError: when a ``transformers.Trainer`` that ignores ``mpt_weights`` asks
            for the batch (see the class docstring).
        """
        self._check_weights_are_read(sys._getframe(1))
        batch = pad_examples(
            examples, self.pad_token_id, self.tokenizer.padding_side, self.pad_to_multiple_of
        )
        special = batch.pop("special_tokens_mask", None)
        word_ids = batch.pop("word_ids", None)
        offsets = batch.pop("offset_mapping", None)
        input_ids = batch["input_ids"]
        _check_ids(input_ids, len(self._special_ids))
        if special is None:
            special = self._special_ids.to(input_ids.device)[input_ids.clamp(0, None)]
        maskable = ~special.bool() & batch["attention_mask"].bool()
        continues = None
        if self.whole_word_mask:
            continues = self._word_continuations(input_ids, word_ids, offsets)
        batch["input_ids"], batch["labels"], batch[_WEIGHTS] = self.mask_tokens(
            input_ids, maskable, continues
        )
        return batch

    def __getstate__(self):
        # A DataLoader started by spawn or forkserver pickles the collator in the process of
        # the Trainer that iterates it, whose stack the worker will not see.
        self._check_weights_are_read(sys._getframe(1))
        return self.__dict__.copy()

    def _check_weights_are_read(self, frame):
        trainer = calling_trainer(frame, self)
        if trainer is None:
            return
        key = (os.getpid(), id(trainer))
        if self._checked_trainer == key:
            return
        if trainer_ignores(trainer, _WEIGHTS):
            raise TypeError(
                f"{type(trainer).__name__} minimises the loss that "
                f"{type(trainer.model).__name__} computes from 'labels' and passes the "
                f"collator's {_WEIGHTS!r} into its forward(**kwargs), which ignores them: it "
                "would train plain cross-entropy at MPT's mask sizes, not the MPT objective. "
                "Use pyro_mpt.transformers.MPTTrainer (same arguments) with MPTDataCollator, "
                "or transformers.DataCollatorForLanguageModeling for BERT's own loss."
            )
        self._checked_trainer = key

    def mask_tokens(self, input_ids, maskable, continues_word=None):
        """Masks a padded batch of token ids.

        :param torch.Tensor input_ids: long ``(B, L)``.
        :param torch.Tensor maskable: boolean ``(B, L)``, ``True`` where a token may be masked.
        :param torch.Tensor continues_word: optional boolean ``(B, L)``, ``True`` where a
            token continues the word of the token before it (whole-word masking).
        :returns: ``(corrupted_ids, labels, weights)``: long ``(B, L)``, long ``(B, L)`` with
            ``-100`` at unmasked positions, and float ``(B,)`` weights ``D_i / M_i``.
        :raises ValueError: if a sequence has no maskable token.
        """
        maskable = maskable.bool()
        if continues_word is not None:
            continues_word = continues_word.bool()
        units, counts = mask_units.unit_index(maskable, continues_word)
        empty = torch.nonzero(counts == 0).squeeze(-1)
        if empty.numel():
            raise ValueError(
                f"sequence(s) {empty.tolist()} of the batch have no maskable token (every token "
                "is special or padding); drop empty texts before collating, e.g. filter on "
                "len(input_ids) > 2 for BERT."
            )
        generator = self._stream.generator(input_ids.device)
        sizes = mask_units.sizes_for_rows(self.schedule, counts, generator)
        width = int(counts.max())
        if self.span_masking:
            chosen = mask_units.geometric_spans(
                counts, sizes, width, self.span_geometric_p, self.max_span_length, generator
            )
        else:
            chosen = mask_units.uniform_subsets(counts, sizes, width, generator)
        # One corruption draw per unit: 0 = mask token, 1 = random token, 2 = keep.
        draw = torch.rand(
            chosen.shape, dtype=torch.float32, device=chosen.device, generator=generator
        )
        action = (draw >= self.mask_replace_prob).long()
        action += draw >= self.mask_replace_prob + self.random_replace_prob
        safe_units = units.clamp(min=0)
        masked = maskable & chosen.gather(-1, safe_units)
        action = action.gather(-1, safe_units)
        labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
        corrupted = torch.where(masked & (action == 0), self.mask_token_id, input_ids)
        to_random = masked & (action == 1)
        if self.random_replace_prob > 0 and to_random.any():
            pool = self._replacement_ids.to(input_ids.device)
            size = (int(to_random.sum()),)
            picks = torch.randint(len(pool), size, device=input_ids.device, generator=generator)
            corrupted = corrupted.masked_scatter(to_random, pool[picks])
        weights = counts.to(torch.float32) / sizes
        return corrupted, labels, weights

    def _word_continuations(self, input_ids, word_ids, offsets):
        if word_ids is not None:
            previous = torch.full_like(word_ids, -1)
            previous[:, 1:] = word_ids[:, :-1]
            return (word_ids >= 0) & (word_ids == previous)
        if offsets is not None:
            previous_end = torch.full_like(offsets[..., 1], -1)
            previous_end[:, 1:] = offsets[:, :-1, 1]
            return offsets[..., 0] == previous_end
        if self._continues_word is None:
            self._continues_word = self._vocabulary_continuations()
        table = self._continues_word.to(input_ids.device)
        return table[input_ids.clamp(0, len(table) - 1)]

    def _vocabulary_continuations(self):
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        tokens = [t if isinstance(t, str) else "" for t in tokens]
        if any(t.startswith("##") for t in tokens):
            flags = [t.startswith("##") for t in tokens]
        elif any(t.startswith(_WORD_START_MARKERS) for t in tokens):
            flags = [not t.startswith(_WORD_START_MARKERS) for t in tokens]
        else:
            raise ValueError(
                f"whole_word_mask=True needs word boundaries, but the vocabulary of "
                f"{type(self.tokenizer).__name__} marks none ('##' continuations or 'Ġ'/'▁' "
                "word starts); pass features with 'word_ids' (encoding.word_ids()) or "
                "'offset_mapping' (return_offsets_mapping=True), or use whole_word_mask=False."
            )
        return torch.tensor(flags, dtype=torch.bool) & ~self._special_ids
