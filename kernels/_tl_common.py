"""Shared Triton device helpers (activation, gathered-row dot products).

Imported only by the Triton op modules; importing it imports triton.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _act(v, ACT: tl.constexpr):
    """Activation in fp32; ``ACT`` is the code of the name in kernels.common.ACTS (none 0, relu 1, silu 2,
    gelu_tanh 3, gelu 4). gelu_tanh uses 0.5*(1+tanh(z)) == sigmoid(2z) (no tanh intrinsic needed); gelu is
    exact: 0.5*v*(1+erf(v/sqrt(2)))."""
    if ACT == 1:
        v = tl.maximum(v, 0.0)
    elif ACT == 2:
        v = v / (1.0 + tl.exp(-v))
    elif ACT == 3:
        z = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = v / (1.0 + tl.exp(-2.0 * z))
    elif ACT == 4:
        v = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
    return v


@triton.jit
def _dot_rows(x_ptr, stride_xb, w1_ptr, w2_ptr, roff, rmask, d, kend, B,
              TWO: tl.constexpr, B_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[b, r] = sum_k W[row r, k] * x[b, k] for BLOCK_R gathered rows (row offsets `roff` in elements).

    Loops over d in BLOCK_K chunks up to `kend` (d, or 0 for a program with no valid row: no loads at all).
    With TWO, a second matrix with the same row offsets shares the x loads (gate and up).
    Returns two [B_PAD, BLOCK_R] fp32 accumulators (the second equals the first when not TWO).
    """
    if B_PAD == 1:
        a1 = tl.zeros([BLOCK_R], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, kend, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < d
            xv = tl.load(x_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            wm = rmask[:, None] & cm[None, :]
            w1 = tl.load(w1_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0,
                         eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(w2_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0,
                             eviction_policy="evict_first")
                a2 += tl.sum(w2.to(tl.float32) * xv[None, :], axis=1)
            a1 += tl.sum(w1.to(tl.float32) * xv[None, :], axis=1)
        r1 = a1[None, :]
        if TWO:
            r2 = a2[None, :]
        else:
            r2 = r1
    else:
        bs = tl.arange(0, B_PAD)
        r1 = tl.zeros([B_PAD, BLOCK_R], dtype=tl.float32)
        r2 = tl.zeros([B_PAD, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, kend, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < d
            xv = tl.load(x_ptr + bs[:, None] * stride_xb + cols[None, :],
                         mask=(bs[:, None] < B) & cm[None, :], other=0.0).to(tl.float32)
            wm = rmask[:, None] & cm[None, :]
            w1 = tl.load(w1_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0,
                         eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(w2_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0,
                             eviction_policy="evict_first")
                r2 += tl.sum(w2.to(tl.float32)[None, :, :] * xv[:, None, :], axis=2)
            r1 += tl.sum(w1.to(tl.float32)[None, :, :] * xv[:, None, :], axis=2)
        if not TWO:
            r2 = r1
    return r1, r2


@triton.jit
def _accum_rows(acc, h, w, B_PAD: tl.constexpr):
    """acc[b, c] += sum_r h[b, r] * w[r, c]  (acc [B_PAD, C], h [B_PAD, R] fp32, w [R, C] fp32)."""
    if B_PAD == 1:
        hv = tl.sum(h, axis=0)
        acc += tl.sum(hv[:, None] * w, axis=0)[None, :]
    else:
        acc += tl.sum(h[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def _dot_rows_mma(x_ptr, stride_xb, w1_ptr, w2_ptr, roff, rmask, d, kend, B,
                  TWO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NB: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """Tensor-core version of _dot_rows for batch > 1: [BLOCK_R, BLOCK_K] x [BLOCK_K, NB] tl.dot with the
    batch padded to NB (16) columns; x is cast to the weight dtype (fp16/bf16 only). Returns [NB, BLOCK_R].
    DOT_F32 (set only under the CPU interpreter, whose bf16 tl.dot is broken in triton 3.9) upcasts."""
    bs = tl.arange(0, NB)
    a1 = tl.zeros([BLOCK_R, NB], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_R, NB], dtype=tl.float32)
    for k0 in range(0, kend, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < d
        xt = tl.load(x_ptr + bs[None, :] * stride_xb + cols[:, None], mask=(bs[None, :] < B) & cm[:, None], other=0.0)
        wm = rmask[:, None] & cm[None, :]
        w1 = tl.load(w1_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
        xt = xt.to(w1.dtype)
        if DOT_F32:
            xt = xt.to(tl.float32)
        if TWO:
            w2 = tl.load(w2_ptr + roff[:, None] + cols[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
            if DOT_F32:
                w2 = w2.to(tl.float32)
            a2 = tl.dot(w2, xt, a2)
        if DOT_F32:
            w1 = w1.to(tl.float32)
        a1 = tl.dot(w1, xt, a1)
    r1 = tl.trans(a1)
    if TWO:
        r2 = tl.trans(a2)
    else:
        r2 = r1
    return r1, r2
