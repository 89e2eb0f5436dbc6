"""Triton kernels for a prefill's elementwise steps: RMS norm and the rotate-half rotary embedding, one kernel each.

    rms_norm(x, w, eps, one_plus=False) -> y, x's shape
    rotary(x, cos, sin) -> y [B, H, T, D] contiguous

Both compute in fp32 and take fp32 tensors (the float32 scoring forwards; other dtypes stay with the eager code).
``rms_norm``: one program per row of the last dim, y = x / rms(x) * w (Llama, Qwen2), or * (1 + w) with
``one_plus`` (Gemma-3); the reference is :func:`kernels.reference.rms_norm`. ``rotary``: x [B, H, T, D] with any
strides but a unit last one (the transposed view attention makes of its projections), cos / sin [B, T, D]; one
program per (b, t), every head of it: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]), the
reference :func:`kernels.reference.rot_half`. In eager PyTorch the norm is five kernels over the activations
(pow, mean, add and rsqrt, two multiplies) and the rotary embedding of q and k ten (slices, a negation, a
concatenation, multiplies, adds); here they read and write each activation once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps, ONE_PLUS: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = w + 1.0
    tl.store(out_ptr + row * stride_out + cols, x * rstd * w, mask=live)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, T, sxb, sxh, sxt, scb, sct, HALF, BLOCK_H: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)     # one (b, t): every head of the token, its cos / sin row read once
    t = pid % T
    b = pid // T
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    col = i < HALF
    live = (h < H) & col
    xp = x_ptr + b * sxb + h * sxh + t * sxt
    cp = cos_ptr + b * scb + t * sct
    sp = sin_ptr + b * scb + t * sct
    x1 = tl.load(xp + i, mask=live, other=0.0)
    x2 = tl.load(xp + HALF + i, mask=live, other=0.0)
    c1 = tl.load(cp + i, mask=col, other=0.0)
    c2 = tl.load(cp + HALF + i, mask=col, other=0.0)
    s1 = tl.load(sp + i, mask=col, other=0.0)
    s2 = tl.load(sp + HALF + i, mask=col, other=0.0)
    op = out_ptr + ((b * H + h) * T + t) * (2 * HALF)
    tl.store(op + i, x1 * c1 - x2 * s1, mask=live)
    tl.store(op + HALF + i, x2 * c2 + x1 * s2, mask=live)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def _fp32(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32:
            raise ValueError(f"norm_rope_triton takes float32 tensors, got {t.dtype}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, one_plus: bool = False) -> torch.Tensor:
    _fp32(x, w)
    d = x.shape[-1]
    if w.shape != (d,):
        raise ValueError(f"rms_norm: weight of shape {tuple(w.shape)} for rows of {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, w.contiguous(), out, d, rows.stride(0), out.stride(0), float(eps),
                                           ONE_PLUS=bool(one_plus), BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _fp32(x, cos, sin)
    if x.ndim != 4 or cos.ndim != 3 or cos.shape != sin.shape or x.shape[-1] % 2:
        raise ValueError(f"rotary: x [B, H, T, D] (D even) and cos / sin [B, T, D], got {tuple(x.shape)} and "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    B, H, T, D = x.shape
    if cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"rotary: cos / sin {tuple(cos.shape)} for x {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, H, T, D), dtype=torch.float32, device=x.device)
    if out.numel():
        block, block_h = triton.next_power_of_2(D // 2), triton.next_power_of_2(H)
        _rope_kernel[(B * T,)](x, cos, sin, out, H, T, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                               cos.stride(1), D // 2, BLOCK_H=block_h, BLOCK=block, num_warps=_warps(block * block_h))
    return out
