"""Input sparsity allocated across the projections (TEAL / WINA option ``greedy``): per layer (``"block"``) or one
sparsity per projection kind for the whole model (``"model"``).

**Block greedy** (``greedy: true`` / ``"block"``; TEAL's ``teal/greedyopt.py``): per layer, starting from 0,
repeatedly raise by one step the projection whose step adds the least error to the *block's* output on
calibration tokens (dense inputs), steps sized so that each one skips the same number of weights
(step_p ∝ 1/numel_p), until the weight-weighted mean sparsity of the block reaches ``BLOCK_MAX``. The path
(block budget -> per-projection sparsities) is computed once per (model, calibration, score, projections) and a
budget reads the first point that reaches it (:func:`block_sparsities_at`). On SmolLM2 it was worse than uniform
at 25 % of the weights and did not rank settings end to end.

**Model greedy** (``greedy: "model"``): measured one projection kind at a time (benchmarks/results/history-quality.md, "Where Gemma-3
loses"), the kinds differ by more than 10x in what half of their inputs cost in perplexity (SmolLM2: o free, down
+2.5 %, up +16 %; Gemma-3: k and v, 3 % of the weights each, +6 % each), so the budget belongs where it costs
least, measured on the whole model. Start with every kind dense; at each step, for every kind p of
``projections`` measure the mean next-token KL to the dense model (calibration tokens, every layer's p at
``cur[p] + MODEL_STEP``, the other kinds at their current sparsities), and raise the kind with the least KL
increase per weight element skipped. Every layer of a kind has the same sparsity (its threshold per layer from
that layer's histogram). A step of a large kind (gate, up, down) skips more weights than one of k or v; the path
records after each step the fraction of the swept projections' weights skipped (``budget``), and
:func:`model_sparsities_at` reads the per-kind sparsities at a budget by interpolating the one kind that moved
between the two points around it, so a plan's budget is met exactly. Cost: up to ``len(projections)`` forwards
of ``MODEL_TOKENS`` calibration tokens per step, and a step per ``MODEL_STEP`` of one kind (to a budget b with
seven kinds of similar size, about 7·b / MODEL_STEP steps). The path is measured only as far as the largest
budget asked for; a larger budget later continues it.

Both paths are cached under ``$CTXSPARSE_HOME/input_greedy`` (``<key>.json`` and ``model-<key>.json``) by
(model, activation cache, tokens, score, projections, settings). :func:`per_projection_sparsities` turns a
per-layer budget into each layer's per-projection sparsities (``uniform`` or either greedy); the method fits
(:mod:`workers.methods.teal.fit`) turn those into thresholds.

Imports: :mod:`workers.sparsity.input_thresholds` (thresholds) and :mod:`workers.sparsity.input_sparse` (the
module swap the searches measure with); never the method fits.
"""
from __future__ import annotations

import hashlib
import json

import torch

from workers.loading import data
from workers.loading.adapters import get_path, linear_weight
from workers.paths import home, write_json_atomic
from workers.sparsity import histograms as H
from workers.sparsity.input_sparse import InputStats, apply_input_sparsity, projection_paths
from workers.sparsity.input_thresholds import Thresholds
from workers.sparsity.next_token import next_token_logp, token_kl

GREEDY_KINDS = ("block", "model")

BLOCK_STEP = 0.05         # a step of projection p raises its sparsity by BLOCK_STEP * mean numel / numel_p
BLOCK_MAX = 0.75          # the block path is computed up to this block budget
BLOCK_TOKENS = 1024       # calibration tokens (windows of BLOCK_SEQ) the block errors are measured on
BLOCK_SEQ = 512

MODEL_STEP = 0.05         # a kind's sparsity rises by this much per step
MODEL_CAP = 0.95          # no kind goes above this sparsity
MODEL_MAX_BUDGET = 0.75   # the model path never goes beyond this fraction of the swept weights skipped
MODEL_TOKENS = 1024       # calibration tokens (windows of MODEL_SEQ) the KL is measured on
MODEL_SEQ = 512


