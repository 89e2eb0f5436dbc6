"""Triton kernels for head-sparse attention projections (GQA-aware).

    kv_heads_for(q_idx, q_count, n_heads, n_kv_heads) -> (kv_idx [n_kv] int32, kv_count [1] int32,
                                                          kv_slot [Kq] int32)
    head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim,
                    bias=None) -> (q [B, Kq, hd], k [B, Kkv, hd], v [B, Kkv, hd])
    head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=..., bias=None) -> y [B, d]

``w_qkv`` is the packed [ (H + 2*KV) * hd, d ] projection (q rows, then k, then v: one launch);
``w_o_t`` is o_proj.weight.t().contiguous(), [H * hd, d], so each head is hd contiguous rows.
Active KV heads are those any active query head needs (kv = q // (H / KV)), in ascending order;
``kv_slot[j]`` is the position in kv_idx of the KV head of query head ``q_idx[j]``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs as C
from ._tl_common import _dot_rows
from . import common as _c
from ._launch import launch_config, launch_down
from .common import check_idx, check_weight, check_x, next_pow2


@triton.jit
def _kv_heads_kernel(q_idx_ptr, q_count_ptr, kv_idx_ptr, kv_count_ptr, kv_slot_ptr, KQ, GROUP, NKV,
                     HAS_COUNT: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr):
    jq = tl.arange(0, Q_PAD)
    if HAS_COUNT:
        nq = tl.minimum(tl.load(q_count_ptr).to(tl.int32), KQ)
    else:
        nq = KQ
    qv = jq < nq
    qh = tl.load(q_idx_ptr + jq, mask=qv, other=0).to(tl.int32)
    kvh = qh // GROUP
    ks = tl.arange(0, KV_PAD)
    hit = tl.where((kvh[None, :] == ks[:, None]) & qv[None, :], 1, 0)  # [KV_PAD, Q_PAD]
    act = tl.max(hit, axis=1)                                         # [KV_PAD]
    act = tl.where(ks < NKV, act, 0)
    na = tl.where(ks < NKV, 1 - act, 0)
    tot = tl.sum(act, axis=0)
    pos = tl.where(act > 0, tl.cumsum(act, axis=0) - act, tot + tl.cumsum(na, axis=0) - na)
    tl.store(kv_idx_ptr + pos, tl.where(act > 0, ks, 0), mask=ks < NKV)
    tl.store(kv_count_ptr + ks * 0, ks * 0 + tot, mask=ks == 0)
    # slot of kv head h = number of active kv heads below h
    below = tl.where((ks[:, None] < kvh[None, :]) & (act[:, None] > 0), 1, 0)
    slot = tl.sum(below, axis=0)
    tl.store(kv_slot_ptr + jq, tl.where(qv, slot, 0), mask=jq < KQ)


@triton.jit
def _qkv_kernel(x_ptr, stride_xb, w_ptr, b_ptr, q_idx_ptr, q_count_ptr, kv_idx_ptr, kv_count_ptr,
                out_ptr, stride_ob, KQ, KKV, NH, NKV, d, B,
                HD: tl.constexpr, HAS_QC: tl.constexpr, HAS_KVC: tl.constexpr, HAS_BIAS: tl.constexpr,
                B_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output column j of [q | k | v] (KQ*HD + 2*KKV*HD columns) = gathered row of w_qkv . x."""
    pid = tl.program_id(0)
    if HAS_QC:
        nq = tl.minimum(tl.load(q_count_ptr).to(tl.int32), KQ)
    else:
        nq = KQ
    if HAS_KVC:
        nkv = tl.minimum(tl.load(kv_count_ptr).to(tl.int32), KKV)
    else:
        nkv = KKV
    total = (KQ + 2 * KKV) * HD
    j = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    qpart = j < KQ * HD
    jk = j - KQ * HD
    kpart = (jk >= 0) & (jk < KKV * HD)
    jv = jk - KKV * HD
    vpart = (jv >= 0) & (j < total)
    local = tl.where(qpart, j, tl.where(kpart, jk, jv))   # column within its part
    slot = local // HD
    valid = tl.where(qpart, slot < nq, slot < nkv) & (j < total)
    hq = tl.load(q_idx_ptr + slot, mask=qpart & valid, other=0).to(tl.int64)
    hkv = tl.load(kv_idx_ptr + slot, mask=(kpart | vpart) & valid, other=0).to(tl.int64)
    base = tl.where(qpart, hq, tl.where(kpart, NH + hkv, NH + NKV + hkv))
    rows = base * HD + local % HD
    any_valid = tl.max(valid.to(tl.int32), axis=0) > 0
    kend = tl.where(any_valid, d, 0)
    a1, a2 = _dot_rows(x_ptr, stride_xb, w_ptr, w_ptr, rows * d, valid, d, kend, B,
                       False, B_PAD, BLOCK_R, BLOCK_K)
    if HAS_BIAS:
        a1 += tl.load(b_ptr + rows, mask=valid, other=0.0).to(tl.float32)[None, :]
    bs = tl.arange(0, B_PAD)
    h = tl.where(valid[None, :], a1, 0.0)
    tl.store(out_ptr + bs[:, None] * stride_ob + j[None, :], h.to(out_ptr.dtype.element_ty),
             mask=(bs[:, None] < B) & (j[None, :] < total))


