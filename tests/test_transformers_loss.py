"""The MPT loss from logits, labels and weights against a hand computation."""

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from pyro_mpt.transformers import (  # noqa: E402
    masked_token_log_probs,
    mpt_mlm_loss,
    mpt_sequence_estimates,
)


def _example(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator, dtype=dtype)
    labels = torch.full((3, 5), -100)
    labels[0, 1], labels[0, 3] = 2, 6
    labels[1, 0] = 4
    labels[2, 1], labels[2, 2], labels[2, 4] = 0, 1, 5
    weights = torch.tensor([4 / 2, 3 / 1, 5 / 3], dtype=dtype)
    return logits, labels, weights


def _by_hand(logits, labels, weights):
    """Loops and the definition of a softmax: sum_i w_i sum_j log q(label_ij)."""
    estimates = []
    for i in range(labels.shape[0]):
        total = 0.0
        for j in range(labels.shape[1]):
            if labels[i, j] == -100:
                continue
            row = [float(v) for v in logits[i, j]]
            log_norm = math.log(sum(math.exp(v) for v in row))
            total += row[int(labels[i, j])] - log_norm
        estimates.append(float(weights[i]) * total)
    return estimates


def test_estimates_and_loss_equal_a_hand_computation():
    logits, labels, weights = _example()
    expected = _by_hand(logits, labels, weights)
    got = mpt_sequence_estimates(logits, labels, weights)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    per_sequence = mpt_mlm_loss(logits, labels, weights, normalize="sequences").item()
    assert per_sequence == pytest.approx(-sum(expected) / 3)
    # Per token (the default): divided by sum_i w_i K_i = 4 + 3 + 5 maskable tokens.
    per_token = mpt_mlm_loss(logits, labels, weights, normalize="tokens").item()
    assert per_token == pytest.approx(-sum(expected) / 12)
    assert mpt_mlm_loss(logits, labels, weights).item() == per_token
    assert mpt_mlm_loss(logits, labels, weights, num_items=6.0).item() == pytest.approx(
        -sum(expected) / 6
    )


def test_token_log_probs_and_rows():
    logits, labels, _ = _example()
    log_probs, rows = masked_token_log_probs(logits, labels)
    assert rows.tolist() == [0, 0, 1, 2, 2, 2]
    reference = torch.log_softmax(logits, -1)[labels != -100].gather(
        -1, labels[labels != -100].unsqueeze(-1)
    )
    assert torch.allclose(log_probs, reference.squeeze(-1))


def test_gradient_matches_the_hand_derivative():
    # d loss / d logits = -(w_i / N) (onehot - softmax) at scored positions, 0 elsewhere.
    logits, labels, weights = _example()
    logits.requires_grad_(True)
    mpt_mlm_loss(logits, labels, weights, normalize="sequences").backward()
    expected = torch.zeros_like(logits)
    probs = torch.softmax(logits.detach(), -1)
    for i, j in (labels != -100).nonzero().tolist():
        onehot = torch.nn.functional.one_hot(labels[i, j], 7).double()
        expected[i, j] = -(weights[i] / 3) * (onehot - probs[i, j])
    assert torch.allclose(logits.grad, expected, atol=1e-12)


def test_half_precision_logits_are_scored_in_float32():
    logits, labels, weights = _example(torch.float32)
    reference = mpt_mlm_loss(logits, labels, weights)
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        got = mpt_mlm_loss(low, labels, weights)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(
            mpt_mlm_loss(low.float(), labels, weights).item(), rel=1e-6
        )
        assert got.item() == pytest.approx(reference.item(), rel=2e-2)


def test_the_default_loss_is_the_masked_lm_cross_entropy_when_weights_are_equal():
    # Equal weights D_i / M_i: per token, the MPT loss is the mean cross-entropy over the
    # scored tokens, the loss BertForMaskedLM returns (torch's cross_entropy, ignore -100).
    logits, labels, _ = _example()
    weights = torch.full((3,), 2.5)
    bert = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))
    assert mpt_mlm_loss(logits, labels, weights).item() == pytest.approx(bert.item(), rel=1e-12)
    # Uniform predictions over V tokens: log V per token whatever the lengths and weights,
    # D_i log V per sequence.
    labels = torch.tensor([[-100, 3, -100, 1], [2, -100, -100, -100]])
    weights = torch.tensor([4 / 2, 4 / 1])
    assert mpt_mlm_loss(torch.zeros(2, 4, 11), labels, weights).item() == pytest.approx(
        math.log(11)
    )
    per_sequence = mpt_mlm_loss(torch.zeros(2, 4, 11), labels, weights, normalize="sequences")
    assert per_sequence.item() == pytest.approx(4 * math.log(11))


def test_uniform_predictions_give_d_log_v():
    # Uniform logits score every token at -log V: each estimate is -D_i log V exactly.
    labels = torch.tensor([[-100, 3, -100, 1], [2, -100, -100, -100]])
    weights = torch.tensor([4 / 2, 4 / 1])
    est = mpt_sequence_estimates(torch.zeros(2, 4, 11), labels, weights)
    assert torch.allclose(est, torch.full((2,), -4 * math.log(11)))


@pytest.mark.parametrize(
    "logits_shape, weights_shape, match",
    [
        ((3, 5), (3,), r"logits must have shape labels.shape \+ \(vocab,\)"),
        ((3, 4, 7), (3,), r"logits must have shape labels.shape \+ \(vocab,\)"),
        ((3, 5, 7), (2,), r"weights must hold one value per sequence, shape \(3,\)"),
    ],
)
def test_shape_errors(logits_shape, weights_shape, match):
    _, labels, _ = _example()
    with pytest.raises(ValueError, match=match):
        mpt_mlm_loss(torch.zeros(logits_shape), labels, torch.ones(weights_shape))


def test_labels_that_are_not_integer_ids_raise():
    logits, labels, weights = _example()
    match = "labels must be integer token ids .* got dtype torch.float32"
    with pytest.raises(ValueError, match=match):
        mpt_mlm_loss(logits, labels.float(), weights)


@pytest.mark.parametrize("label", [-1, 7], ids=["negative", "past the vocabulary"])
def test_labels_outside_the_vocabulary_raise_by_name(label):
    logits, labels, weights = _example()
    labels[1, 3] = label
    match = rf"labels must be token ids in \[0, 7\) .* got 1 outside that range \(e.g. {label}\)"
    with pytest.raises(ValueError, match=match):
        mpt_mlm_loss(logits, labels, weights)


def test_unknown_normalization_raises():
    logits, labels, weights = _example()
    with pytest.raises(ValueError, match="normalize must be 'sequences' or 'tokens', got 'batch'"):
        mpt_mlm_loss(logits, labels, weights, normalize="batch")


def test_a_batch_with_no_scored_token_has_loss_zero_not_nan():
    logits, labels, weights = _example()
    logits.requires_grad_(True)
    unscored = torch.full_like(labels, -100)
    loss = mpt_mlm_loss(logits, unscored, weights)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    # With tokens scored, the divisor is the count itself, at least 1 always (D_i >= 1).
    assert mpt_mlm_loss(logits, labels, weights).item() == pytest.approx(
        -sum(_by_hand(logits.detach(), labels, weights))
        / float((weights * (labels != -100).sum(-1)).sum())
    )
