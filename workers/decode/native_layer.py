"""The quantized CPU decode step's decoder layers, each in one native call (kernels.cpu_quant.LayerStack).

    nat = for_step(blocks, plan, cache, fns)    # at the start of a step: None where the per-op path runs
    nat.covers(l)                               # whether layer l runs in one call
    x = nat.run(l, x)                           # the stream after layer l
    x = nat.run_all(x)                          # after every layer, one call a step (a plan with no sparse layer)

A step over GGUF blocks (``DecodeRuntime.from_gguf``) otherwise makes about eight native calls a layer (norm,
QKV, attention, O, add + norm, FFN) with Python between them: on SmolLM2-135M (2-core VM) the step takes 7.8 ms
that way at one thread, 5.9 ms with the layers in one call (5.6 and 3.5 ms at two threads; BENCHMARKS.md). Here one call runs the whole layer, with the same products and glue on the same values, so the
logits are the per-op step's bit for bit; when every layer runs natively, one call runs them all (one parallel
region a step; about 3 % less per token than a call per layer on SmolLM2 at one thread). It runs where the
per-op step would run those same native kernels: quantized weights on the CPU, the native glue (``glue``
"kernel"), batch 1, the exact KV cache (kv_mode "exact"), RMS norms, ``fuse`` on (``DecodeRuntime(fuse=False)``
keeps the per-op step), on the layers the plan leaves dense and on those with input sparsity (TEAL: a threshold
per projection on QKV, O, gate|up, down; the kernels read only the active rows of the transposed blocks,
workers.decode.plan's layouts); other sparse layers run their own path. Input-sparse layers equal the per-op
step up to rounding: the per-op step takes torch's act(gate)·up, and on several threads O and down sum their rows
per thread first. Where it
should run but cannot (no C compiler, the native kernels turned off, a shape they do not take) the per-op step
runs and a RuntimeWarning says why, once per weights.

The packed layers (pointers to the weights, norms, RoPE tables and each layer's cache, scratch) are made once
per (weights, cache) and reused every step; a new cache (``setup``) packs again.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from kernels import cpu as cpu_kernels
from kernels import cpu_quant, ops
from kernels.quant import QuantWeight

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # cache -> (weights, LayerStack or None)
_WARNED: weakref.WeakSet = weakref.WeakSet()                         # weights whose fallback was reported


class StepLayers:
    """One step's view of the packed layers: which layers run natively (``dense``: the covered set, None: all),
    at which position, with which input sparsity (``sparse``: kernels.cpu_quant.SparseLayers or None)."""

    __slots__ = ("stack", "pos", "dense", "sparse")

    def __init__(self, stack: cpu_quant.LayerStack, pos: int, dense, sparse=None):
        self.stack, self.pos, self.dense, self.sparse = stack, pos, dense, sparse

    def covers(self, l: int) -> bool:
        return self.dense is None or l in self.dense

    def run(self, l: int, x: torch.Tensor) -> torch.Tensor:
        return self.stack.run(l, l + 1, x, self.pos, sparse=self.sparse)

    def run_all(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer in one call (one parallel region a step)."""
        return self.stack.run(0, self.stack.n, x, self.pos, sparse=self.sparse)


def layer_specs(w, cache) -> list[cpu_quant.LayerSpec]:
    """The runtime's layers (workers.decode.weights / quant_weights) and a batch-1 cache as LayerStack input."""
    return [cpu_quant.LayerSpec(
        qkv=L.w_qkv, o=L.w_o_t, gate=L.w_gate, up=L.w_up, down=L.w_down_t, n1=L.n1, n2=L.n2,
        k_cache=cache.k[l], v_cache=cache.v[l], b_qkv=L.b_qkv, b_o=L.b_o, b_up=L.b_up, b_down=L.b_down,
        post_attn=L.post_attn, post_ffn=L.post_ffn, qn=L.qn, kn=L.kn,
        cos=L.rope[0] if L.rope is not None else None, sin=L.rope[1] if L.rope is not None else None,
        window=L.window) for l, L in enumerate(w.layers)]


def build(w, cache) -> cpu_quant.LayerStack:
    """The packed layers of quantized weights ``w`` over ``cache`` (ValueError where they cannot run)."""
    if not cpu_kernels.native_available():
        raise ValueError("the native CPU kernels are not built here (no C compiler, or CTXSPARSE_CPU_NATIVE=0)")
    if not all(isinstance(getattr(L, f), QuantWeight) for L in w.layers for f in ("w_qkv", "w_o_t", "w_up",
                                                                                  "w_down_t")):
        raise ValueError("not every projection is quantized")
    if w.norm_kind not in ("rms", "rms1p") or any(L.n1b is not None or L.n2b is not None for L in w.layers):
        raise ValueError(f"norm {w.norm_kind!r}: RMS norms only")
    acts = w.layers[0].w_up.activations
    return cpu_quant.LayerStack(layer_specs(w, cache), n_heads=w.dims.n_heads, n_kv_heads=w.dims.n_kv_heads,
                                head_dim=w.dims.head_dim, eps=w.eps, norm=w.norm_kind, act=w.act, activations=acts)


