"""Triton kernel for a top-k mask in one pass over the scores:

    topk_mask(scores, k) -> bool [T, n]: each row's k largest scores

What the evaluation forward of a top-k setting needs on every FFN layer (the oracle's |activations|, Deja Vu's and
the SVD predictor's scores). Eager PyTorch makes it as a top-k (a radix select writing k values and k indices per
row), a zeroed mask and a scatter of the indices. Here one program holds one row in registers: it reads the scores
once, finds the k-th largest by 32 counting passes over their bits, and writes the mask once.

The set: every score above the k-th largest, and of the scores equal to it the first ones by column, k in all.
Where a row's k-th largest score is unique the set is exactly ``torch.topk``'s. Where it ties, ``torch.topk``
says nothing about which tied entries it returns; these are the lowest columns. The scores are float32 and not
NaN; a row fits one program up to ``MAX_N`` entries (an FFN's width: SmolLM2's 1536, Gemma-3-270M's 2048, 7B
models' 11008). The reference is :func:`reference_topk_mask`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16384


@triton.jit(do_not_specialize=["k"])     # one compile per width (a program per row), whatever the budget
def _topk_mask_kernel(s_ptr, out_ptr, n, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    s = tl.load(s_ptr + row * n + cols, mask=live, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)              # -0.0 as +0.0: equal scores, as torch.topk compares them
    bits = s.to(tl.int32, bitcast=True)
    # float order as int32 order: a negative float's magnitude bits reversed (only a NaN maps to INT32_MIN)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(live, key, -2147483648)       # never counted: every candidate below is above INT32_MIN
    # the k-th largest key, built from the sign bit down: the largest t with at least k keys >= t
    t = tl.where(tl.sum((key >= 0).to(tl.int32), axis=0) >= k, 0, -2147483648)
    for bit in tl.static_range(30, -1, -1):
        cand = t | (1 << bit)                    # t's lower bits are 0: t + 2^bit, in order for either sign
        t = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= k, cand, t)
    above = key > t
    tie = (key == t) & live
    need = k - tl.sum(above.to(tl.int32), axis=0)
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))
    tl.store(out_ptr + row * n + cols, keep, mask=live)


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, n]: each row's ``k`` largest of float32 ``scores`` [T, n] (module docstring: ties)."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"topk_mask takes float32 scores [T, n], got {scores.dtype} of shape {tuple(scores.shape)}")
    rows, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"topk_mask needs 0 <= k <= {n}, got {k}")
    if n > MAX_N:
        raise ValueError(f"topk_mask holds a row of at most {MAX_N} scores in one program, got {n}")
    if not rows or not k:
        return torch.zeros((rows, n), dtype=torch.bool, device=scores.device)
    out = torch.empty((rows, n), dtype=torch.bool, device=scores.device)     # every entry is written
    _topk_mask_kernel[(rows,)](scores.contiguous(), out, n, int(k), BLOCK=triton.next_power_of_2(n),
                               num_warps=4 if n <= 4096 else 8)
    return out


def reference_topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The same set in eager PyTorch: a stable descending sort puts equal scores in column order."""
    m = torch.zeros_like(scores, dtype=torch.bool)
    if k:
        m.scatter_(1, scores.sort(dim=1, descending=True, stable=True).indices[:, :k], True)
    return m