def check_greedy(greedy, method: str):
    """The ``greedy`` option as False, "block" (TEAL's per-layer greedy; also ``true``) or "model" (kinds ranked
    by their end-to-end KL)."""
    if greedy is None or greedy is False:
        return False
    if greedy is True:
        return "block"
    if greedy in GREEDY_KINDS:
        return greedy
    raise ValueError(f"{method}: greedy must be false, true or one of {list(GREEDY_KINDS)}, got {greedy!r}")


def per_projection_sparsities(ctx, sparsity: dict[int, float], score: str, projections: list[str],
                              greedy) -> dict[int, dict[str, float]]:
    """{layer: {projection: sparsity}} for every layer of ``sparsity`` with a budget > 0: the layer's budget
    given to each listed projection (``greedy`` False), or split by the block or the model greedy's path."""
    if greedy == "model":
        path = model_greedy_path(ctx, score, projections, until=max(sparsity.values(), default=0.0))
    elif greedy == "block":
        paths = block_greedy_paths(ctx, score, projections)
    out = {}
    for l, s in sorted(sparsity.items()):
        if s <= 0:
            continue
        if greedy == "model":
            out[l] = model_sparsities_at(path, s)
        elif greedy == "block":
            out[l] = block_sparsities_at(paths[l], s)
        else:
            out[l] = {p: s for p in projections}
    return out


