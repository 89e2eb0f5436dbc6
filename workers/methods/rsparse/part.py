"""R-Sparse's plan part (kind ``rsparse``): per layer and projection a threshold, a score and the rank-r
factors, and the forms the rest of the code runs it in (workers.sparsity.parts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.methods.rsparse import masked
from workers.sparsity.parts import PlanPart, register_part

SCORES = ("abs", "wina")


@dataclass
class LowRankPart:
    """One projection's part: keep input i iff its score > ``threshold`` (-1: every input), and the rank-r factors
    ``a`` = Σ_r V_rᵀ [r, in], ``b`` = U_r [out, r] for the other inputs (both None: r = 0)."""
    threshold: float
    score: str = "abs"
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"rank-sparse score must be one of {SCORES}, got {self.score!r}")
        if (self.a is None) != (self.b is None):
            raise ValueError("a low-rank part needs both factors (a [r, in], b [out, r]) or neither")
        if self.a is not None and (self.a.dim() != 2 or self.b.dim() != 2 or self.a.shape[0] != self.b.shape[1]):
            raise ValueError(f"factors of shapes {tuple(self.a.shape)} and {tuple(self.b.shape)} do not make a "
                             "rank-r product b @ a")

    @property
    def rank(self) -> int:
        return 0 if self.a is None else int(self.a.shape[0])

    def numel(self) -> int:
        """Factor elements read per token: r·(in + out)."""
        return 0 if self.a is None else self.a.numel() + self.b.numel()


@register_part
@dataclass
class RankSparsePlan(PlanPart):
    """{layer: {projection: LowRankPart}} (projections of ``input_sparse.projection_paths``; absent = dense)."""
    kind = "rsparse"
    label = "rank-sparse"
    legacy_key, legacy_prefix = "lowrank", "lowrank."

    parts: dict[int, dict[str, LowRankPart]] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return sorted(self.parts)

    # ---- bundle form: thresholds, scores and ranks in the config, the factors <layer>.<projection>.a / .b
    def to_bundle(self) -> tuple[dict, dict[str, torch.Tensor]]:
        cfg: dict[str, dict[str, dict]] = {}
        tensors = {}
        for l, per in sorted(self.parts.items()):
            for p, part in sorted(per.items()):
                cfg.setdefault(str(l), {})[p] = {"threshold": float(part.threshold), "score": part.score,
                                                 "rank": part.rank}
                if part.a is not None:
                    tensors[f"{l}.{p}.a"], tensors[f"{l}.{p}.b"] = part.a, part.b
        return cfg, tensors

    @classmethod
    def tensor_keys(cls, config: dict) -> set[str]:
        return {f"{l}.{p}.{x}" for l, per in config.items() for p, part in per.items() if int(part["rank"]) > 0
                for x in ("a", "b")}

    @classmethod
    def from_bundle(cls, config: dict, tensors: dict[str, torch.Tensor], device) -> "RankSparsePlan":
        plan = cls()
        for l_s, per in config.items():
            for proj, part in per.items():
                a, b = (tensors.get(f"{l_s}.{proj}.{x}") for x in ("a", "b"))
                got = LowRankPart(float(part["threshold"]), part["score"], None if a is None else a.to(device),
                                  None if b is None else b.to(device))
                if got.rank != int(part["rank"]):
                    raise ValueError(f"layer {l_s} {proj}: factors of rank {got.rank}, manifest says {part['rank']}")
                plan.parts.setdefault(int(l_s), {})[proj] = got
        return plan

    # ---- masked form, bytes, runtime form
    def apply_masked(self, model, stats, swaps) -> int:
        return masked.apply_rank_sparsity(model, self, stats, swaps=swaps).extra_numel

    def extra_numel(self, model=None) -> int:
        """Weight elements every token reads beside the model's own: every part's factors."""
        return lowrank_numel(self)

    def runtime(self, w):
        # imported here: the runtime form builds on workers.decode.plan, which imports the predictors' package (and
        # so this part) itself
        from workers.methods.rsparse.runtime import compile_plan

        return compile_plan(self, w)


def lowrank_numel(plan: RankSparsePlan) -> int:
    """Weight elements every token reads beside the model's own: every part's factors."""
    return sum(p.numel() for per in plan.parts.values() for p in per.values())
