"""The decode runtime's weights with every projection kept in the GGUF's quantized blocks (CPU).

    w = from_gguf(model, gguf_path)      # model: the fp32 HF model loaded from that GGUF (workers.loading)
    rt = DecodeRuntime(w)                # or DecodeRuntime.from_gguf(model, gguf_path)

:func:`workers.decode.weights.from_hf` builds the fp32 structs; this swaps their matrices for
:class:`kernels.quant.QuantWeight` objects read from the file (workers.loading.gguf_tensors): ``w_qkv`` (query,
key, value rows stacked, each part in its own format; the query part carries the folded attention scale as an
fp32 part scale), ``w_o_t`` / ``w_down_t`` (W_o, W_down in the file's [out, in] layout: the slots keep the linear
map, the kernels read the layout they get), ``w_gate``, ``w_up``, the embedding table and the LM head. Norms,
biases, RoPE tables stay the model's fp32 tensors. The weights the runtime reads per token are then the file's
bytes, not 8x them.

Llama GGUFs store the query/key rows permuted for ggml's interleaved RoPE (transformers undoes it on load);
the same permutation moves whole quantized rows here, so values stay exact. ``verify`` (default) checks that
every swapped matrix dequantizes to exactly the fp32 struct's values (bit for bit, the attention scale's product
included): a GGUF that is not the model's file, or a layout this module gets wrong, is refused instead of decoding
garbage. About 1 s for SmolLM2-135M.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kernels import cpu_quant
from kernels.quant import QuantWeight
from workers.decode.weights import ModelWeights, from_hf
from workers.loading.gguf_tensors import read_gguf_matrices

# GGUF architectures whose query/key rows llama.cpp's converter permuted (transformers' TENSOR_PROCESSORS)
PERMUTED_QK = ("llama",)


class GGUFMismatch(ValueError):
    """The GGUF's matrices are not the model's weights (or not laid out as this module expects)."""


def _unpermute(w: QuantWeight, n_head: int) -> QuantWeight:
    """transformers' reverse permutation of llama query/key rows: HF row (h, a, j) = GGUF row (h, j, a)."""
    dim = w.rows // n_head // 2
    perm = torch.arange(w.rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)
    return w.take_rows(perm)


def from_gguf(model, gguf: str | Path, *, verify: bool = True, activations: str = "fp32") -> ModelWeights:
    """fp32 runtime weights of ``model`` (CPU) with its projections, embedding and LM head replaced by the
    quantized matrices of ``gguf`` (the file the model was loaded from). ``activations`` (kernels.quant.
    ACTIVATIONS): "fp32", the products of the dequantized weights to fp32 summation order; "q8", the decode
    step's activations quantized to 8 bits per 32 first (llama.cpp's way, approximate; the prefill stays fp32)."""
    base = from_hf(model, torch.float32, "cpu")
    if base.family == "opt":
        raise ValueError("quantized weights: llama-style GGUF tensor names only (llama, mistral, qwen2, gemma3)")
    g = read_gguf_matrices(gguf)
    m = g.matrices
    dims = base.dims
    H, KV = dims.n_heads, dims.n_kv_heads
    permute = g.architecture in PERMUTED_QK

    def get(name):
        if name not in m:
            raise GGUFMismatch(f"{Path(gguf).name} has no tensor {name!r}")
        return m[name]

    layers = []
    for i, L in enumerate(base.layers):
        q, k = get(f"blk.{i}.attn_q.weight"), get(f"blk.{i}.attn_k.weight")
        if permute:
            q, k = _unpermute(q, H), _unpermute(k, KV)
        q = q.with_scale(base.q_fold) if base.q_fold != 1.0 else q
        qkv = QuantWeight.stack([q, k, get(f"blk.{i}.attn_v.weight")])
        new = dict(w_qkv=qkv, w_o_t=get(f"blk.{i}.attn_output.weight"), w_up=get(f"blk.{i}.ffn_up.weight"),
                   w_down_t=get(f"blk.{i}.ffn_down.weight"))
        if L.w_gate is not None:
            new["w_gate"] = get(f"blk.{i}.ffn_gate.weight")
        if verify:
            _verify(f"layer {i}", new, dict(w_qkv=L.w_qkv, w_o_t=L.w_o_t.t(), w_up=L.w_up, w_down_t=L.w_down_t.t(),
                                            w_gate=L.w_gate))
        layers.append(dataclasses.replace(L, **new))
    embed = get("token_embd.weight")
    head = m.get("output.weight", embed)
    if verify:
        _verify("embedding / LM head", dict(embed=embed, lm_head=head), dict(embed=base.embed, lm_head=base.lm_head))
    out = dataclasses.replace(base, layers=tuple(layers), embed=embed, lm_head=head)
    return out if activations == "fp32" else with_activations(out, activations)


QUANT_FIELDS = ("w_qkv", "w_o_t", "w_gate", "w_up", "w_down_t")


def with_activations(w: ModelWeights, activations: str) -> ModelWeights:
    """The same quantized weights multiplied the ``activations`` way (kernels.quant.ACTIVATIONS), blocks shared."""
    layers = tuple(dataclasses.replace(L, **{f: getattr(L, f).with_activations(activations) for f in QUANT_FIELDS
                                             if isinstance(getattr(L, f), QuantWeight)}) for L in w.layers)
    return dataclasses.replace(w, layers=layers, lm_head=w.lm_head.with_activations(activations))


def _verify(where: str, quant: dict, ref: dict) -> None:
    for name, qw in quant.items():
        want = ref[name]
        if tuple(want.shape) != qw.shape:
            raise GGUFMismatch(f"{where}: {name} is {qw.shape} in the GGUF, {tuple(want.shape)} in the model")
        if not torch.equal(cpu_quant.dequantize(qw).view(torch.int32), want.view(torch.int32)):
            raise GGUFMismatch(f"{where}: {name} dequantized from the GGUF differs from the model's weights")
