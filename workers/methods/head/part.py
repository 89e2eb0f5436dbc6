"""The predicted head's plan part (kind ``head``): the screen (P, S), the candidate count and the forms the rest of
the code runs it in (workers.sparsity.parts). It changes no decoder layer, so it runs beside any other part."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.methods.head import masked
from workers.methods.head.screen import SCREENS
from workers.sparsity.parts import PlanPart, register_part

ALL = "all"          # the candidate count that makes the head dense


def candidate_count(k, vocab: int) -> int:
    """A deploy-time candidate count: an int in 1..vocab, or ``"all"`` (the dense head: ``vocab``)."""
    if k == ALL:
        return vocab
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= vocab:
        raise ValueError(f"head candidates must be an int in 1..{vocab} or {ALL!r}, got {k!r}")
    return k


@register_part
@dataclass
class PredictedHead(PlanPart):
    """P [r, d] and S [V, r] (float32): the screen S (P h) estimates every logit; the ``candidates`` largest get
    their exact logits. ``screen`` names how P and S were fitted (workers.methods.head.screen)."""
    kind = "head"
    label = "predicted-head"
    alone = False
    decoder = False
    reports = ()

    p: torch.Tensor = None
    s: torch.Tensor = None
    candidates: int = 0
    screen: str = "hidden"
    tail: tuple = (1.0, 0.0)       # (a, b): the non-candidates' logits a·(S P h) + b (screen.fit_tail)

    def __post_init__(self):
        if self.screen not in SCREENS:
            raise ValueError(f"head screen must be one of {SCREENS}, got {self.screen!r}")
        if self.p.dim() != 2 or self.s.dim() != 2 or self.p.shape[0] != self.s.shape[1]:
            raise ValueError(f"head screen: P [r, d] and S [V, r] needed, got {tuple(self.p.shape)} and "
                             f"{tuple(self.s.shape)}")
        self.candidates = candidate_count(self.candidates, self.vocab)
        self.tail = (float(self.tail[0]), float(self.tail[1]))

    @property
    def vocab(self) -> int:
        return self.s.shape[0]

    @property
    def rank(self) -> int:
        return self.p.shape[0]

    def with_candidates(self, k) -> "PredictedHead":
        """The same screen with another candidate count (an int, or ``"all"``: the dense head); no refit."""
        return PredictedHead(p=self.p, s=self.s, candidates=candidate_count(k, self.vocab), screen=self.screen,
                             tail=self.tail)

    def layers(self) -> list[int]:
        return []

    def read_numel(self, d: int) -> int:
        """Head weight elements a token reads: the screen and the candidates' rows (the dense head reads V·d)."""
        return self.p.numel() + self.s.numel() + self.candidates * d

    # ---- bundle form
    def to_bundle(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return ({"candidates": int(self.candidates), "screen": self.screen, "tail": list(self.tail)},
                {"p": self.p, "s": self.s})

    @classmethod
    def tensor_keys(cls, config: dict) -> set[str]:
        return {"p", "s"}

    @classmethod
    def from_bundle(cls, config: dict, tensors: dict[str, torch.Tensor], device) -> "PredictedHead":
        return cls(p=tensors["p"].to(device), s=tensors["s"].to(device), candidates=int(config["candidates"]),
                   screen=config["screen"], tail=tuple(config["tail"]))

    # ---- masked form: the head's own counters, not the decoder's byte charges
    def apply_masked(self, model, stats, swaps) -> int:
        masked.apply_head(model, self, swaps)
        return 0

    # ---- runtime form: imported when the decode runtime asks for it (it builds on workers.decode)
    def runtime(self, w):
        from workers.methods.head.runtime import compile_head

        return compile_head(self, w)
