"""GGUF block-quantized weights kept in their file format: the block formats, a Python reference dequantizer per
format, and the weight types the CPU quantized kernels (kernels.cpu_quant) read.

A GGUF matrix W [out, in] is stored row by row, each row a run of blocks along ``in`` (ggml's layout). Every
format here dequantizes as ``value = fp32(scale · code) + offset``: an integer code per element, an fp32 scale
per group of ``group`` elements along ``in`` (and for some formats an fp32 offset per group), rounded exactly as
gguf-py's ``dequantize`` (what transformers loads a GGUF through) rounds:

    format  block  bytes  group  value (each product and sum rounded to fp32)
    Q4_0      32     18     32   d · (q - 8)
    Q4_1      32     20     32   d · q + m
    Q5_0      32     22     32   d · (q - 16)
    Q5_1      32     24     32   d · q + m
    Q8_0      32     34     32   d · q                                (q signed)
    Q4_K     256    144     32   (d · sc) · q - (dmin · mn)           (6-bit sc, mn per 32)
    Q5_K     256    176     32   (d · sc) · q - (dmin · mn)
    Q6_K     256    210     16   (d · sc) · (q - 32)                  (int8 sc per 16)
    F16 / F32                    the value itself

``split_<format>(blocks)`` returns that decomposition (:class:`ScaleCodes`) of uint8 blocks [n, bytes], and
:func:`dequantize_blocks` composes it: one numpy function per format, written from the format, checked bit for
bit against gguf-py's dequantizer and against the model loader's weights (tests/kernels/test_quant.py).

The decomposition is also what makes an exact transposed layout possible (:class:`QuantWeightT`, rows of Wᵀ for
the down projection and input sparsity): the scale/offset groups run along ``in``, so a row of Wᵀ (one input
channel) has its own scale per output; storing codes [in, out] and the fp32 scales/offsets [in / group, out]
keeps every value identical without requantizing.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import numpy as np
import torch

QK_K = 256


@dataclass(frozen=True)
class QuantFormat:
    name: str
    ggml_type: int          # gguf.GGMLQuantizationType value (also the C kernels' format id)
    block: int              # elements per block
    nbytes: int             # bytes per block
    group: int              # elements sharing one scale (and offset)
    offset: bool            # whether a per-group offset is added
    code_bits: int          # bits of the stored code (F16/F32: 0)
    code_bias: int          # code = stored value - bias (unsigned stored codes)


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("F32", 0, 1, 4, 1, False, 0, 0),
    QuantFormat("F16", 1, 1, 2, 1, False, 0, 0),
    QuantFormat("Q4_0", 2, 32, 18, 32, False, 4, 8),
    QuantFormat("Q4_1", 3, 32, 20, 32, True, 4, 0),
    QuantFormat("Q5_0", 6, 32, 22, 32, False, 5, 16),
    QuantFormat("Q5_1", 7, 32, 24, 32, True, 5, 0),
    QuantFormat("Q8_0", 8, 32, 34, 32, False, 8, 0),
    QuantFormat("Q4_K", 12, QK_K, 144, 32, True, 4, 0),
    QuantFormat("Q5_K", 13, QK_K, 176, 32, True, 5, 0),
    QuantFormat("Q6_K", 14, QK_K, 210, 16, False, 6, 32),
)}
BY_TYPE: dict[int, QuantFormat] = {f.ggml_type: f for f in FORMATS.values()}
BLOCK_FORMATS = tuple(n for n, f in FORMATS.items() if f.code_bits)
F16_SCALES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")    # formats whose scale (and offset) is one fp16 per block
ACTIVATIONS = ("fp32", "q8")


def format_of(ggml_type) -> QuantFormat:
    """The format of a gguf tensor type (an int or a gguf.GGMLQuantizationType)."""
    f = BY_TYPE.get(int(ggml_type))
    if f is None:
        name = getattr(ggml_type, "name", ggml_type)
        raise NotImplementedError(f"GGUF tensor type {name} is not supported (supported: {sorted(FORMATS)})")
    return f


class ScaleCodes(NamedTuple):
    """value[i] = fp32(scale[i // group] · code[i]) + offset[i // group] (offset None: no addition), per block."""

    scale: np.ndarray            # float32 [n, block / group]
    code: np.ndarray             # int16 [n, block]
    offset: np.ndarray | None    # float32 [n, block / group]


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 in two uint8 columns -> float32 [n, 1] (exact)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16·c] bytes -> [n, 32·c] codes: per run of 16 bytes, the low nibbles then the high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] bits, bit i for element i."""
    u = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1)
    return ((u >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def split_q4_0(b: np.ndarray) -> ScaleCodes:
    return ScaleCodes(_f16(b[:, 0:2]), _nibbles(b[:, 2:18]).astype(np.int16) - 8, None)


def split_q4_1(b: np.ndarray) -> ScaleCodes:
    return ScaleCodes(_f16(b[:, 0:2]), _nibbles(b[:, 4:20]).astype(np.int16), _f16(b[:, 2:4]))


def split_q5_0(b: np.ndarray) -> ScaleCodes:
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return ScaleCodes(_f16(b[:, 0:2]), q.astype(np.int16) - 16, None)


def split_q5_1(b: np.ndarray) -> ScaleCodes:
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return ScaleCodes(_f16(b[:, 0:2]), q.astype(np.int16), _f16(b[:, 2:4]))


def split_q8_0(b: np.ndarray) -> ScaleCodes:
    return ScaleCodes(_f16(b[:, 0:2]), np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.int16), None)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K -> (sc, mn) uint8 [n, 8], six bits each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_sub_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes -> 256 codes: per run of 32 bytes, the low nibbles (a 32-element group) then the
    high nibbles (the next group)."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, QK_K)


def split_q4_k(b: np.ndarray) -> ScaleCodes:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return ScaleCodes(d * sc.astype(np.float32), _k_sub_nibbles(b[:, 16:144]).astype(np.int16),
                      -(dmin * mn.astype(np.float32)))


def split_q5_k(b: np.ndarray) -> ScaleCodes:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    n = b.shape[0]
    hi = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1   # group g: bit g
    q = _k_sub_nibbles(b[:, 48:176]) | (hi.reshape(n, QK_K) << 4)
    return ScaleCodes(d * sc.astype(np.float32), q.astype(np.int16), -(dmin * mn.astype(np.float32)))


def split_q6_k(b: np.ndarray) -> ScaleCodes:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    # each half of 128 elements: ql[64] (low nibbles: elements 0-63, high nibbles: 64-127), qh[32] (2 bits per
    # element, bits 2s..2s+1 for elements 32s..32s+31)
    lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = lo.reshape(n, QK_K) | (hi.reshape(n, QK_K) << 4)
    return ScaleCodes(d * sc, q.astype(np.int16) - 32, None)


SPLIT: dict[str, Callable[[np.ndarray], ScaleCodes]] = {
    "Q4_0": split_q4_0, "Q4_1": split_q4_1, "Q5_0": split_q5_0, "Q5_1": split_q5_1, "Q8_0": split_q8_0,
    "Q4_K": split_q4_k, "Q5_K": split_q5_k, "Q6_K": split_q6_k,
}


def dequantize_blocks(fmt: QuantFormat | str, blocks: np.ndarray) -> np.ndarray:
    """Reference dequantizer: uint8 [..., nbytes·k] (whole blocks along the last axis) -> float32 [..., block·k],
    bit for bit gguf-py's ``dequantize``."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    blocks = np.asarray(blocks)
    lead = blocks.shape[:-1]
    if fmt.name == "F32":
        return np.ascontiguousarray(blocks).view(np.float32).copy()
    if fmt.name == "F16":
        return np.ascontiguousarray(blocks).view(np.float16).astype(np.float32)
    b = np.ascontiguousarray(blocks).reshape(-1, fmt.nbytes)
    s = SPLIT[fmt.name](b)
    v = np.repeat(s.scale, fmt.group, axis=1) * s.code.astype(np.float32)
    if s.offset is not None:
        v = v + np.repeat(s.offset, fmt.group, axis=1)
    return v.reshape(*lead, -1)


