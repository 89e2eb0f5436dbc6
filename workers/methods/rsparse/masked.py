"""R-Sparse's masked form: a :class:`~workers.methods.rsparse.part.RankSparsePlan` on a Hugging Face model, the
exact function (:mod:`workers.methods.rsparse`'s doc): dense products, the dropped inputs zeroed in W's product
and the kept ones in the low-rank term. :class:`RankSparseLinear` replaces each planned projection; ``.revert()``
restores the model. The decode runtime's form is :mod:`.runtime`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.loading.adapters import adapter_for, get_path, linear_weight
from workers.sparsity.input_sparse import InputStats, column_norms, input_score, model_projection_numel, \
    projection_paths
from workers.sparsity.swaps import ModuleSwaps


class RankSparseLinear(nn.Module):
    """A projection computed as W on the inputs whose score exceeds ``threshold`` plus the rank-r term on the
    others (see the module doc)."""

    def __init__(self, orig: nn.Module, part, layer: int, proj: str, stats: InputStats):
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


def apply_rank_sparsity(model: nn.Module, plan, stats: InputStats | None = None,
                        swaps: ModuleSwaps | None = None) -> AppliedRankSparse:
    """Swap every projection of ``plan`` (a RankSparsePlan) for a :class:`RankSparseLinear` (masked mode);
    ``.revert()`` restores the model. ``stats``: where the kept inputs are counted; ``swaps``: record the swaps
    there instead (``sparse_exec.apply_sparsity``). The result's ``extra_numel`` is the plan's factors'."""
    ad = adapter_for(model)
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    stats = stats if stats is not None else InputStats(model_projection_numel(model))
    applied = AppliedRankSparse(model, stats, plan.extra_numel(model))
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
