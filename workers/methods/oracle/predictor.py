"""Oracle: the true per-token top set (the upper bound every predictor is compared against).

MLP: the k = (1-s)·D neurons with the largest |act(gate)·up| (non-gated: |act(fc1)|) for this very token,
computed from the dense activations (two passes: Deja Vu's existence study). Attention: the k heads with the
largest output norm for this token. Neither saves compute; both say what the best contextual set costs in
quality.
"""
from __future__ import annotations

import torch

from kernels.common import apply_act
from workers.sparsity.predictors.base import (
    FitContext, HeadPredictor, MLPPredictor, SparsityPlan, k_for, register, same_tensor,
)


class OracleMLP(MLPPredictor):
    method = "oracle"

    def __init__(self, weights: dict[str, torch.Tensor], act: str, k: int):
        super().__init__("ffn_in", "topk", k, weights["up"].shape[0])
        self.act = act
        # references to the layer's own weights: nothing to store in a bundle
        self._gate = weights.get("gate")
        self._up = weights["up"]
        self._b_up = weights.get("b_up")

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self._up.dtype)
        if self._gate is not None:
            return (apply_act(x @ self._gate.t(), self.act) * (x @ self._up.t())).abs()
        z = x @ self._up.t() + (self._b_up if self._b_up is not None else 0)
        return apply_act(z, self.act).abs()

    reads_ffn = True

    def scores_from_ffn(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return h.abs()          # |act(gate) · up|, or |act(fc1)| (then h is a)

    def same_ffn(self, weights: dict[str, torch.Tensor]) -> bool:
        if self._gate is not None:          # gated: act(x gateᵀ) · (x upᵀ), no bias
            return same_tensor(self._gate, weights.get("gate")) and same_tensor(self._up, weights["up"])
        return (weights.get("gate") is None and same_tensor(self._up, weights["up"])
                and same_tensor(self._b_up, weights.get("b_up")))

    def config(self) -> dict:
        return {**super().config(), "act": self.act}

    @classmethod
    def from_parts(cls, config, tensors, weights):
        return cls(weights, config["act"], config["k"])


class OracleHeads(HeadPredictor):
    method = "oracle"

    def __init__(self, k: int, n_heads: int, head_dim: int):
        super().__init__("head_out", k, n_heads)
        self.head_dim = head_dim

    def scores(self, attn_out: torch.Tensor) -> torch.Tensor:
        return attn_out.reshape(attn_out.shape[0], self.n_heads, self.head_dim).float().norm(dim=-1)

    def config(self) -> dict:
        return {**super().config(), "head_dim": self.head_dim}

    @classmethod
    def from_parts(cls, config, tensors, weights):
        return cls(config["k"], config["n_heads"], config["head_dim"])


@register("oracle")
def fit_oracle(ctx: FitContext, sparsity: dict[int, float], rank=None, attn_sparsity: float | None = None,
               **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"oracle: unknown options {sorted(unknown)}")
    act, dims = ctx.act_name(), ctx.lm.dims
    plan = SparsityPlan(dense_gate=True)   # the oracle needs every gate and up value: it saves nothing
    for l, s in sparsity.items():
        k = k_for(s, dims.D)
        plan.mlp[l] = OracleMLP(ctx.ffn_weights(l), act, k)
        plan.info[l] = {"target_sparsity": s, "k": k}
        if attn_sparsity is not None:
            plan.attn[l] = OracleHeads(k_for(attn_sparsity, dims.n_heads), dims.n_heads, dims.head_dim)
            plan.info[l]["attn_sparsity"] = attn_sparsity
    return plan
