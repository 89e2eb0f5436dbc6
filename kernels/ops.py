"""Dispatcher: Triton on CUDA, the in-place row kernels of kernels.cpu on the CPU, the index_select path on
Ascend NPUs, the torch reference elsewhere.

Every function here has the signature of the op of the same name in kernels.reference; the
environment variable ``CTXSPARSE_KERNELS`` (triton | cpu | npu | reference) forces a backend (the CPU
tests use ``triton`` with ``TRITON_INTERPRET=1``). ``OPS`` is the one op table, and one rule picks the
function: the backend's own where it has one, else the reference's (``_op``). ``sparse_ffn`` / ``sparse_mlp``
fall back to a dense cuBLAS FFN (masked to the same active set, so the result is the same function) where
``configs.DENSE_FROM_BATCH`` says dense was measured faster (GPU only: on the CPU a masked dense FFN reads
the same rows as the sparse one). ``dense_ffn`` / ``dense_mlp``: the fastest dense FFN of the backend.
"""
from __future__ import annotations

import importlib
import os
import types

import torch

from . import configs as C
from . import cpu as _cpu
from . import npu as _npu
from . import reference as _ref
from .common import MAX_BATCH

# Every op, and the Triton module that has its kernel (None: none; the reference runs there). kernels.cpu and
# kernels.npu define the ops they have under these names; whatever a backend lacks runs kernels.reference's.
OPS = {
    "gated_gather_gemv": "ffn_triton",
    "gather_gemv": "ffn_triton",
    "gather_down": "ffn_triton",
    "compact": "ffn_triton",
    "union_active": "ffn_triton",
    "sequential_gate_filter": "ffn_triton",
    "sparse_ffn": "ffn_triton",
    "sparse_mlp": "ffn_triton",
    "dense_ffn": None,
    "dense_mlp": None,
    "kv_heads_for": "attn_triton",
    "head_sparse_qkv": "attn_triton",
    "head_sparse_out": "attn_triton",
    "decode_attention": "decode_attn_triton",
    "rms_norm": None,
    "add_rms_norm": None,
    "input_sparse_linear": "input_sparse_triton",
    "input_sparse_linear_segments": "input_sparse_triton",
    "topk_select": "select_triton",
    "topk_threshold": "select_triton",
}
_TRITON = None


def _triton_backend():
    """The Triton ops of OPS in one namespace (their modules imported on first use: importing triton is slow)."""
    global _TRITON
    if _TRITON is None:
        _TRITON = types.SimpleNamespace(**{name: getattr(importlib.import_module(f"kernels.{mod}"), name)
                                           for name, mod in OPS.items() if mod is not None})
    return _TRITON


def backend_name(t: torch.Tensor) -> str:
    forced = os.environ.get("CTXSPARSE_KERNELS")
    if forced:
        if forced not in ("triton", "cpu", "npu", "reference"):
            raise ValueError(f"CTXSPARSE_KERNELS={forced!r}")
        return forced
    if t.device.type == "cuda":
        return "triton"
    if t.device.type == "npu":
        return "npu"
    if t.device.type == "cpu":
        return "cpu"
    return "reference"


def backend(t: torch.Tensor):
    name = backend_name(t)
    if name == "triton":
        return _triton_backend()
    return {"npu": _npu, "cpu": _cpu}.get(name, _ref)


def _op(x, name: str):
    """The one fallback rule: ``x``'s backend's own ``name`` (an op of OPS), else the torch reference's."""
    return getattr(backend(x), name, None) or getattr(_ref, name)


def gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None):
    return _op(x, "gated_gather_gemv")(x, w_gate, w_up, idx, count, act, out_dtype)


def gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None):
    return _op(x, "gather_gemv")(x, w, idx, count, act, bias, scale, out_dtype)


def gather_down(h, w_t, idx, count=None, bias=None, group=1, *, out_dtype=None):
    return _op(h, "gather_down")(h, w_t, idx, count, bias, group, out_dtype=out_dtype)


def compact(keep, idx=None, values=None):
    return _op(keep, "compact")(keep, idx, values)


def union_active(mask):
    return _op(mask, "union_active")(mask)


def sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0):
    return _op(x, "sequential_gate_filter")(x, w_gate, idx, count, act, threshold)


def _dense_faster(x, idx, n: int, gated: bool, allow_dense: bool) -> bool:
    """Whether a sparse FFN of ``x`` over ``idx`` runs the masked dense FFN instead: past MAX_BATCH, or below the
    measured crossover (``allow_dense``); never on the CPU backend (any batch; a masked dense FFN reads the same
    rows there)."""
    if backend_name(x) == "cpu":
        return False
    return x.shape[0] > MAX_BATCH or (allow_dense and C.use_dense(x.shape[0], idx.shape[0], n, gated=gated))


def sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None, *, allow_dense=True):
    if _dense_faster(x, idx, w_gate.shape[0], True, allow_dense):
        mask = _ref.active_mask(idx, count, w_gate.shape[0])
        return _ref.dense_ffn(x, w_gate, w_up, w_down_t, act, mask)
    return _op(x, "sparse_ffn")(x, w_gate, w_up, w_down_t, idx, count, act, threshold)


