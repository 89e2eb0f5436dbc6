"""CPU ops over GGUF block-quantized weights (kernels.quant.QuantWeight / QuantWeightT), fp32 activations.

    y = linear(x, w, bias)                 # x @ Wᵀ: the dense GEMV (few tokens), dequantize + matmul for many
    z = rows_dot(x, w, rows, kpad, w2=..., act=...)     # output sparsity: whole quantized rows by an index
    y = dense_ffn(x, w_gate, w_up, w_down, act)         # the dense FFN in one parallel region
    y = rows_axpy_t(weights, wt, rows)     # rows of Wᵀ (exact transposed layout): down over active neurons
    y = input_sparse_linear_parts(x, TransposedParts.of(w), thresholds)   # input sparsity (TEAL / WINA)
    y = sparse_ffn(x, w_gate, w_up, TransposedParts.of(w_down).one, idx, count, act)   # output sparsity
    q, k, v = head_sparse_qkv(x, w_qkv, q_idx, ...) ; y = head_sparse_out(a, w_o_t, q_idx, ...)  # (predictors)
    W = dequantize(w) ; E = embedding(ids, w)           # bit for bit the model loader's fp32 values
    st = LayerStack(layers, shapes) ; x = st.run(l0, l1, x, pos)   # whole decoder layers, one native call
    x = st.run(l0, l1, x, pos, sparse=SparseLayers(st.n, groups, counts))   # ... some projections input-sparse

The weights are dequantized inside the kernels (``cpu_quant.c``: one translation unit of its parts
``cpu_quant_formats.c``, ``_team.c``, ``_rows.c``, ``_transposed.c``, ``_layers.c`` and the header ``cpu_quant.h``;
AVX2/FMA where the compiler targets them, a scalar fallback elsewhere) and multiplied with the fp32 activations
in fp32: results equal the products over the dequantized fp32 weights up to fp32 summation order
(tests/kernels/test_quant.py states the tolerance).
``dequantize`` / ``embedding`` are exact. A weight with ``activations="q8"`` (kernels.quant.QuantWeight) is
multiplied llama.cpp's way instead: the few-token kernels quantize the activations to 8 bits per 32 and take
integer products (W x̂, not W x); the dequantize + matmul path of many tokens stays fp32.
Thread count: torch's (one thread: no OpenMP region). The library is built for the instruction set
``CTXSPARSE_CPU_ISA`` asks for (kernels.isa; :func:`library_isa` says what a loaded one targets). Where it cannot
be built (a kernels.cpu.NativeBuildWarning says why, once) or ``CTXSPARSE_CPU_NATIVE=0``, these ops fall back to
the numpy reference dequantizer and torch (slow, but the same values), and ``native_available()`` says so;
:class:`LayerStack` has no fallback (its caller keeps the per-op path: workers.decode.native_layer).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import MAX_BATCH, act_code, apply_act
from . import cpu as _cpu
from .cpu import _idx64
from .quant import QuantPart, QuantWeight, QuantWeightT

_SRC = Path(__file__).with_name("cpu_quant.c")      # includes its parts; kernels.cpu hashes them into the build key
# d·q + m must stay two fp32 roundings (gguf-py's dequantizer): no contraction into FMA; the kernels' products
# use explicit FMA intrinsics, which this flag leaves alone.
EXTRA_FLAGS = ("-ffp-contract=off",)
_LIBS: dict = {}            # every flag set -> (library or None, its status)
_LOCK = threading.Lock()
_F32 = torch.float32


class QPart(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scale", ctypes.c_float)]


def _setup(lib: ctypes.CDLL) -> None:
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.cs_q_dequant.argtypes = [P, I, I64, P, I64, P, I]
    lib.cs_q_rows.argtypes = [P, I, P, I, I64, P, P, I64, I64, P, I64, I, I, P, I]
    lib.cs_q_ffn.argtypes = [P, I, P, I, P, I, I64, I64, P, P, P, I64, I, I, P, P, I]
    lib.cs_qt_axpy.argtypes = [P, I, I, P, P, I, I64, I64, I64, P, I64, P, I64, I64, P, P, I]
    lib.cs_q_simd.argtypes = []
    lib.cs_q_layers.argtypes = [P, P, I64, I64, P, P, P, I64, P, I64, I]
    lib.cs_q_layers_scratch.argtypes = [P, I, I64]
    lib.cs_q_layers_scratch.restype = I64
    for f in (lib.cs_q_dequant, lib.cs_q_rows, lib.cs_q_ffn, lib.cs_qt_axpy, lib.cs_q_simd, lib.cs_q_layers):
        f.restype = I


_DEFAULT = None             # the library of the requested build (what the ops use), once loaded
_DEFAULT_KEY = None         # its key in _LIBS


def load_library(extra_flags=(), *, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels of the instruction-set build ``isa`` (kernels.isa: "native", "avx2", "scalar"; default:
    the one ``CTXSPARSE_CPU_ISA`` asks for, read at first use, ValueError for an unknown one), cached per flag
    set; ``extra_flags``: more compiler flags. None where the library does not build (a NativeBuildWarning says
    why, once) or ``CTXSPARSE_CPU_NATIVE=0``."""
    global _DEFAULT, _DEFAULT_KEY
    if _cpu.native_disabled():
        return None
    default = isa is None and not extra_flags
    if default and _DEFAULT_KEY is not None:
        return _DEFAULT
    key = tuple(_cpu.native_flags(isa, EXTRA_FLAGS + tuple(extra_flags)))
    with _LOCK:
        if key not in _LIBS:
            _LIBS[key] = _cpu.load_native(_SRC, _setup, EXTRA_FLAGS + tuple(extra_flags), isa=isa)
        lib = _LIBS[key][0]
        if default:
            _DEFAULT, _DEFAULT_KEY = lib, key
        return lib


