"""The decode runtime's pure-torch glue: norms, RoPE + attention over the static cache (the torch
``kernels.reference.decode_attention``), the gated activation.

These are the elementwise parts of a decoder layer (the projections go through ``kernels``). On CUDA the
runtime compiles them with ``torch.compile`` (:func:`glue_fns`); the prefill always runs them eagerly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import ops
from kernels.common import apply_act
from kernels.reference import decode_attention, rms_norm_1p


def norm(x, w, b, kind: str, eps: float):
    """``kind``: "ln" (LayerNorm), "rms" (Llama: w * y.to(dtype)) or "rms1p" (Gemma: (y * (1 + w)).to(dtype);
    ``w`` then holds 1 + w in fp32)."""
    if kind == "ln":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if kind == "rms1p":
        return rms_norm_1p(x, w, eps)
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_norm(x, y, w, b, kind: str, eps: float):
    """(x + y, norm(x + y)): the residual add and the next norm in one fused function."""
    x = x + y
    return x, norm(x, w, b, kind, eps)


def act_mul(gu, act: str):
    """act(gate) * up of a packed [.., 2D] gate|up product."""
    D = gu.shape[-1] // 2
    return apply_act(gu[..., :D], act) * gu[..., D:]


def attn_prefill(q, k, v, window: int | None):
    """q [B, H, T, hd] (pre-scaled), k/v [B, KV, T, hd]: causal (+ window) attention -> [B, T, H*hd]."""
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    i = torch.arange(T, device=q.device)
    m = i[None, :] <= i[:, None]
    if window is not None:
        m = m & (i[None, :] > i[:, None] - window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=1.0)
    return o.transpose(1, 2).reshape(B, T, H * hd)


EAGER = dict(norm=norm, add_norm=add_norm, act_mul=act_mul, attn=decode_attention)
ATTENTIONS = ("torch", "kernel")


def check_attention(attention: str) -> str:
    """``attention`` if it is one of ATTENTIONS, else ValueError naming them."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    return attention


def glue_fns(compile: bool, attention: str = "torch") -> dict:
    """The step's glue functions: compiled (``torch.compile``, static shapes, full graph) when ``compile``,
    else eager; eager too where compiling is unavailable. ``attention`` "kernel": the decode attention is
    ``kernels.ops.decode_attention`` (one Triton kernel on CUDA) instead of the torch function."""
    check_attention(attention)
    fns = dict(EAGER)
    if compile:
        try:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fns = {k: torch.compile(v, dynamic=False, fullgraph=True) for k, v in EAGER.items()}
        except Exception:  # pragma: no cover - compile unavailable: eager glue
            pass
    if attention == "kernel":
        fns["attn"] = ops.decode_attention
    return fns
