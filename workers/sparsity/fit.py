"""Fitting one sparsity setting: the steps a sweep's fit unit (``workers.units``) and the points runner
(``benchmarks.quality``) share.

  1. per-layer FFN budget from the allocation: ``uniform`` (every layer at the setting's sparsity), ``greedy``
     (``workers.sparsity.allocation``: single-layer damage curves measured on calibration tokens, the model-wide
     budget spent where it hurts least) or ``exchange`` (budget moved between layers by their KL effect measured
     with every layer sparsified); any other name is a ValueError naming the known ones;
  2. the method fitted at those budgets, the attention sparsity folded into its options (``dense``: the empty
     plan);
  3. the plan's per-layer quality on held-out activations, and the store's layer rows from it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from workers.names import DENSE

ALLOCATIONS = ("uniform", "greedy", "exchange")
DAMAGE_TOKENS = 256      # calibration tokens (one window of this length) the greedy allocation's curves use
EXCHANGE_TOKENS = 512    # calibration tokens (one window) the in-context exchange measures KL on


def check_allocation(name: str) -> str:
    if name not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {name!r}; known: {list(ALLOCATIONS)}")
    return name


def greedy_curves(ctx) -> dict[int, list[float]]:
    """Damage curves of ``ctx``'s layers on the first calibration tokens of its activations' source."""
    from workers.loading.data import token_windows
    from workers.sparsity.allocation import damage_curves

    source = ctx.cache.manifest["data_source"]
    toks = token_windows(ctx.lm.tokenizer, source, "calib", DAMAGE_TOKENS, DAMAGE_TOKENS)
    return damage_curves(ctx, toks)


def layer_budgets(ctx, sparsity: float, allocation: str = "uniform",
                  curves: Callable[[], dict[int, list[float]]] | None = None) -> dict[int, float]:
    """Per-layer FFN sparsity of ``ctx.layers`` whose mean is ``sparsity``. ``curves`` supplies the damage curves
    for ``greedy`` (default: :func:`greedy_curves`, cached on disk); it is called only then."""
    check_allocation(allocation)
    if allocation == "uniform":
        return {l: sparsity for l in ctx.layers}
    if allocation == "exchange":
        from workers.loading.data import token_windows
        from workers.sparsity.allocation import exchange_allocation

        toks = token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", EXCHANGE_TOKENS,
                             EXCHANGE_TOKENS)
        return exchange_allocation(ctx, toks, sparsity)
    from workers.sparsity.allocation import allocate

    return allocate((curves or (lambda: greedy_curves(ctx)))(), sparsity)


@dataclass
class Fitted:
    plan: object                     # SparsityPlan
    per_layer: dict[int, float]      # the FFN budget each layer was fitted at ({} for dense)
    fit_s: float                     # time in the method's fit
    facts: dict = field(default_factory=dict)   # the predicted head's fit facts, where it has one


def fit_setting(ctx, method: str, sparsity: float, rank: int | None = None, attn_sparsity: float | None = None,
                allocation: str = "uniform", options: dict | None = None,
                curves: Callable[[], dict[int, list[float]]] | None = None, head: dict | None = None) -> Fitted:
    """Fit ``method`` for every layer of ``ctx`` at the allocation's per-layer budgets, and the predicted output
    head ``head`` ({rank, candidates, screen}: workers.methods.head) beside it where given."""
    from workers.sparsity.predictors import SparsityPlan, fit_method

    check_allocation(allocation)
    t0 = time.time()
    if method == DENSE:
        fitted = Fitted(SparsityPlan(), {}, 0.0)
    else:
        per_layer = layer_budgets(ctx, sparsity, allocation, curves)
        opts = dict(options or {})
        if attn_sparsity is not None:
            opts["attn_sparsity"] = attn_sparsity
        fitted = Fitted(fit_method(method, ctx, per_layer, rank=rank, **opts), per_layer, 0.0)
    if head is not None:
        from workers.methods.head.fit import fit_head

        part, fitted.facts = fit_head(ctx, **head)
        fitted.plan.parts.append(part)
    fitted.fit_s = time.time() - t0
    return fitted


def layer_quality(plan, heldout_cache, lm, attn_sparsity: float | None = None) -> list:
    """Every planned layer's quality (``workers.sparsity.metrics.LayerQuality``) on held-out activations."""
    from workers.sparsity.metrics import plan_quality
    from workers.sparsity.predictors.base import layer_out_norms

    weights = None
    if plan.mlp_mode == "sequential" and plan.seq_filter_on == "damage":   # the filter reads |h|·c_i
        layers = lm.adapter.decoder_layers(lm.model)
        weights = {l: layer_out_norms(lm.adapter, layers[l]).float().cpu() for l in plan.mlp}
    return plan_quality(plan, heldout_cache, lm.adapter.act_name(lm.model.config), attn_target=attn_sparsity,
                        filter_weights=weights)


def layer_rows(plan, quality: list) -> list[dict]:
    """The store's layer rows (``db.schemas.LayerRow`` fields): fractions clamped to [0, 1], NaN as None, and
    the MLP layers' calibrated threshold where the method has one."""
    return [{"layer": q.layer, "component": q.component, "recall": _frac(q.recall),
             "precision": _frac(q.precision), "realized_sparsity": _frac(q.realized_sparsity),
             "target_sparsity": _frac(q.target_sparsity), "auc": _frac(q.auc), "threshold": _threshold(plan, q)}
            for q in quality]


def mean_mlp(quality: list, field: str) -> float:
    """Mean of one metric over the MLP layers (NaN if none)."""
    xs = [getattr(q, field) for q in quality if q.component == "mlp"]
    return sum(xs) / len(xs) if xs else float("nan")


def _frac(x):
    return None if x is None or x != x else min(1.0, max(0.0, float(x)))


def _threshold(plan, q):
    if q.component != "mlp":
        return None
    info = plan.info.get(q.layer, {})
    t = info.get("threshold", plan.seq_filter.get(q.layer))
    return None if t is None else float(t)
