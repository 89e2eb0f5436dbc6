"""R-Sparse: rank-aware activation sparsity, training-free (method ``rsparse``).

Reference: Zhang et al., "R-Sparse: Rank-Aware Activation Sparsity for Efficient LLM Inference", ICLR 2025
(arXiv 2504.19449); code VITA-Group/R-Sparse: ``utils/prepare_low_rank_weight.py`` (a plain SVD of every linear
weight, no input statistics), ``utils/setup.py`` (``set_threshold_r_sparse``: a linear's recipe (s, ρ) -> its
kept inputs and its rank), ``models/modeling_llama.py`` (the forward) and
``config/llama3_sparsity_50_evolutionary_search.npy`` (their searched recipe for Llama-3-8B at 50 %). How a plan
runs and what its factors cost in bytes: :mod:`workers.methods.rsparse`.

**A projection's recipe**, as the reference: a budget b = 1 - s of its dense weight bytes, a share ρ of it spent on
W's columns (the inputs whose score is above the (1 - ρ·b)-quantile of the calibration scores are kept: a fraction
ρ·b of them on calibration data) and the rest on the rank, r = floor((1 - ρ)·b·in·out / (in + out)) (r·(in + out)
factor elements). The score is |x_i|·‖W[:, i]‖₂ where ρ < 1 and |x_i| at ρ = 1 (the reference's two modes; option
``score``). Thresholds come from the activation cache's input histograms (``inhist``), like TEAL's; ρ = 1 with
score ``abs`` is TEAL.

**Recipe search.** The paper searches the recipe with an evolutionary search whose fitness is the perplexity on
calibration text at a fixed model-level sparsity; its released recipe has s = 0.5 in every linear and a ρ per
linear (ρ = 1 in 193 of 224, as low as 0.02 in a few). Here ρ is chosen per projection from ``RHOS`` by the
projection's own output error on calibration tokens (dense inputs; one forward over ``RECIPE_TOKENS`` tokens with
every planned projection's input hooked):

    err(s, ρ) = Σ_tokens ‖W x - W (x ⊙ m) - B_r A_r (x ⊙ (1 - m))‖² = Σ_tokens Σ_{j >= r} σ_j² (v_jᵀ (x ⊙ (1 - m)))²

(W = Σ_j σ_j u_j v_jᵀ, m the kept inputs), the best ρ per projection (ties, within rounding: the larger ρ, fewer
factor bytes); not an end-to-end search (a perplexity per
candidate recipe is out of reach of a 2-core CPU). The table of errors is cached under
``$CTXSPARSE_HOME/rsparse`` by (model, activation cache, tokens, layers, projections, levels, ρ grid, score).

**Allocation** (option ``allocate``):
  ``layer``   (default) every projection of layer l at the layer's budget s_l (the sweep's allocation: uniform,
              greedy, exchange), as the reference's released recipe does;
  ``greedy``  a sparsity per projection from the model-wide greedy (:func:`workers.sparsity.greedy.greedy_allocate`)
              over every (layer, projection) under the total bytes budget Σ_l s_l·(layer l's projection bytes): a
              unit's cost at each level of ``GRID`` is its best err over ρ relative to its dense output energy
              Σ ‖W x‖², per weight element; a step's size is the bytes it skips (numel·Δs: the factor bytes are inside
              s by construction). The projections' errors are commensurate only through that normalization.

Options:
  ``rho``          ``"search"`` (default: the best of ``RHOS`` per projection) or a number in (0, 1] for every
                   projection (the paper's uniform recipe is 0.95)
  ``allocate``     ``"layer"`` or ``"greedy"`` (above)
  ``score``        ``"auto"`` (the reference's: wina where ρ < 1, abs at ρ = 1), ``"abs"`` or ``"wina"``
  ``projections``  the projections to sparsify (default: all of the model's)
The sweep's ``rank`` field is refused: the rank of each projection comes from its recipe.
"""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch

from workers.loading import data
from workers.loading.adapters import get_path, linear_weight
from workers.methods.rsparse.part import LowRankPart, RankSparsePlan
from workers.paths import home, write_json_atomic
from workers.sparsity.greedy import greedy_allocate
from workers.sparsity.input_sparse import projection_paths
from workers.sparsity.input_thresholds import Thresholds, calib_sparsity
from workers.sparsity.predictors.base import FitContext, SparsityPlan, register

RHOS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)       # the share of a projection's budget on W's columns, searched
GRID = tuple(round(0.1 * i, 1) for i in range(10))  # the greedy allocation's sparsity levels per projection: 0 .. 0.9
ALLOCATIONS = ("layer", "greedy")
SCORE_OPTIONS = ("auto", "abs", "wina")
RECIPE_TOKENS = 512       # calibration tokens (windows of RECIPE_SEQ) the recipe errors are measured on
RECIPE_SEQ = 512
TIE = 1e-9                # errors within TIE x the dense output energy are ties (float rounding)


