"""Triton kernels for the contextually sparse FFN (CUDA; CPU through TRITON_INTERPRET=1).

Ops (same signatures as kernels.reference and kernels.npu; index convention in kernels.common):

    gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None) -> h [B, K]
    gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None) -> h [B, K]
    gather_down(h, w_t, idx, count=None, bias=None, group=1) -> y [B, d]         (deterministic)
    sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0) -> (a, idx2, count2)
    compact(keep, idx=None, values=None) -> (idx2, count2[, values2])
    sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None) -> y [B, d]
    sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu") -> y [B, d]

Weights are row-major [N, d]: W_gate, W_up, W_fc1 as stored by nn.Linear; the down projection as
W_down^T (``w_down_t = down_proj.weight.t().contiguous()``), so an active neuron is one contiguous
row of length d. Every reduction has a fixed order (split-K partials to an fp32 workspace, then a
fixed-order reduce; no atomics): the same inputs give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs as C
from ._launch import launch_config, launch_down, launch_reduce, use_dot
from ._tl_common import _accum_rows, _act, _dot_rows, _dot_rows_mma
from . import common as _c
from .common import MAX_BATCH, act_code, check_idx, check_weight, check_x, next_pow2

MAX_D = 16384
COMPACT_MAX = 1 << 20
COMPACT_CHUNK = 8192  # one scan per 8192 entries: its shared memory (~8 B/entry) stays well under 227 KB


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _gather_gemv_kernel(
    x_ptr, stride_xb, w1_ptr, w2_ptr, b1_ptr, s_ptr, stride_sb, idx_ptr, count_ptr,
    out_ptr, stride_ob, keep_ptr, thr,
    K, d, B,
    MODE: tl.constexpr,  # 0: act(W1 x + b1)   1: act(W1 x) * (W2 x)   2: s * (W1 x)
    ACT: tl.constexpr, HAS_COUNT: tl.constexpr, HAS_BIAS: tl.constexpr, FILTER: tl.constexpr,
    B_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_COUNT:
        n = tl.minimum(tl.load(count_ptr).to(tl.int32), K)
    else:
        n = K
    j = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = j < n
    rows = tl.load(idx_ptr + j, mask=rm, other=0).to(tl.int64)
    roff = rows * d
    kend = tl.where(pid * BLOCK_R < n, d, 0)  # programs past count issue no loads
    if USE_DOT:
        a1, a2 = _dot_rows_mma(x_ptr, stride_xb, w1_ptr, w2_ptr, roff, rm, d, kend, B,
                               MODE == 1, BLOCK_R, BLOCK_K, B_PAD, DOT_F32)
    else:
        a1, a2 = _dot_rows(x_ptr, stride_xb, w1_ptr, w2_ptr, roff, rm, d, kend, B,
                           MODE == 1, B_PAD, BLOCK_R, BLOCK_K)
    bs = tl.arange(0, B_PAD)
    if MODE == 0:
        if HAS_BIAS:
            a1 += tl.load(b1_ptr + rows, mask=rm, other=0.0).to(tl.float32)[None, :]
        h = _act(a1, ACT)
    elif MODE == 1:
        h = _act(a1, ACT) * a2
    else:
        sv = tl.load(s_ptr + bs[:, None] * stride_sb + j[None, :],
                     mask=(bs[:, None] < B) & rm[None, :], other=0.0).to(tl.float32)
        h = sv * a1
    h = tl.where(rm[None, :], h, 0.0)
    om = (bs[:, None] < B) & (j[None, :] < K)
    tl.store(out_ptr + bs[:, None] * stride_ob + j[None, :], h.to(out_ptr.dtype.element_ty), mask=om)
    if FILTER:
        big = tl.where((tl.abs(h) > thr) & (bs[:, None] < B), 1, 0)
        keep = (tl.max(big, axis=0) > 0) & rm
        tl.store(keep_ptr + j, keep.to(tl.int8), mask=j < K)


@triton.jit
def _fused_ffn_kernel(
    x_ptr, stride_xb, w1_ptr, w2_ptr, b1_ptr, s_ptr, stride_sb, wd_ptr, idx_ptr, count_ptr, ws_ptr,
    K, d, B,
    MODE: tl.constexpr, ACT: tl.constexpr, HAS_COUNT: tl.constexpr, HAS_BIAS: tl.constexpr,
    B_PAD: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr, EARLY_DOWN: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per split of the active rows: gate/up (or fc1) over whole rows, then the down
    rows accumulated into an fp32 [B_PAD, D_PAD] register accumulator -> ws[pid, b, :].
    EARLY_DOWN issues the W_down^T row loads together with the gate/up loads (they depend only on
    idx), and the next block's indices are loaded one iteration ahead. PDL: let the reduce launch
    (programmatic dependent launch, sm_90+) while this grid runs; the reduce waits for its end."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_COUNT:
        n = tl.minimum(tl.load(count_ptr).to(tl.int32), K)
    else:
        n = K
    nblk = (n + BLOCK_R - 1) // BLOCK_R
    per = ((nblk + nprog - 1) // nprog) * BLOCK_R
    start = pid * per
    end = tl.minimum(start + per, n)
    cols = tl.arange(0, D_PAD)
    cm = cols < d
    bs = tl.arange(0, B_PAD)
    acc = tl.zeros([B_PAD, D_PAD], dtype=tl.float32)
    jn = start + tl.arange(0, BLOCK_R)
    rows_next = tl.load(idx_ptr + jn, mask=jn < end, other=0)
    for r0 in range(start, end, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        rm = j < end
        rows = rows_next.to(tl.int64)
        jn = j + BLOCK_R
        rows_next = tl.load(idx_ptr + jn, mask=jn < end, other=0)
        roff = rows * d
        if EARLY_DOWN:
            wd = tl.load(wd_ptr + roff[:, None] + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                         eviction_policy="evict_first")
        a1, a2 = _dot_rows(x_ptr, stride_xb, w1_ptr, w2_ptr, roff, rm, d, d, B,
                           MODE == 1, B_PAD, BLOCK_R, D_PAD)
        if MODE == 0:
            if HAS_BIAS:
                a1 += tl.load(b1_ptr + rows, mask=rm, other=0.0).to(tl.float32)[None, :]
            h = _act(a1, ACT)
        elif MODE == 1:
            h = _act(a1, ACT) * a2
        else:
            sv = tl.load(s_ptr + bs[:, None] * stride_sb + j[None, :],
                         mask=(bs[:, None] < B) & rm[None, :], other=0.0).to(tl.float32)
            h = sv * a1
        h = tl.where(rm[None, :] & (bs[:, None] < B), h, 0.0)
        if not EARLY_DOWN:
            wd = tl.load(wd_ptr + roff[:, None] + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                         eviction_policy="evict_first")
        acc = _accum_rows(acc, h, wd.to(tl.float32), B_PAD)
    tl.store(ws_ptr + (pid * B + bs[:, None]) * d + cols[None, :], acc,
             mask=(bs[:, None] < B) & cm[None, :])


@triton.jit
def _compact_chunk(keep_ptr, idx_ptr, v_ptr, stride_vb, idx2_ptr, v2_ptr, stride_v2b, j, N, B, tot, base_k, base_d,
                   HAS_IDX: tl.constexpr, HAS_V: tl.constexpr, B_PAD: tl.constexpr):
    m = j < N
    k = tl.load(keep_ptr + j, mask=m, other=0).to(tl.int32)
    k = tl.where(k != 0, 1, 0)
    nk = tl.where(m, 1 - k, 0)
    pos = tl.where(k > 0, base_k + tl.cumsum(k, axis=0) - k, tot + base_d + tl.cumsum(nk, axis=0) - nk)
    kept = k > 0
    if HAS_IDX:
        src = tl.load(idx_ptr + j, mask=m & kept, other=0)
    else:
        src = j
    tl.store(idx2_ptr + pos, tl.where(kept, src, 0).to(idx2_ptr.dtype.element_ty), mask=m)
    if HAS_V:
        for b in tl.static_range(B_PAD):
            bm = (j * 0 + b) < B
            v = tl.load(v_ptr + b * stride_vb + j, mask=m & kept & bm, other=0.0)
            tl.store(v2_ptr + b * stride_v2b + pos, tl.where(kept, v, 0.0).to(v2_ptr.dtype.element_ty),
                     mask=m & bm)
    return tl.sum(k, axis=0), tl.sum(nk, axis=0)


@triton.jit
def _compact_kernel(keep_ptr, idx_ptr, v_ptr, stride_vb, idx2_ptr, v2_ptr, stride_v2b, count2_ptr,
                    N, B, HAS_IDX: tl.constexpr, HAS_V: tl.constexpr,
                    B_PAD: tl.constexpr, N_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Stable device-side compaction (one program): kept positions first in their original order, then
    the dropped ones; dropped slots get idx 0 and value 0; count2 = number kept. One scan when
    N_PAD <= CHUNK, else a counting pass and a scan pass over CHUNK-sized pieces (shared memory)."""
    if N_PAD <= CHUNK:
        j = tl.arange(0, N_PAD)
        k = tl.load(keep_ptr + j, mask=j < N, other=0).to(tl.int32)
        tot = tl.sum(tl.where(k != 0, 1, 0), axis=0)
        _compact_chunk(keep_ptr, idx_ptr, v_ptr, stride_vb, idx2_ptr, v2_ptr, stride_v2b, j, N, B, tot, 0, 0,
                       HAS_IDX, HAS_V, B_PAD)
    else:
        tot = tl.full([], 0, tl.int32)
        for c0 in range(0, N, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            k = tl.load(keep_ptr + j, mask=j < N, other=0).to(tl.int32)
            tot += tl.sum(tl.where(k != 0, 1, 0), axis=0)
        base_k = tl.full([], 0, tl.int32)
        base_d = tl.full([], 0, tl.int32)
        for c0 in range(0, N, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            nk_, nd_ = _compact_chunk(keep_ptr, idx_ptr, v_ptr, stride_vb, idx2_ptr, v2_ptr, stride_v2b, j, N, B,
                                      tot, base_k, base_d, HAS_IDX, HAS_V, B_PAD)
            base_k += nk_
            base_d += nd_
    jj = tl.arange(0, 2)
    tl.store(count2_ptr + jj * 0, (jj * 0 + tot).to(count2_ptr.dtype.element_ty), mask=jj == 0)


# ------------------------------------------------------------------------------------------------
# launch helpers
# ------------------------------------------------------------------------------------------------
def _launch_gather(x, w1, w2, b1, scale, idx, count, out, keep, thr, mode, act, config=None):
    B, d = x.shape
    K = idx.shape[0]
    bp = C.b_pad(B)
    cfg = launch_config("gather", bp, config, x.device)
    block_k = cfg["BLOCK_K"] or next_pow2(d)
    block_k = min(block_k, next_pow2(d))
    block_r = cfg["BLOCK_R"]
    dot = use_dot(cfg, x)
    if dot:
        bp = 16
        assert block_r >= 16 and block_k >= 16, "the tl.dot path needs BLOCK_R, BLOCK_K >= 16"
    if K == 0:
        return out
    grid = (triton.cdiv(K, block_r),)
    _gather_gemv_kernel[grid](
        x, x.stride(0), w1, w2 if w2 is not None else w1, b1 if b1 is not None else w1,
        scale if scale is not None else x, scale.stride(0) if scale is not None else 0,
        idx, count if count is not None else idx,
        out, out.stride(0), keep if keep is not None else idx, float(thr),
        K, d, B,
        MODE=mode, ACT=act_code(act), HAS_COUNT=count is not None, HAS_BIAS=b1 is not None,
        FILTER=keep is not None, B_PAD=bp, BLOCK_R=block_r, BLOCK_K=block_k, USE_DOT=dot,
        DOT_F32=dot and x.device.type == "cpu", num_warps=cfg["num_warps"],
    )
    return out


def _pdl(cfg, t) -> bool:
    """Programmatic dependent launch for the reduce: asked for by the config (``pdl``), on CUDA sm_90+ only."""
    return bool(cfg.get("pdl")) and t.device.type == "cuda" and torch.cuda.get_device_capability(t.device)[0] >= 9


def _launch_fused(x, w1, w2, b1, scale, w_t, idx, count, bias2, mode, act, config=None):
    B, d = x.shape
    K = idx.shape[0]
    bp = C.b_pad(B)
    cfg = launch_config("fused", bp, config, x.device)
    block_r = cfg["BLOCK_R"]
    nsplit = cfg.get("nsplit") or cfg["progs_per_sm"] * C.sm_count(x)
    nsplit = max(1, min(nsplit, triton.cdiv(K, block_r)))
    ws = _c.empty((nsplit, B, d), x.device, torch.float32)
    pdl = _pdl(cfg, x)
    _fused_ffn_kernel[(nsplit,)](
        x, x.stride(0), w1, w2 if w2 is not None else w1, b1 if b1 is not None else w1,
        scale if scale is not None else x, scale.stride(0) if scale is not None else 0,
        w_t, idx, count if count is not None else idx, ws, K, d, B,
        MODE=mode, ACT=act_code(act), HAS_COUNT=count is not None, HAS_BIAS=b1 is not None,
        B_PAD=bp, BLOCK_R=block_r, D_PAD=next_pow2(d), EARLY_DOWN=cfg.get("early_down", True), PDL=pdl,
        num_warps=cfg["num_warps"],
    )
    y = _c.empty((B, d), x.device, x.dtype)
    return launch_reduce(ws, nsplit, bias2, y, cfg.get("reduce_block"), pdl)


# ------------------------------------------------------------------------------------------------
# public ops
# ------------------------------------------------------------------------------------------------
def gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None, *, config=None):
    """h[b, j] = act(W_gate[idx[j]] . x[b]) * (W_up[idx[j]] . x[b]) for j < count, 0 after."""
    d = w_gate.shape[1]
    check_x(x, d)
    assert x.is_contiguous()
    check_weight(w_gate, "w_gate", d, x.dtype, x.device)
    check_weight(w_up, "w_up", d, x.dtype, x.device)
    assert w_up.shape == w_gate.shape
    check_idx(idx, count, x.device)
    assert d <= MAX_D
    out = _c.empty((x.shape[0], idx.shape[0]), x.device, out_dtype or x.dtype)
    return _launch_gather(x, w_gate, w_up, None, None, idx, count, out, None, 0.0, 1, act, config)


def gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None, *, config=None):
    """h[b, j] = act(W[idx[j]] . x[b] + bias[idx[j]]) for j < count (0 after). With ``scale``
    ([B, K], e.g. the gate activations of the sequential path), h = scale * (W[idx[j]] . x[b])
    (act and bias must then be unset)."""
    d = w.shape[1]
    check_x(x, d)
    assert x.is_contiguous()
    check_weight(w, "w", d, x.dtype, x.device)
    check_idx(idx, count, x.device)
    assert d <= MAX_D
    B, K = x.shape[0], idx.shape[0]
    if bias is not None:
        assert bias.shape == (w.shape[0],) and bias.device == x.device and bias.is_contiguous()
    if scale is not None:
        assert act == "none" and bias is None, "scale excludes act/bias"
        assert scale.shape == (B, K) and scale.device == x.device and scale.stride(1) == 1
    out = _c.empty((B, K), x.device, out_dtype or x.dtype)
    mode = 2 if scale is not None else 0
    return _launch_gather(x, w, None, bias, scale, idx, count, out, None, 0.0, mode, act, config)


