"""SVDP's calibration on the second half X2 of the calibration tokens: per-neuron biases, and the sequential filter.

**Greedy bias calibration** (:func:`calibrate_bias`). Given the predictor's proxy scores P and the damage of
switching each (token, neuron) pair off, per neuron the tokens are sorted by the proxy (ascending); switching off
the k lowest-scored tokens costs the sum of their squared damages (a prefix constraint: a bias can only switch off
a prefix). Each neuron's order is quantized to Q = 256 steps (step q = the first round(q·N/Q) tokens off). Each
neuron starts at its free prefix (the most steps with zero damage: for ReLU, the natural zeros; for SiLU/GeLU
usually none), then the greedy (:mod:`workers.sparsity.greedy`) repeatedly gives one more step to the neuron whose
next step costs least, until the fraction of (neuron, token) pairs off on X2 reaches the layer's target. The bias
puts the threshold halfway between the last-off and first-on proxy values, so ``score > 0`` reproduces the chosen
off set on X2 (ties of equal proxy values aside); a neuron never switched off gets bias +inf (always on), one
switched off on every calibration token −inf. Where free zeros alone exceed the target (a ReLU layer asked for less
than its natural sparsity) all free zeros are still switched off -- they cost nothing -- and ``offfrac`` says so.

**Sequential filter** (:func:`seq_filter_threshold`): gate runs on the predicted rows, rows with |act(gate)| <= f
are dropped before up/down; f is the largest value whose extra damage (sum of squared damages of predicted-on pairs
with |act(gate)| <= f) is at most ``tol`` of the squared damage the predictor keeps. Per-layer tolerances compound
over the layers: only a small one (1e-4) is negligible (benchmarks/results/history-quality.md, "SVDP internals").

**Superset filter** (:func:`superset_filter_threshold`): the exact gate (or damage) on a predicted superset, f set
so that the fraction of all pairs off reaches the layer's target.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from workers.sparsity.greedy import GREEDY_IMPLS, greedy_allocate, greedy_reference

Q_STEPS = 256
CALIB_IMPLS = GREEDY_IMPLS + ("reference",)     # the greedy's implementations, and the paper's argmin loop


class FilterThreshold(NamedTuple):
    threshold: float         # f: kept pairs whose filter score is <= f are dropped
    extra_offfrac: float     # the fraction of all pairs the filter drops besides the predictor


def quantile_bounds(n_tokens: int, q_steps: int = Q_STEPS) -> np.ndarray:
    """Token counts off at each quantile step: n_q = round(q·N/Q), q = 0..Q (Q capped at N)."""
    Q = max(1, min(q_steps, n_tokens))
    return np.floor(np.arange(Q + 1) * n_tokens / Q + 0.5).astype(np.int64)


def calibration_costs(P: torch.Tensor, damage: torch.Tensor, q_steps: int = Q_STEPS,
                      chunk_elems: int = 1 << 24) -> dict:
    """The per-neuron cost arrays of the bias calibration.

    ``P`` [N, D]: proxy scores; ``damage`` [N, D] >= 0. Per neuron, tokens are sorted by P (ascending, stable);
    ``costs[i, q]`` is the summed squared damage of the first ``nq[q]`` tokens (q = 0..Q). Also returns ``nq``,
    the step ``sizes`` (tokens), ``free`` (each neuron's zero-cost prefix, in steps), ``p_lo`` / ``p_hi`` [D, Q+1]
    (the proxy value of the last token off / first token on at each step, ∓inf past the ends) and ``total`` (the
    summed squared damage of all pairs). Neurons are processed in blocks of about ``chunk_elems`` pairs, so the
    float64 work arrays stay bounded for large D.
    """
    N, D = P.shape
    if damage.shape != P.shape:
        raise ValueError("P and damage must have the same shape")
    nq = quantile_bounds(N, q_steps)
    nq_t = torch.from_numpy(nq)
    at_lo, at_hi = (nq_t - 1).clamp(min=0), nq_t.clamp(max=N - 1)
    costs = np.empty((D, nq.size))
    p_lo = torch.empty(D, nq.size, dtype=torch.float64)
    p_hi = torch.empty(D, nq.size, dtype=torch.float64)
    total = 0.0
    step = max(1, chunk_elems // max(N, 1))
    for a in range(0, D, step):
        b = min(D, a + step)
        sp, order = torch.sort(P[:, a:b].T.contiguous().float(), dim=1, stable=True)   # [n, N] ascending
        d2 = damage[:, a:b].T.contiguous().double().gather(1, order).square_()
        del order
        cum = torch.zeros(b - a, N + 1, dtype=torch.float64)
        torch.cumsum(d2, dim=1, out=cum[:, 1:])
        del d2
        costs[a:b] = cum[:, nq_t].numpy()
        total += float(cum[:, -1].sum())
        p_lo[a:b] = sp[:, at_lo].double()
        p_hi[a:b] = sp[:, at_hi].double()
    p_lo[:, nq == 0] = -math.inf
    p_hi[:, nq == N] = math.inf
    free = (costs == 0.0).sum(axis=1) - 1                                         # costs are non-decreasing
    return {"costs": costs, "nq": nq, "sizes": np.diff(nq).astype(np.float64), "free": free,
            "p_lo": p_lo, "p_hi": p_hi, "total": total}


def calibrate_bias(P: torch.Tensor, damage: torch.Tensor, sparsity: float, q_steps: int = Q_STEPS,
                   impl: str = "sort") -> dict:
    """Greedy per-neuron bias calibration (see the module doc).

    ``P`` [N, D]: proxy scores on the calibration tokens; ``damage`` [N, D] >= 0. Returns ``bias`` [D] (float64
    tensor, score = P + bias > 0 keeps), ``steps`` [D] (quantile steps off per neuron), ``n_off`` [D] (tokens off),
    ``free_steps`` [D], ``offfrac`` (tokens off / (N·D)), ``free_offfrac``, ``damage_off`` (fraction of the total
    squared damage that the off set drops). ``impl``: ``sort``, ``heap`` or ``reference`` (the argmin loop).
    """
    N, D = P.shape
    c = calibration_costs(P, damage, q_steps)
    costs, nq, free = c["costs"], c["nq"], c["free"]
    already = int(nq[free].sum())
    budget = sparsity * N * D - already                                           # tokens still to switch off
    if impl == "reference":
        steps = greedy_reference(costs, budget, start=free, sizes=c["sizes"])
    else:
        steps = greedy_allocate(costs, budget, start=free, sizes=c["sizes"], impl=impl)
    n_off = torch.from_numpy(nq[steps])
    rows, st = torch.arange(D), torch.from_numpy(steps)
    lo, hi = c["p_lo"][rows, st], c["p_hi"][rows, st]
    # halfway between the last-off and the first-on proxy value; ±inf where a neuron is never / always off
    thr = torch.where(torch.isinf(lo) | torch.isinf(hi), torch.where(torch.isinf(lo), lo, hi), 0.5 * (lo + hi))
    dropped = float(costs[np.arange(D), steps].sum())
    return {"bias": -thr, "steps": torch.from_numpy(steps), "n_off": n_off, "free_steps": torch.from_numpy(free),
            "offfrac": float(n_off.sum()) / (N * D), "free_offfrac": already / (N * D),
            "damage_off": dropped / c["total"] if c["total"] > 0 else 0.0}


def seq_filter_threshold(act_gate_abs: torch.Tensor, damage: torch.Tensor, keep: torch.Tensor,
                         tol: float = 1e-4) -> FilterThreshold:
    """Largest f such that dropping the kept pairs with |act(gate)| <= f loses at most ``tol`` of the kept squared
    damage."""
    a = act_gate_abs[keep].double()
    d2 = damage[keep].double().square()
    total = float(d2.sum())
    if a.numel() == 0:
        return FilterThreshold(0.0, 0.0)
    a_sorted, idx = torch.sort(a)
    cum = torch.cumsum(d2[idx], 0)
    # j = how many of the lowest pairs may go; then back off so that no pair equal to the threshold stays on
    j = int(torch.searchsorted(cum, torch.tensor([tol * total], dtype=torch.float64), right=True))
    if j <= 0:
        f = 0.0
    else:
        f_val = a_sorted[j - 1]
        if j < a_sorted.numel() and a_sorted[j] == f_val:
            first = int(torch.searchsorted(a_sorted, f_val.reshape(1), right=False))
            f_val = a_sorted[first - 1] if first > 0 else torch.tensor(0.0, dtype=torch.float64)
        f = max(float(f_val), 0.0)
    return FilterThreshold(f, int((a <= f).sum()) / keep.numel())


def superset_filter_threshold(score: torch.Tensor, keep: torch.Tensor, target: float) -> FilterThreshold:
    """The filter f for the exact gate on a predicted superset: among the kept pairs, those with score <= f
    (|act(gate)|, or the damage |act(gate)·up|·c_i) are dropped so that the fraction of all pairs off reaches
    ``target``."""
    a = score[keep].double()
    n_drop = int(round(target * keep.numel())) - int((~keep).sum())
    if n_drop <= 0 or a.numel() == 0:
        return FilterThreshold(0.0, 0.0)
    n_drop = min(n_drop, a.numel())
    f = float(torch.kthvalue(a, n_drop).values)
    return FilterThreshold(f, int((a <= f).sum()) / keep.numel())
