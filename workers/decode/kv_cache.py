"""The decode runtime's static KV cache: fixed [batch, KV heads, max_len, head_dim] buffers per layer and the
device position counter the one-token step reads (so graph replays need no host sync).

``track_valid`` (kv_mode "active"): a [batch, KV + 1, max_len] bool mask per layer of the (head, position)
entries that were written (the extra slot KV takes the skipped heads' writes); attention masks the rest out.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device, track_valid: bool = False):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.batch, self.max_len, self.n_kv_heads = batch, max_len, n_kv_heads
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.valid = ([torch.zeros(batch, n_kv_heads + 1, max_len, dtype=torch.bool, device=device)
                       for _ in range(n_layers)] if track_valid else None)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)   # the next position to write

    def fits(self, batch: int, length: int) -> bool:
        return self.batch == batch and length <= self.max_len

    def write_prompt(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``l``'s K/V of a whole prompt [B, KV, T, hd] at positions 0..T-1 (all heads valid)."""
        T = k.shape[2]
        self.k[l][:, :, :T] = k
        self.v[l][:, :, :T] = v
        if self.valid is not None:
            self.valid[l].zero_()
            self.valid[l][:, :, :T] = True

    def mark_written(self, l: int, on: torch.Tensor) -> torch.Tensor:
        """kv_mode "active": record which KV heads (``on`` [KV + 1] bool) were written at ``pos``; returns the
        layer's mask [B, KV, L] for attention."""
        B = self.batch
        self.valid[l].index_copy_(2, self.pos, on.view(1, -1, 1).expand(B, -1, 1).contiguous())
        return self.valid[l][:, : self.n_kv_heads]
