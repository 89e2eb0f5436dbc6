"""Input sparsity allocated across projection kinds by their end-to-end effect (TEAL / WINA option
``greedy: "model"``).

TEAL's block-wise greedy (``input_sparsity.greedy_paths``) ranks a layer's projections by the error they add to
that block's output with dense inputs; on SmolLM2 it was worse than uniform at 25 % of the weights and did not rank
settings end to end. Measured one projection kind at a time (BENCHMARKS.md, "Where Gemma-3 loses"), the kinds
differ by more than 10x in what half of their inputs cost in perplexity (SmolLM2: o free, down +2.5 %, up +16 %;
Gemma-3: k and v, 3 % of the weights each, +6 % each), so the budget belongs where it costs least, measured on
the whole model.

The path: start with every kind dense; at each step, for every kind p of ``projections`` measure the mean
next-token KL to the dense model (calibration tokens, every layer's p at ``cur[p] + STEP``, the other kinds at
their current sparsities), and raise the kind with the least KL increase per weight element skipped. Every layer
of a kind has the same sparsity (its threshold per layer from that layer's histogram). A step of a large kind
(gate, up, down) skips more weights than one of k or v; the path records after each step the fraction of the
swept projections' weights skipped (``budget``), and ``path_at`` reads the per-kind sparsities at a budget by
interpolating the one kind that moved between the two points around it, so a plan's budget is met exactly.
Cost: up to ``len(projections)`` forwards of ``TOKENS`` calibration tokens per step, and a step per ``STEP`` of
one kind (to a budget b with seven kinds of similar size, about 7·b / STEP steps). The path is measured only as
far as the largest budget asked for, and cached under ``$CTXSPARSE_HOME/input_greedy`` by (model, activation
cache, tokens, score, projections, settings); a larger budget later continues it.
"""
from __future__ import annotations

import hashlib
import json

import torch

from workers.loading.adapters import get_path, linear_weight
from workers.paths import home, write_json_atomic
from workers.sparsity import histograms as H
from workers.sparsity.allocation import next_token_logp, token_kl
from workers.sparsity.input_sparse import InputStats, apply_input_sparsity, projection_paths

STEP = 0.05          # a kind's sparsity rises by this much per step
CAP = 0.95           # no kind goes above this sparsity
MAX_BUDGET = 0.75    # the path never goes beyond this fraction of the swept weights skipped
TOKENS = 1024        # calibration tokens (windows of SEQ) the KL is measured on
SEQ = 512


def model_greedy_path(ctx, score: str, projections: list[str], until: float = MAX_BUDGET) -> list:
    """[(budget, {kind: sparsity}, kl), ...] from all-dense until ``until`` (at most ``MAX_BUDGET``) or every
    kind at ``CAP``; the thresholds tried are the ones the plan will carry (``input_sparsity``'s calibration
    rule). The cached path is a prefix: a later call for a larger budget continues it from its last point."""
    from workers.loading.data import token_windows

    until = min(until, MAX_BUDGET)
    toks = token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", TOKENS, SEQ)
    key = hashlib.sha256(json.dumps(["model", ctx.lm.fingerprint, ctx.cache.manifest.get("key"), toks.fingerprint,
                                     score, projections, STEP, CAP, list(ctx.layers), H.BINS],
                                    sort_keys=True).encode()).hexdigest()[:32]
    cached = home() / "input_greedy" / f"model-{key}.json"
    doc = json.loads(cached.read_text()) if cached.exists() else {"path": None, "complete": False}
    path = doc["path"]
    if path is None or (path[-1][0] < until - 1e-9 and not doc["complete"]):
        path, complete = _measure(ctx, score, projections, toks, until, path)
        write_json_atomic(cached, {"path": path, "complete": complete})
    return path


@torch.no_grad()
def _measure(ctx, score, projections, toks, until: float, path: list | None) -> tuple[list, bool]:
    """Continue ``path`` (None: from all-dense) until its budget reaches ``until``; -> (path, every kind capped)."""
    from workers.sparsity.predictors.input_sparsity import input_hist, threshold_for

    model, ad = ctx.lm.model, ctx.lm.adapter
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    numel = {p: sum(linear_weight(get_path(layers[l], paths[p])).numel() for l in ctx.layers) for p in projections}
    total = sum(numel.values())
    hists = {(l, p): input_hist(ctx, l, p) for l in ctx.layers for p in projections}
    thr_cache: dict[tuple, float] = {}

    def thr(l, p, sp):
        k = (l, p, round(sp, 9))
        if k not in thr_cache:
            thr_cache[k] = threshold_for(hists[(l, p)], sp, score) if sp > 0 else -1.0
        return thr_cache[k]

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
                if cur[p] + STEP > CAP + 1e-9:
                    continue
                set_kind(p, cur[p] + STEP)
                k = kl()
                set_kind(p, cur[p])
                per_weight = (k - base) / (STEP * numel[p])
                if best is None or per_weight < best[0]:
                    best = (per_weight, p, k)
            if best is None:
                return path, True
            _, p, base = best
            cur[p] = round(cur[p] + STEP, 6)
            set_kind(p, cur[p])
            budget = sum(cur[q] * numel[q] for q in projections) / total
            path.append([round(budget, 6), dict(cur), base])
    finally:
        applied.revert()
    return path, False


def path_at(path: list, budget: float) -> dict[str, float]:
    """Per-kind sparsities at ``budget``: between the two path points around it exactly one kind moved; its
    sparsity is interpolated so that the weight-weighted mean is ``budget`` (the path's last point beyond it)."""
    if budget <= 0:
        return dict(path[0][1])
    for (b0, s0, _), (b1, s1, _) in zip(path, path[1:]):
        if b1 >= budget - 1e-12:
            t = (budget - b0) / (b1 - b0) if b1 > b0 else 1.0
            return {p: round(s0[p] + t * (s1[p] - s0[p]), 6) for p in s1}
    return dict(path[-1][1])
