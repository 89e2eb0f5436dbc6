"""Threshold baseline (CATS-style): no predictor, a per-layer magnitude threshold on the gate activation.

The gate projection runs dense; neuron i is kept for a token iff |act(gate_i(x))| > t, with t the s-quantile
of |act(gate)| over the calibration tokens, so a fraction s of (token, neuron) pairs is dropped on calibration
data. Up and down then run on the kept rows only. Target: the gate activation's magnitude, which on gated
SiLU/GeLU models ignores the up projection (the "gate-only" ceiling). For non-gated ReLU models the same rule
on |act(fc1)| is exact sparsity with t = 0 at the natural zero fraction.
The best realizable FFN saving is therefore 2/3 (gate stays dense): recorded as ``plan.dense_gate``.
"""
from __future__ import annotations

import torch

from kernels.common import apply_act
from workers.sparsity.predictors.base import FitContext, MLPPredictor, SparsityPlan, register, same_tensor


class GateThreshold(MLPPredictor):
    """score = |act(x W1ᵀ + b1)| − t, W1 the FFN's own first projection (gate, or fc1 with its bias b1)."""

    method = "threshold"

    def __init__(self, w_first: torch.Tensor, act: str, threshold: float, b_first: torch.Tensor | None = None):
        super().__init__("ffn_in", "positive", None, w_first.shape[0])
        self.act = act
        self.threshold = float(threshold)
        # plain attributes, not buffers: the layer's own weights, which a bundle does not store
        self._w = w_first
        self._b = b_first

    @property
    def w_first(self) -> torch.Tensor:
        """The first projection's weight W1 [D, d] the score reads (the layer's own gate or fc1)."""
        return self._w

    @property
    def b_first(self) -> torch.Tensor | None:
        """fc1's bias b1 (non-gated families with biases), else None."""
        return self._b

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        z = x.to(self._w.dtype) @ self._w.t()
        if self._b is not None:
            z = z + self._b
        return apply_act(z, self.act).abs() - self.threshold

    reads_ffn = True

    def gate_threshold(self):
        return self._w, self._b, self.act, self.threshold

    def scores_from_ffn(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return a.abs() - self.threshold

    def same_ffn(self, weights: dict[str, torch.Tensor]) -> bool:
        if weights.get("gate") is not None:     # gated: act(x gateᵀ), no bias
            return same_tensor(self._w, weights["gate"]) and self._b is None
        return same_tensor(self._w, weights["up"]) and same_tensor(self._b, weights.get("b_up"))

    def config(self) -> dict:
        return {**super().config(), "act": self.act, "threshold": self.threshold}

    @classmethod
    def from_parts(cls, config, tensors, weights):
        w = weights.get("gate", weights["up"])
        return cls(w, config["act"], config["threshold"], None if "gate" in weights else weights.get("b_up"))


def quantile(values: torch.Tensor, q: float, max_samples: int = 4_000_000) -> float:
    """q-quantile of a large tensor (torch.quantile caps its input size: subsample deterministically)."""
    flat = values.reshape(-1)
    if flat.numel() > max_samples:
        step = (flat.numel() - 1) / (max_samples - 1)   # float64 arithmetic: float32 linspace overruns the end
        flat = flat[(torch.arange(max_samples, dtype=torch.float64) * step).long()]
    return torch.quantile(flat.float(), q).item()


@register("threshold")
def fit_threshold(ctx: FitContext, sparsity: dict[int, float], rank=None, **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"threshold: unknown options {sorted(unknown)}")
    act = ctx.act_name()
    plan = SparsityPlan(dense_gate=True)
    for l, s in sparsity.items():
        w = ctx.ffn_weights(l)
        a = apply_act(ctx.cache.load(l, "gate"), act).abs()
        t = quantile(a, s) if s > 0 else -1.0
        # the calibrated activations are the first projection's output, fc1's bias included: so is the score
        plan.mlp[l] = GateThreshold(w.get("gate", w["up"]), act, t, None if "gate" in w else w.get("b_up"))
        plan.info[l] = {"target_sparsity": s, "threshold": t, "calib_offfrac": float((a <= t).float().mean())}
    return plan