def library_status() -> dict | None:
    """The status (kernels.cpu.load_native's) of the requested build's library; None before its first use."""
    with _LOCK:
        hit = _LIBS.get(_DEFAULT_KEY) if _DEFAULT_KEY is not None else None
    return None if hit is None else hit[1]


library_isa = _cpu.library_isa      # what a loaded library was compiled for (its cs_isa())


def _forget() -> None:
    """kernels.cpu.reload_native: drop every loaded build."""
    global _DEFAULT, _DEFAULT_KEY
    with _LOCK:
        _LIBS.clear()
        _DEFAULT, _DEFAULT_KEY = None, None


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


@dataclass(frozen=True, eq=False)
class TransposedParts:
    """Wᵀ of quantized weights part by part (:class:`QuantWeightT` each: the query, key and value rows of the
    fused QKV, gate and up, or one projection), each part's scale (the query rows' attention scale) applied to its
    outputs: the layout input sparsity reads over GGUF blocks. Values: the parts' own, exact; a scaled part's
    products are the unscaled ones times the scale (equal to the scaled rows' where the scale is a power of two,
    as 1/sqrt(64); else within one rounding)."""

    parts: tuple                # QuantWeightT, [in, out_j] each
    scales: tuple               # float per part

    @classmethod
    def of(cls, *weights: QuantWeight) -> "TransposedParts":
        parts, scales = [], []
        for w in weights:
            for p in w.parts:
                parts.append(QuantWeightT.build(QuantWeight((QuantPart(p.fmt, p.data),), w.cols)))
                scales.append(float(p.scale))
        if len({t.rows for t in parts}) != 1:
            raise ValueError("the parts of one input-sparse group must share their input")
        return cls(tuple(parts), tuple(scales))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t.cols for t in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.parts[0].rows, sum(self.sizes))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)

    @property
    def one(self) -> QuantWeightT:
        """Wᵀ of a one-projection layout with no scale (O, down: the file's matrix), what :func:`rows_axpy_t`
        reads for the active neurons / heads of output sparsity."""
        if len(self.parts) != 1 or self.scales[0] != 1.0:
            raise ValueError(f"a layout of {len(self.parts)} parts with scales {self.scales}, not one unscaled part")
        return self.parts[0]


