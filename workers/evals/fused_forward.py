"""A scoring forward's elementwise steps fused: inside :func:`fused_elementwise`, every RMS norm of a Llama, Qwen2
or Gemma-3 model and its rotary embedding run as one Triton kernel each (:mod:`kernels.norm_rope_triton`).

Why: profiled on an H200, a 32,768-token float32 scoring forward of SmolLM2 spends about 70 % of its kernel time
outside the products, in eager PyTorch's elementwise kernels over the activations; the norms (pow, mean,
rsqrt, two multiplies) and the rotary embedding (slices, negation, concatenation, multiplies, adds) are most of
them. The same functions, computed in fp32 with another summation order: the logits agree to about 1e-6.

Where it applies: float32 activations and weights on a device where :mod:`kernels.ops` picks Triton (CUDA, or
``CTXSPARSE_KERNELS=triton`` with Triton's interpreter); elsewhere, and for any other dtype, the model's own
code runs. The norms are patched per module (an instance ``forward``), so hooks and module swaps around them
(sparsity, capture) still run; the rotary embedding is the model's modeling module's ``apply_rotary_pos_emb``
(how transformers' Llama, Qwen2 and Gemma-3 attention call it), restored on leaving the block.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

# transformers' RMS norm classes: class name -> (the epsilon's attribute, Gemma's 1 + w gain)
NORMS = {"LlamaRMSNorm": ("variance_epsilon", False), "Qwen2RMSNorm": ("variance_epsilon", False),
         "Gemma3RMSNorm": ("eps", True)}


def _on_triton(t: torch.Tensor) -> bool:
    from kernels.ops import backend_name

    return t.dtype == torch.float32 and backend_name(t) == "triton"


def _fused_norm(module, eps: float, one_plus: bool):
    eager = type(module).forward

    def forward(x):
        from kernels import norm_rope_triton as K

        w = module.weight
        if not (_on_triton(x) and w.dtype == torch.float32):
            return eager(module, x)
        return K.rms_norm(x, w, eps, one_plus)
    return forward


def _fused_rope(eager):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        from kernels import norm_rope_triton as K

        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[-1] if args else 1)
        if (unsqueeze_dim != 1 or q.ndim != 4 or cos.ndim != 3
                or not all(_on_triton(t) for t in (q, k, cos, sin))):
            return eager(q, k, cos, sin, *args, **kwargs)
        return K.rotary(q, cos, sin), K.rotary(k, cos, sin)
    return apply_rotary_pos_emb


@contextmanager
def fused_elementwise(model: torch.nn.Module):
    """Inside the block, ``model``'s RMS norms and rotary embedding run fused (see the module docstring); yields
    how many norms were patched."""
    patched = []
    for m in model.modules():
        spec = NORMS.get(type(m).__name__)
        if spec is not None:
            m.forward = _fused_norm(m, float(getattr(m, spec[0])), spec[1])
            patched.append(m)
    modeling = sys.modules.get(type(model).__module__)
    eager_rope = getattr(modeling, "apply_rotary_pos_emb", None) if patched else None
    if eager_rope is not None:
        modeling.apply_rotary_pos_emb = _fused_rope(eager_rope)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
        if eager_rope is not None:
            modeling.apply_rotary_pos_emb = eager_rope
