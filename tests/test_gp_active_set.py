"""The active-set conditioning maths of ``pyro_mpt.ops.active_set`` against dense references."""

import pytest
import torch

from pyro_mpt.ops.active_set import (
    active_set_conditionals,
    gather_blocks,
    split_masks,
)
from pyro_mpt.ops.gaussian import dense_gaussian_conditionals, normal_log_prob
from pyro_mpt.ops.masks import masks_of_sizes
from tests.helpers import dense_schur_log_conditionals


def _covariance(num_tokens):
    factor = torch.randn(num_tokens, num_tokens)
    return factor @ factor.T / num_tokens + 0.1 * torch.eye(num_tokens)


def test_split_masks_puts_context_first_and_pads_to_the_largest_sets():
    masks = torch.tensor([[True, False, False, True, False], [False, True, True, True, True]])
    active = split_masks(masks)
    # Padding slots hold the first targets of the row: finite indices, flagged invalid.
    assert active.context_index.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert active.context_valid.tolist() == [[True, True, True], [True, False, False]]
    assert active.target_valid.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert active.target_index[0, 2:].tolist() == [0, 3]
    assert active.target_index[1].tolist() == [1, 2, 3, 4]


def test_gather_blocks_broadcasts_a_shared_covariance_without_copying_it():
    cov = _covariance(6)
    rows = torch.tensor([[0, 2], [5, 1], [3, 3]])
    cols = torch.tensor([[1, 4, 5]])
    blocks = gather_blocks(cov.expand(1, 6, 6), rows, cols)
    assert blocks.shape == (3, 2, 3)
    for b in range(3):
        torch.testing.assert_close(blocks[b], cov[rows[b]][:, cols[0]])
    batched = torch.stack([cov, 2 * cov])  # (2, 6, 6) against indices of batch (3, 1)
    blocks = gather_blocks(batched, rows.unsqueeze(1), cols)
    assert blocks.shape == (3, 2, 2, 3)
    torch.testing.assert_close(blocks[1, 1], 2 * cov[rows[1]][:, cols[0]])


def test_padded_masks_of_every_size_match_a_dense_schur_complement():
    num_tokens = 8
    cov, loc = _covariance(num_tokens), torch.randn(num_tokens)
    x = torch.distributions.MultivariateNormal(loc, cov).sample((4,))
    sizes = torch.tensor([[1, 3, 7, 8], [2, 8, 5, 1]])  # (P, N): every row padded differently
    masks = masks_of_sizes(sizes, num_tokens)
    active, mean, var = active_set_conditionals(x, loc, cov, masks)
    log_p = normal_log_prob(x.expand(2, 4, -1).gather(-1, active.target_index), mean, var)
    for p in range(2):
        for n in range(4):
            expected = dense_schur_log_conditionals(x[n], loc, cov, masks[p, n])
            slots = active.target_index[p, n][active.target_valid[p, n]].tolist()
            values = log_p[p, n][active.target_valid[p, n]]
            assert sorted(slots) == sorted(expected)
            for j, value in zip(slots, values):
                assert value.item() == pytest.approx(expected[j].item(), abs=1e-10)


def test_dense_path_factorises_only_the_context_block(monkeypatch):
    """Shared masks on a shared covariance: one |R| x |R| Cholesky, whatever N and the batch."""
    num_tokens, context_size = 40, 5
    cov = _covariance(num_tokens)
    x = torch.randn(6, num_tokens)
    masks = torch.ones(1, 1, num_tokens, dtype=torch.bool)
    masks[..., torch.randperm(num_tokens)[:context_size]] = False
    shapes = []
    cholesky = torch.linalg.cholesky

    def recording_cholesky(matrix, *args, **kwargs):
        shapes.append(tuple(matrix.shape))
        return cholesky(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky", recording_cholesky)
    mean, var = dense_gaussian_conditionals(
        x, torch.zeros(num_tokens), cov.expand(1, -1, -1), ~masks
    )
    assert shapes == [(1, 1, context_size, context_size)]
    assert mean.shape == (1, 6, num_tokens) and var.shape == (1, 1, num_tokens)


def test_gradients_match_the_dense_schur_complement():
    num_tokens = 6
    factor = torch.randn(num_tokens, num_tokens, requires_grad=True)
    x = torch.randn(num_tokens)
    mask = torch.tensor([True, False, True, True, False, False])

    def covariance():
        return factor @ factor.T + 0.5 * torch.eye(num_tokens)

    active, mean, var = active_set_conditionals(x, torch.zeros(num_tokens), covariance(), mask)
    ours = normal_log_prob(x[active.target_index], mean, var).sum()
    dense = sum(
        dense_schur_log_conditionals(x, torch.zeros(num_tokens), covariance(), mask).values()
    )
    (grad,) = torch.autograd.grad(ours, factor)
    (expected,) = torch.autograd.grad(dense, factor)
    torch.testing.assert_close(grad, expected)