# ---------------------------------------------------------------------------------------------------------
# weights
@dataclass(frozen=True, eq=False)
class QuantPart:
    """Rows of one format: ``data`` uint8 [rows, row_bytes] (blocks along the columns), times ``scale``."""

    fmt: QuantFormat
    data: torch.Tensor
    scale: float = 1.0      # the rows' values times this (fp32 product): e.g. the attention scale on query rows

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """W [out, in] as GGUF blocks along ``in``: the rows of ``parts`` one after another (fused projections whose
    parts have different formats, e.g. Gemma-3's Q5_0 query/key and Q8_0 value rows). The linear map is
    x -> x Wᵀ whatever slot of a weight struct holds it (the kernels read W's rows, or rows of Wᵀ from
    :meth:`transposed`). ``activations`` "fp32" (default): the products equal the ones over the dequantized
    weights up to fp32 summation order; "q8": the activations are quantized to 8 bits per 32 first
    (:func:`quantize_q8`) and multiplied in integers, llama.cpp's way: faster, but W x̂ instead of W x."""

    parts: tuple
    cols: int
    activations: str = "fp32"     # how the kernels multiply: ACTIVATIONS

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        for p in self.parts:
            f = p.fmt
            if p.data.dtype != torch.uint8 or p.data.dim() != 2 or not p.data.is_contiguous():
                raise ValueError("a part's data must be a contiguous uint8 [rows, row_bytes] tensor")
            if self.cols % f.block or p.data.shape[1] != self.cols // f.block * f.nbytes:
                raise ValueError(f"{f.name} rows of {self.cols} columns need {self.cols // f.block * f.nbytes} "
                                 f"bytes, got {p.data.shape[1]}")

    @cached_property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.fmt.name for p in self.parts)

    @classmethod
    def of(cls, fmt: QuantFormat | str, data, cols: int, scale: float = 1.0) -> "QuantWeight":
        fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
        t = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        return cls((QuantPart(fmt, t.view(torch.uint8).reshape(t.shape[0], -1).contiguous(), float(scale)),), cols)

    @classmethod
    def stack(cls, weights) -> "QuantWeight":
        """Rows of several weights (same ``cols``) one after another."""
        weights = list(weights)
        cols = {w.cols for w in weights}
        if len(cols) != 1:
            raise ValueError(f"stacked weights must share their columns, got {sorted(cols)}")
        acts = {w.activations for w in weights}
        if len(acts) != 1:
            raise ValueError(f"stacked weights must share their activations mode, got {sorted(acts)}")
        return cls(tuple(p for w in weights for p in w.parts), cols.pop(), acts.pop())

    def take_rows(self, perm: torch.Tensor) -> "QuantWeight":
        """The rows in the order ``perm`` (int64 [rows] of one part's rows; single-part weights only): whole rows
        of blocks move, so values stay exact."""
        if len(self.parts) != 1:
            raise ValueError("take_rows needs a single-part weight")
        p = self.parts[0]
        return QuantWeight((QuantPart(p.fmt, p.data.index_select(0, perm).contiguous(), p.scale),), self.cols,
                           self.activations)

    def with_scale(self, scale: float) -> "QuantWeight":
        return QuantWeight(tuple(QuantPart(p.fmt, p.data, float(scale)) for p in self.parts), self.cols,
                           self.activations)

    def with_activations(self, activations: str) -> "QuantWeight":
        """The same blocks multiplied the ``activations`` way (ACTIVATIONS)."""
        return QuantWeight(self.parts, self.cols, activations)

    def dequantize_reference(self) -> torch.Tensor:
        """fp32 [out, in] through the numpy reference (slow; the kernels have a native one)."""
        outs = []
        for p in self.parts:
            v = torch.from_numpy(dequantize_blocks(p.fmt, p.data.numpy()))
            outs.append(v * p.scale if p.scale != 1.0 else v)
        return torch.cat(outs, 0)

    def transposed(self) -> "QuantWeightT":
        return QuantWeightT.build(self)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The "q8" activations: x [..., n] (n a multiple of 32, fp32) -> (q int8 [..., n], d fp32 [..., n / 32])
    with d = max|x| / 127 per 32 elements and q = round-half-even(x · (1 / d)) (0 where d = 0); x̂ = d · q.
    The same fp32 operations as the kernels' quantizer (cpu_quant.c), so the same q and d."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros((), dtype=d.dtype))
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    return q.reshape(x.shape), d


