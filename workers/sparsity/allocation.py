"""Model-wide FFN sparsity allocation: spend a global budget where it hurts least.

Uniform allocation gives every layer the same sparsity. Here each layer's *damage curve* is measured end to
end: with only layer l sparsified by the oracle at sparsity s (each token keeps its top-(1-s)·D neurons by
|act(gate)·up|), damage_l(s) = mean over tokens of KL(dense next-token distribution || sparse one), on a few
calibration windows, at a few sparsities (``points``), linearly interpolated onto a 0.05 grid (damage(0) = 0,
made non-decreasing). A greedy then raises, one grid step at a time, the layer whose next step adds the least
damage, until the mean sparsity over layers reaches the budget (:mod:`workers.sparsity.greedy`). Layers all
have D neurons, so the mean over layers is the model's FFN sparsity. The curves are method-independent (what the
best set loses); a method then fits each layer at its allocated sparsity.

Cheaper proxies (the lost FFN-output energy relative to the FFN output, or to the residual stream) were measured
first on SmolLM2 and allocated *worse* than uniform (oracle at a 0.5 budget: ppl +8 % and +12 % vs +3 % uniform):
a massive-activation layer looks nearly free by output energy yet is not. Hence the end-to-end measurement.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from workers.paths import home, write_json_atomic
from workers.sparsity.greedy import greedy_allocate
from workers.sparsity.next_token import next_token_logp, token_kl  # noqa: F401 (benchmarks import them here)
from workers.sparsity.predictors.base import SparsityPlan, k_for

DEFAULT_GRID = tuple(round(0.05 * i, 2) for i in range(20))   # 0.0 .. 0.95
# measured points: a coarse set (e.g. 0.25/0.5/0.75) makes the interpolated marginals piecewise constant with a
# kink at each point, and the greedy then stops every layer at the same kink (seen: uniform 0.5 exactly)
DEFAULT_POINTS = tuple(round(0.1 * i, 1) for i in range(1, 10))


def damage_curves(ctx, tokens, points=DEFAULT_POINTS, grid=DEFAULT_GRID) -> dict[int, list[float]]:
    """Per layer of ``ctx.layers``: mean next-token KL to the dense model with only that layer sparsified.

    Cached as JSON under ``$CTXSPARSE_HOME/allocation`` by (model, tokens, layers, points, grid).
    """
    return _cached_per_layer([ctx.lm.fingerprint, tokens.fingerprint, list(ctx.layers), list(points), list(grid)],
                             lambda: _measure_curves(ctx, tokens, points, grid))


def _cached_per_layer(key_parts: list, compute):
    """``compute()`` ({layer: value}) cached as JSON under ``$CTXSPARSE_HOME/allocation`` by the hash of
    ``key_parts``; written atomically, read back with int layer keys."""
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    path = home() / "allocation" / f"{key}.json"
    if path.exists():
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    out = compute()
    write_json_atomic(path, out)
    return out


@torch.no_grad()
def _measure_curves(ctx, tokens, points, grid) -> dict[int, list[float]]:
    from workers.methods.oracle.predictor import OracleMLP
    from workers.sparsity.sparse_exec import apply_sparsity

    model, act = ctx.lm.model, ctx.act_name()
    dev = next(model.parameters()).device
    ids = tokens.windows.to(dev)
    dense = next_token_logp(model, ids)
    curves = {}
    for l in ctx.layers:
        w = ctx.ffn_weights(l, device=dev)          # the oracle runs inside the model
        measured = [0.0]
        for s in points:
            plan = SparsityPlan(mlp={l: OracleMLP(w, act, k_for(s, ctx.lm.dims.D))})
            with apply_sparsity(model, plan):
                logp = next_token_logp(model, ids)
            measured.append(token_kl(logp, dense).mean().item())
        curves[l] = curve_on_grid(points, measured[1:], grid)
    return curves


def curve_on_grid(points, measured, grid=DEFAULT_GRID) -> list[float]:
    """Damage measured at sparsities ``points`` (damage(0) = 0 added), made non-decreasing and linearly
    interpolated onto ``grid``."""
    xs = torch.tensor((0.0, *points), dtype=torch.float64)
    ys = torch.tensor((0.0, *measured), dtype=torch.float64).cummax(0).values
    curve = []
    for g in grid:
        i = min(int(torch.searchsorted(xs, torch.tensor(g, dtype=torch.float64), right=True)) - 1, len(xs) - 2)
        t = (g - xs[i]) / (xs[i + 1] - xs[i])
        curve.append(float(ys[i] + t * (ys[i + 1] - ys[i])))
    return curve


def allocate(curves: dict[int, list[float]], budget: float, grid=DEFAULT_GRID) -> dict[int, float]:
    """Per-layer sparsities on ``grid`` whose mean is the smallest grid-reachable value >= ``budget``: the greedy
    (:func:`workers.sparsity.greedy.greedy_allocate`) over the layers' curves, a step's size its rise in sparsity."""
    if not 0 <= budget <= grid[-1]:
        raise ValueError(f"budget must be within [0, {grid[-1]}]")
    layers = sorted(curves)
    if any(len(curves[l]) != len(grid) for l in layers):
        raise ValueError(f"every curve needs one damage per grid point ({len(grid)})")
    steps = greedy_allocate([curves[l] for l in layers], budget * len(layers) - 1e-9, sizes=np.diff(grid))
    return {l: grid[k] for l, k in zip(layers, steps.tolist())}


def total_damage(curves: dict[int, list[float]], alloc: dict[int, float], grid=DEFAULT_GRID) -> float:
    return sum(curves[l][grid.index(s)] for l, s in alloc.items())


# ------------------------------------------------------------------------------------------------------------
# in-context exchange: every layer's effect measured with all the others sparsified at their own budgets
def exchange_allocation(ctx, tokens, budget: float, delta: float = 0.1, rounds: int = 3,
                        lo: float = 0.0, hi: float = 0.95) -> dict[int, float]:
    """Per-layer sparsities with mean ``budget``, from end-to-end KL measured in context.

    The single-layer curves above measure each layer with every other layer dense; at a real budget every other
    layer is sparse too, and on SmolLM2 the single-layer curves all have nearly the same shape (the greedy then
    barely moves from uniform). Here, starting from uniform, each round measures, with every layer at its current
    sparsity, the KL change of raising one layer by ``delta`` (cost) and of lowering it by ``delta`` (gain), then
    moves ``delta`` from the layers with the largest gain to those with the smallest cost, pair by pair while the
    pair's cost is below its gain (each layer moves once per round, the mean stays ``budget``), keeps the new
    allocation only if its measured KL is lower, and halves ``delta``. Cost: 2·L + 2 forward passes per round.
    Cached under ``$CTXSPARSE_HOME/allocation`` like the curves.
    """
    return _cached_per_layer(["exchange", ctx.lm.fingerprint, tokens.fingerprint, list(ctx.layers), budget, delta,
                              rounds, lo, hi], lambda: _exchange(ctx, tokens, budget, delta, rounds, lo, hi))


@torch.no_grad()
def _exchange(ctx, tokens, budget, delta, rounds, lo, hi) -> dict[int, float]:
    from workers.methods.oracle.predictor import OracleMLP
    from workers.sparsity.sparse_exec import apply_sparsity

    model, act, D = ctx.lm.model, ctx.act_name(), ctx.lm.dims.D
    dev = next(model.parameters()).device
    ids = tokens.windows.to(dev)
    dense = next_token_logp(model, ids)
    weights = {l: ctx.ffn_weights(l, device=dev) for l in ctx.layers}

    def kl(alloc: dict[int, float]) -> float:
        plan = SparsityPlan(mlp={l: OracleMLP(weights[l], act, k_for(s, D)) for l, s in alloc.items() if s > 0})
        with apply_sparsity(model, plan):
            logp = next_token_logp(model, ids)
        return token_kl(logp, dense).mean().item()

    cur = {l: float(budget) for l in ctx.layers}
    base = kl(cur)
    for _ in range(rounds):
        cost, gain = {}, {}
        for l in ctx.layers:
            if cur[l] + delta <= hi + 1e-9:
                cost[l] = kl({**cur, l: cur[l] + delta}) - base
            if cur[l] - delta >= lo - 1e-9:
                gain[l] = base - kl({**cur, l: cur[l] - delta})
        ups = sorted(cost, key=cost.get)
        downs = sorted(gain, key=gain.get, reverse=True)
        new, moved = dict(cur), set()
        for u, d in zip(ups, downs):
            if u in moved or d in moved or u == d or cost[u] >= gain[d]:
                break
            new[u], new[d] = round(new[u] + delta, 6), round(new[d] - delta, 6)
            moved |= {u, d}
        if moved:
            k = kl(new)
            if k < base:
                cur, base = new, k
        delta /= 2
    return cur
