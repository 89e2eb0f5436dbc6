"""Rank-aware input sparsity (R-Sparse) on a Hugging Face model: each projection computes W on its large inputs and
a low-rank approximation of W on the rest.

Reference: Zhang et al., "R-Sparse: Rank-Aware Activation Sparsity for Efficient LLM Inference", ICLR 2025
(arXiv 2504.19449); code VITA-Group/R-Sparse, ``models/modeling_llama.py`` (``R_Sparse_Linear``, mode
``r_sparse``) and ``utils/prepare_low_rank_weight.py`` (a plain SVD of every linear weight). The fit (the recipe:
sparsity and rank per projection) is :mod:`workers.sparsity.predictors.rsparse`; this module puts a
:class:`RankSparsePlan` on a model.

For a token x entering projection W ([out, in]) with a part (threshold t, score, rank r, factors A = Σ_r V_rᵀ
[r, in] and B = U_r [out, r], W = U Σ Vᵀ):

    m_i = score_i > t        score_i = |x_i| ("abs") or |x_i|·‖W[:, i]‖₂ ("wina": the reference's scaled input)
    y   = W (x ⊙ m) + B (A (x ⊙ (1 - m)))  (+ W's bias)

so the large inputs go through W's kept columns and the small ones through the rank-r term (r = 0: TEAL's
product; r = min(in, out): W exactly, whatever the mask). One threshold per projection, calibrated on the
activation cache's histograms (the reference calibrates one per linear on one 512-token window), so the number
of kept inputs varies per token, as TEAL's.

**Bytes.** Per token the projection reads the kept columns of W (counted in ``input_sparse.InputStats`` like
TEAL's) and the factors, r·(in + out) elements (``lowrank_numel``, charged in "decoder bytes skipped" through
``SparseStats.extra_numel``, as LaRoSA's rotations are). A kernel could read only A's columns of the dropped
inputs; the full factors are charged, as the reference's budget does.

Masked mode here, the exact function: dense products, the dropped inputs zeroed in W's product and the kept ones
in the low-rank term (the decode runtime's form is workers.decode.plan's low-rank terms beside its input-sparse
products): :class:`RankSparseLinear` replaces each planned projection; ``.revert()`` restores the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.loading.adapters import adapter_for, get_path, linear_weight
from workers.sparsity.input_sparse import InputStats, column_norms, input_score, model_projection_numel, \
    projection_paths
from workers.sparsity.swaps import ModuleSwaps

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


@dataclass
class RankSparsePlan:
    """{layer: {projection: LowRankPart}} (projections of ``input_sparse.projection_paths``; absent = dense)."""
    parts: dict[int, dict[str, LowRankPart]] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return sorted(self.parts)


def lowrank_numel(plan: RankSparsePlan) -> int:
    """Weight elements every token reads beside the model's own: every part's factors."""
    return sum(p.numel() for per in plan.parts.values() for p in per.values())


class RankSparseLinear(nn.Module):
    """A projection computed as W on the inputs whose score exceeds ``threshold`` plus the rank-r term on the
    others (see the module doc)."""

    def __init__(self, orig: nn.Module, part: LowRankPart, layer: int, proj: str, stats: InputStats):
        super().__init__()
        w = linear_weight(orig).detach()
        out_f, in_f = w.shape
        if part.a is not None and (part.a.shape[1] != in_f or part.b.shape[0] != out_f):
            raise ValueError(f"layer {layer} {proj}: factors {tuple(part.b.shape)} @ {tuple(part.a.shape)} do not "
                             f"fit a [{out_f}, {in_f}] weight")
        self.orig = orig                       # kept so revert and state_dict see the same parameters
        self.threshold, self.layer, self.proj, self._stats = float(part.threshold), layer, proj, stats
        self.register_buffer("scale", column_norms(orig).to(w.device) if part.score == "wina" else None,
                             persistent=False)
        self.register_buffer("a", None if part.a is None else part.a.detach().to(w.device, w.dtype).contiguous(),
                             persistent=False)
        self.register_buffer("b", None if part.b is None else part.b.detach().to(w.device, w.dtype).contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = input_score(x, self.scale) > self.threshold
        self._stats.add_mask(self.layer, self.proj, keep)
        y = self.orig(torch.where(keep, x, 0))
        if self.a is None:
            return y
        small = x * (~keep).to(x.dtype)
        return y + ((small @ self.a.to(x.dtype).T) @ self.b.to(x.dtype).T).to(y.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, proj={self.proj}, threshold={self.threshold:.4g}, " \
               f"rank={0 if self.a is None else self.a.shape[0]}, score={'wina' if self.scale is not None else 'abs'}"


@dataclass
class AppliedRankSparse(ModuleSwaps):
    model: nn.Module
    stats: InputStats
    extra_numel: int = 0

    def __post_init__(self):
        ModuleSwaps.__init__(self)


def apply_rank_sparsity(model: nn.Module, plan: RankSparsePlan, stats: InputStats | None = None,
                        swaps: ModuleSwaps | None = None) -> AppliedRankSparse:
    """Swap every planned projection for a :class:`RankSparseLinear` (masked mode); ``.revert()`` restores the
    model. ``stats``: where the kept inputs are counted; ``swaps``: record the swaps there instead
    (``sparse_exec.apply_sparsity``). The result's ``extra_numel`` is :func:`lowrank_numel`."""
    ad = adapter_for(model)
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    stats = stats if stats is not None else InputStats(model_projection_numel(model))
    applied = AppliedRankSparse(model, stats, lowrank_numel(plan))
    log = swaps if swaps is not None else applied
    try:
        for l in plan.layers():
            if not 0 <= l < len(layers):
                raise ValueError(f"rank-sparse plan for layer {l}, model has {len(layers)}")
            bad = set(plan.parts[l]) - set(paths)
            if bad:
                raise ValueError(f"layer {l}: projections {sorted(bad)} not in this model ({sorted(paths)})")
            for p, part in sorted(plan.parts[l].items()):
                orig = get_path(layers[l], paths[p])
                if not (isinstance(orig, nn.Linear) or type(orig).__name__ == "Conv1D"):
                    raise ValueError(f"layer {l} {p}: {type(orig).__name__} is not a plain projection "
                                     "(already swapped by another plan part?)")
                log.swap(layers[l], paths[p], RankSparseLinear(orig, part, l, p, stats))
    except Exception:
        log.revert()
        raise
    return applied
