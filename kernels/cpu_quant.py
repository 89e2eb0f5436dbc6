"""CPU ops over GGUF block-quantized weights (kernels.quant.QuantWeight / QuantWeightT), fp32 activations.

    y = linear(x, w, bias)                 # x @ Wᵀ: the dense GEMV (few tokens), dequantize + matmul for many
    z = rows_dot(x, w, rows, kpad, w2=..., act=...)     # output sparsity: whole quantized rows by an index
    y = dense_ffn(x, w_gate, w_up, w_down, act)         # the dense FFN in one parallel region
    y = rows_axpy_t(weights, wt, rows)     # rows of Wᵀ (exact transposed layout): down over active neurons
    W = dequantize(w) ; E = embedding(ids, w)           # bit for bit the model loader's fp32 values

The weights are dequantized inside the kernels (``cpu_quant.c``, AVX2/FMA where the compiler targets them, a
scalar fallback elsewhere) and multiplied with the fp32 activations in fp32: results equal the products over the
dequantized fp32 weights up to fp32 summation order (tests/kernels/test_quant.py states the tolerance).
``dequantize`` / ``embedding`` are exact. A weight with ``activations="q8"`` (kernels.quant.QuantWeight) is
multiplied llama.cpp's way instead: the few-token kernels quantize the activations to 8 bits per 32 and take
integer products (W x̂, not W x); the dequantize + matmul path of many tokens stays fp32.
Thread count: torch's (one thread: no OpenMP region). Where the
native library cannot be built these ops fall back to the numpy reference dequantizer and torch (slow, but the
same values), and ``native_available()`` says so.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import MAX_BATCH, act_code, apply_act
from .cpu import compile_native
from .quant import QuantWeight, QuantWeightT

_SRC = Path(__file__).with_name("cpu_quant.c")
# d·q + m must stay two fp32 roundings (gguf-py's dequantizer): no contraction into FMA; the kernels' products
# use explicit FMA intrinsics, which this flag leaves alone.
EXTRA_FLAGS = ("-ffp-contract=off",)
_LIBS: dict = {}
_LOCK = threading.Lock()
_F32 = torch.float32


class QPart(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scale", ctypes.c_float)]


def load_library(extra_flags=()) -> ctypes.CDLL | None:
    """The compiled kernels (cached per flag set; ``extra_flags`` e.g. ``-mno-avx2`` builds the scalar fallback)."""
    key = tuple(extra_flags)
    with _LOCK:
        if key not in _LIBS:
            out = compile_native(_SRC, EXTRA_FLAGS + key)
            lib = None
            if out is not None:
                lib = ctypes.CDLL(str(out))
                P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                lib.cs_q_dequant.argtypes = [P, I, I64, P, I64, P, I]
                lib.cs_q_rows.argtypes = [P, I, P, I, I64, P, P, I64, I64, P, I64, I, I, P, I]
                lib.cs_q_ffn.argtypes = [P, I, P, I, P, I, I64, I64, P, P, P, I64, I, I, P, P, I]
                lib.cs_qt_axpy.argtypes = [P, I, I, P, P, I, I64, I64, I64, P, I64, P, I64, I64, P, P, I]
                lib.cs_q_simd.argtypes = []
                for f in (lib.cs_q_dequant, lib.cs_q_rows, lib.cs_q_ffn, lib.cs_qt_axpy, lib.cs_q_simd):
                    f.restype = I
            _LIBS[key] = lib
        return _LIBS[key]


def native_available() -> bool:
    return load_library() is not None


def simd() -> bool:
    """Whether the AVX2/FMA paths run (else the scalar fallback)."""
    lib = load_library()
    return bool(lib is not None and lib.cs_q_simd())


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _parts(w: QuantWeight):
    """(ctypes array of QPart, count); the tensors stay alive through ``w``."""
    arr = (QPart * len(w.parts))()
    for i, p in enumerate(w.parts):
        arr[i] = QPart(p.fmt.ggml_type, p.rows, p.data.shape[1], p.data.data_ptr(), p.scale)
    return arr, len(w.parts)


_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_parts(w: QuantWeight):
    """The QPart array of a weight, made once per weight object (the op runs per layer and token)."""
    c = _PARTS.get(w)
    if c is None:
        c = _PARTS[w] = _parts(w)
    return c


def _p(t):
    return None if t is None else t.data_ptr()


def _f32(t):
    return None if t is None else t.to(_F32).contiguous()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise IndexError(f"{what}: an index is outside the weight's rows, or the weight's layout is invalid")


# ---------------------------------------------------------------------------------------------------------
def dequantize(w: QuantWeight, rows: torch.Tensor | None = None, *, lib=None) -> torch.Tensor:
    """fp32 [k, cols] of the rows ``rows`` (int64; None: all), bit for bit gguf-py's dequantizer (times each
    part's scale, an fp32 product)."""
    lib = lib or load_library()
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    k = w.rows if idx is None else idx.numel()
    if lib is None:
        full = w.dequantize_reference()
        return full if idx is None else full.index_select(0, idx)
    out = torch.empty(k, w.cols, dtype=_F32)
    parts, n = _cached_parts(w)
    _check(lib.cs_q_dequant(parts, n, w.cols, _p(idx), k, out.data_ptr(), _threads()), "dequantize")
    return out


def embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The rows ``ids`` (any shape) of an embedding table kept quantized: [*ids.shape, cols] fp32, exact."""
    return dequantize(w, ids.reshape(-1)).reshape(*ids.shape, w.cols)


def rows_dot(x, w: QuantWeight, rows, kpad: int, *, w2: QuantWeight | None = None, bias=None, act: str = "none",
             lib=None):
    """out [B, kpad] fp32: out[:, j] = act(x @ W[rows[j]] + bias[rows[j]]) (* x @ W2[rows[j]]) for j < len(rows),
    0 beyond; ``rows`` int64 [k] (None: rows 0..kpad-1, the dense GEMV). Whole quantized rows are read."""
    lib = lib or load_library()
    if x.dtype is not _F32 or not x.is_contiguous():
        x = x.to(_F32).contiguous()
    B, n = x.shape
    if n != w.cols or (w2 is not None and (w2.cols != n or w2.rows != w.rows)):
        raise ValueError(f"x [B, {n}] does not match the weight [{w.rows}, {w.cols}]")
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    k = kpad if idx is None else idx.numel()
    if bias is not None and (bias.dtype is not _F32 or not bias.is_contiguous()):
        bias = bias.to(_F32).contiguous()
    if lib is None:
        r = torch.arange(k) if idx is None else idx
        z = apply_act(x @ dequantize(w, r).t() + (bias[r] if bias is not None else 0), act)
        if w2 is not None:
            z = z * (x @ dequantize(w2, r).t())
        out = torch.zeros(B, kpad, dtype=_F32)
        out[:, :k] = z
        return out
    out = torch.empty(B, kpad, dtype=_F32)
    parts, n1 = _cached_parts(w)
    parts2, n2 = _cached_parts(w2) if w2 is not None else (None, 0)
    _check(lib.cs_q_rows(parts, n1, parts2, n2, n, _p(bias), _p(idx), k, kpad, x.data_ptr(), B, act_code(act),
                         w.activations == "q8", out.data_ptr(), _threads()), "rows_dot")
    return out


def linear(x, w: QuantWeight, bias=None):
    """x @ Wᵀ (+ bias), x [..., in] -> [..., out] in x's dtype: the quantized GEMV for up to MAX_BATCH tokens, else
    the weight dequantized (exact) and a matmul (the prefill)."""
    if x.dim() == 2 and x.shape[0] <= MAX_BATCH:           # the decode step: no reshapes
        y = rows_dot(x, w, None, w.rows, bias=bias)
        return y if x.dtype is _F32 else y.to(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= MAX_BATCH:
        y = rows_dot(x2, w, None, w.rows, bias=bias)
    else:
        y = F.linear(x2.to(_F32), dequantize(w), _f32(bias))
    return y.to(x.dtype).reshape(*lead, w.rows)


def dense_ffn(x, w_gate: QuantWeight | None, w_up: QuantWeight, w_down: QuantWeight, act: str = "silu", *,
              b_up=None, b_down=None, lib=None):
    """The dense FFN over quantized weights: y = W_down (act(W_gate x) * (W_up x)) (+ b_down); ``w_gate`` None:
    y = W_down act(W_up x + b_up) (+ b_down). W_gate, W_up [D, d], W_down [d, D] (the file's layout, not Wᵀ).
    x [B, d] -> [B, d] in x's dtype; many tokens: dequantized weights and matmuls."""
    lib = lib or load_library()
    D, d = w_up.shape
    if w_down.shape != (d, D) or (w_gate is not None and w_gate.shape != (D, d)):
        raise ValueError(f"FFN shapes: gate/up [{D}, {d}], down {w_down.shape}")
    xf = x if x.dtype is _F32 and x.is_contiguous() else x.to(_F32).contiguous()
    B = xf.shape[0]
    if b_up is not None or b_down is not None:
        b_up, b_down = _f32(b_up), _f32(b_down)
    if lib is None or B > MAX_BATCH:
        z = F.linear(xf, dequantize(w_up, lib=lib), b_up if w_gate is None else None)
        h = apply_act(F.linear(xf, dequantize(w_gate, lib=lib)), act) * z if w_gate is not None else apply_act(z, act)
        return F.linear(h, dequantize(w_down, lib=lib), b_down).to(x.dtype)
    h = torch.empty(B, D, dtype=_F32)
    y = torch.empty(B, d, dtype=_F32)
    g, ng = _cached_parts(w_gate) if w_gate is not None else (None, 0)
    u, nu = _cached_parts(w_up)
    dn, nd = _cached_parts(w_down)
    _check(lib.cs_q_ffn(g, ng, u, nu, dn, nd, d, D, _p(b_up), _p(b_down), xf.data_ptr(), B, act_code(act),
                        w_up.activations == "q8", h.data_ptr(), y.data_ptr(), _threads()), "dense_ffn")
    return y if x.dtype is _F32 else y.to(x.dtype)


def rows_axpy_t(weights, wt: QuantWeightT, rows, *, bias=None, lib=None):
    """y [B, out] = bias + Σ_j weights[:, j] · Wᵀ[rows[j], :] over the exact transposed layout (``rows`` int64 [k],
    None: every row with ``weights`` [B, in]). Rows of one scale group are summed before their scales are
    applied, so sorted indices read each group's scales once."""
    lib = lib or load_library()
    w = weights.to(_F32).contiguous()
    B, K = w.shape
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    k = wt.rows if idx is None else idx.numel()
    if K < k:
        raise ValueError(f"weights [B, {K}] cover fewer than the {k} rows")
    bias = _f32(bias)
    if wt.codes is None or lib is None:
        full = wt.dense if wt.codes is None else wt.dequantize_reference()
        r = torch.arange(k) if idx is None else idx
        y = w[:, :k] @ full.index_select(0, r)
        return y + bias if bias is not None else y
    y = torch.empty(B, wt.cols, dtype=_F32)
    _check(lib.cs_qt_axpy(wt.codes.data_ptr(), wt.code_bits, wt.code_bias, wt.scale.data_ptr(), _p(wt.offset),
                          wt.scale.dtype == torch.float16, wt.group, wt.rows, wt.cols, _p(idx), k, w.data_ptr(), K, B,
                          _p(bias), y.data_ptr(), _threads()), "rows_axpy_t")
    return y
