"""Static: one fixed neuron set per layer, the same for every token (non-contextual): the lower bound.

The set is the k = (1-s)·D neurons with the largest mean |act(gate)·up| over the calibration tokens (what a
structured-pruning baseline keeps). Heads likewise by mean output norm.
"""
from __future__ import annotations

import torch

from workers.sparsity.predictors.base import FitContext, HeadPredictor, MLPPredictor, SparsityPlan, k_for, register


class _FixedImportance:
    """Scores every token with the same per-unit importance (a buffer); rebuilt from it in a bundle."""

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.importance.expand(x.shape[0], -1)

    @classmethod
    def from_parts(cls, config, tensors, weights):
        return cls(tensors["importance"], config["k"])


class StaticMLP(_FixedImportance, MLPPredictor):
    method = "static"

    def __init__(self, importance: torch.Tensor, k: int):
        super().__init__("ffn_in", "topk", k, importance.numel())
        self.register_buffer("importance", importance.float().clone())


class StaticHeads(_FixedImportance, HeadPredictor):
    method = "static"

    def __init__(self, importance: torch.Tensor, k: int):
        super().__init__("residual", k, importance.numel())   # the input only gives the token count
        self.register_buffer("importance", importance.float().clone())


@register("static")
def fit_static(ctx: FitContext, sparsity: dict[int, float], rank=None, attn_sparsity: float | None = None,
               **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"static: unknown options {sorted(unknown)}")
    dims = ctx.lm.dims
    plan = SparsityPlan()
    for l, s in sparsity.items():
        imp = ctx.cache.load(l, "inter").abs().mean(0)
        k = k_for(s, dims.D)
        plan.mlp[l] = StaticMLP(imp, k)
        plan.info[l] = {"target_sparsity": s, "k": k}
        if attn_sparsity is not None:
            plan.attn[l] = StaticHeads(ctx.cache.load(l, "head_norm").mean(0), k_for(attn_sparsity, dims.n_heads))
    return plan
