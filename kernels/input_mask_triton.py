"""Triton kernel for the masked input of an input-sparse projection in an evaluation forward, one pass:

    masked_inputs(x, threshold, scale=None) -> where(|x| (· scale) > threshold, x, 0), x's shape

TEAL's score is |x|, WINA's |x| · ‖W[:, i]‖ (``scale``: one value per input channel, the last dim). Eager PyTorch
runs this as three kernels over the activations (abs, compare, where; four with WINA's multiply), each reading
and writing a 32k-token activation; here x is read once and the result written once. The same IEEE operations
in the same order (the threshold a float32 scalar, as PyTorch casts a Python float for a float32 tensor), so the
result equals ``torch.where(input_score(x, scale) > threshold, x, 0)`` bit for bit; the reference is
:func:`kernels.reference.masked_inputs`. Float32 only (the scoring forwards' activations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit(do_not_specialize=["n"])      # one compile whatever the batch's entry count
def _masked_inputs_kernel(x_ptr, s_ptr, out_ptr, n, d, thr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0)
    a = tl.abs(x)
    if HAS_SCALE:
        a = a * tl.load(s_ptr + offs % d, mask=live, other=0.0)
    tl.store(out_ptr + offs, tl.where(a > thr, x, 0.0), mask=live)


def masked_inputs(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype != torch.float32 or (scale is not None and scale.dtype != torch.float32):
        raise ValueError(f"masked_inputs takes float32 tensors, got {x.dtype}"
                         + ("" if scale is None else f" and a {scale.dtype} scale"))
    d = x.shape[-1]
    if scale is not None and scale.shape != (d,):
        raise ValueError(f"masked_inputs: a scale of shape {tuple(scale.shape)} for inputs of {d}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        s = scale.contiguous() if scale is not None else xc
        _masked_inputs_kernel[(triton.cdiv(n, BLOCK),)](xc, s, out, n, d, float(threshold),
                                                        HAS_SCALE=scale is not None, BLOCK=BLOCK, num_warps=8)
    return out
