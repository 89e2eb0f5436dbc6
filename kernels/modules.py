"""nn.Module drop-ins holding weights in the kernels' layout (built once from a model's Linears).

Each forward takes the active set explicitly (``idx``, ``count``; see kernels.common), so a predictor
or an ``apply_*`` helper elsewhere decides what is active; these modules only compute.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ops


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().contiguous(), requires_grad=False)


class SparseGatedMLP(nn.Module):
    """Gated MLP (SwiGLU / GeGLU / ReGLU) over the active neurons: W_down[:, I] (act(W_gate[I] x) * W_up[I] x)."""

    def __init__(self, w_gate, w_up, w_down_t, act: str = "silu"):
        super().__init__()
        self.w_gate, self.w_up, self.w_down_t = _frozen(w_gate), _frozen(w_up), _frozen(w_down_t)
        self.act = act

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act: str = "silu"):
        assert gate_proj.bias is None and up_proj.bias is None and down_proj.bias is None
        return cls(gate_proj.weight, up_proj.weight, down_proj.weight.t(), act)

    def forward(self, x, idx, count=None, threshold=None):
        shape = x.shape
        y = ops.sparse_ffn(x.reshape(-1, shape[-1]).contiguous(), self.w_gate, self.w_up, self.w_down_t,
                           idx, count, self.act, threshold)
        return y.reshape(shape)


class SparseMLP(nn.Module):
    """Non-gated (OPT-style) MLP: W_fc2[:, I] act(W_fc1[I] x + b_fc1[I]) + b_fc2."""

    def __init__(self, w_fc1, b_fc1, w_fc2_t, b_fc2, act: str = "relu"):
        super().__init__()
        self.w_fc1, self.w_fc2_t = _frozen(w_fc1), _frozen(w_fc2_t)
        self.b_fc1 = _frozen(b_fc1) if b_fc1 is not None else None
        self.b_fc2 = _frozen(b_fc2) if b_fc2 is not None else None
        self.act = act

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, act: str = "relu"):
        return cls(fc1.weight, fc1.bias, fc2.weight.t(), fc2.bias, act)

    def forward(self, x, idx, count=None):
        shape = x.shape
        y = ops.sparse_mlp(x.reshape(-1, shape[-1]).contiguous(), self.w_fc1, self.b_fc1, self.w_fc2_t,
                           self.b_fc2, idx, count, self.act)
        return y.reshape(shape)


class HeadSparseQKV(nn.Module):
    """Packed QKV projection over the active query heads and the KV heads they need (GQA)."""

    def __init__(self, w_qkv, n_heads: int, n_kv_heads: int, head_dim: int, bias=None):
        super().__init__()
        self.w_qkv = _frozen(w_qkv)
        self.bias = _frozen(bias) if bias is not None else None
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim

    @classmethod
    def from_linears(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, n_heads: int, n_kv_heads: int):
        head_dim = q_proj.weight.shape[0] // n_heads
        w = torch.cat([q_proj.weight, k_proj.weight, v_proj.weight], 0)
        b = None
        if q_proj.bias is not None:
            b = torch.cat([q_proj.bias, k_proj.bias, v_proj.bias], 0)
        return cls(w, n_heads, n_kv_heads, head_dim, b)

    def forward(self, x, q_idx, q_count=None):
        """x [B, d] -> (q [B, Kq, hd], k [B, n_kv, hd], v [B, n_kv, hd], kv_idx, kv_count, kv_slot)."""
        kv_idx, kv_count, kv_slot = ops.kv_heads_for(q_idx, q_count, self.n_heads, self.n_kv_heads)
        q, k, v = ops.head_sparse_qkv(x.contiguous(), self.w_qkv, q_idx, q_count, kv_idx, kv_count,
                                      self.n_heads, self.n_kv_heads, self.head_dim, self.bias)
        return q, k, v, kv_idx, kv_count, kv_slot


class HeadSparseOut(nn.Module):
    """Output projection over the active heads (W_o^T stored contiguous: a head is head_dim rows)."""

    def __init__(self, w_o_t, head_dim: int, bias=None):
        super().__init__()
        self.w_o_t = _frozen(w_o_t)
        self.bias = _frozen(bias) if bias is not None else None
        self.head_dim = head_dim

    @classmethod
    def from_linear(cls, o_proj: nn.Linear, n_heads: int):
        return cls(o_proj.weight.t(), o_proj.weight.shape[1] // n_heads, o_proj.bias)

    def forward(self, attn, q_idx, q_count=None):
        return ops.head_sparse_out(attn, self.w_o_t, q_idx, q_count, self.head_dim, self.bias)
