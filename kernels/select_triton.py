"""Device-side top-k selection for the predictor's scores (CUDA; CPU through TRITON_INTERPRET=1).

    topk_select(scores, k) -> idx [B, k] int32, ascending per row
    topk_threshold(x, k, nseg) -> t [B, nseg] fp32: |x_j| > t keeps each row's k largest |x_j|

The k largest scores of each row, as indices in ascending order (a fixed-size buffer: k is static per layer, so
the op is CUDA-graph capturable). Ties at the k-th value go to the lowest indices, so the result is
deterministic and equal to ``kernels.reference.topk_select`` (stable descending sort, first k, sorted);
without ties the set is exactly ``torch.topk``'s. -0.0 counts as +0.0; NaN is not supported.

Two implementations, the same result:

One CTA per row (n < MULTI_MIN_N, fp32 scores) holds the whole row in registers (n up to MAX_N):
  1. key: the score's bits made order-preserving (fp16/bf16: 16 bits, fp32: 32 bits), lanes past n = -1;
  2. the k-th largest key T by a radix search from the top bit: BITS bits per step, one packed reduction
     per step (counts of key >= candidate for the 2^BITS - 1 candidates in one int64 sum);
  3. one packed scan (keys > T, keys == T): position of each chosen entry = (# > T before it)
     + min(# == T before it, k - # > T); store the index there.

Multi-CTA (16-bit scores, n >= MULTI_MIN_N; the decode default for FFN predictors): chunks of MULTI_CHUNK
entries, one program each, three launches: (1) a 256-bin histogram of the keys' high bytes (integer atomics,
so exact whatever the order); (2) every program finds the bin b* of the k-th largest key, counts its chunk's
low bytes inside b* (atomically into a second histogram) and keeps its own counts; (3) every program finds T,
sums the counts of the chunks before it and writes its chunk's chosen indices at their final positions (the
same rule as step 3 above, offset by the earlier chunks).

Measured (H200, fp16 scores, CUDA graph, µs per call; benchmarks/results/h200_select_multi_2026-12-02.json):
n = 11,008 / 14,336 / 18,944, any k: multi-CTA 15.7–16.3; one CTA 30.1 / 30.1 / 65.8; torch.topk 40–62; n = 32
heads: 2.5. The one-CTA kernel is issue-bound (4 warps 58 µs, 8 warps 32, 16 warps 30 at n = 11,008) and at
16 warps fills an SM's register file; beside the decode step's GEMVs that made the look-ahead side stream the
critical path on Qwen2-7B (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2

MAX_N = 1 << 16
# num_warps by the padded row length (H200: 16 warps best at n = 11008, 4 at n = 32)
NUM_WARPS = ((1024, 4), (4096, 8), (MAX_N, 16))
BITS = 2
# the multi-CTA select: chunk of entries per program, warps per program, and the row length from which it is used
MULTI_CHUNK = 1024
MULTI_WARPS = 4
MULTI_MIN_N = 4096


@triton.jit
def _kth_key(key, k, KEY_BITS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The k-th largest of the non-negative keys [BLOCK] (padding -1): the largest T with #(key >= T) >= k,
    BITS bits at a time from the top, one packed reduction per step."""
    T = tl.zeros([], dtype=key.dtype)
    NC: tl.constexpr = (1 << BITS) - 1
    for step in tl.static_range(KEY_BITS // BITS):
        sh = KEY_BITS - BITS * (step + 1)
        packed = tl.zeros([BLOCK], dtype=tl.int64)
        for c in tl.static_range(1, NC + 1):
            cand = T | (tl.full([], c, key.dtype) << sh)
            packed += tl.where(key >= cand, 1, 0).to(tl.int64) << (21 * (c - 1))
        tot = tl.sum(packed, axis=0)
        best = tl.zeros([], dtype=key.dtype)
        for c in tl.static_range(1, NC + 1):
            cnt = (tot >> (21 * (c - 1))) & 0x1FFFFF
            best = tl.where(cnt >= k, c, best)                          # counts fall with c: the last hit wins
        T = T | (best << sh)
    return T


@triton.jit
def _topk_select_kernel(s_ptr, stride_s, out_ptr, stride_o, n, k,
                        KEY_BITS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    m = j < n
    v = tl.load(s_ptr + row * stride_s + j, mask=m, other=0.0)
    if KEY_BITS == 16:
        s = v.to(tl.int16, bitcast=True).to(tl.int32)                 # sign-extended bits
        s = tl.where(s == -32768, 0, s)                                 # -0.0 -> +0.0
        key = (s ^ ((s >> 15) & 0x7FFF)) + 32768                        # order-preserving, in [0, 2^16)
    else:
        s = v.to(tl.int32, bitcast=True)
        s = tl.where(s == -2147483648, 0, s)
        key = (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.int64) + tl.full([], 1 << 31, tl.int64)   # in [0, 2^32)
    key = tl.where(m, key, -1)
    T = _kth_key(key, k, KEY_BITS, BITS, BLOCK)
    gt = key > T
    eq = key == T
    if BLOCK <= 32768:
        pk = tl.where(gt, 1 << 16, 0) + tl.where(eq, 1, 0)
        incl = tl.cumsum(pk, axis=0)
        ex = incl - pk
        n_gt = tl.sum(tl.where(gt, 1, 0), axis=0)
        ex_gt, ex_eq = ex >> 16, ex & 0xFFFF
    else:
        pk = tl.where(gt, 1 << 32, 0).to(tl.int64) + tl.where(eq, 1, 0).to(tl.int64)
        incl = tl.cumsum(pk, axis=0)
        ex = incl - pk
        n_gt = tl.sum(tl.where(gt, 1, 0), axis=0)
        ex_gt, ex_eq = (ex >> 32).to(tl.int32), (ex & 0xFFFFFFFF).to(tl.int32)
    need = k - n_gt
    sel = gt | (eq & (ex_eq < need))
    pos = ex_gt + tl.minimum(ex_eq, need)
    tl.store(out_ptr + row * stride_o + pos, j.to(tl.int32), mask=sel)


@triton.jit
def _key16(s_ptr, row, stride_s, n, c, CHUNK: tl.constexpr):
    """Chunk ``c`` of a row: indices, in-range mask, and the order-preserving 16-bit keys (hi byte, lo byte);
    lanes past n get hi = 256 (outside the 256 bins counted)."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    m = j < n
    v = tl.load(s_ptr + row * stride_s + j, mask=m, other=0.0)
    s = v.to(tl.int16, bitcast=True).to(tl.int32)
    s = tl.where(s == -32768, 0, s)
    key = (s ^ ((s >> 15) & 0x7FFF)) + 32768
    return j, m, key, tl.where(m, key >> 8, 256), key & 0xFF


@triton.jit
def _bin_of_kth(h_ptr, k):
    """From a 256-bin count [b] (global, complete): the bin b* holding the k-th largest key and the count of
    keys in bins above it."""
    b = tl.arange(0, 256)
    h = tl.load(h_ptr + b)
    ge = tl.sum(h, axis=0) - (tl.cumsum(h, axis=0) - h)                # #(bin >= b), non-increasing
    bstar = tl.sum(tl.where(ge >= k, 1, 0), axis=0) - 1
    above = tl.sum(tl.where(b > bstar, h, 0), axis=0)
    return bstar, above


@triton.jit
def _multi_hist_hi_kernel(s_ptr, stride_s, hist_ptr, n, CHUNK: tl.constexpr):
    c, row = tl.program_id(0), tl.program_id(1)
    j, m, key, hi, lo = _key16(s_ptr, row, stride_s, n, c, CHUNK)
    h = tl.histogram(hi, 512)
    b = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + row * 512 + b, h, mask=b < 256)


@triton.jit
def _multi_hist_lo_kernel(s_ptr, stride_s, hist_ptr, part_ptr, n, k, P_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c, row = tl.program_id(0), tl.program_id(1)
    bstar, above = _bin_of_kth(hist_ptr + row * 512, k)
    j, m, key, hi, lo = _key16(s_ptr, row, stride_s, n, c, CHUNK)
    h = tl.histogram(tl.where(hi == bstar, lo, 256), 512)              # lo bytes of the keys in bin b*
    b = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + row * 512 + 256 + b, h, mask=b < 256)
    # this chunk's own counts for the output offsets: lo histogram of bin b*, and in slot 256 #(hi > b*)
    n_above = tl.sum(tl.where(m & (hi > bstar) & (hi < 256), 1, 0), axis=0)
    part = part_ptr + (row * P_PAD + c) * 512
    tl.store(part + b, tl.where(b == 256, n_above, h), mask=b <= 256)


@triton.jit
def _multi_write_kernel(s_ptr, stride_s, hist_ptr, part_ptr, out_ptr, stride_o, n, k,
                        P_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c, row = tl.program_id(0), tl.program_id(1)
    bstar, above = _bin_of_kth(hist_ptr + row * 512, k)
    lstar, above_lo = _bin_of_kth(hist_ptr + row * 512 + 256, k - above)
    T = (bstar << 8) | lstar                                           # the k-th largest key
    need = k - above - above_lo                                         # entries == T to take (lowest indices)
    # what the chunks before this one hold: #(key > T) and #(key == T)
    pc = tl.arange(0, P_PAD)
    b = tl.arange(0, 256)
    prev = pc < c
    tile = tl.load(part_ptr + (row * P_PAD + pc[:, None]) * 512 + b[None, :], mask=prev[:, None], other=0)
    gt_before = (tl.sum(tl.load(part_ptr + (row * P_PAD + pc) * 512 + 256, mask=prev, other=0), axis=0)
                 + tl.sum(tl.sum(tl.where(b[None, :] > lstar, tile, 0), axis=1), axis=0))
    eq_before = tl.sum(tl.sum(tl.where(b[None, :] == lstar, tile, 0), axis=1), axis=0)
    j, m, key, hi, lo = _key16(s_ptr, row, stride_s, n, c, CHUNK)
    gt = m & (key > T)
    eq = m & (key == T)
    pk = tl.where(gt, 1 << 16, 0) + tl.where(eq, 1, 0)
    ex = tl.cumsum(pk, axis=0) - pk
    ex_gt = (ex >> 16) + gt_before
    ex_eq = (ex & 0xFFFF) + eq_before
    sel = gt | (eq & (ex_eq < need))
    pos = ex_gt + tl.minimum(ex_eq, need)
    tl.store(out_ptr + row * stride_o + pos, j.to(tl.int32), mask=sel)


def _multi(s: torch.Tensor, k: int, out: torch.Tensor, chunk: int, num_warps: int = MULTI_WARPS) -> None:
    """The multi-CTA select of [B, n] 16-bit scores into ``out`` [B, k] (three launches, grid chunks x rows)."""
    B, n = s.shape
    assert 256 <= chunk <= 32768 and chunk & (chunk - 1) == 0, "chunk must be a power of two in [256, 32768]"
    P = triton.cdiv(n, chunk)
    p_pad = next_pow2(P)
    hist = torch.zeros(B, 512, device=s.device, dtype=torch.int32)        # [hi-byte bins | lo bins of b*]
    part = torch.empty(B, p_pad, 512, device=s.device, dtype=torch.int32)  # per chunk: lo bins, #(hi > b*)
    grid = (P, B)
    _multi_hist_hi_kernel[grid](s, s.stride(0), hist, n, CHUNK=chunk, num_warps=num_warps)
    _multi_hist_lo_kernel[grid](s, s.stride(0), hist, part, n, k, P_PAD=p_pad, CHUNK=chunk, num_warps=num_warps)
    _multi_write_kernel[grid](s, s.stride(0), hist, part, out, out.stride(0), n, k, P_PAD=p_pad, CHUNK=chunk,
                              num_warps=num_warps)


def topk_select(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None, num_warps: int | None = None,
                bits: int = BITS, multi: bool | None = None, chunk: int = MULTI_CHUNK) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``scores`` [B, n] (or [n]): int32 [B, k] (or [k]),
    ascending; ties at the k-th value resolved to the lowest indices. ``multi``: the multi-CTA select (16-bit
    scores; None: from MULTI_MIN_N entries), over chunks of ``chunk`` entries, ``num_warps`` a program; else
    the one-CTA kernel."""
    one = scores.dim() == 1
    s = scores[None] if one else scores
    assert s.dim() == 2, "scores must be [n] or [B, n]"
    assert s.dtype in (torch.float16, torch.bfloat16, torch.float32), f"scores dtype {s.dtype}"
    B, n = s.shape
    assert 1 <= n <= MAX_N, f"n={n} must be in [1, {MAX_N}]"
    assert 1 <= k <= n, f"k={k} must be in [1, n={n}]"
    assert bits in (1, 2), "bits per step must be 1 or 2"
    if s.stride(1) != 1:
        s = s.contiguous()
    if out is None:
        out = torch.empty(B, k, device=s.device, dtype=torch.int32)
    assert out.shape == (B, k) and out.dtype == torch.int32 and out.stride(1) == 1
    key_bits = 32 if s.dtype == torch.float32 else 16
    if multi is None:
        multi = key_bits == 16 and n >= MULTI_MIN_N
    if multi:
        assert key_bits == 16, "the multi-CTA select takes fp16/bf16 scores"
        _multi(s, k, out, chunk, num_warps or MULTI_WARPS)
    else:
        block = next_pow2(n)
        if num_warps is None:
            num_warps = next(w for lim, w in NUM_WARPS if block <= lim)
        _topk_select_kernel[(B,)](s, s.stride(0), out, out.stride(0), n, k,
                                  KEY_BITS=key_bits, BITS=bits, BLOCK=block, num_warps=num_warps)
    return out[0] if one else out


@triton.jit
def _topk_threshold_kernel(x_ptr, stride_x, out_ptr, n, k, NSEG: tl.constexpr, NSEG_P: tl.constexpr,
                           BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    m = j < n
    a = tl.abs(tl.load(x_ptr + row * stride_x + j, mask=m, other=0.0).to(tl.float32))
    bits = a.to(tl.int32, bitcast=True)                     # |x| >= 0: its bits are in value order
    key = tl.where(m, tl.where(bits < 0, 0, bits), -1).to(tl.int64)   # |-0.0| -> 0; padding -1
    T = _kth_key(key, k, 32, BITS, BLOCK).to(tl.int32)      # bits of the k-th largest |x| (< 2^31)
    t = tl.where(T > 0, (T - 1).to(tl.float32, bitcast=True), -1.0)   # the float just below it
    c = tl.arange(0, NSEG_P)
    tl.store(out_ptr + row * NSEG + c, tl.zeros([NSEG_P], dtype=tl.float32) + t, mask=c < NSEG)


def topk_threshold(x: torch.Tensor, k: int, nseg: int = 1) -> torch.Tensor:
    """Each row's threshold keeping its ``k`` largest |x_j| under the input-sparse kernels' rule |x_j| > t: the
    float just below the k-th largest |x_j| (-1 where that is 0), fp32 [B, nseg] (``nseg`` copies, one per
    output segment). One launch, one CTA per row; the same radix search as the top-k select."""
    s = x[None] if x.dim() == 1 else x
    assert s.dim() == 2 and s.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"x must be [n] or [B, n] fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}"
    B, n = s.shape
    assert 1 <= n <= MAX_N and 1 <= k <= n, f"n={n} must be in [1, {MAX_N}] and k={k} in [1, n]"
    if s.stride(1) != 1:
        s = s.contiguous()
    out = torch.empty(B, nseg, device=s.device, dtype=torch.float32)
    block = next_pow2(n)
    num_warps = next(w for lim, w in NUM_WARPS if block <= lim)
    _topk_threshold_kernel[(B,)](s, s.stride(0), out, n, k, NSEG=nseg, NSEG_P=next_pow2(nseg), BITS=BITS,
                                 BLOCK=block, num_warps=num_warps)
    return out
