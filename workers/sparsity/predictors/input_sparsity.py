"""Input sparsity: TEAL and WINA. No predictor: each projection drops the small entries of its own input.

TEAL (Liu et al., "Training-free activation sparsity in large language models", ICLR 2025; code
FasterDecoding/TEAL): every projection of a decoder layer (q, k, v, o, gate, up, down) keeps input i of a
token iff |x_i| > t, one threshold t per (layer, projection) calibrated so that a fraction s of the
calibration inputs fall below it. The matrix then reads only the columns of the kept inputs.
WINA (2025): the same with the score |x_i|·‖W[:, i]‖₂ (an input feeding small weights matters less).

Calibration reads the per-projection input histograms of the activation cache (``inhist``: |x| split by sign,
and the WINA score; :mod:`workers.sparsity.histograms`) and takes the s-quantile of the score directly, which
is right whatever the shape of the distribution. TEAL's code instead takes icdf(0.5 + s/2) of the *signed*
distribution, which equals the |x| quantile only if x is symmetric around 0; option ``symmetric=True``
reproduces that rule (``symmetry_gaps`` measures how far apart the two are on a cache; on SmolLM2 the rule is
within 2 points of s for q/k/v, gate/up and down (act(gate)·up takes the sign of up, so it is symmetric in
sign) but up to 12 points off for o in some layers).

Allocation inside a layer: ``uniform`` gives every listed projection of layer l the sparsity given for l (a
per-layer budget from the sweep's allocation is honoured as given). ``greedy=True`` is TEAL's block-wise greedy
(their ``teal/greedyopt.py``): starting from 0, repeatedly raise by one step the projection whose step adds the
least error to the *block's* output on calibration tokens, steps sized so that each one skips the same number
of weights (step_p ∝ 1/numel_p), until the weight-weighted mean sparsity of the block reaches its budget. The
path (budget -> per-projection sparsities) is computed once per (model, calibration, score, projections) for
every budget up to ``GREEDY_MAX`` and cached under ``$CTXSPARSE_HOME/input_greedy``.

Options:
  ``projections``  the projections to sparsify (default: all of the model's; ``qkv`` on GPT-2's fused c_attn)
  ``symmetric``    TEAL's icdf(0.5 + s/2) rule instead of the |x| quantile (TEAL scoring only)
  ``greedy``       ``true`` / ``"block"``: TEAL's block-wise greedy allocation over the projections of each layer
                   (see above); ``"model"``: one sparsity per projection kind for the whole model, the kinds
                   raised in the order of their end-to-end KL per weight skipped
                   (:mod:`workers.sparsity.input_allocation`)
  ``ffn``          a neuron predictor on the FFN beside input sparsity on attention:
                   ``{"method": "svd", "sparsity": 0.5, "rank": 256, "options": {...}}``; then ``projections``
                   must not include gate, up or down
"""
from __future__ import annotations

import hashlib
import json

import torch

from workers.loading.adapters import get_path, linear_weight
from workers.paths import home, write_json_atomic
from workers.sparsity import histograms as H
from workers.sparsity.input_sparse import FFN_PROJECTIONS, InputStats, apply_input_sparsity, projection_paths
from workers.sparsity.predictors.base import FitContext, SparsityPlan, fit_method, register

GREEDY_STEP = 0.05        # a step of projection p raises its sparsity by GREEDY_STEP * mean numel / numel_p
GREEDY_MAX = 0.75         # the path is computed up to this block budget
GREEDY_TOKENS = 1024      # calibration tokens (windows of GREEDY_SEQ) the block errors are measured on
GREEDY_SEQ = 512

_ROW = {"pos": 0, "neg": 1, "wina": 2}


def abs_hist(h):
    """|x| histogram of a projection input from its stored rows (x > 0 and x <= 0)."""
    return h[_ROW["pos"]] + h[_ROW["neg"]]


def threshold_for(h, s: float, score: str = "abs", symmetric: bool = False) -> float:
    """The threshold that drops a fraction ``s`` of a projection's calibration inputs (``h``: its [3, bins]
    histograms). ``symmetric``: TEAL's icdf(0.5 + s/2) of the signed input instead (exact only for symmetric x)."""
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {s}")
    if symmetric:
        if score != "abs":
            raise ValueError("the symmetric (signed icdf) rule applies to TEAL's |x| score only")
        return max(H.signed_icdf(h[_ROW["pos"]], h[_ROW["neg"]], 0.5 + s / 2), 0.0)
    return H.quantile(abs_hist(h) if score == "abs" else h[_ROW["wina"]], s)


def calib_sparsity(h, t: float, score: str = "abs") -> float:
    """Fraction of the calibration inputs whose score is <= t."""
    return H.cdf(abs_hist(h) if score == "abs" else h[_ROW["wina"]], t)


def input_hist(ctx: FitContext, layer: int, proj: str):
    if "inhist" not in ctx.cache.components:
        raise ValueError("the activation cache has no input histograms: collect it with the 'inhist' component")
    return ctx.cache.load_hist(layer, proj)


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
    if greedy == "model":
        from workers.sparsity import input_allocation

        model_path = input_allocation.model_greedy_path(ctx, score, projections, until=max(sparsity.values(), default=0.0))
    paths = greedy_paths(ctx, score, projections) if greedy == "block" else {}
    for l, s in sorted(sparsity.items()):
        if s <= 0:
            continue
        if greedy == "model":
            per_proj = input_allocation.path_at(model_path, s)
        elif greedy == "block":
            per_proj = path_at(paths[l], s)
        else:
            per_proj = {p: s for p in projections}
        thr, calib = {}, {}
        for p, sp in per_proj.items():
            if sp <= 0:
                continue
            h = input_hist(ctx, l, p)
            thr[p] = threshold_for(h, sp, score, symmetric)
            calib[p] = round(calib_sparsity(h, thr[p], score), 5)
        plan.inputs[l] = thr
        plan.info.setdefault(l, {})["inputs"] = {"target_sparsity": s, "score": score, "symmetric": symmetric,
                                                 "greedy": greedy, "calib_sparsity": calib}
    return plan


