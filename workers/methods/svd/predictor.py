"""SVDP's predictor, the form a bundle stores: ``score(x) = proxy(x) + bias`` from the low-rank factors
:mod:`workers.methods.svd.fit` computes, a neuron running iff its score is > 0 (rule ``positive``).
"""
from __future__ import annotations

import torch

from workers.loading.adapters import activation_fn
from workers.sparsity.predictors.base import MLPPredictor, linear

TARGETS = ("gate", "product")


class SVDPredictor(MLPPredictor):
    """score(x) = proxy(x) + bias; a neuron runs iff score > 0.

    ``target="gate"``: proxy = (x Aᵀ) Bᵀ.  ``target="product"``: proxy = |act((x Aᵀ) Bᵀ) · (x A_upᵀ) B_upᵀ|
    (bias = −t: keep iff |act(ĝ)·û| > t). B A is never formed: two skinny matmuls per factor pair.
    """

    method = "svd"

    def __init__(self, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor, input_kind: str = "ffn_in",
                 target: str = "gate", act: str | None = None, A_up: torch.Tensor | None = None,
                 B_up: torch.Tensor | None = None):
        D = B.shape[0]
        super().__init__(input_kind=input_kind, rule="positive", k=None, n_neurons=D)
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}")
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or bias.shape != (D,):
            raise ValueError(f"shapes: A [r, d], B [D, r], bias [D]; got {tuple(A.shape)}, {tuple(B.shape)}, "
                             f"{tuple(bias.shape)}")
        if target == "product":
            if A_up is None or B_up is None or act is None:
                raise ValueError("target 'product' needs A_up, B_up and act")
            if A_up.shape[1] != A.shape[1] or B_up.shape[0] != D or A_up.shape[0] != B_up.shape[1]:
                raise ValueError("A_up [r_up, d], B_up [D, r_up] must match A and B")
            activation_fn(act)  # validates the name
        self.target, self.act = target, act
        self.register_buffer("A", A.detach().float().contiguous())
        self.register_buffer("B", B.detach().float().contiguous())
        self.register_buffer("bias", bias.detach().float().contiguous())
        if target == "product":
            self.register_buffer("A_up", A_up.detach().float().contiguous())
            self.register_buffer("B_up", B_up.detach().float().contiguous())
        self._act_fn = activation_fn(act) if act is not None else None

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @torch.no_grad()
    def proxy(self, x: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, D]: the score before the bias (what the calibration sorts tokens by)."""
        x = x.to(self.A.dtype)
        g = linear(linear(x, self.A), self.B)
        if self.target == "gate":
            return g
        u = linear(linear(x, self.A_up), self.B_up)
        return (self._act_fn(g) * u).abs_()

    @torch.no_grad()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.proxy(x) + self.bias

    def config(self) -> dict:
        cfg = super().config()
        cfg.update({"target": self.target, "act": self.act, "rank": self.rank,
                    "rank_up": self.A_up.shape[0] if self.target == "product" else None})
        return cfg

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None = None):
        if config.get("method") != cls.method:
            raise ValueError(f"not an {cls.method!r} predictor config: {config.get('method')!r}")
        return cls(tensors["A"], tensors["B"], tensors["bias"], input_kind=config["input_kind"],
                   target=config.get("target", "gate"), act=config.get("act"),
                   A_up=tensors.get("A_up"), B_up=tensors.get("B_up"))