def input_sparse_linear_parts(x, tp: TransposedParts, thresholds, bias=None, *, counts=None, lib=None):
    """y [B, out] = x Wᵀ (+ bias) over each part's active inputs only: part j reads row i of its Wᵀ iff some token
    has |x_i| > ``thresholds[j]`` (a tensor [nparts], or [nparts, in]: one threshold per input channel), each
    token adding its own active entries (:func:`rows_axpy_t`). ``counts`` (float64 [nparts]) get the active
    (token, input) entries. Where the part has a scale: (Σ) · scale + bias, two roundings (as cs_q_layers)."""
    xf = x.to(_F32)
    B, n_in = xf.shape
    if n_in != tp.shape[0]:
        raise ValueError(f"x has {n_in} inputs, the weights {tp.shape[0]}")
    thr = torch.as_tensor(thresholds, dtype=_F32)
    if thr.shape[0] != len(tp.parts):
        raise ValueError(f"{thr.shape[0]} thresholds for {len(tp.parts)} parts")
    bias = _f32(bias)
    ax = xf.abs()
    outs, lo = [], 0
    for j, (wt, sc) in enumerate(zip(tp.parts, tp.scales)):
        keep = ax > thr[j]
        if counts is not None:
            counts[j] += float(keep.sum())
        idx = keep.any(0).nonzero().flatten()
        wts = (xf * keep)[:, idx] if B > 1 else xf[:, idx]
        b = None if bias is None else bias[lo: lo + wt.cols]
        if sc == 1.0:
            y = rows_axpy_t(wts, wt, idx, bias=b, lib=lib)
        else:
            y = rows_axpy_t(wts, wt, idx, lib=lib).mul_(sc)
            if b is not None:
                y.add_(b)
        outs.append(y)
        lo += wt.cols
    y = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return y if x.dtype is _F32 else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# output sparsity (FFN neurons, attention heads of a predictor's active set): kernels.reference's ops of the
# same names (kernels.common's (idx, count) convention; a batch shares one set), over quantized weights. The
# first projections read whole quantized rows (rows_dot), the second ones the active rows of the exact Wᵀ
# (rows_axpy_t: ``w_down_t`` / ``w_o_t`` are QuantWeightT, e.g. ``TransposedParts.of(w).one``). Values: the
# reference's over the dequantized weights up to fp32 summation order.
def _out(y, x):
    return y if x.dtype is _F32 else y.to(x.dtype)


def _neurons(idx, count):
    """(the active neurons int64 ascending, how many): rows_axpy_t sums the rows of a scale group before applying
    its scales, so sorted rows read each group's scales once (top-k sets come unsorted; one SmolLM2 layer's W_downᵀ
    rows at 70 % sparsity, weights in cache: 25 µs unsorted, 15 µs sorted, the sort 5 µs)."""
    rows, k = _idx64(idx, count)
    return rows.sort().values, k


def sparse_ffn(x, w_gate: QuantWeight, w_up: QuantWeight, w_down_t: QuantWeightT, idx, count=None, act="silu",
               threshold=None, *, lib=None):
    """y [B, d] = Σ_{j active} act(<W_gate[j], x>) · <W_up[j], x> · W_downᵀ[j]. ``threshold`` (the sequential
    pipeline): gate on the active rows first, the rows with |act(gate)| <= threshold for every token dropped
    before up and down."""
    rows, k = _neurons(idx, count)
    if threshold is None:
        h = rows_dot(x, w_gate, rows, k, w2=w_up, act=act, lib=lib)
    else:
        a = rows_dot(x, w_gate, rows, k, act=act, lib=lib)
        keep = (a.abs() > threshold).any(0)
        rows, a = rows[keep], a[:, keep]
        h = rows_dot(x, w_up, rows, rows.numel(), lib=lib).mul_(a)
    return _out(rows_axpy_t(h, w_down_t, rows, lib=lib), x)


