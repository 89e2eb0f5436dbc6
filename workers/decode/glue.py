"""The decode runtime's pure-torch glue: norms, RoPE + attention over the static cache, the gated activation.

These are the elementwise parts of a decoder layer (the projections go through ``kernels``). On CUDA the
runtime compiles them with ``torch.compile`` (:func:`glue_fns`); the prefill always runs them eagerly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common import apply_act


def norm(x, w, b, kind: str, eps: float):
    """``kind``: "ln" (LayerNorm), "rms" (Llama: w * y.to(dtype)) or "rms1p" (Gemma: (y * (1 + w)).to(dtype);
    ``w`` then holds 1 + w in fp32)."""
    if kind == "ln":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms1p":
        return (y * w).to(x.dtype)
    return w * y.to(x.dtype)


def add_norm(x, y, w, b, kind: str, eps: float):
    """(x + y, norm(x + y)): the residual add and the next norm in one fused function."""
    x = x + y
    return x, norm(x, w, b, kind, eps)


def rot_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def act_mul(gu, act: str):
    """act(gate) * up of a packed [.., 2D] gate|up product."""
    D = gu.shape[-1] // 2
    return apply_act(gu[..., :D], act) * gu[..., D:]


def attn_decode(q, k, v, k_cache, v_cache, cos_t, sin_t, pos, qn, kn, eps: float, window: int | None,
                valid=None):
    """One decode position. q [B, H, hd], k/v [B, KV, hd]; caches [B, KV, L, hd]; pos [1] int64.
    Applies the q/k norms (Gemma) and RoPE, writes k/v at ``pos``, attends over the filled positions (and the
    sliding ``window``). ``valid`` [B, KV, L] bool (kv_mode "active"): extra per-(head, position) mask.
    Returns [B, H*hd]."""
    B, H, hd = q.shape
    KV = k.shape[1]
    if qn is not None:
        q = norm(q, qn, None, "rms1p", eps)
        k = norm(k, kn, None, "rms1p", eps)
    if cos_t is not None:
        cos = cos_t.index_select(0, pos).to(q.dtype)   # [1, hd]
        sin = sin_t.index_select(0, pos).to(q.dtype)
        q = q * cos + rot_half(q) * sin
        k = k * cos + rot_half(k) * sin
    kc, vc = k_cache[:, :KV], v_cache[:, :KV]
    kc.index_copy_(2, pos, k.unsqueeze(2))
    vc.index_copy_(2, pos, v.unsqueeze(2))
    L = kc.shape[2]
    s = torch.matmul(q.reshape(B, KV, H // KV, hd), kc.transpose(-1, -2)).float()   # [B, KV, G, L]
    j = torch.arange(L, device=q.device)
    m = j <= pos
    if window is not None:
        m = m & (j > pos - window)
    m = m.view(1, 1, 1, L)
    if valid is not None:
        m = m & valid[:, :, None, :]
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(p, vc).reshape(B, H * hd)


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


EAGER = dict(norm=norm, add_norm=add_norm, act_mul=act_mul, attn=attn_decode)


def glue_fns(compile: bool) -> dict:
    """The step's glue functions: compiled (``torch.compile``, static shapes, full graph) when ``compile``,
    else eager; eager too where compiling is unavailable."""
    if not compile:
        return dict(EAGER)
    try:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        return {k: torch.compile(v, dynamic=False, fullgraph=True) for k, v in EAGER.items()}
    except Exception:  # pragma: no cover - compile unavailable: eager glue
        return dict(EAGER)