GREEDY_KINDS = ("block", "model")


def check_greedy(greedy, method: str):
    """The ``greedy`` option as False, "block" (TEAL's per-layer greedy; also ``true``) or "model"
    (``workers.sparsity.input_allocation``: kinds ranked by their end-to-end KL)."""
    if greedy is None or greedy is False:
        return False
    if greedy is True:
        return "block"
    if greedy in GREEDY_KINDS:
        return greedy
    raise ValueError(f"{method}: greedy must be false, true or one of {list(GREEDY_KINDS)}, got {greedy!r}")


def path_at(path: list, budget: float) -> dict[str, float]:
    """The first point of a greedy path whose block budget reaches ``budget`` (the last one if none does)."""
    for eff, per_proj, _ in path:
        if eff >= budget - 1e-9:
            return per_proj
    return path[-1][1]


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


def greedy_paths(ctx: FitContext, score: str, projections: list[str]) -> dict:
    """{layer: [(block budget, {projection: sparsity}, block output error), ...]} from 0 up to GREEDY_MAX."""
    from workers.loading.data import token_windows

    step, max_budget, n_tokens, seq_len = GREEDY_STEP, GREEDY_MAX, GREEDY_TOKENS, GREEDY_SEQ

    toks = token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", n_tokens, seq_len)
    key = hashlib.sha256(json.dumps([ctx.lm.fingerprint, ctx.cache.manifest.get("key"), toks.fingerprint, score,
                                     projections, step, max_budget, list(ctx.layers), H.BINS],
                                    sort_keys=True).encode()).hexdigest()[:32]
    cached = home() / "input_greedy" / f"{key}.json"
    if cached.exists():
        return {int(k): v for k, v in json.loads(cached.read_text()).items()}
    model, ad = ctx.lm.model, ctx.lm.adapter
    layers = ad.decoder_layers(model)
    seen: dict[int, tuple] = {}
    hooks = [layers[l].register_forward_pre_hook(lambda m, a, k, l=l: seen.__setitem__(l, (a, k)), with_kwargs=True)
             for l in ctx.layers]
    try:
        with torch.no_grad():
            model(input_ids=toks.windows.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for l in ctx.layers:
        out[l] = _greedy_layer(ctx, l, score, projections, seen.pop(l), step, max_budget)
    write_json_atomic(cached, {str(k): v for k, v in out.items()})
    return out


def _greedy_layer(ctx, l: int, score: str, projections: list[str], inputs, step: float, max_budget: float) -> list:
    model, ad = ctx.lm.model, ctx.lm.adapter
    layer = ad.decoder_layers(model)[l]
    args, kwargs = inputs
    paths = projection_paths(ad)
    numel = {p: linear_weight(get_path(layer, paths[p])).numel() for p in projections}
    total = sum(numel.values())
    steps = {p: step * (total / len(numel)) / numel[p] for p in projections}
    hists = {p: input_hist(ctx, l, p) for p in projections}
    thr_cache: dict[tuple[str, float], float] = {}

    def thr(p, sp):
        k = (p, round(sp, 9))
        if k not in thr_cache:
            thr_cache[k] = threshold_for(hists[p], sp, score) if sp > 0 else -1.0
        return thr_cache[k]

    with torch.no_grad():
        target = _layer_out(layer(*args, **kwargs)).float()
        applied = apply_input_sparsity(model, {l: {p: -1.0 for p in projections}}, score, "masked", InputStats())
        try:
            mods = {p: get_path(layer, paths[p]) for p in projections}

            def error(per_proj):
                for p, sp in per_proj.items():
                    mods[p].threshold = thr(p, sp)
                y = _layer_out(layer(*args, **kwargs)).float()
                return float((y - target).pow(2).sum())

            cur = {p: 0.0 for p in projections}
            budget = 0.0
            path = [(0.0, dict(cur), 0.0)]
            while budget < max_budget - 1e-9:
                best = None
                for p in projections:
                    if cur[p] + steps[p] > 0.99:
                        continue
                    trial = {**cur, p: cur[p] + steps[p]}
                    e = error(trial)
                    if best is None or e < best[0]:
                        best = (e, p)
                if best is None:
                    break
                cur[best[1]] += steps[best[1]]
                budget = sum(cur[p] * numel[p] for p in projections) / total
                path.append((round(budget, 6), {p: round(v, 6) for p, v in cur.items()}, best[0]))
        finally:
            applied.revert()
    return path


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


def symmetry_gaps(cache, layers, projections, sparsities=(0.25, 0.4, 0.5)) -> dict:
    """Per projection input: how far TEAL's signed icdf(0.5 + s/2) threshold is from the |x| quantile.

    Returns {proj: {s: {"realized": mean over layers of the calibration sparsity the symmetric rule gives,
    "max_abs_err": its largest |realized - s| over layers, "neg_frac": mean fraction of x <= 0}}}."""
    out = {}
    for p in projections:
        out[p] = {}
        for s in sparsities:
            real, negs = [], []
            for l in layers:
                h = cache.load_hist(l, p)
                real.append(calib_sparsity(h, threshold_for(h, s, symmetric=True)))
                negs.append(float(h[_ROW["neg"]].sum() / abs_hist(h).sum()))
            out[p][s] = {"realized": sum(real) / len(real), "max_abs_err": max(abs(r - s) for r in real),
                         "neg_frac": sum(negs) / len(negs)}
    return out
