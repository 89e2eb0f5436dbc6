"""Per-layer predictor quality against the oracle, on held-out activations.

For layer l at target sparsity s the oracle set of a token is its k = (1-s)·D neurons with the largest
|act(gate)·up| (the ``inter`` component), and its top-k heads by output norm for attention. For a predictor:
  recall     |predicted ∩ oracle| / |oracle|
  precision  |predicted ∩ oracle| / |predicted|
  predicted_sparsity  1 - |predicted| / (T·D)
  realized_sparsity   after the sequential filter (|act(gate)| > threshold on the predicted rows), else the same
  auc        per-token ROC-AUC of the predictor's scores for the oracle label, averaged over a token subsample
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kernels.common import apply_act
from workers.sparsity.predictors.base import (
    HeadPredictor, MLPPredictor, SparsityPlan, k_for, predictor_inputs, topk_mask,
)


@dataclass(frozen=True)
class LayerQuality:
    layer: int
    component: str               # "mlp" | "attn"
    target_sparsity: float
    recall: float
    precision: float
    predicted_sparsity: float
    realized_sparsity: float
    auc: float

    def row(self) -> dict:
        return asdict(self)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over tokens (rows) of the per-token ROC-AUC (Mann-Whitney; ties broken by order).

    Per token, not pooled: the oracle label is a per-token top-k, so only the ranking of neurons within a
    token matters (a pooled AUC penalizes even the oracle for tokens whose activations are small overall).
    Rows with no positive or no negative label are skipped.
    """
    s = scores.double()
    y = labels.bool()
    ranks = s.argsort(dim=1).argsort(dim=1).double() + 1
    n_pos = y.sum(1).double()
    n_neg = y.shape[1] - n_pos
    ok = (n_pos > 0) & (n_neg > 0)
    if not ok.any():
        return float("nan")
    u = (ranks * y).sum(1) - n_pos * (n_pos + 1) / 2
    return float((u[ok] / (n_pos[ok] * n_neg[ok])).mean())


def mlp_quality(pred: MLPPredictor, cache, layer: int, target: float, act: str, seq_filter: float | None = None,
                max_tokens: int = 2048, auc_tokens: int = 256,
                filter_weight: torch.Tensor | None = None) -> LayerQuality:
    """``seq_filter``: the sequential pipeline's filter f on |act(gate)|, or with ``filter_weight`` c [D] on the
    damage |act(gate)·up|·c_i (SparsityPlan.seq_filter_on)."""
    inter = cache.load(layer, "inter", max_tokens=max_tokens)
    T, D = inter.shape
    oracle = topk_mask(inter.abs(), k_for(target, D))
    with torch.no_grad():
        x = predictor_inputs(cache, layer, pred.input_kind, max_tokens)
        scores = pred.scores(x)
        predicted = pred.select(scores)
    realized = predicted
    if seq_filter is not None and filter_weight is not None:
        realized = predicted & (inter.abs() * filter_weight > seq_filter)
    elif seq_filter is not None:
        realized = predicted & (apply_act(cache.load(layer, "gate", max_tokens=max_tokens), act).abs() > seq_filter)
    hit = (realized & oracle).sum().item()
    n_pred = realized.sum().item()
    return LayerQuality(layer, "mlp", target, recall=hit / max(oracle.sum().item(), 1),
                        precision=hit / max(n_pred, 1),
                        predicted_sparsity=1 - predicted.sum().item() / (T * D),
                        realized_sparsity=1 - n_pred / (T * D),
                        auc=roc_auc(scores[:auc_tokens], oracle[:auc_tokens]))


def head_quality(pred: HeadPredictor, cache, layer: int, target: float, max_tokens: int = 2048) -> LayerQuality:
    norms = cache.load(layer, "head_norm", max_tokens=max_tokens)
    T, H = norms.shape
    oracle = topk_mask(norms, k_for(target, H))
    with torch.no_grad():
        scores = norms if pred.input_kind == "head_out" else \
            pred.scores(predictor_inputs(cache, layer, pred.input_kind, max_tokens))
    predicted = topk_mask(scores, pred.k)
    hit = (predicted & oracle).sum().item()
    sp = 1 - predicted.sum().item() / (T * H)
    return LayerQuality(layer, "attn", target, recall=hit / max(oracle.sum().item(), 1),
                        precision=hit / max(predicted.sum().item(), 1), predicted_sparsity=sp, realized_sparsity=sp,
                        auc=roc_auc(scores, oracle))


def plan_quality(plan: SparsityPlan, cache, act: str, attn_target: float | None = None,
                 max_tokens: int = 2048, filter_weights: dict | None = None) -> list[LayerQuality]:
    """Every planned layer's quality on the held-out cache (``filter_weights``: {layer: c} for the damage
    filter, see :func:`mlp_quality`)."""
    if plan.mlp_mode == "sequential" and plan.seq_filter_on == "damage" and not filter_weights:
        raise ValueError("the damage filter's quality needs filter_weights (c_i = ‖g ⊙ W_down[:, i]‖ per layer)")
    out = []
    for l, pred in sorted(plan.mlp.items()):
        target = plan.info.get(l, {}).get("target_sparsity", 1 - (pred.k or 0) / pred.n_neurons)
        thr = plan.seq_filter.get(l) if plan.mlp_mode == "sequential" else None
        fw = (filter_weights or {}).get(l) if thr is not None and plan.seq_filter_on == "damage" else None
        out.append(mlp_quality(pred, cache, l, target, act, thr, max_tokens, filter_weight=fw))
    for l, pred in sorted(plan.attn.items()):
        target = attn_target if attn_target is not None else 1 - pred.k / pred.n_heads
        out.append(head_quality(pred, cache, l, target, max_tokens))
    return out
