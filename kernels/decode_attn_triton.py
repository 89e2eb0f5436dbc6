"""One-token decode attention in one Triton kernel (CUDA; CPU through TRITON_INTERPRET=1).

    decode_attention(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None,
                     eps=1e-6, window=None, q_idx=None, q_count=None, n_heads=None, valid=None) -> [B, S * hd]

Same signature and result as ``kernels.reference.decode_attention`` (the torch path the runtime compiles), which
on CUDA is five to seven kernels per layer (RoPE, two cache writes, score GEMM, masked softmax, value GEMM, the
head scatter/gather of the head-sparse path). Here it is one launch over a (batch, slot) grid:

* programs ``j < S`` are query slots: every head (``q_idx`` None) or the compact active heads ``q_idx`` (slots
  past ``q_count`` write zeros and read nothing). Each applies the q/k norms and RoPE to its query and to its KV
  head's new key, attends with an online softmax over the cached positions before ``pos`` (and inside the
  sliding ``window``), and takes position ``pos`` itself from the new key/value in registers;
* programs ``S <= j < S + KV`` write the KV heads' normed, rotated keys and values at ``pos``.

Long caches with few query programs split the cached positions over a third grid axis (flash-decoding): each
split writes its running max, weight sum and unnormalized output to an fp32 workspace and a second launch
combines the splits in a fixed order (``splits_for``: four programs per SM, chunks of at least MIN_CHUNK positions;
``config={"nsplit": n}`` forces n). The result does not depend on timing: the same inputs give the same bits.

No program reads what another writes in the same launch, so there is no race and no ordering to rely on; the
cache holds exactly the bits the query programs used for position ``pos``. Intermediate roundings follow the
reference (norm, then each RoPE product and their sum rounded to the activation dtype; scores rounded to it
before the softmax); the softmax itself is online (running max), so results agree with the reference to
rounding, not bit for bit. Per-(head, position) masks (``valid``, the runtime's kv_mode "active") take the
reference path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as _c
from . import configs as C
from . import reference as _ref
from .common import next_pow2


@triton.jit
def _prep(ptr, w_ptr, d, dr, dm, sign, cos, sin, hd, eps, ROPE: tl.constexpr, NORM: tl.constexpr):
    """Row ``ptr[0:hd]`` normed (x / rms(x) * w, rounded) and rotated (x cos + rot_half(x) sin, each product
    and the sum rounded): fp32 values of the activation dtype."""
    x = tl.load(ptr + d, mask=dm, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hd + eps)
        xf = (xf * rstd * tl.load(w_ptr + d, mask=dm, other=0.0)).to(dt).to(tl.float32)
    if ROPE:
        xr = tl.load(ptr + dr, mask=dm, other=0.0).to(tl.float32)
        if NORM:
            xr = (xr * rstd * tl.load(w_ptr + dr, mask=dm, other=0.0)).to(dt).to(tl.float32)
        a = (xf * cos).to(dt).to(tl.float32)
        b = (sign * xr * sin).to(dt).to(tl.float32)
        xf = (a + b).to(dt).to(tl.float32)
    return xf


@triton.jit
def _decode_attn_kernel(
    q_ptr, sq_b, sq_h, k_ptr, sk_b, sk_h, v_ptr, sv_b, sv_h,
    kc_ptr, vc_ptr, sc_b, sc_h, sc_l,
    pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, qidx_ptr, qcount_ptr, out_ptr, so_b, ws_ptr,
    S, GROUP, hd, eps, window, CHUNK,
    HAS_IDX: tl.constexpr, HAS_COUNT: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
    WINDOW: tl.constexpr, SPLIT: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (B, S + KV, NSPLIT). SPLIT: query program (b, j, sp) covers the cached positions
    [lo + sp * CHUNK, lo + (sp + 1) * CHUNK) and writes its running max, weight sum and unnormalized output to
    ws[b, j, sp] = (acc[0:hd], m, l) for _combine_kernel; split 0 also takes position pos. Else one program per
    slot writes the output itself."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    sp = tl.program_id(2)
    nsp = tl.num_programs(2)
    pos = tl.load(pos_ptr).to(tl.int32)
    d = tl.arange(0, HD_PAD)
    dm = d < hd
    half = hd // 2
    dr = tl.where(d < half, d + half, d - half)        # rot_half's source column
    sign = tl.where(d < half, -1.0, 1.0)
    dt = q_ptr.dtype.element_ty
    cos = tl.zeros([HD_PAD], dtype=tl.float32)
    sin = tl.zeros([HD_PAD], dtype=tl.float32)
    if ROPE:   # the tables' rows at pos, rounded to the activation dtype as the reference does
        cos = tl.load(cos_ptr + pos * hd + d, mask=dm, other=0.0).to(dt).to(tl.float32)
        sin = tl.load(sin_ptr + pos * hd + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    cb = kc_ptr + b * sc_b
    vb = vc_ptr + b * sc_b
    if j >= S:                                          # a writer: KV head g's key and value at pos
        if sp == 0:
            g = j - S
            kx = _prep(k_ptr + b * sk_b + g * sk_h, kn_ptr, d, dr, dm, sign, cos, sin, hd, eps, ROPE, NORM)
            vx = tl.load(v_ptr + b * sv_b + g * sv_h + d, mask=dm, other=0.0)
            tl.store(cb + g * sc_h + pos * sc_l + d, kx.to(dt), mask=dm)
            tl.store(vb + g * sc_h + pos * sc_l + d, vx, mask=dm)
    else:
        active = True
        if HAS_COUNT:
            active = j < tl.load(qcount_ptr).to(tl.int32)
        m = float("-inf")
        l_sum = 0.0
        acc = tl.zeros([HD_PAD], dtype=tl.float32)
        if active:
            head = j
            if HAS_IDX:
                head = tl.load(qidx_ptr + j).to(tl.int32)
            g = head // GROUP
            qx = _prep(q_ptr + b * sq_b + j * sq_h, qn_ptr, d, dr, dm, sign, cos, sin, hd, eps, ROPE, NORM)
            lo = 0
            if WINDOW:
                lo = tl.maximum(pos - window + 1, 0)
            end = pos
            if SPLIT:
                lo = lo + sp * CHUNK
                end = tl.minimum(lo + CHUNK, pos)
            if sp == 0:   # position pos from registers: the running max starts at its score, its weight at 1
                kx = _prep(k_ptr + b * sk_b + g * sk_h, kn_ptr, d, dr, dm, sign, cos, sin, hd, eps, ROPE, NORM)
                m = tl.sum(qx * kx, axis=0).to(dt).to(tl.float32)
                l_sum = m * 0.0 + 1.0
                acc = tl.load(v_ptr + b * sv_b + g * sv_h + d, mask=dm, other=0.0).to(tl.float32)
            kh = cb + g * sc_h
            vh = vb + g * sc_h
            for n0 in range(lo, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                nm = n < end
                off = n[:, None] * sc_l + d[None, :]
                tm = nm[:, None] & dm[None, :]
                kt = tl.load(kh + off, mask=tm, other=0.0).to(tl.float32)
                s = tl.sum(kt * qx[None, :], axis=1).to(dt).to(tl.float32)
                s = tl.where(nm, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))    # finite: n0 < end, so one score is valid
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new)
                vt = tl.load(vh + off, mask=tm, other=0.0).to(tl.float32)
                l_sum = l_sum * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
                m = m_new
        if SPLIT:
            w = ws_ptr + ((b * S + j) * nsp + sp) * (hd + 2)
            tl.store(w + d, acc, mask=dm)
            tl.store(w + hd, m)
            tl.store(w + hd + 1, l_sum)
        else:
            o = tl.where(l_sum > 0, acc / tl.maximum(l_sum, 1e-30), 0.0)   # inactive slots: 0
            tl.store(out_ptr + b * so_b + j * hd + d, o.to(dt), mask=dm)


@triton.jit
def _combine_kernel(ws_ptr, out_ptr, so_b, S, hd, NSPLIT, HD_PAD: tl.constexpr, SP_PAD: tl.constexpr):
    """out[b, j] = sum_sp e^(m_sp - M) acc_sp / sum_sp e^(m_sp - M) l_sp over the splits, in split order
    (M the largest m; a slot with nothing attended, l = 0 everywhere, gets 0)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    d = tl.arange(0, HD_PAD)
    dm = d < hd
    sp = tl.arange(0, SP_PAD)
    spm = sp < NSPLIT
    w = ws_ptr + ((b * S + j) * NSPLIT + sp) * (hd + 2)
    m = tl.load(w + hd, mask=spm, other=float("-inf"))
    lw = tl.load(w + hd + 1, mask=spm, other=0.0)
    acc = tl.load(w[:, None] + d[None, :], mask=spm[:, None] & dm[None, :], other=0.0)
    big = tl.max(m, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)
    e = tl.where(spm & (lw > 0), tl.exp(m - big), 0.0)
    den = tl.sum(e * lw, axis=0)
    o = tl.sum(e[:, None] * acc, axis=0)
    o = tl.where(den > 0, o / tl.maximum(den, 1e-30), 0.0)
    tl.store(out_ptr + b * so_b + j * hd + d, o.to(out_ptr.dtype.element_ty), mask=dm)


