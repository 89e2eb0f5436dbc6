"""Realized sparsity of the decode steps: device counters the step adds to (no host sync), read afterwards.

``mlp`` / ``heads``: mean fraction of FFN neurons / query heads not computed over all layers (dense layers count
0; batch-1 top-k layers count their static k, the rest their counted union). With input sparsity: ``inputs``
(fraction of the decoder's projection weights q, k, v, o, gate, up, down not read because of input sparsity)
and ``weights`` (the same fraction counting every part of the plan).
"""
from __future__ import annotations

import torch

from workers.decode.plan import RuntimePlan
from workers.decode.weights import PROJ, ModelWeights


class Counters:
    def __init__(self, n_layers: int, device):
        z = dict(dtype=torch.float64, device=device)
        self.mlp = torch.zeros(n_layers, **z)            # active neurons summed over steps (compacted sets)
        self.heads = torch.zeros(n_layers, **z)          # active query heads
        self.inputs = torch.zeros(n_layers, len(PROJ), **z)   # active (token, input) entries per projection
        self.steps = 0

    def reset(self) -> None:
        self.mlp.zero_()
        self.heads.zero_()
        self.inputs.zero_()
        self.steps = 0


def _kept(rp: RuntimePlan, c: Counters, key: str, n_layers: int, N: int, batch: int) -> torch.Tensor:
    """Mean kept count per layer (dense layers: N)."""
    preds = rp.mlp if key == "mlp" else rp.heads
    stat = (c.mlp if key == "mlp" else c.heads).cpu()
    n = max(c.steps, 1)
    out = torch.full((n_layers,), float(N), dtype=torch.float64)
    for l, p in preds.items():
        if getattr(p, "rule", "topk") == "topk" and batch == 1:
            out[l] = max(1, min(N, int(p.k)))
        else:
            out[l] = float(stat[l]) / n
    return out


def realized_sparsity(rp: RuntimePlan, w: ModelWeights, c: Counters, batch: int) -> dict:
    nl = len(w.layers)
    out = {}
    kept = {}
    for key, N in (("mlp", w.dims.D), ("heads", w.dims.n_heads)):
        if key in rp.reports:
            kept[key] = _kept(rp, c, key, nl, N, batch)
            out[key] = 1.0 - float(kept[key].sum()) / (N * nl)
    if "inputs" in rp.reports:
        out.update(_weights_skipped(rp, w, c, batch, kept))
    return out


def _weights_skipped(rp: RuntimePlan, w: ModelWeights, c: Counters, batch: int, kept: dict) -> dict:
    numel = w.proj_numel()
    nl = len(w.layers)
    total = nl * sum(n for n, _ in numel.values())
    seen = max(c.steps, 1) * max(batch, 1)
    stat = c.inputs.cpu()
    skipped_in = 0.0
    for l in range(nl):
        for p in rp.inputs.get(l, {}):
            if p in numel:
                n, n_in = numel[p]
                skipped_in += (1.0 - float(stat[l, PROJ.index(p)]) / (seen * n_in)) * n
    # what plan parts read beside the projections: LaRoSA's adapters / rotations, R-Sparse's low-rank factors
    skipped = skipped_in - rp.extra_numel
    if "mlp" in kept:
        for l in rp.mlp:
            frac_skip = 1.0 - float(kept["mlp"][l]) / w.dims.D
            parts = ("up", "down") if (l in rp.thr_ffn or rp.dense_gate) \
                else (("gate", "up", "down") if w.gated else ("up", "down"))
            skipped += frac_skip * sum(numel[p][0] for p in parts)
    if "heads" in kept:
        for l in rp.heads:
            skipped += (1.0 - float(kept["heads"][l]) / w.dims.n_heads) * (numel["q"][0] + numel["o"][0])
    # the predictors' own weights are read for every token (as sparse_exec's weight_skipped counts them)
    skipped -= sum(t.numel() for p in [*rp.mlp.values(), *rp.heads.values()] for t in p.to_tensors().values())
    return {"inputs": skipped_in / total, "weights": skipped / total}
