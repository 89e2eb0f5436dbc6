"""Triton kernel for input sparsity (TEAL / WINA style): a column-sparse GEMV for any projection.

Ops (same signatures as kernels.reference):

    input_sparse_linear(x, w_t, threshold, bias=None) -> y [B, out]
    input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None) -> y [B, sum(sizes)]

``w_t`` is W^T stored [in, out] contiguous (``linear.weight.t().contiguous()``), so input channel i is one
contiguous row. y[b] = sum over i with |x[b, i]| > t of x[b, i] * w_t[i, :] (+ bias). A row of w_t is read only
if some token of the batch has that channel active (the union); each token's inactive entries are zeroed, so
every token gets exactly its own masked product. No host sync (the threshold may be a 0-d device tensor),
CUDA-graph capturable. Paths (``path``, configs.py; the default per batch and projection kind there):

* "mask": the mask is applied in the weight load, no compaction. Bytes fall with the sparsity, instructions do
  not (every row's converts and FMAs run, on zeros), so its time flattens at high sparsity.
* "local": each program first lists the active channels of its own K slice (a prefix sum over the slice, written
  to a scratch row that every column block of the slice fills with the same values), then loads and multiplies
  only those rows. Bytes and instructions both fall with the sparsity; one launch.
* "tile" (batch 1): one grid of (column block, K slice) programs that either load masked [BLOCK_M, BLOCK_N]
  tiles (TEAL's loop, every tile's loads in flight together) or compact their slice's active rows into a
  scratch row of their own (no two programs writing one address) and stream those rows with the next steps in
  flight, or pick one of the two by their own active count; partials by the ticket or a reduce launch.
* "dense": cuBLAS on the masked x (one launch masks x, one product per segment): from batch 2, and at batch 1
  where the caller says its sparsity is below the measured crossover (configs.input_sparse_dense).

The segmented op is the fused QKV case: one input x, W^T of q, k and v concatenated along out, and one
threshold per output segment (up to 4 segments): segment j uses the mask |x| > thresholds[j]. A threshold may
also be one per input channel (thresholds [nseg, in]): WINA's |x_i|·‖W[:, i]‖ > t is |x_i| > t/‖W[:, i]‖, the
product itself unchanged; those thresholds are read with the x chunk.

Deterministic: every program owns a block of output columns and a fixed slice of the input channels; with one
slice per column block it writes y directly, otherwise its fp32 partial goes to a workspace and the partials
are summed in a fixed order, either by the last program of the column block to finish (``reduce="ticket"``:
an atomic arrival counter picks that program, it never touches the sums) or by a second launch
(``reduce="kernel"``). No atomic adds: the same inputs give the same bits. The mask path has three inner loops:
CUDA-core FMAs with the next two weight tiles prefetched in registers (batch <= 4; the frozen choice at batch
1 and 2), the same loop with tensor-core tl.dot (``mma``), and a cp.async-pipelined tl.dot with the batch
padded to 16 rows (``dot``; batch >= 4). fp32 accumulation throughout; fp16, bf16 and fp32 inputs.

Measured on an H200 (kernels/NOTES.md, BENCHMARKS.md): at batch 1 every path pays a per-call constant above
cuBLAS's; the default (local for gate|up, fused QKV and down, tile for q/o and GQA k/v) is 1.1-1.5x cuBLAS at
50 % sparsity and 1.4-1.9x at 70 %, bf16 as fast as fp16; TEAL's atomic kernel stays 3-19 % faster at 40-50 %.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as _c
from . import configs as C
from . import reference as _ref
from ._tl_common import _accum_rows, _act
from .common import MAX_BATCH, PROLOGUES, act_code, check_x, prologue_in
from ._launch import launch_reduce as _launch_reduce

MAX_SEGMENTS = 4


@triton.jit
def _segment_of(pid, N, c1, c2, c3, NSEG: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program -> (segment, first column, segment end): the column blocks of each segment are numbered after
    those of the segments before it, so no block straddles two segments."""
    seg = pid * 0
    lo = pid * 0
    hi = pid * 0 + N
    blk = pid
    if NSEG > 1:
        hi = pid * 0 + c1
        b1 = (c1 + BLOCK_N - 1) // BLOCK_N
        e2 = c2 if NSEG > 2 else N
        b2 = b1 + (e2 - c1 + BLOCK_N - 1) // BLOCK_N
        in1 = pid >= b1
        seg = tl.where(in1, 1, seg)
        lo = tl.where(in1, c1, lo)
        hi = tl.where(in1, e2, hi)
        blk = tl.where(in1, pid - b1, blk)
        if NSEG > 2:
            e3 = c3 if NSEG > 3 else N
            b3 = b2 + (e3 - c2 + BLOCK_N - 1) // BLOCK_N
            in2 = pid >= b2
            seg = tl.where(in2, 2, seg)
            lo = tl.where(in2, c2, lo)
            hi = tl.where(in2, e3, hi)
            blk = tl.where(in2, pid - b2, blk)
            if NSEG > 3:
                in3 = pid >= b3
                seg = tl.where(in3, 3, seg)
                lo = tl.where(in3, c3, lo)
                hi = tl.where(in3, N, hi)
                blk = tl.where(in3, pid - b3, blk)
    return seg, lo + blk * BLOCK_N, hi


@triton.jit
def _thr_at(thr, ks, km, THR_VEC: tl.constexpr):
    """The threshold of input channels ``ks``: ``thr`` itself, or (THR_VEC) loaded from ``thr`` + ks, one per
    channel (WINA's t / ‖W[:, i]‖); channels past the end get +inf (never active)."""
    if THR_VEC:
        return tl.load(thr + ks, mask=km, other=float("inf")).to(tl.float32)
    else:
        return thr


@triton.jit
def _x_chunk(x_ptr, stride_xb, k0, k_hi, thr, bs, bm, BLOCK_K: tl.constexpr, THR_VEC: tl.constexpr):
    """x[:, k0:k0+BLOCK_K] with each token's inactive entries (|x| <= thr) zeroed, and the union row mask."""
    ks = k0 + tl.arange(0, BLOCK_K)
    km = ks < k_hi
    xv = tl.load(x_ptr + bs[:, None] * stride_xb + ks[None, :], mask=bm[:, None] & km[None, :], other=0.0)
    t = _thr_at(thr, ks, km, THR_VEC)
    if THR_VEC:
        t = t[None, :]
    on = (tl.abs(xv.to(tl.float32)) > t) & bm[:, None] & km[None, :]
    rowm = tl.max(on.to(tl.int32), axis=0) > 0  # union over the batch
    return tl.where(on, xv, tl.zeros_like(xv)), rowm