NUM_WARPS = 8


def block_n_for(hd: int) -> int:
    """Cached positions per iteration: a [BLOCK_N, hd] fp32 tile of K and of V stays within 64 registers a
    thread at NUM_WARPS = 8 (measured on an H200, hd 128: 128 x 8 warps 1.2-1.5x faster than 64 x 4 or 32 x 4/8)."""
    return max(16, 64 * 32 * NUM_WARPS // next_pow2(hd))


MIN_CHUNK = 128      # cached positions per split at least (one BLOCK_N tile at hd 128)
PROGRAMS_PER_SM = 4


def splits_for(B: int, S: int, L: int, t: torch.Tensor, block_n: int = MIN_CHUNK) -> int:
    """Splits of the cached positions (flash-decoding) for query programs on ``t``'s device: enough programs for
    PROGRAMS_PER_SM per SM, each split a whole number of ``block_n`` tiles and at least MIN_CHUNK positions, and
    none empty. 1 (one launch, no workspace) for short caches and wide batches. Measured on an H200 (Llama-2-7B,
    one token, 1,088 cached positions): 9 splits of 128 positions 13.5 µs per layer, 5 of 256 17.8, 1 split 45."""
    want = max(1, (PROGRAMS_PER_SM * C.sm_count(t)) // max(1, B * S))
    chunk = triton.cdiv(max(MIN_CHUNK, triton.cdiv(L, want)), block_n) * block_n
    return max(1, triton.cdiv(L, chunk)) if L >= 2 * MIN_CHUNK else 1


def decode_attention(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None,
                     eps: float = 1e-6, window: int | None = None, q_idx=None, q_count=None, n_heads=None,
                     valid=None, *, config=None):
    if valid is not None:       # per-(head, position) masks: the torch path
        return _ref.decode_attention(q, k, v, k_cache, v_cache, pos, cos_t, sin_t, q_norm, k_norm, eps, window,
                                     q_idx, q_count, n_heads, valid)
    B, S, hd = q.shape
    KV = k.shape[1]
    H = _c.query_heads(S, q_idx, n_heads)
    assert H % KV == 0, f"{H} query heads do not split into {KV} KV heads"
    assert k.shape == v.shape == (B, KV, hd), f"k/v must be [B, KV, hd], got {tuple(k.shape)}, {tuple(v.shape)}"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "q/k/v rows must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[0] == B and k_cache.shape[1] >= KV and k_cache.shape[3] == hd
    assert k_cache.dtype == q.dtype == k.dtype == v.dtype, "q, k, v and the caches share one dtype"
    assert (q_norm is None) == (k_norm is None), "q and k norms come together"
    if cos_t is not None:
        assert hd % 2 == 0 and cos_t.shape[1] == hd and cos_t.is_contiguous() and sin_t.is_contiguous()
    if q_idx is not None:
        assert q_idx.shape == (S,), f"q_idx must be [S={S}]"
    out = _c.empty((B, S * hd), q.device, q.dtype)
    hd_pad = next_pow2(hd)
    cfg = {"BLOCK_N": block_n_for(hd), "num_warps": NUM_WARPS, **(config or {})}
    L = k_cache.shape[2]
    block_n = cfg["BLOCK_N"]
    nsplit = max(1, int(cfg.get("nsplit") or splits_for(B, S, L, q, block_n)))
    chunk = triton.cdiv(triton.cdiv(L, nsplit), block_n) * block_n
    ws = _c.empty((B, S, nsplit, hd + 2), q.device, torch.float32) if nsplit > 1 else out
    dummy = q
    _decode_attn_kernel[(B, S + KV, nsplit)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        pos, cos_t if cos_t is not None else dummy, sin_t if sin_t is not None else dummy,
        q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        q_idx if q_idx is not None else pos, q_count if q_count is not None else pos, out, out.stride(0), ws,
        S, H // KV, hd, float(eps), int(window or 0), chunk,
        HAS_IDX=q_idx is not None, HAS_COUNT=q_count is not None, ROPE=cos_t is not None,
        NORM=q_norm is not None, WINDOW=window is not None, SPLIT=nsplit > 1, HD_PAD=hd_pad, BLOCK_N=block_n,
        num_warps=cfg["num_warps"],
    )
    if nsplit > 1:
        _combine_kernel[(B, S)](ws, out, out.stride(0), S, hd, nsplit, HD_PAD=hd_pad,
                                SP_PAD=next_pow2(nsplit), num_warps=4)
    return out