def sparse_mlp(x, w_fc1: QuantWeight, b_fc1, w_fc2_t: QuantWeightT, b_fc2, idx, count=None, act="relu", *,
               lib=None):
    """y [B, d] = b_fc2 + Σ_{j active} act(<W_fc1[j], x> + b_fc1[j]) · W_fc2ᵀ[j] (a non-gated MLP)."""
    rows, k = _neurons(idx, count)
    h = rows_dot(x, w_fc1, rows, k, bias=b_fc1, act=act, lib=lib)
    return _out(rows_axpy_t(h, w_fc2_t, rows, bias=b_fc2, lib=lib), x)


def damage_filter_ffn(x, w_gate: QuantWeight, w_up: QuantWeight, w_down_t: QuantWeightT, idx, count, act,
                      threshold, weight, *, lib=None):
    """kernels.ops.damage_filter_ffn: gate and up on the active rows, then the rows whose |act(gate)·up|·weight[i]
    <= ``threshold`` for every token dropped before down."""
    rows, k = _neurons(idx, count)
    h = rows_dot(x, w_gate, rows, k, w2=w_up, act=act, lib=lib)
    keep = (h.abs() * weight.index_select(0, rows)).gt(threshold).any(0)
    rows, h = rows[keep], h[:, keep]
    return _out(rows_axpy_t(h, w_down_t, rows, lib=lib), x)


def threshold_ffn(x, z, w_up: QuantWeight | None, w_down_t: QuantWeightT, threshold, act, *, b_act=None,
                  b_score=None, b_down=None, stat=None, lib=None):
    """kernels.cpu.threshold_ffn over quantized weights: after the dense first projection ``z`` [B, D] (gate, or
    fc1 without its bias), a = act(z + b_act); token b keeps neuron j iff |act(z + b_score)| > ``threshold``;
    y_b = b_down + Σ_{j kept by b} a_bj (· <W_up[j], x_b>: gated, ``w_up`` given) · W_downᵀ[j]; the rows of the
    neurons some token keeps are read once. ``stat`` (float64, one element) gets the number of those neurons."""
    a = apply_act(z if b_act is None else z + b_act, act)
    s = a if b_score is b_act else apply_act(z if b_score is None else z + b_score, act)
    keep = s.abs() > threshold
    rows = keep.any(0).nonzero().flatten()
    coef = torch.where(keep, a, torch.zeros((), dtype=a.dtype))[:, rows].to(_F32)
    if stat is not None:
        stat += rows.numel()
    u = coef if w_up is None else rows_dot(x, w_up, rows, rows.numel(), lib=lib).mul_(coef)
    return _out(rows_axpy_t(u, w_down_t, rows, bias=b_down, lib=lib), x)