def rank_for(rho: float, budget: float, n_in: int, n_out: int) -> int:
    """The rank a share 1 - ρ of a projection's budget b (fraction of its in·out weights) buys: r·(in + out) <=
    (1 - ρ)·b·in·out (the reference's ``set_threshold_r_sparse``)."""
    return min(n_in, n_out, int(math.floor((1.0 - rho) * budget * n_in * n_out / (n_in + n_out) + 1e-9)))


def input_sparsity_for(rho: float, budget: float) -> float:
    """The fraction of a projection's inputs dropped when a share ρ of its budget b goes to W's columns."""
    return 1.0 - rho * budget


def score_for(rho: float, score: str) -> str:
    return ("abs" if rho >= 1.0 else "wina") if score == "auto" else score


def low_rank_factors(svd, r: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(A, B) = (Σ_r V_rᵀ [r, in], U_r [out, r]) float32 from ``svd`` = (U, Σ, Vᵀ) of W (B A = W at
    r = min(in, out)); (None, None) at r = 0."""
    if r == 0:
        return None, None
    u, sig, vh = svd
    return (sig[:r, None] * vh[:r]).float().contiguous(), u[:, :r].float().contiguous()


def best_rho_index(errs, energy: float) -> int:
    """The recipe a projection runs: the largest ρ (fewest factor bytes; ``RHOS`` is decreasing) whose error is
    within TIE·energy of the least one (errors that differ by rounding only are ties)."""
    errs = np.asarray(errs, dtype=np.float64)
    return int(np.flatnonzero(errs <= errs.min() + TIE * energy)[0])


def _rhos(rho) -> tuple[float, ...]:
    if rho == "search":
        return RHOS
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0.0 < float(rho) <= 1.0:
        raise ValueError(f"rsparse: rho must be 'search' or a number in (0, 1], got {rho!r}")
    return (float(rho),)


def _projections(ad, projections) -> list[str]:
    known = list(projection_paths(ad))
    projections = known if projections is None else list(projections)
    if not projections or len(set(projections)) != len(projections) or set(projections) - set(known):
        raise ValueError(f"rsparse: projections must be distinct names among {known}, got {projections}")
    return projections


# ---------------------------------------------------------------- the recipe errors
def recipe_errors(ctx: FitContext, svds: dict, levels: dict[int, list[float]], projs: list[str],
                  rhos: tuple[float, ...], score: str) -> dict[tuple[int, str], dict]:
    """{(layer, projection): {"err": [[err(s, ρ) for ρ in rhos] for s in levels[layer]], "energy": Σ ‖W x‖²}} on
    the first RECIPE_TOKENS calibration tokens of the cache's source (dense inputs; see the module doc), cached."""
    toks = data.token_windows(ctx.lm.tokenizer, ctx.cache.manifest["data_source"], "calib", RECIPE_TOKENS, RECIPE_SEQ)
    key = [ctx.lm.fingerprint, ctx.cache.manifest.get("key"), toks.fingerprint, sorted(levels.items()), projs,
           list(rhos), score]
    path = home() / "rsparse" / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.json"
    if path.exists():
        return {(int(k.split(".")[0]), k.split(".", 1)[1]): v for k, v in json.loads(path.read_text()).items()}
    out = _measure(ctx, svds, levels, projs, rhos, score, toks)
    write_json_atomic(path, {f"{l}.{p}": v for (l, p), v in out.items()})
    return out


@torch.no_grad()
def _measure(ctx, svds, levels, projs, rhos, score, toks) -> dict:
    model, ad = ctx.lm.model, ctx.lm.adapter
    decoder, paths = ad.decoder_layers(model), projection_paths(ad)
    dev = next(model.parameters()).device
    thr = {sc: Thresholds(ctx, sc) for sc in {score_for(r, score) for r in rhos}}
    acc, hooks = {}, []
    for l, lv in levels.items():
        for p in projs:
            mod = get_path(decoder[l], paths[p])
            _, sig, vh = svds[(l, p)]
            n_out, n_in = linear_weight(mod).shape
            combos = []               # (level index, ρ index, rank, score, threshold) of every candidate recipe
            for i, s in enumerate(lv):
                for j, rho in enumerate(rhos):
                    if s > 0:
                        b, sc = 1.0 - s, score_for(rho, score)
                        combos.append((i, j, rank_for(rho, b, n_in, n_out), sc,
                                       thr[sc](l, p, input_sparsity_for(rho, b))))
            acc[(l, p)] = {"err": np.zeros((len(lv), len(rhos))), "energy": 0.0}
            hooks.append(mod.register_forward_pre_hook(_hook(acc[(l, p)], combos, sig, vh, mod, toks.prefix_len,
                                                             dev)))
    try:
        for w in toks.windows:
            model(input_ids=w[None].to(dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: {"err": v["err"].tolist(), "energy": v["energy"]} for k, v in acc.items()}


def _hook(acc, combos, sig, vh, mod, prefix_len, dev):
    sig2 = sig.double().square().to(dev)
    vh_t = vh.float().T.contiguous().to(dev)                     # [in, min]
    cols = linear_weight(mod).detach().float().norm(dim=0).to(dev)

    def hook(module, args, kwargs=None):
        x = args[0][:, prefix_len:].float()
        x = x.reshape(-1, x.shape[-1])
        acc["energy"] += float(((x @ vh_t).double().square().sum(0) * sig2).sum())
        scores = {"abs": x.abs()}
        scores["wina"] = scores["abs"] * cols
        for i, j, r, sc, t in combos:
            small = x * (scores[sc] <= t)
            e = (small @ vh_t).double().square().sum(0) * sig2       # each singular direction's share of the error
            acc["err"][i, j] += float(e[r:].sum())
    return hook


# ---------------------------------------------------------------- the fit
@register("rsparse", fit_cost=1)
def fit_rsparse(ctx: FitContext, sparsity: dict[int, float], rank=None, rho="search", allocate: str = "layer",
                score: str = "auto", projections=None, **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"rsparse: unknown options {sorted(unknown)}")
    if rank is not None:
        raise ValueError("rsparse: each projection's rank comes from its recipe (budget and rho); leave rank unset")
    rhos = _rhos(rho)
    if allocate not in ALLOCATIONS:
        raise ValueError(f"rsparse: allocate must be one of {ALLOCATIONS}, got {allocate!r}")
    if score not in SCORE_OPTIONS:
        raise ValueError(f"rsparse: score must be one of {SCORE_OPTIONS}, got {score!r}")
    ad = ctx.lm.adapter
    projs = _projections(ad, projections)
    layers = [l for l, s in sorted(sparsity.items()) if s > 0]
    if layers and "inhist" not in ctx.cache.components:
        raise ValueError("rsparse: the activation cache has no input histograms: collect it with the 'inhist' "
                         "component")
    decoder, paths = ad.decoder_layers(ctx.lm.model), projection_paths(ad)
    weights = {(l, p): linear_weight(get_path(decoder[l], paths[p])).detach() for l in layers for p in projs}
    svds = {k: torch.linalg.svd(w.to("cpu", torch.float64), full_matrices=False) for k, w in weights.items()}

    levels = {l: ([sparsity[l]] if allocate == "layer" else list(GRID)) for l in layers}
    table = recipe_errors(ctx, svds, levels, projs, rhos, score) if len(rhos) > 1 or allocate == "greedy" else None
    chosen = _allocate(table, levels, sparsity, weights) if allocate == "greedy" else \
        {k: 0 for k in weights}                                   # the level index each projection runs at

    thr = {sc: Thresholds(ctx, sc) for sc in SCORE_OPTIONS[1:]}
    lowrank = RankSparsePlan()
    out = SparsityPlan(parts=[lowrank])
    for l in layers:
        recipe = {}
        for p in projs:
            k = chosen[(l, p)]
            s = levels[l][k]
            if s <= 0:
                continue
            errs = None if table is None else table[(l, p)]["err"][k]
            energy = None if table is None else table[(l, p)]["energy"]
            j = 0 if errs is None else best_rho_index(errs, energy)
            rho_p, b = rhos[j], 1.0 - s
            n_out, n_in = weights[(l, p)].shape
            r, s_in, sc = rank_for(rho_p, b, n_in, n_out), input_sparsity_for(rho_p, b), score_for(rho_p, score)
            t = thr[sc](l, p, s_in)
            lowrank.parts.setdefault(l, {})[p] = LowRankPart(t, sc, *low_rank_factors(svds[(l, p)], r))
            recipe[p] = {"sparsity": s, "rho": rho_p, "rank": r, "input_sparsity": round(s_in, 6), "score": sc,
                         "calib_sparsity": round(calib_sparsity(thr[sc].hist(l, p), t, sc), 5),
                         "rel_error": None if errs is None else round(errs[j] / max(energy, 1e-300), 6)}
        out.info[l] = {"rsparse": {"target_sparsity": sparsity[l], "allocate": allocate, "recipe": recipe}}
    return out


def _allocate(table, levels, sparsity, weights) -> dict[tuple[int, str], int]:
    """The level of GRID each projection runs at: the greedy over every (layer, projection) (module doc)."""
    units = sorted(weights)
    numel = [weights[u].numel() for u in units]
    costs = [np.min(np.asarray(table[u]["err"]), axis=1) / max(table[u]["energy"], 1e-300) / n
             for u, n in zip(units, numel)]
    sizes = [n * np.diff(GRID) for n in numel]
    budget = sum(sparsity[l] * n for (l, _), n in zip(units, numel))
    steps = greedy_allocate(costs, budget - 1e-9, sizes=sizes)
    return {u: int(k) for u, k in zip(units, steps)}
