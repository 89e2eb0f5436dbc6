"""Index path for Ascend NPUs (and any torch device): ``index_select`` of the active rows, then dense
matmuls in the model dtype. Same signatures as kernels.reference.

``torch_npu`` is imported lazily, only when a tensor lives on an ``npu`` device; it is never needed
elsewhere (the CPU CI runs this module on CPU tensors). On an NPU the gathered copy costs one extra
read+write of the active rows (the price of having no fused gather kernel there); on CUDA the Triton
kernels avoid it and benchmarks.kernels shows the gap ("torch_index" rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference as _ref
from .common import apply_act, group_rows, valid_mask

_NPU_READY = False


def _ensure_backend(t: torch.Tensor) -> None:
    global _NPU_READY
    if t.device.type == "npu" and not _NPU_READY:
        import torch_npu  # noqa: F401  (registers the npu device with torch)

        _NPU_READY = True


def _zero_invalid(h, valid):
    return h * valid.to(h.dtype)[None, :]


def gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None, *, config=None):
    _ensure_backend(x)
    valid = valid_mask(idx, count)
    rows = group_rows(idx, valid, 1)
    g = F.linear(x, w_gate.index_select(0, rows))
    u = F.linear(x, w_up.index_select(0, rows))
    return _zero_invalid(apply_act(g, act) * u, valid).to(out_dtype or x.dtype)


def gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None, *, config=None):
    _ensure_backend(x)
    valid = valid_mask(idx, count)
    rows = group_rows(idx, valid, 1)
    z = F.linear(x, w.index_select(0, rows), bias.index_select(0, rows) if bias is not None else None)
    h = apply_act(z, act)
    if scale is not None:
        h = (scale * h.to(scale.dtype))
    return _zero_invalid(h, valid).to(out_dtype or x.dtype)


def gather_down(h, w_t, idx, count=None, bias=None, group=1, *, out_dtype=None, config=None):
    _ensure_backend(h)
    valid = valid_mask(idx, count)
    rows = group_rows(idx, valid, group)
    vg = valid.repeat_interleave(group) if group > 1 else valid
    hh = _zero_invalid(h.to(w_t.dtype), vg)
    y = hh @ w_t.index_select(0, rows)
    if bias is not None:
        y = y + bias
    return y.to(out_dtype or w_t.dtype)


def sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0, *, config=None):
    _ensure_backend(x)
    valid = valid_mask(idx, count)
    rows = group_rows(idx, valid, 1)
    a = _zero_invalid(apply_act(F.linear(x, w_gate.index_select(0, rows)).float(), act), valid)
    keep = valid & (a.abs() > threshold).any(dim=0)
    idx2, count2, a2 = _ref.compact(keep, idx, a)
    return a2, idx2, count2


def sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None, *, path=None, config=None):
    if threshold is not None:
        a2, idx2, count2 = sequential_gate_filter(x, w_gate, idx, count, act, threshold)
        h = gather_gemv(x, w_up, idx2, count2, scale=a2, out_dtype=x.dtype)
        return gather_down(h, w_down_t, idx2, count2, out_dtype=x.dtype)
    h = gated_gather_gemv(x, w_gate, w_up, idx, count, act)
    return gather_down(h, w_down_t, idx, count)


def sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu", *, path=None, config=None):
    h = gather_gemv(x, w_fc1, idx, count, act=act, bias=b_fc1)
    return gather_down(h, w_fc2_t, idx, count, bias=b_fc2)


def head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim, bias=None,
                    *, config=None):
    _ensure_backend(x)
    B = x.shape[0]
    outs = []
    for part_idx, part_count, off in ((q_idx, q_count, 0), (kv_idx, kv_count, n_heads),
                                      (kv_idx, kv_count, n_heads + n_kv_heads)):
        valid = valid_mask(part_idx, part_count)
        rows = group_rows(part_idx.long() + off, valid, head_dim)
        z = F.linear(x, w_qkv.index_select(0, rows), bias.index_select(0, rows) if bias is not None else None)
        z = _zero_invalid(z, valid.repeat_interleave(head_dim))
        outs.append(z.view(B, part_idx.shape[0], head_dim))
    return tuple(outs)


def head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=None, bias=None, *, config=None):
    B = attn.shape[0]
    return gather_down(attn.reshape(B, -1), w_o_t, q_idx, q_count, bias=bias, group=head_dim,
                       out_dtype=attn.dtype)


def input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None, *, config=None):
    """Input sparsity over ``w_t`` = Wᵀ [in, out] (segments as in kernels.reference): ``index_select`` of the
    rows active for some token under some segment's threshold, then each segment's masked x over those rows.
    Thresholds: floats, a tensor [nseg], or per input channel [nseg, in] (WINA). Finding the rows is one
    ``nonzero`` (a host sync per call): the price of a gather without a masked-load kernel."""
    _ensure_backend(x)
    sizes = [int(s) for s in sizes]
    assert sum(sizes) == w_t.shape[1], f"segment sizes {sizes} must sum to out = {w_t.shape[1]}"
    n_in = x.shape[1]
    if isinstance(thresholds, torch.Tensor) and thresholds.dim() == 2:
        th = thresholds.to(device=x.device, dtype=torch.float32)
    else:
        ts = thresholds if isinstance(thresholds, torch.Tensor) else list(thresholds)
        th = torch.stack([torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1).expand(n_in)
                          for t in ts])
    assert th.shape == (len(sizes), n_in), f"thresholds {tuple(th.shape)} for {len(sizes)} segment(s) of {n_in}"
    on = x.abs().float()[None, :, :] > th[:, None, :]                     # [nseg, B, in]
    rows = on.any(dim=1).any(dim=0).nonzero().squeeze(1)
    wr = w_t.index_select(0, rows)
    xr, onr = x.index_select(1, rows), on.index_select(2, rows)
    outs, lo = [], 0
    for j, s in enumerate(sizes):
        outs.append((xr * onr[j].to(x.dtype)).to(w_t.dtype) @ wr[:, lo:lo + s])
        lo += s
    y = torch.cat(outs, dim=1)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def input_sparse_linear(x, w_t, threshold, bias=None, *, config=None):
    """y = (x · [|x| > t]) @ w_t (+ bias) over the gathered active rows; ``threshold`` a float, a one-element
    tensor or one per input channel [in]."""
    t = threshold.reshape(1, -1) if isinstance(threshold, torch.Tensor) and threshold.numel() > 1 else [threshold]
    return input_sparse_linear_segments(x, w_t, t, [w_t.shape[1]], bias)

