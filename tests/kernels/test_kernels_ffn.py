"""Triton FFN kernels vs the torch reference (fp64 ground truth), odd shapes, s in {0, .5, .9, 1}."""
import pytest
import torch

from kernels import ffn_triton as T
from kernels import reference as R
from tests.kernels.kernel_support import (D_FF, D_MODEL, ffn_weights, gpu_meaning_only, grid, make_idx, rel_err,
                                          rnd, TOL, up)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPARS = [0.0, 0.5, 0.9, 1.0]
F32, F16, BF16 = DTYPES


def _check(out, ref, dtype, what=""):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what} rel err {err:.3g} > {TOL[dtype]}"


# in the interpreter (tests/kernels/kernel_support.py): every dtype with each index form (fixed, padded + count)
# and each batch padding, every sparsity (0: all rows; 1: none) at least once
@grid("dtype,s,batch,mode", [DTYPES, SPARS, [1, 3], ["fixed", "padded"]], cover=["dtype*mode", "dtype*batch", "s"])
def test_gated_gather_gemv(dtype, s, batch, mode, device, gen, poison):
    wg, wu, _ = ffn_weights(gen, dtype, device)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, mode, device)
    out = T.gated_gather_gemv(x, wg, wu, idx, count, "silu")
    ref = R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, "silu")
    assert out.shape == (batch, idx.shape[0]) and out.dtype == dtype
    _check(out, ref, dtype)
    if count is not None:
        assert (out[:, int(count):] == 0).all()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu", "none"])
def test_gated_activations(act, device, gen, poison):
    dtype = torch.float32
    wg, wu, _ = ffn_weights(gen, dtype, device)
    x = rnd((2, D_MODEL), gen, dtype, device, 3.0)  # wide range: both tails of the activation
    idx, count = make_idx(gen, D_FF, 0.5, "padded", device, torch.int64)
    out = T.gated_gather_gemv(x, wg, wu, idx, count, act)
    ref = R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, act)
    _check(out, ref, dtype, act)


@grid("dtype,s,batch", [DTYPES, [0.0, 0.9], [1, 5]], cover=["dtype", "s", "batch"])
def test_gather_gemv_bias_and_scale(dtype, s, batch, device, gen, poison):
    w, _, _ = ffn_weights(gen, dtype, device)
    b = rnd((D_FF,), gen, dtype, device)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, "padded", device)
    out = T.gather_gemv(x, w, idx, count, act="relu", bias=b)
    ref = R.gather_gemv(up(x), up(w), idx, count, act="relu", bias=up(b))
    _check(out, ref, dtype, "bias")
    sc = rnd((batch, idx.shape[0]), gen, torch.float32, device)
    out = T.gather_gemv(x, w, idx, count, scale=sc, out_dtype=torch.float32)
    ref = R.gather_gemv(up(x), up(w), idx, count, scale=up(sc))
    _check(out, ref, dtype, "scale")


@grid("dtype,s,batch,mode", [DTYPES, SPARS, [1, 3, 8], ["fixed", "padded"]], cover=["dtype*mode", "s", "batch"])
def test_gather_down(dtype, s, batch, mode, device, gen, poison):
    _, _, wdt = ffn_weights(gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, mode, device)
    h = rnd((batch, idx.shape[0]), gen, dtype, device)
    bias = rnd((D_MODEL,), gen, dtype, device) if batch == 3 else None
    out = T.gather_down(h, wdt, idx, count, bias=bias)
    ref = R.gather_down(up(h), up(wdt), idx, count, bias=up(bias))
    assert out.shape == (batch, D_MODEL) and out.dtype == dtype
    _check(out, ref, dtype)


@gpu_meaning_only     # the order of a GPU's split reductions; the interpreter runs programs one at a time
def test_gather_down_bit_identical(device, gen, poison):
    dtype = torch.float16
    _, _, wdt = ffn_weights(gen, dtype, device)
    idx, count = make_idx(gen, D_FF, 0.5, "padded", device)
    h = rnd((2, idx.shape[0]), gen, dtype, device)
    first = T.gather_down(h, wdt, idx, count)
    for _ in range(5):
        assert torch.equal(T.gather_down(h, wdt, idx, count).view(torch.int16), first.view(torch.int16))