def _stack(w, cache):
    hit = _STACKS.get(cache)
    if hit is not None and hit[0] is w:
        return hit[1]
    try:
        st = build(w, cache)
    except ValueError as e:
        st = None
        if w not in _WARNED:
            _WARNED.add(w)
            warnings.warn(f"quantized decode: the one-call native layer cannot run ({e}); the per-op step runs "
                          "instead (same values, slower)", RuntimeWarning, stacklevel=3)
    _STACKS[cache] = (w, st)
    return st


_LAYOUT = dict(qkv="qkv_t", o="o_t", gu="gu_t", down="down_t")      # workers.decode.plan's Wᵀ layouts


def native_groups(w, rp, l: int) -> dict | None:
    """Layer ``l``'s input-sparse groups as cs_q_layers takes them ({group: (TransposedParts, thresholds)}), or
    None where the kernels cannot (a group other than QKV, O, gate|up, down; WINA's per-channel thresholds;
    a float part; a part of outputs not a multiple of 32)."""
    out = {}
    L = w.layers[l]
    for g, ent in [*(rp.in_attn.get(l) or {}).items(), *(rp.in_ffn.get(l) or {}).items()]:
        tp = L.layouts.get(_LAYOUT.get(g))
        if (g not in cpu_quant.SPARSE_GROUPS or ent.thresholds.dim() != 1
                or not isinstance(tp, cpu_quant.TransposedParts) or len(tp.parts) != ent.thresholds.numel()
                or any(t.codes is None or t.cols % 32 for t in tp.parts)):
            return None
        out[g] = (tp, ent.thresholds.tolist())
    return out


def _sparse_pack(w, rp, layers, counts: torch.Tensor | None):
    """The plan's native input sparsity over ``layers``, made once per (plan, counters)."""
    key = None if counts is None else counts.data_ptr()
    hit = rp.native.get("sparse")
    if hit is not None and hit[0] == key:
        return hit[1]
    pack = cpu_quant.SparseLayers(len(w.layers), {l: native_groups(w, rp, l) for l in layers}, counts)
    rp.native["sparse"] = (key, pack)
    return pack


def for_step(blocks, rp, cache, fns: dict, counts: torch.Tensor | None = None) -> StepLayers | None:
    """The native layers of this step, or None where the per-op step runs: not quantized, ``fuse`` off, not
    the native glue, batch > 1, kv_mode "active", or no layer left that the kernels take (dense, or input-sparse
    on QKV / O / gate|up / down with one threshold per projection). ``counts``: the runtime's input counters
    [layers, 7], to which the native input-sparse layers add their active inputs."""
    w = blocks.w
    if not (w.quantized and blocks.fuse and cache is not None and cache.batch == 1 and cache.valid is None
            and fns.get("attn") is ops.decode_attention and w.device.type == "cpu"):
        return None
    if ops.backend_name(cache.pos) != "cpu":
        return None                      # CTXSPARSE_KERNELS forces another backend
    covered, sparse_in = _plan_layers(w, rp)
    if covered is not None and not covered:
        return None
    st = _stack(w, cache)
    if st is None:
        return None
    return StepLayers(st, int(cache.pos), covered, _sparse_pack(w, rp, sparse_in, counts) if sparse_in else None)


def _plan_layers(w, rp) -> tuple:
    """(the layers the native call covers, None: all; those of them input-sparse), once per plan."""
    hit = rp.native.get("layers")
    if hit is None:
        covered, sparse_in = None, frozenset()
        if not rp.dense or rp.thr_ffn:
            other = set(rp.mlp) | set(rp.heads) | set(rp.thr_ffn) | set(rp.attn_fn) | set(rp.ffn_fn)
            inputs = set(rp.in_attn) | set(rp.in_ffn)
            sparse_in = frozenset(l for l in inputs if l not in other and native_groups(w, rp, l) is not None)
            covered = (frozenset(range(len(w.layers))) - other - inputs) | sparse_in
            if len(covered) == len(w.layers):
                covered = None
        hit = rp.native["layers"] = (covered, sparse_in)
    return hit
