"""The held-out metrics of a masked language model for ``bert-rates``: the area under the MPT
curve, the accuracy of masked-token predictions at a 15% rate, and a linear topic probe on
mean final hidden states."""

import torch

from experiments import _common as common
from experiments._probe import linear_probe_accuracy

__all__ = ["evaluate_masked_lm"]


def _batches(rows, size, device, pad_id):
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, row in enumerate(chunk):
            ids[i, : len(row)] = torch.tensor(row)
        yield ids.to(device), (ids != pad_id).long().to(device)


@torch.no_grad()
def _accuracy_at_15(model, tokenizer, rows, device, seed, repeats=4):
    from pyro_mpt.transformers import MPTDataCollator

    collator = MPTDataCollator(tokenizer, rate=0.15, mask_replace_prob=1.0, random_replace_prob=0)
    common.seed_everything(common.derived_seed(seed, 4))
    model.eval()
    hits = total = 0
    for _ in range(repeats):
        for start in range(0, len(rows), 64):
            batch = collator(rows[start : start + 64])
            labels = batch["labels"].to(device)
            logits = model(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
            ).logits
            scored = labels != -100
            hits += int((logits[scored].argmax(-1) == labels[scored]).sum())
            total += int(scored.sum())
    return hits / total


@torch.no_grad()
def _features(model, tokenizer, rows, device):
    model.eval()
    special = torch.tensor(tokenizer.all_special_ids, device=device)
    out = []
    for ids, attention in _batches(rows, 64, device, tokenizer.pad_token_id):
        hidden = model.bert(input_ids=ids, attention_mask=attention).last_hidden_state
        keep = (~torch.isin(ids, special)).unsqueeze(-1).to(hidden.dtype)
        out.append((hidden * keep).sum(1) / keep.sum(1).clamp(min=1))
    return torch.cat(out).double().cpu()


def evaluate_masked_lm(model, data, cfg, seed, device):
    """The held-out area under the MPT curve, accuracy at 15% and topic probe of ``model``
    (see the ``bert-rates`` reproduction for the definitions)."""
    from pyro_mpt.transformers import mlm_mpt_curve

    tokenizer = data["tokenizer"]
    common.seed_everything(common.derived_seed(seed, 5))  # the same held-out masks for every model
    curve = mlm_mpt_curve(
        model,
        tokenizer,
        data["held_out"],
        rates=cfg["rates"],
        num_masks=cfg["num_masks"],
        batch_size=64,
        progress=False,
    )
    (rows_train, y_train), (rows_test, y_test) = data["probe_train"], data["probe_test"]
    probe = linear_probe_accuracy(
        _features(model, tokenizer, rows_train, device),
        y_train,
        _features(model, tokenizer, rows_test, device),
        y_test,
        l2=cfg["probe_l2"],
    )
    return dict(
        area=common.rate_mean_area(curve),
        area_per_token=common.rate_mean_area(curve) / float(curve.num_features.double().mean()),
        scores=curve.scores.tolist(),
        acc15=_accuracy_at_15(model, tokenizer, data["held_out"], device, seed),
        probe=probe,
    )