def _head_rows(heads, head_dim: int):
    """The rows of the heads ``heads`` (int64) in a [heads · head_dim, ...] matrix, head by head."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def head_sparse_qkv(x, w_qkv: QuantWeight, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim,
                    bias=None, *, lib=None):
    """(q [B, S, hd], k, v [B, S_kv, hd]): the rows of the active query heads ``q_idx`` and KV heads ``kv_idx`` of
    the fused QKV (query, key, value rows stacked, each part with its scale), one row product for the three;
    slots past a count hold 0."""
    B, hd = x.shape[0], head_dim
    qh, kq = _idx64(q_idx, q_count)
    kvh, kk = _idx64(kv_idx, kv_count)
    heads = torch.cat([qh, kvh + n_heads, kvh + (n_heads + n_kv_heads)])
    rows = _head_rows(heads, hd)      # a few torch ops per layer
    z = _out(rows_dot(x, w_qkv, rows, rows.numel(), bias=bias, lib=lib), x)
    outs = []
    for y, slots in zip(z.split([kq * hd, kk * hd, kk * hd], 1), (q_idx.shape[0], kv_idx.shape[0],
                                                                   kv_idx.shape[0])):
        if y.shape[1] < slots * hd:
            y = F.pad(y, (0, slots * hd - y.shape[1]))
        outs.append(y.view(B, slots, hd))
    return tuple(outs)


def head_sparse_out(attn, w_o_t: QuantWeightT, q_idx, q_count=None, head_dim=None, bias=None, *, lib=None):
    """y [B, d] = b_o + Σ over the active heads' slots j of attn[:, j] · W_oᵀ[rows of head q_idx[j]]; ``attn``
    [B, S, hd] or [B, S · hd], the active heads compact."""
    heads, _ = _idx64(q_idx, q_count)
    rows = _head_rows(heads, head_dim)
    return _out(rows_axpy_t(attn.reshape(attn.shape[0], -1), w_o_t, rows, bias=bias, lib=lib), attn)


# ---------------------------------------------------------------------------------------------------------
# whole decoder layers in one native call (cs_q_layers)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class QLayer(ctypes.Structure):
    """cpu_quant.h's ``qlayer`` (every field 8 bytes)."""
    _fields_ = ([(n, _P) for n in ("qkv", "o", "gate", "up", "down")]
                + [(n, _I64) for n in ("nqkv", "no", "ngate", "nup", "ndown")]
                + [(n, _P) for n in ("b_qkv", "b_o", "b_up", "b_down", "n1", "n2", "post_attn", "post_ffn", "qn",
                                     "kn", "cos_t", "sin_t", "kc", "vc")]
                + [("window", _I64)])


class QTPart(ctypes.Structure):
    """cpu_quant.h's ``qtpart``: one part of an input-sparse group."""
    _fields_ = ([(n, _P) for n in ("codes", "scale", "offset")]
                + [(n, _I64) for n in ("bits", "cbias", "half", "group", "nout")]
                + [("post", ctypes.c_double), ("thr", ctypes.c_double)])


class QSparse(ctypes.Structure):
    """cpu_quant.h's ``qsparse``: one layer's input-sparse groups (NULL: dense)."""
    _fields_ = ([(n, _P) for n in ("qkv", "o", "gu", "down")] + [("nqkv", _I64), ("ngu", _I64), ("counts", _P)]
                + [("dense_above", ctypes.c_double)])


SPARSE_GROUPS = ("qkv", "o", "gu", "down")       # the groups cs_q_layers runs input-sparse
# a group (with one threshold for its parts) more active than this share runs its dense rows on its input with
# the inactive entries zeroed: the same products, at the dense kernel's cost (benchmarks/results/history-cpu.md, "CPU sparse execution")
DENSE_ABOVE = 0.6


class SparseLayers:
    """Input sparsity for :meth:`LayerStack.run`: ``groups`` {layer: {group: (TransposedParts, thresholds)}} with
    group one of SPARSE_GROUPS (qkv: the q, k, v parts; gu: gate, up; o, down: one part) and thresholds one
    float per part (|x_i| > t reads row i); the rest of each layer runs dense. ``counts`` (float64 [n_layers, 7],
    contiguous CPU; or None) get each layer's active inputs per q, k, v, o, gate, up, down. ``dense_above``: a
    group more active than that share runs its dense rows on the masked input (1 or more: never)."""

    def __init__(self, n_layers: int, groups: dict, counts: torch.Tensor | None = None,
                 dense_above: float = DENSE_ABOVE):
        if counts is not None and not (counts.dtype == torch.float64 and counts.is_contiguous() and counts.is_cpu
                                       and tuple(counts.shape) == (n_layers, 7)):
            raise ValueError(f"counts must be a contiguous float64 CPU tensor [{n_layers}, 7]")
        self.n, self.counts = n_layers, counts
        self.arr = (QSparse * n_layers)()
        self._keep = []
        for l, per in groups.items():
            if not 0 <= l < n_layers:
                raise IndexError(f"layer {l} outside 0..{n_layers - 1}")
            z = QSparse()
            z.dense_above = float(dense_above)
            for g, (tp, thr) in per.items():
                if g not in SPARSE_GROUPS:
                    raise ValueError(f"group {g!r}: one of {SPARSE_GROUPS}")
                thr = [float(t) for t in thr]
                if len(thr) != len(tp.parts) or (g in ("o", "down") and len(thr) != 1):
                    raise ValueError(f"layer {l} {g}: {len(thr)} thresholds for {len(tp.parts)} parts")
                parts = (QTPart * len(tp.parts))()
                for j, (wt, sc) in enumerate(zip(tp.parts, tp.scales)):
                    if wt.codes is None:
                        raise ValueError(f"layer {l} {g}: float weights have no block layout for the kernels")
                    parts[j] = QTPart(wt.codes.data_ptr(), wt.scale.data_ptr(), _p(wt.offset), wt.code_bits,
                                      wt.code_bias, int(wt.scale.dtype == torch.float16), wt.group, wt.cols, sc,
                                      thr[j])
                self._keep.append((tp, parts))
                setattr(z, g, ctypes.addressof(parts))
                if g in ("qkv", "gu"):
                    setattr(z, "n" + g, len(tp.parts))
            if counts is not None:
                z.counts = counts.data_ptr() + l * 7 * 8
            self.arr[l] = z