def gather_down(h, w_t, idx, count=None, bias=None, group=1, *, out_dtype=None, config=None):
    """y[b] = sum_{j < count*group} h[b, j] * W^T[idx[j // group] * group + j % group] (+ bias).

    ``w_t`` is [N, d] (the transposed down/out weight, contiguous). ``h`` is [B, K * group].
    Deterministic: fixed split-K partials in fp32, then a fixed-order reduce (no atomics)."""
    d = w_t.shape[1]
    assert h.dim() == 2 and 1 <= h.shape[0] <= MAX_BATCH
    assert h.shape[1] == idx.shape[0] * group, f"h has {h.shape[1]} columns, idx*group = {idx.shape[0] * group}"
    assert h.stride(1) == 1
    check_weight(w_t, "w_t", d, w_t.dtype, h.device)
    assert h.dtype in (torch.float16, torch.bfloat16, torch.float32)
    check_idx(idx, count, h.device)
    if bias is not None:
        assert bias.shape == (d,) and bias.device == h.device
    return launch_down(h, w_t, idx, count, bias, group, out_dtype or w_t.dtype, config)


def compact(keep, idx=None, values=None):
    """Stable compaction of a [N] bool/int8 mask (device-side, one launch, no sync).

    Returns (idx2 [N] int32, count2 [1] int32) or, with ``values`` [B, N], also values2 [B, N] (fp32):
    kept entries first in their original order (``idx[j]`` if idx is given, else ``j``), then 0s."""
    assert keep.dim() == 1 and keep.shape[0] <= COMPACT_MAX
    N = keep.shape[0]
    if keep.dtype == torch.bool:
        keep = keep.view(torch.int8)
    dev = keep.device
    idx2 = _c.empty(N, dev, torch.int32)
    count2 = _c.empty(1, dev, torch.int32)
    B = 1
    v2 = None
    if values is not None:
        assert values.dim() == 2 and values.shape[1] == N and values.stride(1) == 1
        B = values.shape[0]
        v2 = _c.empty((B, N), dev, torch.float32)
    n_pad = next_pow2(N)
    _compact_kernel[(1,)](
        keep, idx if idx is not None else keep, values if values is not None else idx2,
        values.stride(0) if values is not None else 0,
        idx2, v2 if v2 is not None else idx2, v2.stride(0) if v2 is not None else 0, count2,
        N, B, HAS_IDX=idx is not None, HAS_V=values is not None, B_PAD=next_pow2(B), N_PAD=n_pad,
        CHUNK=COMPACT_CHUNK if keep.device.type != "cpu" else 256,
        num_warps=max(4, min(32, min(n_pad, COMPACT_CHUNK) // 512)),
    )
    if values is not None:
        return idx2, count2, v2
    return idx2, count2


def union_active(mask):
    """Union over the batch of per-token active masks [B, D] (bool) -> (idx [D] int32, count [1])."""
    assert mask.dim() == 2
    return compact(mask.any(dim=0))


def sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0, *, config=None):
    """Gate on the predicted rows, drop rows whose |act(gate)| <= threshold for every token.

    Returns (a [B, K] fp32: act(gate) of the kept rows compacted in idx order, then zeros;
             idx2 [K] int32: kept row ids then zeros; count2 [1] int32). Two launches, no sync."""
    d = w_gate.shape[1]
    check_x(x, d)
    assert x.is_contiguous()
    check_weight(w_gate, "w_gate", d, x.dtype, x.device)
    check_idx(idx, count, x.device)
    B, K = x.shape[0], idx.shape[0]
    assert K <= COMPACT_MAX
    a = _c.empty((B, K), x.device, torch.float32)
    keep = _c.empty(K, x.device, torch.int8)
    _launch_gather(x, w_gate, None, None, None, idx, count, a, keep, threshold, 0, act, config)
    idx2, count2, a2 = compact(keep, idx, a)
    return a2, idx2, count2


def _check_ffn(x, w_gate, w_up, w_down_t, idx, count):
    d = w_gate.shape[1]
    check_x(x, d)
    assert x.is_contiguous()
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        if w is not None:
            check_weight(w, name, d, x.dtype, x.device)
    if w_up is not None:
        assert w_up.shape == w_gate.shape
    assert w_down_t.shape == w_gate.shape, "w_down_t must be [D, d] (down_proj.weight.t().contiguous())"
    check_idx(idx, count, x.device)
    assert d <= MAX_D


def sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None, *,
               path=None, config=None):
    """Gated FFN over the active rows: y = W_down[:, I] (act(W_gate[I] x) * W_up[I] x).

    threshold None: parallel pipeline (gate, up, down all on idx). A float: sequential pipeline
    (gate on idx, drop rows with |act(gate)| <= threshold, up and down on the survivors)."""
    _check_ffn(x, w_gate, w_up, w_down_t, idx, count)
    B, d = x.shape
    path = path or C.ffn_path(B, d)
    cfg = config or {}
    if threshold is not None:
        a2, idx2, count2 = sequential_gate_filter(x, w_gate, idx, count, act, threshold, config=cfg.get("gather"))
        if path == "fused":
            return _launch_fused(x, w_up, None, None, a2, w_down_t, idx2, count2, None, 2, "none", cfg.get("fused"))
        h = gather_gemv(x, w_up, idx2, count2, scale=a2, out_dtype=torch.float32, config=cfg.get("gather"))
        return gather_down(h, w_down_t, idx2, count2, out_dtype=x.dtype, config=cfg.get("down"))
    if path == "fused":
        return _launch_fused(x, w_gate, w_up, None, None, w_down_t, idx, count, None, 1, act, cfg.get("fused"))
    h = gated_gather_gemv(x, w_gate, w_up, idx, count, act, out_dtype=torch.float32, config=cfg.get("gather"))
    return gather_down(h, w_down_t, idx, count, out_dtype=x.dtype, config=cfg.get("down"))


def sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu", *, path=None, config=None):
    """Non-gated (OPT-style) MLP over the active rows: y = W_fc2[:, I] act(W_fc1[I] x + b_fc1[I]) + b_fc2."""
    _check_ffn(x, w_fc1, None, w_fc2_t, idx, count)
    B, d = x.shape
    cfg = config or {}
    if B == 1 and path is None and config is None and x.device.type != "cpu":
        path, cfg = C.MLP_B1["path"], C.MLP_B1
    path = path or C.ffn_path(B, d)
    if path == "fused":
        return _launch_fused(x, w_fc1, None, b_fc1, None, w_fc2_t, idx, count, b_fc2, 0, act, cfg.get("fused"))
    h = gather_gemv(x, w_fc1, idx, count, act=act, bias=b_fc1, out_dtype=torch.float32, config=cfg.get("gather"))
    return gather_down(h, w_fc2_t, idx, count, bias=b_fc2, out_dtype=x.dtype, config=cfg.get("down"))
