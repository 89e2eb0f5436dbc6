import pytest
import torch

from workers.sparsity.allocation import allocate, total_damage
from workers.sparsity.metrics import roc_auc, topk_mask


def test_roc_auc_perfect_random_and_inverted():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(50, 40, generator=g)
    lab = topk_mask(s, 10)
    assert roc_auc(s, lab) == pytest.approx(1.0)
    assert roc_auc(-s, lab) == pytest.approx(0.0)
    assert abs(roc_auc(torch.randn(50, 40, generator=g), lab) - 0.5) < 0.08


def test_roc_auc_matches_a_brute_force_count():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 30, generator=g)
    lab = torch.rand(3, 30, generator=g) < 0.3
    per_row = []
    for r in range(3):
        pos, neg = s[r][lab[r]], s[r][~lab[r]]
        per_row.append((pos[:, None] > neg[None, :]).double().mean().item())
    assert roc_auc(s, lab) == pytest.approx(sum(per_row) / 3)


def test_greedy_allocation_beats_uniform_at_equal_total_sparsity():
    grid = tuple(round(0.05 * i, 2) for i in range(20))
    # layer 0 is fragile, layer 2 is robust: convex curves with different scales
    curves = {0: [10 * s ** 2 for s in grid], 1: [3 * s ** 2 for s in grid], 2: [0.5 * s ** 2 for s in grid]}
    alloc = allocate(curves, 0.5, grid)
    assert sum(alloc.values()) / 3 == pytest.approx(0.5)
    assert alloc[0] < alloc[1] < alloc[2]
    uniform = {l: 0.5 for l in curves}
    assert total_damage(curves, alloc, grid) < total_damage(curves, uniform, grid)


def test_allocation_rejects_an_impossible_budget():
    with pytest.raises(ValueError, match="budget"):
        allocate({0: [0.0, 1.0]}, 0.99, (0.0, 0.05))
