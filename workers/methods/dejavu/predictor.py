"""Deja Vu's predictor modules, the form a bundle stores: a rank-r map ``fc2(fc1(x))`` from the predictor input to
one logit per FFN neuron (:class:`DejaVuMLPPredictor`) or per attention head (:class:`DejaVuHeadPredictor`); the
layer keeps the top-k logits per token. Fitting them is :mod:`workers.methods.dejavu.fit`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from workers.sparsity.predictors.base import HeadPredictor, MLPPredictor, linear


class LowRank:
    """Shared by both predictors: ``fc2(fc1(x))``, a rank-``rank`` map from d inputs to ``n_out`` logits."""

    fc1: nn.Linear
    fc2: nn.Linear

    def _build(self, d: int, rank: int, n_out: int) -> None:
        if d < 1 or rank < 1 or n_out < 1:
            raise ValueError(f"need d, rank, outputs >= 1, got {d}, {rank}, {n_out}")
        self.d, self.rank = int(d), int(rank)
        # no RNG draw here: fitting initializes from a seeded generator, from_parts loads tensors
        self.fc1 = nn.Linear(d, rank, bias=False)
        self.fc2 = nn.Linear(rank, n_out, bias=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return linear(linear(x.to(self.fc1.weight.dtype), self.fc1.weight), self.fc2.weight)

    @torch.no_grad()
    def reset_random(self, generator: torch.Generator) -> None:
        """nn.Linear's default init (uniform, bound 1/sqrt(fan_in)) drawn from ``generator``."""
        for lin in (self.fc1, self.fc2):
            bound = 1.0 / math.sqrt(lin.in_features)
            w = torch.empty(lin.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            lin.weight.copy_(w)

    def _lowrank_config(self) -> dict:
        return {"d": self.d, "rank": self.rank}


class DejaVuMLPPredictor(LowRank, MLPPredictor):
    """Deja Vu MLP predictor: top-k of ``fc2(fc1(x))`` over the D neurons. See :mod:`workers.methods.dejavu.fit`."""

    method = "dejavu"

    def __init__(self, d: int, rank: int, n_neurons: int, k: int, input_kind: str = "residual",
                 label: str = "topk"):
        MLPPredictor.__init__(self, input_kind, "topk", k, n_neurons)
        if label not in ("active", "topk", "damage"):
            raise ValueError(f"label must be 'active', 'topk' or 'damage', got {label!r}")
        self.label = label
        with torch.random.fork_rng(devices=[]):  # nn.Linear draws an init we overwrite: leave global RNG alone
            self._build(d, rank, n_neurons)

    def config(self) -> dict:
        return {**MLPPredictor.config(self), **self._lowrank_config(), "label": self.label}

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights=None) -> "DejaVuMLPPredictor":
        p = cls(config["d"], config["rank"], config["n_neurons"], config["k"], config["input_kind"],
                config.get("label", "topk"))
        p.load_state_dict(tensors, strict=True)
        return p


class DejaVuHeadPredictor(LowRank, HeadPredictor):
    """Deja Vu attention-head predictor: top-k of ``fc2(fc1(x))`` over the H heads."""

    method = "dejavu"

    def __init__(self, d: int, rank: int, n_heads: int, k: int, input_kind: str = "lookahead",
                 label_k: int | None = None):
        HeadPredictor.__init__(self, input_kind, k, n_heads)
        self.label_k = int(label_k) if label_k is not None else math.ceil(0.3 * n_heads)
        with torch.random.fork_rng(devices=[]):
            self._build(d, rank, n_heads)

    def config(self) -> dict:
        return {**HeadPredictor.config(self), **self._lowrank_config(), "label_k": self.label_k}

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights=None) -> "DejaVuHeadPredictor":
        p = cls(config["d"], config["rank"], config["n_heads"], config["k"], config["input_kind"],
                config.get("label_k"))
        p.load_state_dict(tensors, strict=True)
        return p