def damage_filter_ffn(x, w_gate, w_up, w_down_t, idx, count, act, threshold, weight):
    """Gated FFN, sequential pipeline with the damage filter: gate and up on the rows ``idx`` (a predicted
    superset), then the rows whose |act(gate)·up|·weight[i] <= ``threshold`` for every token of the batch dropped
    before down (the kept rows compacted on the device: no host sync, graph-capturable). ``weight`` [D] fp32:
    c_i = ‖g ⊙ W_down[:, i]‖ (workers.sparsity.predictors.base.neuron_out_norm)."""
    h = gated_gather_gemv(x, w_gate, w_up, idx, count, act, out_dtype=torch.float32)
    rows = idx
    if count is not None:          # entries past count may hold anything: read c at row 0 there, and drop them
        valid = torch.arange(idx.shape[0], device=idx.device) < count
        rows = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
    keep = (h.abs() * weight.index_select(0, rows)).gt(threshold).any(0)
    if count is not None:
        keep &= valid
    idx2, count2, h2 = compact(keep, idx, h)
    return gather_down(h2, w_down_t, idx2, count2, out_dtype=x.dtype)


def sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu", *, allow_dense=True):
    if _dense_faster(x, idx, w_fc1.shape[0], False, allow_dense):
        mask = _ref.active_mask(idx, count, w_fc1.shape[0])
        return _ref.dense_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act, mask)
    return _op(x, "sparse_mlp")(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count, act)


def dense_ffn(x, w_gate, w_up, w_down_t, act="silu", mask=None):
    return _op(x, "dense_ffn")(x, w_gate, w_up, w_down_t, act, mask)


def dense_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act="relu", mask=None):
    return _op(x, "dense_mlp")(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act, mask)


def kv_heads_for(q_idx, q_count, n_heads, n_kv_heads):
    return _op(q_idx, "kv_heads_for")(q_idx, q_count, n_heads, n_kv_heads)


def head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim, bias=None):
    return _op(x, "head_sparse_qkv")(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads,
                                     head_dim, bias)


def head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=None, bias=None):
    return _op(attn, "head_sparse_out")(attn, w_o_t, q_idx, q_count, head_dim, bias)


def decode_attention(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None, eps=1e-6,
                     window=None, q_idx=None, q_count=None, n_heads=None, valid=None):
    """One-token attention with RoPE, q/k norms and the cache write (kernels.reference.decode_attention): one
    Triton kernel on CUDA, one native call on the CPU (fp32), the torch reference elsewhere."""
    return _op(q, "decode_attention")(q, k, v, k_cache, v_cache, pos, cos_t, sin_t, q_norm, k_norm, eps, window,
                                      q_idx, q_count, n_heads, valid)


def rms_norm(x, w, eps, one_plus=False):
    return _op(x, "rms_norm")(x, w, eps, one_plus)


def add_rms_norm(x, y, w, eps, one_plus=False):
    return _op(x, "add_rms_norm")(x, y, w, eps, one_plus)


INPUT_PATHS = ("auto",) + C.INPUT_PATHS


def check_input_path(path: str) -> str:
    """``path`` if it is one of INPUT_PATHS ("auto": the kernel's own choice by shape and batch; "mask": the
    masked-load kernel; "local": the compaction inside each program), else ValueError naming them."""
    if path not in INPUT_PATHS:
        raise ValueError(f"input path must be one of {INPUT_PATHS}, got {path!r}")
    return path


def _input_path_config(x, path: str):
    """The Triton kernel's launch override for ``path``; other backends have one path: "auto" only."""
    if check_input_path(path) == "auto":
        return {}
    if backend_name(x) != "triton":
        raise ValueError(f"input path {path!r} is a Triton kernel choice; backend here: {backend_name(x)}")
    return {"config": {"path": path}}


def input_sparse_linear(x, w_t, threshold, bias=None, *, path="auto"):
    return _op(x, "input_sparse_linear")(x, w_t, threshold, bias, **_input_path_config(x, path))


def input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None, *, path="auto", prologue=None,
                                 residual=None):
    """The input-sparse product; ``prologue`` (kernels.common.Prologue) and ``residual`` fused where the
    backend's kernel takes them (Triton, the reference), else the same ops composed around it."""
    fn = _op(x, "input_sparse_linear_segments")
    cfg = _input_path_config(x, path)
    if prologue is None and residual is None:
        return fn(x, w_t, thresholds, sizes, bias, **cfg)
    if backend_name(x) in ("triton", "reference"):
        return fn(x, w_t, thresholds, sizes, bias, prologue=prologue, residual=residual, **cfg)
    return _ref.around_product(lambda h: fn(h, w_t, thresholds, sizes, bias, **cfg), x, prologue, residual)


def topk_select(scores, k, *, multi=None):
    """Indices of the ``k`` largest scores per row, int32, ascending, ties to the lowest index (the reference's
    result; kernels.select_triton's radix select where the Triton kernels run). ``multi`` (Triton only): True /
    False forces the multi-CTA / one-CTA select; None leaves it to the kernel's size rule."""
    if multi is None:
        return _op(scores, "topk_select")(scores, k)
    if backend_name(scores) != "triton":
        raise ValueError(f"multi={multi!r} is a Triton kernel choice; backend here: {backend_name(scores)}")
    return _op(scores, "topk_select")(scores, k, multi=multi)


def topk_threshold(x, k, nseg=1):
    """Each row's threshold keeping its ``k`` largest |x_j| under the input-sparse kernels' rule |x_j| > t:
    fp32 [B, nseg] (kernels.reference.topk_threshold; one launch where the Triton kernels run)."""
    return _op(x, "topk_threshold")(x, k, nseg)
