"""Per-token sparse FFN / head-sparse out-projection vs the dense-then-select formula."""
import pytest
import torch

from kernels.token_sparse import reference_token_sparse_ffn, token_sparse_ffn, token_sparse_head_out


def _case(gated, density, T=37, d=24, D=61, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, w_up, w_down_t = r(T, d), r(D, d), r(D, d)
    w_gate = r(D, d) if gated else None
    b_up, b_down = (r(D), r(d)) if bias else (None, None)
    mask = torch.rand(T, D, generator=g) < density
    return x, w_up, w_down_t, mask, w_gate, b_up, b_down


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("gated, act, bias", [(True, "silu", False), (True, "gelu_tanh", False),
                                              (False, "relu", True)])
def test_matches_reference(density, gated, act, bias):
    x, w_up, w_down_t, mask, w_gate, b_up, b_down = _case(gated, density, bias=bias)
    y, n1, n2 = token_sparse_ffn(x, w_up, w_down_t, mask, act, w_gate=w_gate, b_up=b_up, b_down=b_down)
    ref, r1, r2 = reference_token_sparse_ffn(x, w_up, w_down_t, mask, act, w_gate, b_up, b_down)
    assert (n1, n2) == (r1, r2) == (int(mask.sum()), int(mask.sum()))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_sequential_filter_drops_small_activations():
    x, w_up, w_down_t, mask, w_gate, _, _ = _case(True, 0.6)
    thr = 0.3
    y, n1, n2 = token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate=w_gate, filter_threshold=thr)
    ref, r1, r2 = reference_token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate, filter_threshold=thr)
    assert n1 == r1 and n2 == r2 and 0 < n2 < n1
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_selected_entries_only_are_used():
    """Poison every weight row a token did not select: its output must not change."""
    x, w_up, w_down_t, mask, w_gate, _, _ = _case(True, 0.3, T=1)
    y, _, _ = token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate=w_gate)
    off = ~mask[0]
    for w in (w_up, w_down_t, w_gate):
        w[off] = float("nan")
    y2, _, _ = token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate=w_gate)
    assert torch.isfinite(y2).all()
    torch.testing.assert_close(y, y2)


def test_token_sparse_head_out():
    g = torch.Generator().manual_seed(1)
    T, H, hd, d = 11, 6, 5, 20
    attn = torch.randn(T, H * hd, generator=g, dtype=torch.float64)
    w_o = torch.randn(d, H * hd, generator=g, dtype=torch.float64)
    b = torch.randn(d, generator=g, dtype=torch.float64)
    hm = torch.rand(T, H, generator=g) < 0.5
    y = token_sparse_head_out(attn, w_o, hm, hd, b)
    ref = (attn * hm.repeat_interleave(hd, dim=1)) @ w_o.t() + b
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_bad_shapes_are_rejected():
    x, w_up, w_down_t, mask, w_gate, _, _ = _case(True, 0.5)
    with pytest.raises(ValueError, match="mask"):
        token_sparse_ffn(x, w_up, w_down_t, mask[:, :-1], "silu", w_gate=w_gate)
    with pytest.raises(ValueError, match="W_down transposed"):
        token_sparse_ffn(x, w_up, w_down_t[:, :-1], mask, "silu", w_gate=w_gate)


def test_damage_filter_keeps_pairs_by_act_times_up_times_column_weight():
    """The damage filter: gate and up on the selected pairs, then down only where |act(gate)·up|·c_i > f; the
    result written out from its definition, pair by pair."""
    x, w_up, w_down_t, mask, w_gate, _, _ = _case(True, 0.6, T=9, d=7, D=13)
    c = torch.rand(13, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
    h = torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)
    f = float((h.abs() * c)[mask].median())
    want = torch.zeros(9, 7, dtype=torch.float64)
    n_keep = 0
    for t in range(9):
        for i in range(13):
            if mask[t, i] and abs(float(h[t, i])) * float(c[i]) > f:
                want[t] += h[t, i] * w_down_t[i]
                n_keep += 1
    y, n1, n2 = token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate=w_gate, filter_threshold=f, filter_weight=c)
    ref, r1, r2 = reference_token_sparse_ffn(x, w_up, w_down_t, mask, "silu", w_gate, filter_threshold=f,
                                             filter_weight=c)
    assert (n1, n2) == (r1, r2) == (int(mask.sum()), n_keep) and 0 < n_keep < n1
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    # up is read on the selected pairs only, down on the survivors only
    for tok in range(9):
        xs, ms = x[tok: tok + 1], mask[tok: tok + 1]
        keep = ms[0] & (h[tok].abs() * c > f)
        wu, wd = w_up.clone(), w_down_t.clone()
        wu[~ms[0]] = float("nan")
        wd[~keep] = float("nan")
        y1, _, _ = token_sparse_ffn(xs, wu, wd, ms, "silu", w_gate=w_gate, filter_threshold=f, filter_weight=c)
        torch.testing.assert_close(y1, want[tok: tok + 1], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="gated"):
        token_sparse_ffn(x, w_up, w_down_t, mask, "relu", filter_threshold=f, filter_weight=c)