@triton.jit
def _x_row(x_ptr, ks, km, t, b, B):
    m = km & ((ks * 0 + b) < B)
    xv = tl.load(x_ptr + ks, mask=m, other=0.0).to(tl.float32)
    on = (tl.abs(xv) > t) & m
    return tl.where(on, xv, 0.0), on


@triton.jit
def _x_in(x_ptr, offs, ks, m, g_ptr, r, K, XPRO: tl.constexpr, ACT: tl.constexpr):
    """The projection's input at x offsets ``offs`` (channels ``ks``) in fp32, as the unfused layer hands it
    over (rounded through x's dtype at the same points): XPRO 0 x itself; 1 Llama's RMS norm g * (x * r).to(dt);
    2 Gemma's (x * r * g).to(dt) (g = 1 + w in fp32); 3 act(gate) * up of a packed gate|up row (up ``K``
    further on). ``r`` is the token's 1 / rms (:func:`_rms_r`)."""
    xv = tl.load(x_ptr + offs, mask=m, other=0.0, eviction_policy="evict_last")
    if XPRO == 0:
        return xv.to(tl.float32)
    dt = x_ptr.dtype.element_ty
    if XPRO == 3:
        u = tl.load(x_ptr + offs + K, mask=m, other=0.0)
        a = _act(xv.to(tl.float32), ACT).to(dt).to(tl.float32)
        return (a * u.to(tl.float32)).to(dt).to(tl.float32)
    g = tl.load(g_ptr + ks, mask=m, other=0.0).to(tl.float32)
    y = xv.to(tl.float32) * r
    if XPRO == 1:
        return (y.to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
    return (y * g).to(dt).to(tl.float32)


@triton.jit
def _rms_r(x_ptr, K, eps, XPRO: tl.constexpr, BLOCK: tl.constexpr):
    """1 / rms(x[0, :K]) in fp32 for the norm prologues (XPRO 1, 2; every program reads the whole row, a few KB
    from L2), else 1."""
    if XPRO == 1 or XPRO == 2:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            acc += v * v
        return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)
    else:
        return 1.0


@triton.jit
def _x_rows(x_ptr, stride_xb, k0, k_hi, thr, B, B_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
            THR_VEC: tl.constexpr):
    """Per token b < 4: x[b, k0:k0+BLOCK_K] in fp32 with inactive entries zeroed (zeros past B), and the union
    row mask. One [BLOCK_K] vector per token, so they broadcast against a w tile without a layout change."""
    ks = k0 + tl.arange(0, BLOCK_K)
    km = ks < k_hi
    thr = _thr_at(thr, ks, km, THR_VEC)
    x0, rm = _x_row(x_ptr, ks, km, thr, 0, B)
    x1 = x0 * 0.0
    x2 = x1
    x3 = x1
    if B_PAD > 1:
        x1, on = _x_row(x_ptr + stride_xb, ks, km, thr, 1, B)
        rm = rm | on
    if B_PAD > 2:
        x2, on = _x_row(x_ptr + 2 * stride_xb, ks, km, thr, 2, B)
        rm = rm | on
        x3, on = _x_row(x_ptr + 3 * stride_xb, ks, km, thr, 3, B)
        rm = rm | on
    return x0, x1, x2, x3, rm


@triton.jit
def _w_tile(w_ptr, k0, N, cols, cm, rowm, BLOCK_K: tl.constexpr):
    """Rows k0..k0+BLOCK_K of w_t at ``cols``; rows outside ``rowm`` are masked out of the load (not read)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + ks.to(tl.int64)[:, None] * N + cols[None, :], mask=rowm[:, None] & cm[None, :],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def _segment_thr(seg, thr_ptr, t0, t1, t2, t3, K, THR_PTR: tl.constexpr, THR_VEC: tl.constexpr):
    """Segment ``seg``'s threshold: a pointer to its row of per-channel thresholds (THR_VEC), or a scalar."""
    if THR_VEC:
        return thr_ptr + seg * K
    elif THR_PTR:
        return tl.load(thr_ptr + seg).to(tl.float32)
    else:
        return tl.where(seg == 0, t0, tl.where(seg == 1, t1, tl.where(seg == 2, t2, t3)))


@triton.jit
def _program_tile(thr_ptr, t0, t1, t2, t3, B, K, N, c1, c2, c3, NSEG: tl.constexpr, THR_PTR: tl.constexpr,
                  THR_VEC: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (column block, K slice) ids, segment, threshold, output columns and token rows."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    seg, c0, hi = _segment_of(pid_n, N, c1, c2, c3, NSEG, BLOCK_N)
    thr = _segment_thr(seg, thr_ptr, t0, t1, t2, t3, K, THR_PTR, THR_VEC)
    cols = c0 + tl.arange(0, BLOCK_N)
    bs = tl.arange(0, B_PAD)
    return pid_n, pid_s, seg, thr, cols, cols < hi, bs, bs < B


@triton.jit
def _write_out(out, bs, bm, cols, cm, pid_n, pid_s, nsplit, B, N, ws_ptr, cnt_ptr, y_ptr, stride_yb, bias_ptr,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, TICKET: tl.constexpr, S_PAD: tl.constexpr,
               B_R: tl.constexpr, res_ptr, HAS_RES: tl.constexpr):
    """A program's [B_PAD, BLOCK_N] sums: into y directly (one K slice), or as an fp32 partial whose column
    block is then summed in a fixed order by its last program (TICKET; ``nsplit`` partials) or by a reduce
    launch. HAS_RES: y = residual + (sum (+ bias)).to(dt), the residual laid out as y (the add of the unfused
    layer, rounded as it rounds)."""
    om = bm[:, None] & cm[None, :]
    if PARTIAL:
        tl.store(ws_ptr + (pid_s * B + bs[:, None]) * N + cols[None, :], out, mask=om)
        if TICKET:
            # the last program of this column block to finish sums all the partials as one [S_PAD, BLOCK_N]
            # tile per token (a fixed reduction tree, whoever is last: deterministic), then re-arms the counter
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == nsplit - 1:
                ss = tl.arange(0, S_PAD)
                for b in tl.static_range(B_R):
                    rb = ((cols * 0 + b) < B) & cm
                    part = tl.load(ws_ptr + (ss[:, None] * B + b) * N + cols[None, :],
                                   mask=(ss[:, None] < nsplit) & rb[None, :], other=0.0, cache_modifier=".cg")
                    tot = tl.sum(part, axis=0)
                    if HAS_BIAS:
                        tot += tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                    if HAS_RES:
                        tot = tot.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                            res_ptr + b * stride_yb + cols, mask=rb, other=0.0).to(tl.float32)
                    tl.store(y_ptr + b * stride_yb + cols, tot.to(y_ptr.dtype.element_ty), mask=rb)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            out = out.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                res_ptr + bs[:, None] * stride_yb + cols[None, :], mask=om, other=0.0).to(tl.float32)
        tl.store(y_ptr + bs[:, None] * stride_yb + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=om)