# every dtype on each launch path (fused: one kernel + reduce; split: gather, down, reduce), each path with each
# index form, every sparsity and batch at least once
@grid("dtype,s,batch,mode,path", [DTYPES, SPARS, [1, 6], ["fixed", "padded"], ["fused", "split"]],
      cover=["dtype*path", "mode*path", "s", "batch"])
def test_sparse_ffn_parallel(dtype, s, batch, mode, path, device, gen, poison):
    wg, wu, wdt = ffn_weights(gen, dtype, device)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, mode, device)
    out = T.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", path=path)
    ref = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu")
    assert out.shape == (batch, D_MODEL) and out.dtype == dtype
    _check(out, ref, dtype, path)


def _gap_threshold(x, wg, idx, count, act):
    """A threshold in the middle of a wide gap of max_b |act(gate)| near its median, so that the
    keep decision cannot flip between fp16/bf16 and fp64 arithmetic."""
    a = R.gather_gemv(up(x), up(wg), idx, count, act=act).abs().max(dim=0).values
    k = int(count) if count is not None else idx.shape[0]
    v = torch.sort(a[:k]).values
    if k < 4:
        return 0.5 * float(v.max()) if k else 0.0
    gaps = v[1:] - v[:-1]
    lo, hi = k // 4, 3 * k // 4
    i = lo + int(torch.argmax(gaps[lo:hi]))
    return float(0.5 * (v[i] + v[i + 1]))


@grid("dtype,s,batch,path", [DTYPES, [0.0, 0.5, 0.9], [1, 3], ["fused", "split"]], cover=["dtype*path", "s", "batch"])
def test_sparse_ffn_sequential(dtype, s, batch, path, device, gen, poison):
    wg, wu, wdt = ffn_weights(gen, dtype, device)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, "padded", device)
    thr = _gap_threshold(x, wg, idx, count, "silu")
    a2, idx2, count2 = T.sequential_gate_filter(x, wg, idx, count, "silu", thr)
    ra2, ridx2, rcount2 = R.sequential_gate_filter(up(x), up(wg), idx, count, "silu", thr)
    assert torch.equal(count2.cpu(), rcount2.cpu())
    assert torch.equal(idx2.cpu(), ridx2.cpu())
    _check(a2, ra2, dtype, "gate")
    out = T.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", threshold=thr, path=path)
    ref = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu", threshold=thr)
    _check(out, ref, dtype, path)


@grid("dtype,s,batch,path", [DTYPES, SPARS, [1, 4], ["fused", "split"]], cover=["dtype*path", "s", "batch"])
def test_sparse_mlp_relu(dtype, s, batch, path, device, gen, poison):
    w1, _, w2t = ffn_weights(gen, dtype, device)
    b1 = rnd((D_FF,), gen, dtype, device, 0.5)
    b2 = rnd((D_MODEL,), gen, dtype, device, 0.5)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, "padded", device)
    out = T.sparse_mlp(x, w1, b1, w2t, b2, idx, count, "relu", path=path)
    ref = R.sparse_mlp(up(x), up(w1), up(b1), up(w2t), up(b2), idx, count, "relu")
    _check(out, ref, dtype, path)


@pytest.mark.parametrize("n", [1, 200, 1000, 20000])      # 2 s in all in the interpreter
def test_compact_and_union(n, device, gen, poison):
    keep = (torch.rand(n, generator=gen) < 0.4).to(device)
    idx = torch.randperm(n, generator=gen).to(torch.int32).to(device)
    vals = torch.randn(3, n, generator=gen).to(device)
    i2, c2, v2 = T.compact(keep, idx, vals)
    ri2, rc2, rv2 = R.compact(keep, idx, vals)
    assert torch.equal(i2.cpu(), ri2.cpu()) and torch.equal(c2.cpu(), rc2.cpu())
    assert torch.equal(v2.cpu(), rv2.cpu())
    mask = torch.rand(3, n, generator=gen).to(device) < 0.2
    u, uc = T.union_active(mask)
    ru, ruc = R.union_active(mask)
    assert torch.equal(u.cpu(), ru.cpu()) and torch.equal(uc.cpu(), ruc.cpu())


