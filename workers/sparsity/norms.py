"""RMS norms of the models' decoder layers: which modules are one, and the normalized input before their gain (the
activation capture's covariances of normed inputs, LaRoSA's rotations)."""
from __future__ import annotations

import torch
from torch import nn


def is_rms_norm(norm: nn.Module) -> bool:
    """An RMSNorm (no mean subtraction, no bias): what a rotation of the normed input commutes with."""
    return type(norm).__name__.endswith("RMSNorm") and (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps"))


def rms_normalized(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """n = h / rms(h) as the RMSNorm ``norm`` computes it before its gain (float32, or h's dtype if wider)."""
    if not is_rms_norm(norm):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm: rotated input sparsity needs one")
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    x = h.to(torch.promote_types(h.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
