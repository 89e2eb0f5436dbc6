"""How decode steps are timed, and the benchmark policy the timings decide (what the latency rows and
``generate`` run). No Ray, no DB.

    ms = step_times(rt, n)                          # per-step times of n decode steps after a prefill
    per_arm = interleaved(arms, rounds, run)        # run(arm, r) for every arm, the order flipped every round
    pick_cpu_dense(rt)                              # CPU: torch matmuls or the row kernels for dense products
    densify_slow_ffn(rt)                            # batch > 1: predicted FFN layers faster run dense

Two settings timed minutes apart on a shared machine can drift by more than their difference; timed alternately
in one process (the order flipping every round, so neither always runs first) their ratio holds.
"""
from __future__ import annotations

import time

import torch

from kernels.configs import use_dense

# At batch > 1 a layer with an FFN predictor pays, besides the FFN on the union, its predictor and one top-k per
# token; the kernel crossover (kernels.configs.use_dense) counts only the FFN kernels. End to end on an H200
# (Llama-2-7B, batch 4, random Deja Vu r = 256), sparse against dense: 0.95-0.98x at union sparsity 0.32,
# 0.99-1.04x at 0.41, 1.10x at 0.52. Below this union sparsity such a layer runs dense.
SPARSE_FROM_UNION = 0.45


def faster_dense_with_predictor(batch: int, kept: int, n: int, gated: bool = True) -> bool:
    """Whether a predicted FFN layer whose batch union keeps ``kept`` of ``n`` neurons is faster run dense (its
    predictor dropped): the kernel crossover, and from batch 2 also a union sparsity below SPARSE_FROM_UNION."""
    return use_dense(batch, kept, n, gated=gated) or (batch > 1 and 1.0 - kept / n < SPARSE_FROM_UNION)


def step_times(rt, n: int) -> list[float]:
    """Milliseconds of each of ``n`` decode steps of ``rt``: device events around every step on CUDA (no host sync
    inside the loop), the host clock elsewhere."""
    if rt.device.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            rt.step()
            ev[i + 1].record()
        torch.cuda.synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        rt.step()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def interleaved(arms: list, rounds: int, run, warmup: int = 1) -> list[list]:
    """``run(arm, r)`` for every arm in each of ``warmup + rounds`` rounds r, in the order of ``arms`` on even
    rounds and reversed on odd ones; per arm, the results of the rounds after the warm-up."""
    kept = [[] for _ in arms]
    for r in range(warmup + rounds):
        for i in (range(len(arms)) if r % 2 == 0 else reversed(range(len(arms)))):
            out = run(arms[i], r)
            if r >= warmup:
                kept[i].append(out)
    return kept


@torch.no_grad()
def pick_cpu_dense(rt, steps: int = 4, rounds: int = 3) -> bool:
    """On the CPU: time dense decode steps of ``rt`` through torch matmuls and through the row kernels,
    interleaved, and keep the faster for every dense product (``rt.cpu_rows``). Which one wins depends on the CPU
    (caches, MKL's GEMV); the dense baseline of a latency row must be the fastest dense we can run. Returns
    ``cpu_rows``. The plan is restored; the KV cache is dropped (setup() again before decoding)."""
    if rt.device.type != "cpu":
        return rt.cpu_rows
    plan, overlap, kv_mode = rt.plan, rt.overlap, rt.kv_mode
    rt.set_plan(None)
    rt.setup(1, steps + 2)
    ids = torch.zeros(1, 1, dtype=torch.long)

    def run(rows: bool, r: int) -> float:
        rt.cpu_rows = rows
        rt.prefill(ids)
        return sum(step_times(rt, steps))
    matmuls, rows = interleaved([False, True], rounds, run)
    rt.cpu_rows = min(rows) < min(matmuls)
    rt.set_plan(plan, overlap=overlap, kv_mode=kv_mode)
    rt.cache = None
    return rt.cpu_rows


def densify_slow_ffn(rt, faster_dense=None) -> list[int]:
    """At batch > 1 the FFN reads the union of the batch's active sets, which can be nearly every neuron. For every
    layer of ``rt`` whose mean union over the decode steps so far is one at which the dense FFN is faster
    (``faster_dense(batch, kept, D)``; default on CUDA: :func:`faster_dense_with_predictor`, the kernels' crossover
    and the end-to-end one measured with the predictor; elsewhere nothing is switched), the layer runs the dense
    FFN from the next step on and skips its predictor. Reads the counters (one host sync). Returns the layers
    switched; ``set_plan`` restores the plan."""
    if faster_dense is None:
        if rt.device.type != "cuda":
            return []
        gated = rt.gated

        def faster_dense(batch, kept, n):
            return faster_dense_with_predictor(batch, kept, n, gated=gated)
    steps = rt.counters.steps
    if rt.batch <= 1 or steps == 0 or not rt.mlp_pred:
        return []
    kept = (rt.counters.mlp.cpu() / steps).tolist()
    out = sorted(l for l in rt.mlp_pred if faster_dense(rt.batch, max(1, round(kept[l])), rt.dims.D))
    rt.drop_ffn(out)
    return out
