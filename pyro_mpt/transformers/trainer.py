"""``MPTTrainer``: a Hugging Face ``Trainer`` that pre-trains a masked language model with the
MPT objective."""

from transformers import Trainer

from pyro_mpt.transformers.mlm_loss import (
    check_normalize,
    count_items,
    mpt_mlm_loss,
    mpt_sequence_estimates,
    sequence_items,
)

__all__ = ["MPTTrainer"]

_WEIGHTS = "mpt_weights"


def _missing_weights():
    return ValueError(
        f"the batch has no {_WEIGHTS!r}: MPTTrainer needs batches from "
        "pyro_mpt.transformers.MPTDataCollator, e.g. data_collator=MPTDataCollator(tokenizer, "
        "rate='uniform')."
    )


class MPTTrainer(Trainer):
    """A ``transformers.Trainer`` that minimises minus the MPT estimate of ``log p(x)``
    (unbiased for the pseudo-joint only with the collator's ``mask_replace_prob=1.0`` and
    ``rate="uniform"``; see :class:`~pyro_mpt.transformers.MPTDataCollator`).

    Switch an MLM pre-training script to MPT by replacing its collator and its trainer::

        # was DataCollatorForLanguageModeling(tokenizer) and Trainer(...)
        collator = MPTDataCollator(tokenizer, rate="uniform")
        trainer = MPTTrainer(model=model, args=args, train_dataset=train,
                             data_collator=collator)

    Each optimizer step minimises

    .. math::

        \\mathcal{L} = -\\frac{1}{N} \\sum_{i \\in \\text{step}} \\frac{D_i}{M_i}
            \\sum_{j \\in \\mathcal{M}_i} \\log q_\\theta(x_{ij} \\mid \\tilde x_i),

    the sum running over every sequence of the step: all micro-batches of gradient
    accumulation on all processes. ``N`` counts their maskable tokens (``normalize="tokens"``,
    the default: nats per token) or the sequences (``normalize="sequences"``: nats per
    sequence, the estimate of ``log p(x)`` itself).

    **Why per token by default.** Per token, ``loss`` and ``eval_loss`` read like those of a
    plain ``Trainer`` with ``DataCollatorForLanguageModeling`` (``log V`` at random
    initialisation), and the gradients have the size of that loss's, which
    ``TrainingArguments``' defaults are set for. Per sequence both are about ``D`` times
    larger, so ``max_grad_norm=1.0`` cuts every step down and an MLM recipe's learning rate
    no longer fits; choose it when the logged loss should be minus the estimate of
    ``log p(x)``, and set ``max_grad_norm`` and the learning rate for that scale. Within a
    step the two differ by a constant factor (see
    :func:`~pyro_mpt.transformers.mpt_mlm_loss`).

    **Data parallelism and gradient accumulation.** :meth:`get_batch_samples` counts ``N``
    over the step's micro-batches and, under ``torchrun``, sums it over the processes (one
    ``all_gather`` per step, when ``args.average_tokens_across_devices`` is on, the
    default). Each micro-batch's loss is its share of the sum divided by ``N`` and
    multiplied by the number of processes ``W``; the Trainer adds the micro-batches'
    gradients without dividing (``loss_is_scaled_for_ga = True``) and DDP averages over
    the ``W`` processes, so the update is the gradient of :math:`\\mathcal{L}` over the
    whole step, the same as one process with the whole batch (tested with two processes).
    With ``average_tokens_across_devices=False`` every process divides by its own ``N``
    and DDP averages the processes' losses. ``eval_loss`` is the evaluation set's loss as
    one step's: its summed nats over its whole ``N``, each sequence counted once across the
    processes (not a mean of per-batch losses, which would count the sequences that a
    distributed sampler repeats to fill its last batch, and weigh batches by their size).

    Features such as ``word_ids`` reach the collator only with
    ``TrainingArguments(remove_unused_columns=False)``; otherwise whole-word masking reads
    word boundaries from the vocabulary.

    :param str normalize: ``"tokens"`` (default) or ``"sequences"``.

    All other arguments are those of ``transformers.Trainer``.
    """

    loss_is_scaled_for_ga = True

    def __init__(self, *args, normalize="tokens", **kwargs):
        self.normalize = check_normalize(normalize)
        # While an evaluation loop runs: each batch's (minus estimates, items) per sequence,
        # gathered from every process without the repeated fill of the last batch.
        self._evaluated = None
        super().__init__(*args, **kwargs)

    def evaluation_loop(self, dataloader, description, *args, metric_key_prefix="eval", **kwargs):
        """``Trainer.evaluation_loop``, with the loss of the whole evaluation set (see the
        class docstring) in place of the mean of its batches' losses."""
        self._evaluated = []
        try:
            output = super().evaluation_loop(
                dataloader, description, *args, metric_key_prefix=metric_key_prefix, **kwargs
            )
        finally:
            evaluated, self._evaluated = self._evaluated, None
        if evaluated:
            nats = sum(float(pair[0].double().sum()) for pair in evaluated)
            items = sum(float(pair[1].double().sum()) for pair in evaluated)
            output.metrics[f"{metric_key_prefix}_loss"] = nats / max(items, 1.0)
        return output

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The next ``num_batches`` micro-batches and the divisor ``N`` of their step,
        summed over processes (see the class docstring)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        if any(_WEIGHTS not in batch for batch in batches):
            raise _missing_weights()
        total = sum(count_items(b["labels"], b[_WEIGHTS], self.normalize) for b in batches)
        total = total.to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return batches, total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The MPT loss of one micro-batch: its share of the step's loss in training, its own
        loss (divided by its own ``N``) in evaluation."""
        inputs = dict(inputs)
        weights = inputs.pop(_WEIGHTS, None)
        if weights is None:
            raise _missing_weights()
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if model.training and num_items_in_batch is not None:
            loss = mpt_mlm_loss(logits, labels, weights, num_items=num_items_in_batch)
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
        else:
            loss = mpt_mlm_loss(logits, labels, weights, normalize=self.normalize)
            if self._evaluated is not None:
                estimates = mpt_sequence_estimates(logits.detach(), labels, weights)
                items = sequence_items(labels, weights, self.normalize)
                pair = (-estimates.double(), items.double())
                self._evaluated.append(self.accelerator.gather_for_metrics(pair))
        return (loss, outputs) if return_outputs else loss