def _path_file(name: str, parts: list):
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return home() / "input_greedy" / f"{name}{key}.json"


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------- block greedy (TEAL's greedyopt)
def block_greedy_paths(ctx, score: str, projections: list[str]) -> dict:
    """{layer: [(block budget, {projection: sparsity}, block output error), ...]} from 0 up to BLOCK_MAX."""
    toks = data.token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", BLOCK_TOKENS, BLOCK_SEQ)
    cached = _path_file("", [ctx.lm.fingerprint, ctx.cache.manifest.get("key"), toks.fingerprint, score,
                             projections, BLOCK_STEP, BLOCK_MAX, list(ctx.layers), H.BINS])
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
    thr = Thresholds(ctx, score)
    out = {l: _block_path(ctx, l, projections, seen.pop(l), thr) for l in ctx.layers}
    write_json_atomic(cached, {str(k): v for k, v in out.items()})
    return out


def _block_path(ctx, l: int, projections: list[str], inputs, thr: Thresholds) -> list:
    model, ad = ctx.lm.model, ctx.lm.adapter
    layer = ad.decoder_layers(model)[l]
    args, kwargs = inputs
    paths = projection_paths(ad)
    numel = {p: linear_weight(get_path(layer, paths[p])).numel() for p in projections}
    total = sum(numel.values())
    steps = {p: BLOCK_STEP * (total / len(numel)) / numel[p] for p in projections}
    with torch.no_grad():
        target = _layer_out(layer(*args, **kwargs)).float()
        applied = apply_input_sparsity(model, {l: {p: -1.0 for p in projections}}, thr.score, "masked", InputStats())
        try:
            mods = {p: get_path(layer, paths[p]) for p in projections}

            def error(per_proj):
                for p, sp in per_proj.items():
                    mods[p].threshold = thr(l, p, sp)
                y = _layer_out(layer(*args, **kwargs)).float()
                return float((y - target).pow(2).sum())

            cur = {p: 0.0 for p in projections}
            budget = 0.0
            path = [(0.0, dict(cur), 0.0)]
            while budget < BLOCK_MAX - 1e-9:
                best = None
                for p in projections:
                    if cur[p] + steps[p] > 0.99:
                        continue
                    e = error({**cur, p: cur[p] + steps[p]})
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


def block_sparsities_at(path: list, budget: float) -> dict[str, float]:
    """The first point of a block greedy path whose block budget reaches ``budget`` (the last one if none does)."""
    for eff, per_proj, _ in path:
        if eff >= budget - 1e-9:
            return per_proj
    return path[-1][1]


# ---------------------------------------------------------------- model greedy (kinds by end-to-end KL)
def model_greedy_path(ctx, score: str, projections: list[str], until: float = MODEL_MAX_BUDGET) -> list:
    """[(budget, {kind: sparsity}, kl), ...] from all-dense until ``until`` (at most ``MODEL_MAX_BUDGET``) or
    every kind at ``MODEL_CAP``; the thresholds tried are the ones the plan will carry (the fits' calibration
    rule). The cached path is a prefix: a later call for a larger budget continues it from its last point."""
    until = min(until, MODEL_MAX_BUDGET)
    toks = data.token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", MODEL_TOKENS, MODEL_SEQ)
    cached = _path_file("model-", ["model", ctx.lm.fingerprint, ctx.cache.manifest.get("key"), toks.fingerprint,
                                   score, projections, MODEL_STEP, MODEL_CAP, list(ctx.layers), H.BINS])
    doc = json.loads(cached.read_text()) if cached.exists() else {"path": None, "complete": False}
    path = doc["path"]
    if path is None or (path[-1][0] < until - 1e-9 and not doc["complete"]):
        path, complete = _measure(ctx, score, projections, toks, until, path)
        write_json_atomic(cached, {"path": path, "complete": complete})
    return path


@torch.no_grad()
def _measure(ctx, score, projections, toks, until: float, path: list | None) -> tuple[list, bool]:
    """Continue ``path`` (None: from all-dense) until its budget reaches ``until``; -> (path, every kind capped)."""
    model, ad = ctx.lm.model, ctx.lm.adapter
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    numel = {p: sum(linear_weight(get_path(layers[l], paths[p])).numel() for l in ctx.layers) for p in projections}
    total = sum(numel.values())
    thr = Thresholds(ctx, score)
    for l in ctx.layers:            # every histogram read (and checked) before the first forward
        for p in projections:
            thr.hist(l, p)

    path = path or [[0.0, {p: 0.0 for p in projections}, 0.0]]
    budget, cur, base = path[-1][0], dict(path[-1][1]), path[-1][2]
    ids = toks.windows.to(next(model.parameters()).device)
    dense = [next_token_logp(model, w[None]) for w in ids]
    applied = apply_input_sparsity(model, {l: {p: thr(l, p, cur[p]) for p in projections} for l in ctx.layers},
                                   score, "masked", InputStats())
    try:
        mods = {(l, p): get_path(layers[l], paths[p]) for l in ctx.layers for p in projections}

        def set_kind(p, sp):
            for l in ctx.layers:
                mods[(l, p)].threshold = thr(l, p, sp)

        def kl() -> float:
            out = 0.0
            for w, d in zip(ids, dense):
                logp = next_token_logp(model, w[None])
                out += token_kl(logp, d).mean().item()
            return out / len(ids)

        while budget < until - 1e-9:
            best = None
            for p in projections:
                if cur[p] + MODEL_STEP > MODEL_CAP + 1e-9:
                    continue
                set_kind(p, cur[p] + MODEL_STEP)
                k = kl()
                set_kind(p, cur[p])
                per_weight = (k - base) / (MODEL_STEP * numel[p])
                if best is None or per_weight < best[0]:
                    best = (per_weight, p, k)
            if best is None:
                return path, True
            _, p, base = best
            cur[p] = round(cur[p] + MODEL_STEP, 6)
            set_kind(p, cur[p])
            budget = sum(cur[q] * numel[q] for q in projections) / total
            path.append([round(budget, 6), dict(cur), base])
    finally:
        applied.revert()
    return path, False


def model_sparsities_at(path: list, budget: float) -> dict[str, float]:
    """Per-kind sparsities at ``budget``: between the two model path points around it exactly one kind moved; its
    sparsity is interpolated so that the weight-weighted mean is ``budget`` (the path's last point beyond it)."""
    if budget <= 0:
        return dict(path[0][1])
    for (b0, s0, _), (b1, s1, _) in zip(path, path[1:]):
        if b1 >= budget - 1e-12:
            t = (budget - b0) / (b1 - b0) if b1 > b0 else 1.0
            return {p: round(s0[p] + t * (s1[p] - s0[p]), 6) for p in s1}
    return dict(path[-1][1])