def kv_heads_for(q_idx, q_count, n_heads, n_kv_heads):
    assert n_heads % n_kv_heads == 0
    check_idx(q_idx, q_count, q_idx.device)
    assert q_idx.shape[0] <= 4096 and n_heads <= 1024
    dev = q_idx.device
    kv_idx = _c.empty(n_kv_heads, dev, torch.int32)
    kv_count = _c.empty(1, dev, torch.int32)
    kv_slot = _c.empty(q_idx.shape[0], dev, torch.int32)
    _kv_heads_kernel[(1,)](q_idx, q_count if q_count is not None else q_idx, kv_idx, kv_count, kv_slot,
                           q_idx.shape[0], n_heads // n_kv_heads, n_kv_heads,
                           HAS_COUNT=q_count is not None, Q_PAD=next_pow2(q_idx.shape[0]),
                           KV_PAD=next_pow2(n_kv_heads), num_warps=4)
    return kv_idx, kv_count, kv_slot


def head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim,
                    bias=None, *, config=None):
    d = w_qkv.shape[1]
    check_x(x, d)
    assert x.is_contiguous()
    check_weight(w_qkv, "w_qkv", d, x.dtype, x.device)
    assert w_qkv.shape[0] == (n_heads + 2 * n_kv_heads) * head_dim
    check_idx(q_idx, q_count, x.device)
    check_idx(kv_idx, kv_count, x.device)
    if bias is not None:
        assert bias.shape == (w_qkv.shape[0],) and bias.device == x.device
    B = x.shape[0]
    KQ, KKV = q_idx.shape[0], kv_idx.shape[0]
    total = (KQ + 2 * KKV) * head_dim
    out = _c.empty((B, total), x.device, x.dtype)
    bp = C.b_pad(B)
    cfg = launch_config("gather", bp, config, x.device)
    block_k = min(cfg["BLOCK_K"] or next_pow2(d), next_pow2(d))
    block_r = cfg["BLOCK_R"]
    _qkv_kernel[(triton.cdiv(total, block_r),)](
        x, x.stride(0), w_qkv, bias if bias is not None else w_qkv, q_idx,
        q_count if q_count is not None else q_idx, kv_idx, kv_count if kv_count is not None else kv_idx,
        out, out.stride(0), KQ, KKV, n_heads, n_kv_heads, d, B,
        HD=head_dim, HAS_QC=q_count is not None, HAS_KVC=kv_count is not None, HAS_BIAS=bias is not None,
        B_PAD=bp, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=cfg["num_warps"],
    )
    q = out[:, : KQ * head_dim].view(B, KQ, head_dim)
    k = out[:, KQ * head_dim: (KQ + KKV) * head_dim].view(B, KKV, head_dim)
    v = out[:, (KQ + KKV) * head_dim:].view(B, KKV, head_dim)
    return q, k, v


def head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=None, bias=None, *, config=None):
    assert head_dim is not None
    B = attn.shape[0]
    h = attn.reshape(B, -1)
    if not h.is_contiguous():
        h = h.contiguous()
    assert h.shape[1] == q_idx.shape[0] * head_dim
    check_weight(w_o_t, "w_o_t", w_o_t.shape[1], attn.dtype, attn.device)
    check_idx(q_idx, q_count, attn.device)
    return launch_down(h, w_o_t, q_idx, q_count, bias, head_dim, attn.dtype, config)
