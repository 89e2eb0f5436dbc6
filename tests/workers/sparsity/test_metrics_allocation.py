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


def test_exchange_moves_budget_to_the_layer_that_costs_nothing(tmp_path, monkeypatch):
    """Two layers, the second's FFN writes nothing (W_down = 0): sparsifying it costs no KL, so the in-context
    exchange moves budget from layer 0 to layer 1 (0.5 + 0.1 + 0.05 + 0.025), keeps the mean, and measures less KL
    than uniform."""
    from tests.workers.tiny_model_support import loaded, tiny_model
    from workers.loading.data import TokenSet
    from workers.sparsity.allocation import exchange_allocation
    from workers.sparsity.predictors.base import FitContext

    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path))
    m = tiny_model("llama")
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.zero_()
    lm = loaded(m, "llama-exchange")
    toks = TokenSet(torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)), "random", "calib",
                    64, 0, "fp-exchange")
    alloc = exchange_allocation(FitContext(lm, None, [0, 1]), toks, 0.5)
    assert alloc == pytest.approx({0: 0.325, 1: 0.675})
    assert sum(alloc.values()) / 2 == pytest.approx(0.5)
    assert exchange_allocation(FitContext(lm, None, [0, 1]), toks, 0.5) == alloc      # cached: same answer