@triton.jit
def _input_sparse_kernel(
    x_ptr, stride_xb, w_ptr, thr_ptr, t0, t1, t2, t3, bias_ptr, y_ptr, stride_yb, ws_ptr, cnt_ptr,
    B, K, N, k_per_split, c1, c2, c3,
    NSEG: tl.constexpr, THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    TICKET: tl.constexpr, S_PAD: tl.constexpr, B_R: tl.constexpr,
    B_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr, MMA: tl.constexpr,
):
    """Program (column block, K slice): acc[b, n] = sum_{k in slice, |x[b,k]| > t} x[b, k] * w_t[k, n].
    Rows of w_t whose channel is inactive for every token are masked out of the load (no bytes read)."""
    pid_n, pid_s, seg, thr, cols, cm, bs, bm = _program_tile(thr_ptr, t0, t1, t2, t3, B, K, N, c1, c2, c3, NSEG,
                                                             THR_PTR, THR_VEC, B_PAD, BLOCK_N)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if USE_DOT:
        acc = tl.zeros([B_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            xm, rowm = _x_chunk(x_ptr, stride_xb, k0, k_hi, thr, bs, bm, BLOCK_K, THR_VEC)
            w = _w_tile(w_ptr, k0, N, cols, cm, rowm, BLOCK_K)
            if DOT_F32:
                acc = tl.dot(xm.to(tl.float32), w.to(tl.float32), acc)
            elif IEEE:
                acc = tl.dot(xm, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(xm, w, acc)
        out = acc
    else:
        # Register-prefetched loop (B_PAD <= 4): while tile k is consumed, the w rows of tiles k+1 and k+2 (their
        # masks already known) and the x chunk of tile k+3 are in flight. MMA: tensor-core tl.dot of the tokens'
        # masked x (padded to 16 rows) with the tile, fp32 accumulation; else CUDA-core FMAs into one
        # [BLOCK_K, BLOCK_N] fp32 accumulator per token, reduced over K once at the end.
        if MMA:
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            r16 = tl.arange(0, 16)
        else:
            a0 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
            a1 = a0
            a2 = a0
            a3 = a0
        x0, x1, x2, x3, rm = _x_rows(x_ptr, stride_xb, k_lo, k_hi, thr, B, B_PAD, BLOCK_K, THR_VEC)
        w_c = _w_tile(w_ptr, k_lo, N, cols, cm, rm, BLOCK_K)
        y0, y1, y2, y3, rm = _x_rows(x_ptr, stride_xb, k_lo + BLOCK_K, k_hi, thr, B, B_PAD, BLOCK_K, THR_VEC)
        w_n = _w_tile(w_ptr, k_lo + BLOCK_K, N, cols, cm, rm, BLOCK_K)
        z0, z1, z2, z3, rm_nn = _x_rows(x_ptr, stride_xb, k_lo + 2 * BLOCK_K, k_hi, thr, B, B_PAD, BLOCK_K, THR_VEC)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w_nn = _w_tile(w_ptr, k0 + 2 * BLOCK_K, N, cols, cm, rm_nn, BLOCK_K)
            v0, v1, v2, v3, rm_nnn = _x_rows(x_ptr, stride_xb, k0 + 3 * BLOCK_K, k_hi, thr, B, B_PAD, BLOCK_K, THR_VEC)
            if MMA:
                xa = tl.where(r16[:, None] == 0, x0[None, :], 0.0)
                if B_PAD > 1:
                    xa += tl.where(r16[:, None] == 1, x1[None, :], 0.0)
                if B_PAD > 2:
                    xa += tl.where(r16[:, None] == 2, x2[None, :], 0.0)
                    xa += tl.where(r16[:, None] == 3, x3[None, :], 0.0)
                if DOT_F32:
                    acc = tl.dot(xa, w_c.to(tl.float32), acc)
                elif IEEE:
                    acc = tl.dot(xa, w_c, acc, input_precision="ieee")
                else:
                    acc = tl.dot(xa.to(w_c.dtype), w_c, acc)
            else:
                wf = w_c.to(tl.float32)
                a0 += x0[:, None] * wf
                if B_PAD > 1:
                    a1 += x1[:, None] * wf
                if B_PAD > 2:
                    a2 += x2[:, None] * wf
                    a3 += x3[:, None] * wf
            w_c = w_n
            w_n = w_nn
            x0, x1, x2, x3 = y0, y1, y2, y3
            y0, y1, y2, y3 = z0, z1, z2, z3
            z0, z1, z2, z3, rm_nn = v0, v1, v2, v3, rm_nnn
        if MMA:
            out = acc
            bs = r16
            bm = bs < B
        else:
            out = tl.where(bs[:, None] == 0, tl.sum(a0, axis=0)[None, :], 0.0)
            if B_PAD > 1:
                out += tl.where(bs[:, None] == 1, tl.sum(a1, axis=0)[None, :], 0.0)
            if B_PAD > 2:
                out += tl.where(bs[:, None] == 2, tl.sum(a2, axis=0)[None, :], 0.0)
                out += tl.where(bs[:, None] == 3, tl.sum(a3, axis=0)[None, :], 0.0)
    _write_out(out, bs, bm, cols, cm, pid_n, pid_s, tl.num_programs(1), B, N, ws_ptr, cnt_ptr, y_ptr, stride_yb,
               bias_ptr, HAS_BIAS, PARTIAL, TICKET, S_PAD, B_R, y_ptr, False)


@triton.jit
def _input_sparse_local_kernel(
    x_ptr, stride_xb, w_ptr, thr_ptr, t0, t1, t2, t3, bias_ptr, y_ptr, stride_yb, ws_ptr, cnt_ptr, sidx_ptr, sv_ptr,
    g_ptr, eps, res_ptr,
    B, K, N, c1, c2, c3,
    NSEG: tl.constexpr, THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    TICKET: tl.constexpr, S_PAD: tl.constexpr, B_R: tl.constexpr,
    B_PAD: tl.constexpr, PER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    XPRO: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
):
    """The same sums with a compaction inside each program: the program lists the channels of its K slice (PER
    of them) active for some token, in order, with each token's masked x, in a scratch row of its (segment,
    slice) -- every column block of that slice writes the same values there -- then loads and multiplies only
    those rows, BLOCK_R at a time. Instructions and bytes both scale with the active rows. The input through
    the prologue XPRO (:func:`_x_in`; the norms at batch 1 only), the residual added in the epilogue (HAS_RES)."""
    pid_n, pid_s, seg, thr, cols, cm, bs, bm = _program_tile(thr_ptr, t0, t1, t2, t3, B, K, N, c1, c2, c3, NSEG,
                                                             THR_PTR, THR_VEC, B_PAD, BLOCK_N)
    nsplit = tl.num_programs(1)
    ks = pid_s * PER + tl.arange(0, PER)
    km = ks < K
    xm = bm[:, None] & km[None, :]
    r = _rms_r(x_ptr, K, eps, XPRO, PER)
    xv = _x_in(x_ptr, bs[:, None] * stride_xb + ks[None, :], ks[None, :], xm, g_ptr, r, K, XPRO, ACT)
    t = _thr_at(thr, ks, km, THR_VEC)
    if THR_VEC:
        t = t[None, :]
    on = (tl.abs(xv) > t) & xm
    u = tl.max(on.to(tl.int32), axis=0)                 # union over the batch
    pos = tl.cumsum(u, axis=0) - u
    n_act = tl.sum(u, axis=0)
    row = (seg * nsplit + pid_s).to(tl.int64)
    tl.store(sidx_ptr + row * PER + pos, ks, mask=u > 0)
    tl.store(sv_ptr + (row * B_PAD + bs[:, None]) * PER + pos[None, :], tl.where(on, xv, 0.0),
             mask=(u > 0)[None, :])
    tl.debug_barrier()                                  # the scratch row, written by all threads, read by all
    if B_PAD == 1:
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([B_PAD, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, n_act, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        rm = j < n_act
        rows = tl.load(sidx_ptr + row * PER + j, mask=rm, other=0).to(tl.int64)
        w = tl.load(w_ptr + rows[:, None] * N + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        hv = tl.load(sv_ptr + (row * B_PAD + bs[:, None]) * PER + j[None, :], mask=rm[None, :], other=0.0)
        if B_PAD == 1:
            acc += tl.sum(hv, axis=0)[:, None] * w      # one FMA per element; K reduced once, after the loop
        else:
            acc = _accum_rows(acc, hv, w, B_PAD)
    if B_PAD == 1:
        out = tl.sum(acc, axis=0)[None, :]
    else:
        out = acc
    _write_out(out, bs, bm, cols, cm, pid_n, pid_s, tl.num_programs(1), B, N, ws_ptr, cnt_ptr, y_ptr, stride_yb,
               bias_ptr, HAS_BIAS, PARTIAL, TICKET, S_PAD, B_R, res_ptr, HAS_RES)


@triton.jit
def _active_rows(sidx_row, j0, n_act, x_ptr, g_ptr, r, K, XPRO: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Entries j0..j0+BLOCK_R of a program's list of active channels, their input (fp32, :func:`_x_in`) and the
    valid mask."""
    j = j0 + tl.arange(0, BLOCK_R)
    rm = j < n_act
    rows = tl.load(sidx_row + j, mask=rm, other=0)
    xr = _x_in(x_ptr, rows, rows, rm, g_ptr, r, K, XPRO, ACT)
    return rows.to(tl.int64), xr, rm


@triton.jit
def _w_rows(w_ptr, rows, rm, N, cols, cm, EVEN_N: tl.constexpr):
    """w_t[rows, cols] (rows int64); rows outside ``rm`` are not read."""
    if EVEN_N:
        m = rm[:, None]
    else:
        m = rm[:, None] & cm[None, :]
    return tl.load(w_ptr + rows[:, None] * N + cols[None, :], mask=m, other=0.0, eviction_policy="evict_first")


@triton.jit
def _masked_tiles(x_ptr, w_ptr, thr, k_lo, K, N, cols, cm, g_ptr, r, THR_VEC: tl.constexpr, EVEN_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, XPRO: tl.constexpr,
                  ACT: tl.constexpr):
    """sum over the K slice k_lo.. of TILES unrolled [BLOCK_M, BLOCK_N] tiles, each masked by its rows' |x| > t
    in the load (inactive rows not read); the tiles are independent, so their loads are in flight together."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(TILES):
        kt = k_lo + i * BLOCK_M + tl.arange(0, BLOCK_M)
        kmt = kt < K
        xv = _x_in(x_ptr, kt, kt, kmt, g_ptr, r, K, XPRO, ACT)
        ont = (tl.abs(xv) > _thr_at(thr, kt, kmt, THR_VEC)) & kmt
        w = _w_rows(w_ptr, kt.to(tl.int64), ont, N, cols, cm, EVEN_N)
        acc += w.to(tl.float32) * tl.where(ont, xv, 0.0)[:, None]
    return tl.sum(acc, axis=0)


@triton.jit
def _compact_rows(x_ptr, w_ptr, srow, ks, on, N, cols, cm, g_ptr, r, K, EVEN_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DEPTH: tl.constexpr, XPRO: tl.constexpr,
                  ACT: tl.constexpr):
    """The same sum over the slice's active channels ``ks[on]`` only: listed in order in the scratch row
    ``srow`` (a prefix sum; every column block of the slice writes the same values there), then their rows
    loaded and multiplied BLOCK_R at a time, the weight rows of the next DEPTH (1 or 2) steps in flight while a
    step is multiplied and the ids one step further ahead."""
    u = on.to(tl.int32)
    n_act = tl.sum(u, axis=0)
    tl.store(srow + tl.cumsum(u, axis=0) - u, ks, mask=on)
    tl.debug_barrier()                                  # the list, written by all threads, read by all
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    r_0, x_0, m_0 = _active_rows(srow, 0, n_act, x_ptr, g_ptr, r, K, XPRO, ACT, BLOCK_R)
    w_0 = _w_rows(w_ptr, r_0, m_0, N, cols, cm, EVEN_N)
    r_1, x_1, m_1 = _active_rows(srow, BLOCK_R, n_act, x_ptr, g_ptr, r, K, XPRO, ACT, BLOCK_R)
    if DEPTH == 1:
        for r0 in range(0, n_act, BLOCK_R):
            w_1 = _w_rows(w_ptr, r_1, m_1, N, cols, cm, EVEN_N)
            r_2, x_2, m_2 = _active_rows(srow, r0 + 2 * BLOCK_R, n_act, x_ptr, g_ptr, r, K, XPRO, ACT, BLOCK_R)
            acc += x_0[:, None] * w_0.to(tl.float32)
            w_0 = w_1
            x_0 = x_1
            r_1 = r_2
            x_1 = x_2
            m_1 = m_2
    else:
        w_1 = _w_rows(w_ptr, r_1, m_1, N, cols, cm, EVEN_N)
        r_2, x_2, m_2 = _active_rows(srow, 2 * BLOCK_R, n_act, x_ptr, g_ptr, r, K, XPRO, ACT, BLOCK_R)
        for r0 in range(0, n_act, BLOCK_R):
            w_2 = _w_rows(w_ptr, r_2, m_2, N, cols, cm, EVEN_N)
            r_3, x_3, m_3 = _active_rows(srow, r0 + 3 * BLOCK_R, n_act, x_ptr, g_ptr, r, K, XPRO, ACT, BLOCK_R)
            acc += x_0[:, None] * w_0.to(tl.float32)
            w_0 = w_1
            w_1 = w_2
            x_0 = x_1
            x_1 = x_2
            r_2 = r_3
            x_2 = x_3
            m_2 = m_3
    return tl.sum(acc, axis=0)


@triton.jit
def _input_sparse_tile_kernel(
    x_ptr, w_ptr, thr_ptr, t0, t1, t2, t3, bias_ptr, y_ptr, ws_ptr, cnt_ptr, sidx_ptr, g_ptr, eps, res_ptr,
    K, N, c1, c2, c3, nsplit, cut,
    NSEG: tl.constexpr, THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    S_PAD: tl.constexpr, EVEN_N: tl.constexpr, SPLIT_MAJOR: tl.constexpr, COMPACT: tl.constexpr,
    BLOCK_M: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DEPTH: tl.constexpr, TICKET: tl.constexpr, PRIVATE: tl.constexpr, XPRO: tl.constexpr, ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """Batch 1. Program (column block, K slice of TILES * BLOCK_M channels) of one 1-D grid, the slices of a
    column block adjacent (SPLIT_MAJOR) or the column blocks of a slice. Inner loops over the slice:

    * masked tiles (COMPACT 0): TILES unrolled [BLOCK_M, BLOCK_N] weight tiles, each masked by its rows'
      |x| > t in the load (inactive rows not read), all independent so their loads are in flight together;
      the instructions run on every row, read or not (TEAL's loop, with a fixed-order reduction);
    * compacted rows (COMPACT 1): the slice's active channels listed in order (a prefix sum) in a scratch row,
      the program's own (PRIVATE) or its (segment, slice)'s, which every column block of the slice fills with
      the same values, then only those rows loaded and multiplied, BLOCK_R at a time, DEPTH steps of rows in
      flight;
    * COMPACT 2: each program picks one of the two by its own active count (compacted iff count <= ``cut``).

    The [BLOCK_N] fp32 sum goes to y (one slice) or to the partials, summed in a fixed order by the column
    block's last program (TICKET) or by a reduce launch: deterministic either way. The input through the
    prologue XPRO (:func:`_x_in`), the residual added in the epilogue (HAS_RES)."""
    pid = tl.program_id(0)
    if SPLIT_MAJOR:
        pid_n = pid // nsplit
        pid_s = pid - pid_n * nsplit
    else:
        n_blocks = tl.num_programs(0) // nsplit
        pid_s = pid // n_blocks
        pid_n = pid - pid_s * n_blocks
    seg, c0, hi = _segment_of(pid_n, N, c1, c2, c3, NSEG, BLOCK_N)
    thr = _segment_thr(seg, thr_ptr, t0, t1, t2, t3, K, THR_PTR, THR_VEC)
    cols = c0 + tl.arange(0, BLOCK_N)
    cm = cols < hi
    k_lo = pid_s * (TILES * BLOCK_M)
    r = _rms_r(x_ptr, K, eps, XPRO, TILES * BLOCK_M)
    if COMPACT == 0:
        out = _masked_tiles(x_ptr, w_ptr, thr, k_lo, K, N, cols, cm, g_ptr, r, THR_VEC, EVEN_N, BLOCK_M, TILES,
                            BLOCK_N, XPRO, ACT)
    else:
        ks = k_lo + tl.arange(0, TILES * BLOCK_M)
        km = ks < K
        xs = _x_in(x_ptr, ks, ks, km, g_ptr, r, K, XPRO, ACT)
        on = (tl.abs(xs) > _thr_at(thr, ks, km, THR_VEC)) & km
        if PRIVATE:     # a scratch row per program: no two programs write the same addresses
            srow = sidx_ptr + pid.to(tl.int64) * (TILES * BLOCK_M)
        else:
            srow = sidx_ptr + (seg * nsplit + pid_s).to(tl.int64) * (TILES * BLOCK_M)
        if COMPACT == 1:
            out = _compact_rows(x_ptr, w_ptr, srow, ks, on, N, cols, cm, g_ptr, r, K, EVEN_N, BLOCK_R, BLOCK_N,
                                DEPTH, XPRO, ACT)
        else:
            if tl.sum(on.to(tl.int32), axis=0) <= cut:
                out = _compact_rows(x_ptr, w_ptr, srow, ks, on, N, cols, cm, g_ptr, r, K, EVEN_N, BLOCK_R,
                                    BLOCK_N, DEPTH, XPRO, ACT)
            else:
                out = _masked_tiles(x_ptr, w_ptr, thr, k_lo, K, N, cols, cm, g_ptr, r, THR_VEC, EVEN_N, BLOCK_M,
                                    TILES, BLOCK_N, XPRO, ACT)
    bs = tl.arange(0, 1)
    _write_out(out[None, :], bs, bs < 1, cols, cm, pid_n, pid_s, nsplit, 1, N, ws_ptr, cnt_ptr, y_ptr, 0,
               bias_ptr, HAS_BIAS, PARTIAL, TICKET, S_PAD, 1, res_ptr, HAS_RES)


MASK_BLOCK = 1024


@triton.jit
def _mask_kernel(x_ptr, stride_xb, thr_ptr, t0, t1, t2, t3, out_ptr, B, K,
                 NSEG: tl.constexpr, THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, BLOCK: tl.constexpr):
    """out[seg, b, k] = x[b, k] if |x[b, k]| > segment seg's threshold (of channel k) else 0: the masked x the
    dense path hands to cuBLAS, every segment in one launch (grid: flat blocks of B * K, segments)."""
    seg = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < B * K
    b = offs // K
    k = offs - b * K
    xv = tl.load(x_ptr + b * stride_xb + k, mask=m, other=0.0)
    thr = _thr_at(_segment_thr(seg, thr_ptr, t0, t1, t2, t3, K, THR_PTR, THR_VEC), k, m, THR_VEC)
    on = tl.abs(xv.to(tl.float32)) > thr
    tl.store(out_ptr + seg * (B * K) + offs, tl.where(on, xv, tl.zeros_like(xv)), mask=m)


def _segment_bounds(sizes, N):
    """c1, c2, c3: the first column of segments 1..3 (N past the last segment)."""
    bounds = [0]
    for sz in sizes:
        bounds.append(bounds[-1] + sz)
    return (bounds[1:-1] + [N, N, N])[:3]


def _thr_args(x, thresholds):
    """(pointer, four floats, THR_PTR, THR_VEC) as the kernels take thresholds: a device tensor ([nseg] or one
    per channel [nseg, in]), or values (the pointer then unused)."""
    if isinstance(thresholds, torch.Tensor):
        return thresholds, (0.0,) * 4, True, thresholds.dim() == 2
    return x, tuple(float(t) for t in thresholds) + (0.0,) * (4 - len(thresholds)), False, False


def _fusion_args(x, prologue, residual):
    """(g, eps, res, XPRO, ACT, HAS_RES) as the tile and local kernels take the prologue and the residual."""
    xpro = 0 if prologue is None else PROLOGUES[prologue.kind]
    g = prologue.weight if xpro in (1, 2) else x
    act = act_code(prologue.act) if xpro == 3 else 0
    eps = float(prologue.eps) if xpro in (1, 2) else 0.0
    return g, eps, residual if residual is not None else x, xpro, act, residual is not None


def _launch_local(x, w_t, thresholds, sizes, bias, cfg, prologue=None, residual=None):
    """The in-program compaction path: one launch (partials summed by the ticket reduce), no sync."""
    B = x.shape[0]
    K = w_t.shape[0]
    N = w_t.shape[1]
    nseg = len(sizes)
    dev = x.device
    per, block_n, block_r = cfg["per"], cfg["BLOCK_N"], cfg["BLOCK_R"]
    assert per == triton.next_power_of_2(per), f"per (channels per K slice) must be a power of two, got {per}"
    n_blocks = _n_blocks(sizes, block_n)
    nsplit = triton.cdiv(K, per)
    bp = C.b_pad(B)
    c = _segment_bounds(sizes, N)
    y = _c.empty((B, N), dev, x.dtype)
    partial = nsplit > 1
    ws = _c.empty((nsplit, B, N), dev, torch.float32) if partial else y
    cnt = _counters(dev, n_blocks) if partial else y
    sidx = _c.empty((nseg * nsplit, per), dev, torch.int32)
    sv = _c.empty((nseg * nsplit, bp, per), dev, torch.float32)
    thr_ptr, tv, thr_dev, thr_vec = _thr_args(x, thresholds)
    g, eps, res, xpro, act, has_res = _fusion_args(x, prologue, residual)
    _input_sparse_local_kernel[(n_blocks, nsplit)](
        x, x.stride(0), w_t, thr_ptr, *tv, bias if bias is not None else w_t, y, y.stride(0), ws, cnt, sidx, sv,
        g, eps, res, B, K, N, *c,
        NSEG=nseg, THR_PTR=thr_dev, THR_VEC=thr_vec, HAS_BIAS=bias is not None,
        PARTIAL=partial, TICKET=True, S_PAD=triton.next_power_of_2(nsplit), B_R=bp, B_PAD=bp, PER=per,
        BLOCK_R=block_r, BLOCK_N=block_n, XPRO=xpro, ACT=act, HAS_RES=has_res, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 3),
    )
    return y


def _launch_tile(x, w_t, thresholds, sizes, bias, cfg, prologue=None, residual=None):
    """The batch-1 tile kernel: one launch (the partials summed by the ticket), or two (a reduce launch); no
    sync. configs.INPUT_SPARSE_TILE says what each key means."""
    K = w_t.shape[0]
    N = w_t.shape[1]
    nseg = len(sizes)
    dev = x.device
    block_m, tiles, block_n = cfg["BLOCK_M"], cfg["TILES"], cfg["BLOCK_N"]
    ks = block_m * tiles
    assert ks == triton.next_power_of_2(ks), f"BLOCK_M * TILES (channels per K slice) must be a power of two, got {ks}"
    frac = float(cfg.get("compact", 0.0))
    mode = 0 if frac <= 0 else 1 if frac >= 1 else 2
    n_blocks = _n_blocks(sizes, block_n)
    nsplit = triton.cdiv(K, ks)
    c = _segment_bounds(sizes, N)
    y = _c.empty((1, N), dev, x.dtype)
    partial = nsplit > 1
    ticket = partial and cfg.get("reduce", "ticket") == "ticket"
    ws = _c.empty((nsplit, 1, N), dev, torch.float32) if partial else y
    cnt = _counters(dev, n_blocks) if ticket else y
    private = bool(cfg.get("private"))
    sidx = _c.empty((n_blocks * nsplit if private else nseg * nsplit, ks), dev, torch.int32) if mode else y
    thr_ptr, tv, thr_dev, thr_vec = _thr_args(x, thresholds)
    g, eps, res, xpro, act, has_res = _fusion_args(x, prologue, residual)
    _input_sparse_tile_kernel[(n_blocks * nsplit,)](
        x, w_t, thr_ptr, *tv, bias if bias is not None else w_t, y, ws, cnt, sidx, g, eps, res,
        K, N, *c, nsplit, int(frac * ks) if mode == 2 else 0,
        NSEG=nseg, THR_PTR=thr_dev, THR_VEC=thr_vec, HAS_BIAS=bias is not None, PARTIAL=partial,
        S_PAD=triton.next_power_of_2(nsplit), EVEN_N=all(sz % block_n == 0 for sz in sizes),
        SPLIT_MAJOR=cfg.get("order", "split") == "split", COMPACT=mode, BLOCK_M=block_m, TILES=tiles,
        BLOCK_N=block_n, BLOCK_R=cfg.get("BLOCK_R", 16), DEPTH=cfg.get("depth", 1), TICKET=ticket,
        PRIVATE=private, XPRO=xpro, ACT=act, HAS_RES=has_res and not (partial and not ticket),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
    )
    if partial and not ticket:
        _launch_reduce(ws, nsplit, bias, y, cfg.get("reduce_block"))
        if residual is not None:       # the reduce launch has no epilogue: the residual add after it
            y = residual + y
    return y


# ------------------------------------------------------------------------------------------------
def _config(B, K, N, device, override):
    """Launch config: ``override["path"]`` if given, else on CUDA cuBLAS where configs.input_sparse_dense says
    (batch >= 2, or ``override["sparsity"]`` below the kind's crossover), the shape's default kernel at batch 1
    (configs.input_default_path), the masked-load kernel on the CPU; then that path's frozen config for the
    shape, the interpreter's sizes on the CPU, and the override."""
    bp = C.b_pad(B)
    override = override or {}
    path = override.get("path")
    if path is None:
        if device.type != "cuda":
            path = "mask"
        elif C.input_sparse_dense(B, K, N, override.get("sparsity")):
            path = "dense"
        else:
            path = C.input_default_path(K, N) if bp == 1 else "mask"
    if path not in C.INPUT_PATHS:
        raise ValueError(f"input-sparse path must be one of {C.INPUT_PATHS}, got {path!r}")
    if path == "tile" and bp != 1:
        path = "mask"                   # the tile kernel is batch 1 only
    if path == "dense":
        cfg = {}
    elif path == "local":
        cfg = C.input_sparse_local(K, N)
    elif path == "tile":
        cfg = C.input_sparse_tile(K, N)
    else:
        table = C.INPUT_SPARSE
        cfg = dict(table[bp] if bp in table else table[max(table)])
    if device.type == "cpu" and path != "dense":
        cfg.update(C.INTERP["input_sparse" if path == "mask" else "input_sparse_" + path])
    cfg.update(override)
    cfg["path"] = path
    return cfg


def _dense(x, w_t, thresholds, sizes, bias):
    """The same product through cuBLAS: one launch writes each segment's masked x (|x| > its threshold,
    compared in fp32 as the kernels do), then one cuBLAS product per segment into its columns of y (the bias
    added there); no sync."""
    B, K = x.shape
    N = w_t.shape[1]
    nseg = len(sizes)
    xm = _c.empty((nseg, B, K), x.device, x.dtype)
    thr_ptr, tv, thr_dev, thr_vec = _thr_args(x, thresholds)
    _mask_kernel[(triton.cdiv(B * K, MASK_BLOCK), nseg)](
        x, x.stride(0), thr_ptr, *tv, xm, B, K, NSEG=nseg, THR_PTR=thr_dev, THR_VEC=thr_vec, BLOCK=MASK_BLOCK,
        num_warps=4)
    y = _c.empty((B, N), x.device, x.dtype)
    lo = 0
    for j, sz in enumerate(sizes):
        if bias is None:
            torch.mm(xm[j], w_t[:, lo:lo + sz], out=y[:, lo:lo + sz])
        else:
            torch.addmm(bias[lo:lo + sz], xm[j], w_t[:, lo:lo + sz], out=y[:, lo:lo + sz])
        lo += sz
    return y


_COUNTERS: dict = {}


def _counters(device, n):
    """Per-device int32 arrival counters of the ticket reduce (zero between calls: the last program of each
    column block re-arms its own). Allocated once per device and size (a later CUDA-graph capture reuses it;
    two ticket launches must not run concurrently on different streams of one device)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _n_blocks(sizes, block_n):
    return sum(triton.cdiv(s, block_n) for s in sizes)


def _splits(cfg, K, n_blocks, device):
    """K slices per column block: the fixed count ``splits``, or enough slices that the grid reaches
    ``min_progs`` programs (``progs_per_sm`` × SMs); never more than the K blocks."""
    block_k = cfg["BLOCK_K"]
    kb = triton.cdiv(K, block_k)
    if cfg.get("splits"):
        want = cfg["splits"]
    else:
        target = cfg.get("progs_per_sm", 0) * C.num_sms(device.index if device.type == "cuda" else None)
        want = triton.cdiv(target, n_blocks) if target > n_blocks else 1
    s = max(1, min(want, kb, cfg.get("max_splits", 64)))
    per = triton.cdiv(kb, s) * block_k
    return triton.cdiv(K, per), per


def _launch(x, w_t, thresholds, sizes, bias, config, prologue=None, residual=None):
    B = x.shape[0]
    K, N = w_t.shape
    cfg = _config(B, K, N, x.device, config)
    fused = cfg["path"] in ("local", "tile") and (
        prologue is None or prologue.kind == "act_mul" or B == 1)    # the norms' 1/rms is one token's
    if (prologue is not None or residual is not None) and not fused:
        # the other paths take the prologue's output and add the residual after: the layer's own ops
        return _ref.around_product(lambda h: _launch(h, w_t, thresholds, sizes, bias, cfg), x, prologue, residual)
    if cfg["path"] == "dense":
        return _dense(x, w_t, thresholds, sizes, bias)
    if cfg["path"] == "local":
        return _launch_local(x, w_t, thresholds, sizes, bias, cfg, prologue, residual)
    if cfg["path"] == "tile":
        return _launch_tile(x, w_t, thresholds, sizes, bias, cfg, prologue, residual)
    nseg = len(sizes)
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    bp = C.b_pad(B)
    use_dot = bool(cfg.get("dot", True)) or bp > 4  # the register-prefetched loop keeps up to 4 token vectors
    mma = bool(cfg.get("mma")) and not use_dot
    if use_dot or mma:
        assert block_n >= 16 and block_k >= 16, "the tl.dot paths need BLOCK_N, BLOCK_K >= 16"
    if use_dot:
        bp = max(16, bp)
    n_blocks = _n_blocks(sizes, block_n)
    nsplit, per = _splits(cfg, K, n_blocks, x.device)
    c = _segment_bounds(sizes, N)
    thr_ptr, tv, thr_dev, thr_vec = _thr_args(x, thresholds)
    y = _c.empty((B, N), x.device, x.dtype)
    partial = nsplit > 1
    ticket = partial and cfg.get("reduce", "kernel") == "ticket"
    ws = _c.empty((nsplit, B, N), x.device, torch.float32) if partial else y
    cnt = _counters(x.device, n_blocks) if ticket else y
    _input_sparse_kernel[(n_blocks, nsplit)](
        x, x.stride(0), w_t, thr_ptr, *tv, bias if bias is not None else w_t, y, y.stride(0), ws, cnt,
        B, K, N, per, *c,
        NSEG=nseg, THR_PTR=thr_dev, THR_VEC=thr_vec, HAS_BIAS=bias is not None,
        PARTIAL=partial,
        TICKET=ticket, S_PAD=triton.next_power_of_2(nsplit), B_R=C.b_pad(B),
        B_PAD=bp, BLOCK_K=block_k, BLOCK_N=block_n, USE_DOT=use_dot,
        DOT_F32=(use_dot or mma) and x.device.type == "cpu" and x.dtype != torch.float32, MMA=mma,
        IEEE=x.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
    )
    if partial and not ticket:
        _launch_reduce(ws, nsplit, bias, y, cfg.get("reduce_block"))
    return y


def _check(x, w_t, bias, prologue=None, residual=None):
    assert w_t.dim() == 2, "w_t must be 2-D [in, out]"
    check_x(x, x.shape[1], MAX_BATCH)
    assert prologue_in(x, prologue) == w_t.shape[0], \
        f"x has d={x.shape[1]}, weights have d={w_t.shape[0]}" + (" (after the prologue)" if prologue else "")
    if prologue is not None and prologue.kind != "act_mul":
        assert prologue.weight.device == x.device and prologue.weight.is_contiguous(), \
            "the norm weight must be a contiguous [in] tensor on x's device"
    if residual is not None:
        assert residual.shape == (x.shape[0], w_t.shape[1]) and residual.dtype == x.dtype and \
            residual.device == x.device and residual.is_contiguous(), \
            f"residual must be a contiguous [{x.shape[0]}, {w_t.shape[1]}] {x.dtype} tensor on x's device"
    assert x.stride(1) == 1, "x must have contiguous rows"
    assert w_t.dtype == x.dtype, f"w_t dtype {w_t.dtype} != x dtype {x.dtype}"
    assert w_t.device == x.device, f"w_t on {w_t.device}, x on {x.device}"
    assert w_t.is_contiguous(), "w_t must be contiguous [in, out] (linear.weight.t().contiguous())"
    if bias is not None:
        assert bias.shape == (w_t.shape[1],) and bias.device == x.device and bias.is_contiguous(), \
            "bias must be a contiguous [out] tensor on x's device"


def _thr_tensor(t, n, k, device):
    """Thresholds as the kernel reads them: [n] (one per segment) or [n, k] fp32 (one per segment and input
    channel, WINA's t / ‖W[:, i]‖)."""
    assert t.device == device, f"threshold on {t.device}, x on {device}"
    assert t.dtype.is_floating_point, "threshold must be a float tensor"
    if t.dim() == 2 or (t.numel() == n * k and t.numel() != n):
        assert t.shape == (n, k) or (n == 1 and t.shape == (k,)), \
            f"per-channel thresholds must be [{n}, {k}], got {tuple(t.shape)}"
        return t.reshape(n, k).to(torch.float32).contiguous()
    assert t.numel() == n, f"{n} threshold(s) or [{n}, {k}] per-channel ones expected, got {tuple(t.shape)}"
    return t.reshape(n).contiguous()


def input_sparse_linear(x, w_t, threshold, bias=None, *, config=None, prologue=None, residual=None):
    """y = mask(x) @ w_t (+ bias), mask(x)[b, i] = x[b, i] if |x[b, i]| > threshold else 0.

    ``threshold``: a float, a one-element float tensor on x's device (read on the device: no sync), or a tensor
    [in] of one threshold per input channel. ``prologue`` (kernels.common.Prologue) and ``residual``: as
    :func:`input_sparse_linear_segments`."""
    _check(x, w_t, bias, prologue, residual)
    if isinstance(threshold, torch.Tensor):
        threshold = _thr_tensor(threshold, 1, w_t.shape[0], x.device)
    else:
        threshold = (float(threshold),)
    return _launch(x, w_t, threshold, (w_t.shape[1],), bias, config, prologue, residual)


def input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None, *, config=None, prologue=None,
                                 residual=None):
    """Fused projections that share the input x (QKV): ``w_t`` = [W_q^T | W_k^T | W_v^T] ([in, sum(sizes)]),
    output segment j (``sizes[j]`` columns) computed with its own mask |x| > thresholds[j].

    ``thresholds``: a float tensor of len(sizes) on x's device, a tensor [len(sizes), in] of one threshold per
    segment and input channel (WINA: t / ‖W[:, i]‖), or a sequence of floats; at most 4 segments.

    Fusions (batch-1 tile and local paths; the other paths compose the same ops): ``prologue`` (Prologue)
    the input is the prologue's output (the RMS norm before QKV and gate|up, act(gate) * up before down), the
    mask taken on it; ``residual`` [B, out]: y = residual + the product (O and down's residual add)."""
    _check(x, w_t, bias, prologue, residual)
    sizes = tuple(int(s) for s in sizes)
    assert 1 <= len(sizes) <= MAX_SEGMENTS, f"1..{MAX_SEGMENTS} segments, got {len(sizes)}"
    assert all(s > 0 for s in sizes) and sum(sizes) == w_t.shape[1], \
        f"segment sizes {sizes} must be positive and sum to out = {w_t.shape[1]}"
    if isinstance(thresholds, torch.Tensor):
        thresholds = _thr_tensor(thresholds, len(sizes), w_t.shape[0], x.device)
    else:
        thresholds = tuple(float(t) for t in thresholds)
        assert len(thresholds) == len(sizes), f"{len(sizes)} thresholds expected, got {len(thresholds)}"
    return _launch(x, w_t, thresholds, sizes, bias, config, prologue, residual)
