"""Input sparsity: TEAL and WINA. No predictor: each projection drops the small entries of its own input.

TEAL (Liu et al., "Training-free activation sparsity in large language models", ICLR 2025; code
FasterDecoding/TEAL): every projection of a decoder layer (q, k, v, o, gate, up, down) keeps input i of a
token iff |x_i| > t, one threshold t per (layer, projection) calibrated so that a fraction s of the
calibration inputs fall below it. The matrix then reads only the columns of the kept inputs.
WINA (2025): the same with the score |x_i|·‖W[:, i]‖₂ (an input feeding small weights matters less).

Calibration (:mod:`workers.sparsity.input_thresholds`) reads the per-projection input histograms of the activation
cache (``inhist``: |x| split by sign, and the WINA score) and takes the s-quantile of the score directly, which is
right whatever the shape of the distribution; option ``symmetric=True`` takes TEAL's icdf(0.5 + s/2) of the signed
input instead (``input_thresholds.symmetry_gaps`` measures how far apart the two are on a cache; on SmolLM2 the
rule is within 2 points of s for q/k/v, gate/up and down (act(gate)·up takes the sign of up, so it is symmetric
in sign) but up to 12 points off for o in some layers).

Allocation inside a layer (:mod:`workers.sparsity.input_allocation`): ``uniform`` gives every listed projection of
layer l the sparsity given for l (a per-layer budget from the sweep's allocation is honoured as given);
``greedy=True`` is TEAL's block-wise greedy and ``greedy="model"`` one sparsity per projection kind for the whole
model (both described there).

This module only fits: it imports the thresholds and the allocation, neither imports it.

Options:
  ``projections``  the projections to sparsify (default: all of the model's; ``qkv`` on GPT-2's fused c_attn)
  ``symmetric``    TEAL's icdf(0.5 + s/2) rule instead of the |x| quantile (TEAL scoring only)
  ``greedy``       ``true`` / ``"block"``: TEAL's block-wise greedy allocation over the projections of each layer;
                   ``"model"``: one sparsity per projection kind for the whole model, the kinds raised in the order
                   of their end-to-end KL per weight skipped
  ``ffn``          a neuron predictor on the FFN beside input sparsity on attention:
                   ``{"method": "svd", "sparsity": 0.5, "rank": 256, "options": {...}}``; then ``projections``
                   must not include gate, up or down
"""
from __future__ import annotations

from workers.sparsity.input_allocation import check_greedy, per_projection_sparsities
from workers.sparsity.input_sparse import FFN_PROJECTIONS, projection_paths
from workers.sparsity.input_thresholds import calib_sparsity, input_hist, threshold_for
from workers.sparsity.predictors.base import FitContext, SparsityPlan, fit_method, register


def fit_input_sparsity(ctx: FitContext, sparsity: dict[int, float], score: str, method: str,
                       projections=None, symmetric: bool = False, ffn: dict | None = None,
                       greedy: "bool | str" = False) -> SparsityPlan:
    known = tuple(projection_paths(ctx.lm.adapter))
    projections = list(known if projections is None else projections)
    bad = sorted(set(projections) - set(known))
    if bad or not projections or len(set(projections)) != len(projections):
        raise ValueError(f"{method}: projections must be distinct names among {list(known)}, got {projections}")
    plan = SparsityPlan(input_score=score)
    if ffn is not None:
        plan = _with_ffn(ctx, ffn, projections, method)
        plan.input_score = score
    greedy = check_greedy(greedy, method)
    if greedy and symmetric:
        raise ValueError(f"{method}: greedy and symmetric do not combine")
    for l, per_proj in per_projection_sparsities(ctx, sparsity, score, projections, greedy).items():
        thr, calib = {}, {}
        for p, sp in per_proj.items():
            if sp <= 0:
                continue
            h = input_hist(ctx, l, p)
            thr[p] = threshold_for(h, sp, score, symmetric)
            calib[p] = round(calib_sparsity(h, thr[p], score), 5)
        plan.inputs[l] = thr
        plan.info.setdefault(l, {})["inputs"] = {"target_sparsity": sparsity[l], "score": score,
                                                 "symmetric": symmetric, "greedy": greedy, "calib_sparsity": calib}
    return plan


def _with_ffn(ctx: FitContext, ffn: dict, projections: list[str], method: str) -> SparsityPlan:
    if not isinstance(ffn, dict) or "method" not in ffn or "sparsity" not in ffn:
        raise ValueError(f"{method}: ffn must be {{method, sparsity, rank?, options?}}, got {ffn!r}")
    unknown = set(ffn) - {"method", "sparsity", "rank", "options"}
    if unknown:
        raise ValueError(f"{method}: ffn has unknown keys {sorted(unknown)}")
    if ffn["method"] in ("teal", "wina"):
        raise ValueError(f"{method}: ffn must be a neuron predictor method, not {ffn['method']!r}")
    clash = sorted(set(projections) & set(FFN_PROJECTIONS))
    if clash:
        raise ValueError(f"{method}: with an ffn predictor, projections must leave out {clash}")
    return fit_method(ffn["method"], ctx, float(ffn["sparsity"]), rank=ffn.get("rank"), **(ffn.get("options") or {}))


@register("teal")
def fit_teal(ctx: FitContext, sparsity: dict[int, float], rank=None, projections=None, symmetric: bool = False,
             ffn: dict | None = None, greedy: "bool | str" = False, **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"teal: unknown options {sorted(unknown)}")
    return fit_input_sparsity(ctx, sparsity, "abs", "teal", projections, bool(symmetric), ffn, greedy)


@register("wina")
def fit_wina(ctx: FitContext, sparsity: dict[int, float], rank=None, projections=None, ffn: dict | None = None,
             greedy: "bool | str" = False, **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"wina: unknown options {sorted(unknown)}")
    return fit_input_sparsity(ctx, sparsity, "wina", "wina", projections, False, ffn, greedy)
