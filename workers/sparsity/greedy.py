"""Exact greedy allocation of steps to prefix-constrained units, with the paper's argmin loop as its reference.

A unit (an SVDP neuron's quantile steps, a layer's sparsity grid) has a cost for every number of steps taken, and its
steps can only be taken in order. The greedy repeatedly takes the available step with the smallest marginal cost
until a budget of steps (or of step sizes) is spent. Used by SVDP's per-neuron bias calibration
(:func:`workers.methods.svd.calibration.calibrate_bias`) and by the model-wide allocation of FFN
sparsity across layers (:func:`workers.sparsity.allocation.allocate`).

Three exact implementations give identical allocations (ties go to the lowest unit index, as with ``argmin``):
``sort`` (default), ``heap`` (a binary heap, O(log U) per step) and :func:`greedy_reference` (the SVDP paper code's
O(U) argmin per step; kept for tests and ``python -m benchmarks.experiments.svd``). ``sort`` rests on this fact: the greedy
takes steps in non-decreasing order of their *prefix-max marginal* e_i(k) = max(m_i(start..k)) -- a step with a
marginal below the current level is taken right after its predecessor -- and, within equal e, by (unit, step). So
one stable argsort of e plus a cumulative sum of step sizes reproduces the whole greedy. Timings: BENCHMARKS.md,
"SVDP internals".
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import torch

GREEDY_IMPLS = ("sort", "heap")


def _normalize_greedy_args(costs, start, sizes):
    """-> (list of 1-D float64 cost arrays, start int64 [U], steps per unit int64 [U], list of 1-D float64 size
    arrays or None)."""
    if isinstance(costs, np.ndarray) and costs.ndim == 2:
        cl = [np.asarray(r, dtype=np.float64) for r in costs]
    elif isinstance(costs, torch.Tensor) and costs.ndim == 2:
        cl = [r for r in costs.detach().cpu().double().numpy()]
    else:
        cl = [np.asarray(c.detach().cpu().double().numpy() if isinstance(c, torch.Tensor) else c,
                         dtype=np.float64).reshape(-1) for c in costs]
    U = len(cl)
    for i, c in enumerate(cl):
        if c.size < 1:
            raise ValueError(f"unit {i}: a cost array needs at least the entry for 0 steps")
        if not np.isfinite(c).all():
            raise ValueError(f"unit {i}: costs must be finite")
    st = np.zeros(U, dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64).reshape(-1)
    if st.shape != (U,):
        raise ValueError(f"start must have one entry per unit ({U})")
    lens = np.array([c.size - 1 for c in cl], dtype=np.int64)
    if (st < 0).any() or (st > lens).any():
        raise ValueError("start must lie in 0..(steps of the unit)")
    if sizes is None:
        sl = None
    else:
        if isinstance(sizes, torch.Tensor):
            sizes = sizes.detach().cpu().numpy()
        if isinstance(sizes, np.ndarray) and sizes.ndim == 1:
            shared = sizes.astype(np.float64)
            sl = [shared] * U
        else:
            sl = [np.asarray(s, dtype=np.float64).reshape(-1) for s in sizes]
        if len(sl) != U or any(s.size < n for s, n in zip(sl, lens)):
            raise ValueError("sizes must give each unit one size per step")
        if any((s[:n] < 0).any() for s, n in zip(sl, lens)):
            raise ValueError("step sizes must be >= 0")
    return cl, st, lens, sl


def greedy_allocate(costs, budget: float, start=None, sizes=None, impl: str = "sort") -> np.ndarray:
    """Exact greedy allocation of steps to prefix-constrained units.

    ``costs``: one 1-D array per unit (a list, or a 2-D array [U, n+1]): ``costs[i][k]`` is the cost of unit i
    having taken k steps (k = 0..n_i; lengths may differ). The marginal cost of unit i's step k+1 is
    ``costs[i][k+1] - costs[i][k]``; steps of a unit can only be taken in order. ``start``: steps already taken
    (default 0), e.g. each unit's free prefix. ``sizes``: optional size of each step (a 1-D array shared by all
    units, or one array per unit); ``budget`` counts steps, or total size when ``sizes`` is given.

    The greedy repeatedly takes the available step with the smallest marginal cost (ties: lowest unit index)
    until the steps taken beyond ``start`` reach ``budget`` (the last step may overshoot it by less than its
    size) or no step is left. With non-decreasing marginals per unit (convex costs) this is optimal for the
    knapsack "fixed total size, least total cost" (the SVDP paper, Thm A.15); otherwise it is the paper's greedy.

    Returns the steps per unit (int64 [U], ``start`` included). ``impl``: ``sort`` (default; vectorized) or
    ``heap``; both return exactly what the O(U)-per-step argmin loop returns.
    """
    if impl not in GREEDY_IMPLS:
        raise ValueError(f"impl must be one of {GREEDY_IMPLS}")
    cl, st, lens, sl = _normalize_greedy_args(costs, start, sizes)
    if impl == "heap":
        return _greedy_heap(cl, st, sl, budget)
    return _greedy_sort(cl, st, lens, sl, budget)


def _greedy_heap(cl, st, sl, budget) -> np.ndarray:
    cost = [c.tolist() for c in cl]
    size = None if sl is None else [s.tolist() for s in sl]
    steps = st.tolist()
    heap = [(c[k + 1] - c[k], i) for i, (c, k) in enumerate(zip(cost, steps)) if k < len(c) - 1]
    heapq.heapify(heap)
    taken = 0.0
    while taken < budget and heap:
        i = heap[0][1]
        k = steps[i]
        taken += 1.0 if size is None else size[i][k]
        k += 1
        steps[i] = k
        c = cost[i]
        if k < len(c) - 1:
            heapq.heapreplace(heap, (c[k + 1] - c[k], i))
        else:
            heapq.heappop(heap)
    return np.asarray(steps, dtype=np.int64)


def _greedy_sort(cl, st, lens, sl, budget) -> np.ndarray:
    U = len(cl)
    if U == 0 or budget <= 0:
        return st.copy()
    L = int(lens.max())
    if L == 0:
        return st.copy()
    C = np.zeros((U, L + 1))
    for i, c in enumerate(cl):
        C[i, :c.size] = c
    marg = np.diff(C, axis=1)                                       # [U, L], exact same floats as c[k+1]-c[k]
    k = np.arange(L)[None, :]
    cand = (k >= st[:, None]) & (k < lens[:, None])
    marg[k < st[:, None]] = -np.inf                                 # taken already: the prefix max starts at start
    level = np.maximum.accumulate(marg, axis=1)                     # e_i(k): the greedy's order key
    unit, _ = np.nonzero(cand)                                      # unit-major, step-minor
    e = level[cand]
    order = np.argsort(e, kind="stable")                            # ties: (unit, step), as argmin would
    if sl is None:
        take = min(int(math.ceil(budget)), order.size)
    else:
        S = np.zeros((U, L))
        for i, s in enumerate(sl):
            S[i, :lens[i]] = s[:lens[i]]
        cs = np.cumsum(S[cand][order])
        take = min(int(np.searchsorted(cs, budget, side="left")) + 1, order.size)
    return st + np.bincount(unit[order[:take]], minlength=U).astype(np.int64)


def greedy_reference(costs, budget: float, start=None, sizes=None) -> np.ndarray:
    """The paper code's greedy: one O(U) argmin over the units' next marginal costs per step (slow; tests/bench)."""
    cl, st, lens, sl = _normalize_greedy_args(costs, start, sizes)
    steps = st.copy()
    marg = np.full(len(cl), np.inf)
    for i, c in enumerate(cl):
        if steps[i] < lens[i]:
            marg[i] = c[steps[i] + 1] - c[steps[i]]
    taken = 0.0
    while taken < budget:
        i = int(np.argmin(marg))
        if marg[i] == np.inf:
            break
        k = steps[i]
        taken += 1.0 if sl is None else sl[i][k]
        steps[i] = k + 1
        marg[i] = cl[i][k + 2] - cl[i][k + 1] if k + 1 < lens[i] else np.inf
    return steps
