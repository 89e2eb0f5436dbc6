"""SVDP: whitened low-rank SVD predictors with greedy per-neuron bias calibration (arXiv 2603.14110).

Per layer, from the calibration tokens X (the predictor input, ``ffn_in`` by default), split deterministically into
a first half X1 (builds the factors) and a second half X2 (calibrates the biases):

1. **Whitened truncated SVD** of W (:mod:`workers.sparsity.whitening`): ``B A`` is the rank-r W that is best on
   X1 (``info['chol_eps']`` records the ε a singular Gram needed). W is ``W_gate`` (gated MLPs) or ``W_fc1``
   (non-gated). For an input other than ``ffn_in`` (``residual``, ``lookahead``) W is not defined on that input,
   so W is the least-squares map from the input to the gate pre-activation on X1; for ``ffn_in`` that map *is*
   ``W_gate``, and the weights are used directly.

2. **What the predictor scores** (``target``):
   ``gate``     proxy p = B A x (the predicted gate pre-activation), the paper's predictor;
   ``product``  proxy p = |act(ĝ)·û| with ĝ = B A x and û = B_up A_up x, a second whitened SVD of ``W_up`` with
                the same S (rank ``rank_up``, default r). Gated only. A gate-only predictor has a hard ceiling on
                SiLU/GeLU models: a neuron with a large gate but a small up contributes nothing, and the reverse.
   The score is ``p + bias`` and a neuron runs iff score > 0 (rule ``positive``); for ``product`` the bias is
   −t_i, i.e. keep iff |act(ĝ_i)·û_i| > t_i. Default: ``product`` for gated MLPs, ``gate`` otherwise (on SmolLM2
   ``product`` wins from r = 64 up, and at equal predictor bytes from r = 128: benchmarks/results/history-quality.md, "SVDP internals").

3. **What "inactive" means** (``damage``): the damage of switching neuron i off for token t is
   ``gate``     |act(gate)|,
   ``gate_up``  |act(gate)·up|  (= the FFN intermediate),
   ``full``     |act(gate)·up|·‖W_down[:, i]‖  (default: the size of the neuron's contribution to the output);
   non-gated: |act(fc1)| for ``gate`` and ``gate_up``, |act(fc1)|·‖W_down[:, i]‖ for ``full``.
   Where a norm sits on the FFN's output (Gemma-3), ``full`` is measured after it: the down column scaled by the
   norm's gain and divided by the token's rms(y) (:func:`~workers.sparsity.predictors.base.output_damage`).
   Without that, on Gemma-3-270M at s = 0.5 the predictor with the best recall had the worst perplexity.

4. **Greedy bias calibration on X2** (:mod:`workers.methods.svd.calibration`): per neuron, the bias
   that switches off the lowest-scored tokens, the steps given greedily to the neurons whose next step costs least.

**Target sparsity.** In the paper's code the target is relative to the layer's natural ReLU sparsity. Our models
are SiLU/GeLU-gated and have no natural zeros, so here ``sparsity`` is absolute: the fraction of (neuron, token)
pairs predicted off on X2 (``calib_offfrac``; above the target where a ReLU layer's free zeros alone exceed it).

**Sequential mode** (``mode="sequential"``): gate runs on the predicted rows, rows with |act(gate)| <= f are
dropped before up/down; f (``plan.seq_filter[layer]``) is calibrated on X2 within ``seq_tol`` of the kept damage
(default 1e-4: per-layer tolerances compound over the layers). ``superset``: the exact gate (or damage) on a
predicted superset, see :func:`fit_svd`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.loading.adapters import activation_fn
from workers.methods.svd.calibration import (
    CALIB_IMPLS, Q_STEPS, calibrate_bias, seq_filter_threshold, superset_filter_threshold,
)
from workers.methods.svd.predictor import TARGETS, SVDPredictor
from workers.sparsity.predictors.base import (
    INPUT_KINDS, OPTIONS, SEQ_FILTERS, FitContext, SparsityPlan, neuron_out_norm, output_damage, register,
)
from workers.sparsity.whitening import whitened_lowrank, whitened_map, whitening_factor

DAMAGES = ("gate", "gate_up", "full")
MODES = ("parallel", "sequential")
# Default rank as a fraction of min(d, D) (see default_rank).
DEFAULT_RANK_FRAC = 0.125


def default_rank(d: int, D: int) -> int:
    """min(d, D)/8 rounded to a multiple of 8 (SmolLM2: 72, Gemma-3-270M: 80), at least 8 and at most min(d, D)."""
    return min(min(d, D), max(8, 8 * int(round(DEFAULT_RANK_FRAC * min(d, D) / 8))))


@dataclass(frozen=True)
class SVDOptions:
    """The checked options of one fit (see :func:`fit_svd`); ``target`` resolved, ``mode`` sequential with a
    superset."""
    rank: int | None
    damage: str
    target: str
    input_kind: str
    max_tokens: int | None
    mode: str
    rank_up: int | None
    q_steps: int
    seq_tol: float
    greedy: str
    superset: float | None
    superset_filter: str
    gated: bool
    act: str


class LayerFit(NamedTuple):
    predictor: SVDPredictor
    info: dict                    # per-layer facts for the store (plan.info[layer])
    seq_filter: float | None      # plan.seq_filter[layer] in sequential mode


@register("svd", fit_cost=1)
def fit_svd(ctx: FitContext, sparsity: dict[int, float], rank: int | None = None, damage: str = "full",
            target: str | None = None, input_kind: str = "ffn_in", max_tokens: int | None = None,
            mode: str = "parallel", rank_up: int | None = None, q_steps: int = Q_STEPS, seq_tol: float = 1e-4,
            greedy: str = "sort", superset: float | None = None, superset_filter: str = "gate",
            **unknown) -> SparsityPlan:
    """Fit SVDP predictors for the layers in ``sparsity`` (layer -> absolute target off-fraction).

    ``rank``: r (default ``default_rank(d, D)``). ``damage``: one of ``DAMAGES``. ``target``: ``gate`` or
    ``product`` (default: ``product`` for gated MLPs, ``gate`` for non-gated). ``input_kind``: predictor input.
    ``max_tokens``: cap on calibration tokens (split in halves). ``mode``: ``parallel`` or ``sequential`` (also
    calibrates ``plan.seq_filter``). ``rank_up``: rank of the W_up factors (product; default r). ``q_steps``: Q.
    ``seq_tol``: the sequential filter's damage budget. ``greedy``: ``sort`` / ``heap`` / ``reference``.
    ``superset``: exact gate on a predicted superset (implies ``mode="sequential"``): the predictor is calibrated
    to switch off only this fraction (< the layer's target), the exact gate runs on the rows it keeps, and the
    filter |act(gate)| > f, with f set on X2 so that up and down skip the layer's target fraction, picks the
    survivors. Bytes read: the predictor, gate rows (1 − superset), up and down rows (1 − target).
    ``superset_filter``: what picks the survivors of the superset: ``gate`` (|act(gate)|, above) or ``damage``
    (gate and up both run on the superset, and the filter reads each neuron's damage |act(gate)·up|·c_i,
    c_i = ‖g ⊙ W_down[:, i]‖: the oracle's own criterion within the superset, at the price of up's rows on the
    whole superset). Bytes read then: the predictor, gate and up rows (1 − superset), down rows (1 − target).
    """
    if unknown:
        raise ValueError(f"svd: unknown option(s) {sorted(unknown)}; known: {sorted(OPTIONS['svd'] | {'rank'})}")
    if damage not in DAMAGES:
        raise ValueError(f"svd: damage must be one of {DAMAGES}, got {damage!r}")
    if input_kind not in INPUT_KINDS:
        raise ValueError(f"svd: input_kind must be one of {INPUT_KINDS}, got {input_kind!r}")
    if mode not in MODES:
        raise ValueError(f"svd: mode must be 'parallel' or 'sequential', got {mode!r}")
    if greedy not in CALIB_IMPLS:
        raise ValueError(f"svd: greedy must be one of {CALIB_IMPLS}")
    if not (isinstance(q_steps, int) and q_steps >= 1):
        raise ValueError("svd: q_steps must be a positive int")
    if not 0.0 <= seq_tol < 1.0:
        raise ValueError("svd: seq_tol must be in [0, 1)")
    gated = bool(ctx.lm.adapter.ffn.gated)
    if superset is not None:
        if not gated:
            raise ValueError("svd: superset needs a gated MLP (the exact gate decides the survivors)")
        if not 0.0 <= float(superset) < 1.0:
            raise ValueError(f"svd: superset must be in [0, 1), got {superset!r}")
        superset, mode = float(superset), "sequential"
    if superset_filter not in SEQ_FILTERS:
        raise ValueError(f"svd: superset_filter must be one of {SEQ_FILTERS}, got {superset_filter!r}")
    if superset_filter != "gate" and superset is None:
        raise ValueError("svd: superset_filter needs superset (the fraction the predictor may switch off)")
    if target is None:
        target = "product" if gated else "gate"
    if target not in TARGETS:
        raise ValueError(f"svd: target must be one of {TARGETS}, got {target!r}")
    if target == "product" and not gated:
        raise ValueError("svd: target 'product' needs a gated MLP (this model's FFN has no up/gate pair)")
    opts = SVDOptions(rank, damage, target, input_kind, max_tokens, mode, rank_up, q_steps, seq_tol, greedy,
                      superset, superset_filter, gated, ctx.act_name())

    plan = SparsityPlan(mlp_mode=mode, seq_filter_on=superset_filter)
    for layer in sorted(sparsity):
        fit = fit_layer(ctx, layer, float(sparsity[layer]), opts)
        plan.mlp[layer], plan.info[layer] = fit.predictor, fit.info
        if fit.seq_filter is not None:
            plan.seq_filter[layer] = fit.seq_filter
    return plan


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.T
    return y + b if b is not None else y


def fit_layer(ctx: FitContext, layer: int, s: float, o: SVDOptions) -> LayerFit:
    """One layer's SVDP predictor at target off-fraction ``s``: factors on X1, damage and biases on X2 (and the
    sequential filter)."""
    t0 = time.perf_counter()
    if not 0.0 <= s < 1.0:
        raise ValueError(f"svd: sparsity must be in [0, 1), got {s} for layer {layer}")
    if o.superset is not None and o.superset > s:
        raise ValueError(f"svd: superset {o.superset} must not exceed the layer's target {s} (layer {layer})")
    act = activation_fn(o.act)
    W = ctx.ffn_weights(layer)
    Wg = W["gate"] if o.gated else W["up"]
    bg = W.get("b_gate") if o.gated else W.get("b_up")                       # gated families: no biases
    D = Wg.shape[0]
    X = ctx.inputs(layer, o.input_kind, max_tokens=o.max_tokens)
    Xf = X if o.input_kind == "ffn_in" else ctx.inputs(layer, "ffn_in", max_tokens=o.max_tokens)
    N = X.shape[0]
    if Xf.shape[0] != N:
        raise ValueError(f"layer {layer}: input and ffn_in token counts differ ({N} vs {Xf.shape[0]})")
    if N < 4:
        raise ValueError(f"layer {layer}: need at least 4 calibration tokens, got {N}")
    d = X.shape[1]
    r = default_rank(d, D) if o.rank is None else int(o.rank)
    r_up = r if o.rank_up is None else int(o.rank_up)
    if not 1 <= r <= min(d, D) or (o.target == "product" and not 1 <= r_up <= min(d, D)):
        raise ValueError(f"svd: rank must be in 1..{min(d, D)} (got rank={r}, rank_up={r_up})")
    n1 = N // 2
    X1, X2 = X[:n1], X[n1:]
    Xf1, Xf2 = Xf[:n1], Xf[n1:]

    S, eps = whitening_factor(X1)
    other = o.input_kind != "ffn_in"                  # W acts on ffn_in: the least-squares map from X instead

    def ws_of(Wm: torch.Tensor) -> torch.Tensor:
        return whitened_map(Wm, S, X1, Xf1) if other else whitened_map(Wm, S)

    A, B = whitened_lowrank(ws_of(Wg), S, r)
    A_up = B_up = None
    if o.target == "product":
        A_up, B_up = whitened_lowrank(ws_of(W["up"]), S, r_up)
    pred = SVDPredictor(A, B, torch.zeros(D), input_kind=o.input_kind, target=o.target,
                        act=o.act if o.target == "product" else None, A_up=A_up, B_up=B_up)

    # what switching a neuron off costs, on X2
    with torch.no_grad():
        g2 = act(_linear(Xf2, Wg, bg))                                        # act(gate) or act(fc1)
        # act(gate)·up (the FFN intermediate) where the damage or the superset's filter reads it
        need_up = o.gated and (o.damage != "gate" or o.superset_filter == "damage")
        inter = g2 * _linear(Xf2, W["up"], W.get("b_up")) if need_up else g2
        if o.damage == "full":       # measured where the output reaches the residual stream (post-FFN norm)
            dmg = output_damage(inter, W["down"], ctx.ffn_out_gain(layer))
        elif o.damage == "gate" or not o.gated:
            dmg = g2.abs()
        else:
            dmg = inter.abs()
        P = pred.proxy(X2)
    cal = calibrate_bias(P, dmg, s if o.superset is None else o.superset, q_steps=o.q_steps, impl=o.greedy)
    pred.bias.copy_(cal["bias"].float())
    info = {"target_sparsity": s, "calib_offfrac": cal["offfrac"], "free_offfrac": cal["free_offfrac"],
            "damage_off": cal["damage_off"], "rank": r, "rank_up": r_up if o.target == "product" else None,
            "chol_eps": eps, "chol_fallback": eps > 0.0, "n_fit": n1, "n_calib": N - n1,
            "target": o.target, "damage": o.damage, "input_kind": o.input_kind, "act": o.act,
            "q_steps": int(min(o.q_steps, N - n1))}
    f = None
    if o.mode == "sequential":
        with torch.no_grad():
            keep = pred.scores(X2) > 0
        if o.superset is None:
            f, extra = seq_filter_threshold(g2.abs(), dmg, keep, tol=o.seq_tol)
        else:
            if o.superset_filter == "damage":
                score = inter.abs() * neuron_out_norm(W["down"], ctx.ffn_out_gain(layer))
            else:
                score = g2.abs()
            f, extra = superset_filter_threshold(score, keep, s)
            info["superset_filter"] = o.superset_filter
        info.update({"seq_filter": f, "seq_tol": o.seq_tol, "seq_extra_offfrac": extra,
                     "pred_offfrac": 1.0 - float(keep.float().mean())})
    info["fit_s"] = round(time.perf_counter() - t0, 4)
    return LayerFit(pred, info, f)
