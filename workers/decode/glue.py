"""The decode runtime's glue: the parts of a decoder layer between its projections (norms, the residual add +
norm, RoPE + attention over the static cache, the gated activation); the projections go through ``kernels``.

Two implementations (``GLUES``, :func:`glue_fns`): "torch", the torch functions here (attention is
``kernels.reference.decode_attention``), compiled with ``torch.compile`` on CUDA; "kernel", attention through
``kernels.ops.decode_attention`` (one Triton launch on CUDA, one native call on the CPU) and, where not
compiled, the RMS norms through ``kernels.ops``. "auto" (:func:`resolve_glue`) is "kernel" on the CPU and CUDA,
"torch" elsewhere. The prefill always runs the torch functions eagerly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import ops
from kernels.common import apply_act
from kernels.reference import decode_attention, rms_norm


def norm(x, w, b, kind: str, eps: float):
    """``kind``: "ln" (LayerNorm), "rms" (Llama: w * y.to(dtype)) or "rms1p" (Gemma: (y * (1 + w)).to(dtype);
    ``w`` then holds 1 + w in fp32)."""
    if kind == "ln":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return rms_norm(x, w, eps, one_plus=kind == "rms1p")


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
GLUES = ("auto", "torch", "kernel")


def check_glue(glue: str) -> str:
    """``glue`` if it is one of GLUES, else ValueError naming them."""
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
    return glue


def resolve_glue(glue: str, device_type: str) -> str:
    """"auto": the kernels on the CPU (one native call per norm and per attention instead of about ten torch
    ops each) and on CUDA (one Triton launch for RoPE, the cache write and attention: 1.4-5.7 % less per token
    than the compiled torch attention on an H200, every point and prompt measured); the compiled torch
    functions on other accelerators. Figures in BENCHMARKS.md."""
    check_glue(glue)
    if glue == "auto":
        return "kernel" if device_type in ("cpu", "cuda") else "torch"
    return glue


def _kernel_norm(x, w, b, kind: str, eps: float):
    return norm(x, w, b, kind, eps) if kind == "ln" else ops.rms_norm(x, w, eps, kind == "rms1p")


def _kernel_add_norm(x, y, w, b, kind: str, eps: float):
    return add_norm(x, y, w, b, kind, eps) if kind == "ln" else ops.add_rms_norm(x, y, w, eps, kind == "rms1p")


def glue_fns(compile: bool, glue: str = "torch") -> dict:
    """The step's glue functions. ``glue`` "torch": the torch functions above, compiled (``torch.compile``,
    static shapes, full graph) when ``compile``, else eager (eager too where compiling is unavailable).
    "kernel": attention through ``kernels.ops.decode_attention`` (one Triton launch on CUDA, one native call on
    the CPU); the RMS norms through ``kernels.ops`` where they are not compiled (native on the CPU; compiled, the
    torch add + norm is already one kernel)."""
    if check_glue(glue) == "auto":
        raise ValueError("glue_fns: resolve 'auto' for the device first (resolve_glue)")
    fns = dict(EAGER)
    compiled = False
    if compile:
        try:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fns = {k: torch.compile(v, dynamic=False, fullgraph=True) for k, v in EAGER.items()}
            compiled = True
        except Exception:  # pragma: no cover - compile unavailable: eager glue
            pass
    if glue == "kernel":
        fns["attn"] = ops.decode_attention
        if not compiled:
            fns.update(norm=_kernel_norm, add_norm=_kernel_add_norm)
    return fns