class QDims(ctypes.Structure):
    """cpu_quant.h's ``qdims``."""
    _fields_ = ([(n, _I64) for n in ("d", "D", "H", "KV", "hd", "L", "one_plus", "act", "q8")]
                + [("eps", ctypes.c_double)])


@dataclass(frozen=True, eq=False)
class LayerSpec:
    """One decoder layer for :class:`LayerStack`: the quantized projections (W [out, in], the file's layout;
    ``qkv`` the query, key and value rows stacked), fp32 vectors (None where the model has none), its KV cache
    [1, KV, L, hd] (fp32, contiguous; written at the step's position) and its RoPE tables [positions, hd]."""
    qkv: QuantWeight
    o: QuantWeight
    gate: QuantWeight | None
    up: QuantWeight
    down: QuantWeight
    n1: torch.Tensor
    n2: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    b_qkv: torch.Tensor | None = None
    b_o: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None
    post_ffn: torch.Tensor | None = None
    qn: torch.Tensor | None = None
    kn: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    window: int | None = None


class LayerStack:
    """Decoder layers of one token (batch 1) over quantized weights, packed once (pointers, scratch) for
    ``cs_q_layers``: :meth:`run` takes layers l0..l1-1 in one native call and one parallel region, with the same
    products and glue (norms, RoPE, cache write, attention) as the per-op step, so the same values bit for bit.
    ``n_heads``, ``n_kv_heads``, ``head_dim`` as the model's; ``norm`` "rms" (Llama) or "rms1p" (Gemma: the
    norm weights already hold 1 + w); ``act`` a name in kernels.common.ACTS; ``activations`` "fp32" or "q8" (every
    projection must use it). Raises ValueError for what the kernels do not take (then keep the per-op path)."""

    def __init__(self, layers: list[LayerSpec], *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                 norm: str, act: str, activations: str = "fp32", lib=None):
        self.lib = lib or load_library()
        if self.lib is None:
            raise ValueError("the quantized kernels are not built here (no C compiler, or the build failed)")
        if norm not in ("rms", "rms1p"):
            raise ValueError(f"norm must be 'rms' or 'rms1p', got {norm!r}")
        L0 = layers[0]
        d, D, hd = L0.qkv.cols, L0.up.rows, head_dim
        H, KV, L = n_heads, n_kv_heads, L0.k_cache.shape[2]
        if d % 32 or D % 32 or (H * hd) % 32 or H % KV:
            raise ValueError(f"shapes d={d}, D={D}, H*hd={H * hd}: multiples of 32 (and H of KV) only")
        self.dims = QDims(d, D, H, KV, hd, L, int(norm == "rms1p"), act_code(act), int(activations == "q8"), eps)
        self.d, self._keep, self._parts = d, [], []        # what the pointers point into stays alive
        arr = (QLayer * len(layers))()
        for i, s in enumerate(layers):
            ws = (s.qkv, s.o, s.gate, s.up, s.down)
            if any(w is not None and w.activations != activations for w in ws):
                raise ValueError(f"layer {i}: every projection must use activations {activations!r}")
            for c in (s.k_cache, s.v_cache):
                if c.dtype is not _F32 or not c.is_contiguous() or tuple(c.shape) != (1, KV, L, hd):
                    raise ValueError(f"layer {i}: the KV cache must be fp32 [1, {KV}, {L}, {hd}], contiguous")
            vec = {}
            for name in ("b_qkv", "b_o", "b_up", "b_down", "n1", "n2", "post_attn", "post_ffn", "qn", "kn", "cos",
                         "sin"):
                t = getattr(s, name)
                vec[name] = None if t is None else t.to(_F32).contiguous()
            if vec["cos"] is not None and (vec["cos"].shape[0] < L or vec["cos"].shape[1] != hd):
                raise ValueError(f"layer {i}: RoPE tables must be [>= {L}, {hd}]")
            self._keep.append((ws, vec, s.k_cache, s.v_cache))
            qp = {}
            for name, w in zip(("qkv", "o", "gate", "up", "down"), ws):
                qp[name] = _cached_parts(w) if w is not None else (None, 0)
            self._parts.append(qp)
            arr[i] = QLayer(*(ctypes.addressof(qp[n][0]) if qp[n][0] is not None else None
                              for n in ("qkv", "o", "gate", "up", "down")),
                            *(qp[n][1] for n in ("qkv", "o", "gate", "up", "down")),
                            *(_p(vec[n]) for n in ("b_qkv", "b_o", "b_up", "b_down", "n1", "n2", "post_attn",
                                                   "post_ffn", "qn", "kn", "cos", "sin")),
                            s.k_cache.data_ptr(), s.v_cache.data_ptr(), int(s.window or 0))
        self.layers, self.n = arr, len(layers)
        self._scratch: dict[int, torch.Tensor] = {}

    def _scratch_for(self, nt: int) -> torch.Tensor:
        t = self._scratch.get(nt)
        if t is None:
            n = int(self.lib.cs_q_layers_scratch(ctypes.byref(self.dims), nt, self.n))
            t = self._scratch[nt] = torch.zeros(n, dtype=torch.uint8)      # zeroed once (the kernel's claim words)
        return t

    def run(self, l0: int, l1: int, x: torch.Tensor, pos: int, out: torch.Tensor | None = None,
            sparse: SparseLayers | None = None) -> torch.Tensor:
        """The stream [1, d] after layers l0..l1-1 on the stream ``x`` [1, d] (fp32) entering layer l0, each
        writing its K/V at position ``pos`` (the caches given at packing) and attending over 0..pos; into ``out``
        (a new tensor when None; may be ``x``). ``sparse``: the layers' input sparsity (None: dense)."""
        if not 0 <= l0 < l1 <= self.n:
            raise IndexError(f"layers {l0}..{l1 - 1} outside 0..{self.n - 1}")
        if sparse is not None and sparse.n != self.n:
            raise ValueError(f"sparse layers for {sparse.n} layers, the stack has {self.n}")
        if x.dtype is not _F32 or not x.is_contiguous() or x.numel() != self.d:
            x = x.to(_F32).contiguous().reshape(1, self.d)
        out = torch.empty(1, self.d, dtype=_F32) if out is None else out
        nt = _threads()
        sc = self._scratch_for(nt)
        rc = self.lib.cs_q_layers(self.layers, None if sparse is None else sparse.arr, l0, l1,
                                  ctypes.byref(self.dims), x.data_ptr(), out.data_ptr(),
                                  int(pos), sc.data_ptr(), sc.numel(), nt)
        if rc != 0:
            raise ValueError(f"cs_q_layers: position {pos} outside the cache ({self.dims.L}), or a layer's layout "
                             "(or its input-sparse parts) is invalid")
        return out