DOT_CFG = {"gather": {"dot": True, "BLOCK_R": 16, "BLOCK_K": 32},
           "down": {"dot": True, "BLOCK_R": 16, "BLOCK_D": 32}}


@grid("dtype,s,batch", [[F16, BF16], [0.0, 0.9], [1, 5]], cover=["dtype", "s", "batch"])
def test_tensor_core_dot_path(dtype, s, batch, device, gen, poison):
    """tl.dot variants of the gather GEMV and the down projection (batch padded to 16; h rounded to the dtype)."""
    wg, wu, wdt = ffn_weights(gen, dtype, device)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, s, "padded", device)
    out = T.gated_gather_gemv(x, wg, wu, idx, count, "silu", config=DOT_CFG["gather"])
    _check(out, R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, "silu"), dtype, "gather")
    h = rnd((batch, idx.shape[0]), gen, dtype, device)
    out = T.gather_down(h, wdt, idx, count, config=DOT_CFG["down"])
    _check(out, R.gather_down(up(h), up(wdt), idx, count), dtype, "down")
    out = T.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", path="split", config=DOT_CFG)
    _check(out, R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu"), dtype, "ffn")
    thr = _gap_threshold(x, wg, idx, count, "silu")
    out = T.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", threshold=thr, path="split", config=DOT_CFG)
    _check(out, R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu", threshold=thr), dtype, "seq")
    b1, b2 = rnd((D_FF,), gen, dtype, device), rnd((D_MODEL,), gen, dtype, device)
    out = T.sparse_mlp(x, wg, b1, wdt, b2, idx, count, "relu", path="split", config=DOT_CFG)
    _check(out, R.sparse_mlp(up(x), up(wg), up(b1), up(wdt), up(b2), idx, count, "relu"), dtype, "mlp")


@pytest.mark.parametrize("early", [False, True])
def test_fused_early_down_variants(early, device, gen, poison):
    dtype = torch.float16
    wg, wu, wdt = ffn_weights(gen, dtype, device)
    x = rnd((1, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, 0.5, "padded", device)
    cfg = {"fused": {"early_down": early, "BLOCK_R": 8, "nsplit": 5, "reduce_block": 32}}
    out = T.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", path="fused", config=cfg)
    _check(out, R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu"), dtype, "fused")


@pytest.mark.parametrize("backend", ["triton", "cpu", "reference"])
def test_damage_filter_ffn(backend, device, gen, poison, monkeypatch):
    """ops.damage_filter_ffn on each backend: gate and up on idx, then down on the rows whose
    |act(gate)·up|·c_i exceeds f for some token of the batch, written out from that definition in fp64."""
    from kernels import ops

    if backend == "cpu" and device != "cpu":
        pytest.skip("the CPU row kernels take CPU tensors")      # on a GPU host the triton case runs instead
    monkeypatch.setenv("CTXSPARSE_KERNELS", backend)
    dtype = torch.float32
    wg, wu, wdt = ffn_weights(gen, dtype, device)
    x = rnd((3, D_MODEL), gen, dtype, device)
    idx, count = make_idx(gen, D_FF, 0.5, "padded", device)
    c = (torch.rand(D_FF, generator=gen) + 0.5).to(device)
    n = int(count)
    rows = idx[:n].long().cpu()
    h = (torch.nn.functional.silu(up(x) @ up(wg).T) * (up(x) @ up(wu).T)).cpu()[:, rows]
    dmg = h.abs() * c.double().cpu()[rows]
    v = dmg.max(0).values.sort().values                  # f in the widest gap of the middle half: no row sits
    lo, hi = v.numel() // 4, 3 * v.numel() // 4          # within rounding of it (fp32 kernels, fp64 reference)
    i = lo + int(torch.argmax(v[lo + 1: hi] - v[lo: hi - 1]))
    f = float(0.5 * (v[i] + v[i + 1]))
    keep = (dmg > f).any(0)
    want = (h[:, keep] @ up(wdt).cpu()[rows[keep]]).to(dtype)
    assert 0 < int(keep.sum()) < n
    out = ops.damage_filter_ffn(x, wg, wu, wdt, idx, count, "silu", f, c)
    _check(out.cpu(), want, dtype, backend)