def reference_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ Wᵀ (+ bias) through the dequantized weights and torch (the ops' reference; "q8": of x̂)."""
    if w.activations == "q8":
        q, d = quantize_q8(x)
        x = (q.float().reshape(*d.shape, 32) * d[..., None]).reshape(x.shape).to(x.dtype)
    y = x @ w.dequantize_reference().to(x.dtype).t()
    return y + bias.to(x.dtype) if bias is not None else y


# ---------------------------------------------------------------------------------------------------------
# the transposed layout (rows of Wᵀ)
@dataclass(frozen=True, eq=False)
class QuantWeightT:
    """Wᵀ [in, out] of a :class:`QuantWeight` W [out, in], exact: ``codes`` [in, out] (int8, or 4-bit codes packed
    per run of 32 outputs as 16 bytes, low nibbles = the first 16 outputs, stored value = code + ``code_bias``),
    ``scale`` [in / group, out] and ``offset`` [in / group, out] (or None), so that
    W[o, i] = fp32(scale[i // group, o] · code[i, o]) + offset[i // group, o] -- the same fp32 operations as the
    row layout's dequantizer, hence the same values. Scales and offsets are fp16 where the format stores them so
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: exact), else fp32 (the K-quants' products d · sc). F16/F32 weights: ``codes``
    None and ``dense`` the fp32 Wᵀ. Bytes per element: Q4_0 0.5625, Q4_1 0.625 (as the file), Q5_x / Q8_0 about
    1.06-1.13, Q4_K 0.75, Q6_K 1.25. A weight's parts must agree in group and offset (their codes then share one
    width)."""

    rows: int               # in
    cols: int               # out
    group: int
    code_bits: int          # 4 or 8 (0: dense)
    code_bias: int
    codes: torch.Tensor | None
    scale: torch.Tensor | None
    offset: torch.Tensor | None
    dense: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset, self.dense)
                   if t is not None)

    @classmethod
    def build(cls, w: QuantWeight) -> "QuantWeightT":
        fmts = {p.fmt for p in w.parts}
        if any(p.scale != 1.0 for p in w.parts):
            raise ValueError("the transposed layout keeps no row scales: build it from unscaled parts")
        if any(not f.code_bits for f in fmts):
            if len(fmts) != 1:
                raise ValueError("float parts cannot be mixed with block parts in a transposed layout")
            return cls(w.cols, w.rows, 1, 0, 0, None, None, None, dense=w.dequantize_reference().t().contiguous())
        groups, offs = {f.group for f in fmts}, {f.offset for f in fmts}
        if len(groups) != 1 or len(offs) != 1:
            raise ValueError(f"parts {w.formats} differ in scale groups or offsets")
        g, has_off = groups.pop(), offs.pop()
        four = all(f.code_bits == 4 for f in fmts) and len({f.code_bias for f in fmts}) == 1 and w.rows % 32 == 0
        bias = next(iter(fmts)).code_bias if four else 0
        scales, codes, offsets = [], [], []
        for p in w.parts:
            s = SPLIT[p.fmt.name](p.data.numpy().reshape(-1, p.fmt.nbytes))
            r = p.rows
            scales.append(s.scale.reshape(r, -1))
            codes.append(s.code.reshape(r, -1))
            if has_off:
                offsets.append(s.offset.reshape(r, -1))
        code = np.concatenate(codes, 0).T                       # [in, out]
        if four:
            u = (code + bias).astype(np.uint8).reshape(w.cols, -1, 2, 16)
            packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
            code_t = torch.from_numpy(np.ascontiguousarray(packed.reshape(w.cols, -1)))
        else:
            code_t = torch.from_numpy(np.ascontiguousarray(code.astype(np.int8)))
        half = all(f.name in F16_SCALES for f in fmts)          # exact: these scales were fp16 in the file
        sdt = np.float16 if half else np.float32
        scale = torch.from_numpy(np.ascontiguousarray(np.concatenate(scales, 0).T.astype(sdt)))
        offset = (torch.from_numpy(np.ascontiguousarray(np.concatenate(offsets, 0).T.astype(sdt))) if has_off
                  else None)
        return cls(w.cols, w.rows, g, 4 if four else 8, bias, code_t, scale, offset)

    def dequantize_reference(self) -> torch.Tensor:
        """fp32 Wᵀ [in, out] (numpy): value-identical to the row layout's W, transposed."""
        if self.codes is None:
            return self.dense.clone()
        c = self.codes.numpy()
        if self.code_bits == 4:
            u = np.stack([c.reshape(self.rows, -1, 16) & 0x0F, c.reshape(self.rows, -1, 16) >> 4], axis=2)
            code = u.reshape(self.rows, self.cols).astype(np.int16) - self.code_bias
        else:
            code = c.view(np.int8).astype(np.int16)
        v = np.repeat(self.scale.float().numpy(), self.group, axis=0) * code.astype(np.float32)
        if self.offset is not None:
            v = v + np.repeat(self.offset.float().numpy(), self.group, axis=0)
        return torch.from_numpy(v)
