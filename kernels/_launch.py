"""Launch helpers shared by the Triton op modules, and the two kernels they launch for more than one op.

    launch_config(name, bp, override, device)   the frozen config of ``configs.FUSED`` / ``GATHER`` / ``DOWN``
                                                for batch pad ``bp`` (the interpreter's on the CPU), overridden
    use_dot(cfg, t)                             whether a launch takes the tensor-core tl.dot path
    launch_down(h, w_t, idx, count, bias, group, out_dtype, config)
        y = h @ W^T[rows] over gathered rows of a transposed weight (the FFN's down, the head-sparse O
        projection), split-K partials in fp32, then ``launch_reduce``
    launch_reduce(ws, nsplit, bias, y, block, pdl)
        y = sum over the splits of the fp32 partials ws [nsplit, B, d] (+ bias), in a fixed order (no atomics:
        the same inputs give the same bits); every split-K op ends with it

Imported only by the Triton op modules; importing it imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as _c
from . import configs as C
from ._tl_common import _accum_rows
from .common import next_pow2


@triton.jit
def _gather_down_kernel(
    h_ptr, stride_hb, wt_ptr, idx_ptr, count_ptr, ws_ptr,
    K, d, B,
    GROUP: tl.constexpr, HAS_COUNT: tl.constexpr,
    B_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (d-chunk, split): partial[split, b, chunk] = sum over the split's rows j of
    h[b, j] * W^T[row(j), chunk], row(j) = idx[j // GROUP] * GROUP + j % GROUP."""
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    nsplit = tl.num_programs(1)
    if HAS_COUNT:
        n = tl.minimum(tl.load(count_ptr).to(tl.int32), K) * GROUP
    else:
        n = K * GROUP
    nblk = (n + BLOCK_R - 1) // BLOCK_R
    per = ((nblk + nsplit - 1) // nsplit) * BLOCK_R
    start = pid_s * per
    end = tl.minimum(start + per, n)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < d
    bs = tl.arange(0, B_PAD)
    acc = tl.zeros([B_PAD, BLOCK_D], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        rm = j < end
        head = tl.load(idx_ptr + j // GROUP, mask=rm, other=0).to(tl.int64)
        roff = (head * GROUP + j % GROUP) * d
        w = tl.load(wt_ptr + roff[:, None] + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                    eviction_policy="evict_first")
        hv = tl.load(h_ptr + bs[:, None] * stride_hb + j[None, :],
                     mask=(bs[:, None] < B) & rm[None, :], other=0.0)
        if USE_DOT:  # h rounded to the weight dtype (fp16/bf16), fp32 accumulation on tensor cores
            hv = hv.to(w.dtype)
            if DOT_F32:
                acc = tl.dot(hv.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(hv, w, acc)
        else:
            acc = _accum_rows(acc, hv.to(tl.float32), w.to(tl.float32), B_PAD)
    tl.store(ws_ptr + (pid_s * B + bs[:, None]) * d + cols[None, :], acc,
             mask=(bs[:, None] < B) & cm[None, :])


@triton.jit
def _reduce_kernel(ws_ptr, bias_ptr, y_ptr, stride_yb, NSPLIT, B, d,
                   HAS_BIAS: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[b, c] = sum_s ws[s, b, c] (+ bias[c]): one [S_PAD, BLOCK] tile, fixed reduction tree. PDL: launched
    early (programmatic dependent launch); waits here until the partials' grid has finished and its writes
    are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat over B * d
    om = offs < B * d
    ss = tl.arange(0, S_PAD)
    part = tl.load(ws_ptr + ss[:, None] * (B * d) + offs[None, :],
                   mask=(ss[:, None] < NSPLIT) & om[None, :], other=0.0)
    acc = tl.sum(part, axis=0)
    c = offs % d
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=om, other=0.0).to(tl.float32)
    b = offs // d
    tl.store(y_ptr + b * stride_yb + c, acc.to(y_ptr.dtype.element_ty), mask=om)


def launch_config(name: str, bp: int, override: dict | None, device=None) -> dict:
    """The frozen config ``name`` ("fused" | "gather" | "down") for batch pad ``bp`` (the largest entry past the
    table), the interpreter's on the CPU, then ``override``."""
    table = {"fused": C.FUSED, "gather": C.GATHER, "down": C.DOWN}[name]
    cfg = dict(table[bp] if bp in table else table[max(table)])
    if device is not None and device.type == "cpu":
        cfg.update(C.INTERP[name])
    if override:
        cfg.update(override)
    return cfg


def use_dot(cfg, t) -> bool:
    """Tensor-core tl.dot path (batch padded to 16): fp16/bf16 only (fp32 keeps exact FMA math)."""
    return bool(cfg.get("dot")) and t.dtype in (torch.float16, torch.bfloat16)


def launch_reduce(ws, nsplit, bias, y, block=None, pdl=False):
    B, d = y.shape
    s_pad = next_pow2(nsplit)
    block = block or max(16, min(1024, 8192 // s_pad))
    grid = (triton.cdiv(B * d, block),)
    extra = dict(launch_pdl=True) if pdl else {}
    _reduce_kernel[grid](ws, bias if bias is not None else ws, y, y.stride(0), nsplit, B, d,
                         HAS_BIAS=bias is not None, S_PAD=s_pad, BLOCK=block, PDL=pdl, num_warps=4, **extra)
    return y


def launch_down(h, w_t, idx, count, bias, group, out_dtype, config=None):
    B = h.shape[0]
    d = w_t.shape[1]
    K = idx.shape[0]
    bp = C.b_pad(B)
    cfg = launch_config("down", bp, config, h.device)
    block_d = min(cfg["BLOCK_D"], next_pow2(d))
    dot = use_dot(cfg, w_t)
    if dot:
        bp = 16
        assert cfg["BLOCK_R"] >= 16 and block_d >= 16, "the tl.dot path needs BLOCK_R, BLOCK_D >= 16"
    nsplit = max(1, min(cfg["splits"], triton.cdiv(K * group, cfg["BLOCK_R"])))
    ws = _c.empty((nsplit, B, d), h.device, torch.float32)
    grid = (triton.cdiv(d, block_d), nsplit)
    _gather_down_kernel[grid](
        h, h.stride(0), w_t, idx, count if count is not None else idx, ws, K, d, B,
        GROUP=group, HAS_COUNT=count is not None, B_PAD=bp, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=block_d,
        USE_DOT=dot, DOT_F32=dot and h.device.type == "cpu", num_warps=cfg["num_warps"],
    )
    y = _c.empty((B, d), h.device, out_dtype)
    return launch_reduce(ws, nsplit, bias, y)
