"""Benchmark of the SVDP fit on SmolLM2 (CPU): the greedy bias calibration (sort / heap / the paper's argmin loop)
on one layer, and the SVD build + calibration of every layer.

    python -m benchmarks.experiments.svd [--tokens 8192] [--layer 15] [--rank 64] [--sparsity 0.5] [--json NAME]

Calibration activations (``ffn_in``, all layers) are captured once and then read from the activation cache.
The three greedy implementations are timed interleaved (``benchmarks.harness.time_cpu``: median and IQR of
``--repeats`` rounds, speedup over the argmin loop). ``--json NAME`` writes ``benchmarks.harness.Row`` rows
(seconds) to ``benchmarks/results/NAME``.

An experiment: which greedy the SVDP fit calibrates with, and what the fit costs.
Recorded: benchmarks/results/history-quality.md, "SVDP internals".
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks.harness import Row, command_line, device_line, device_name, time_cpu, write_results


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.svd",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens (half fit, half calibration)")
    ap.add_argument("--layer", type=int, default=15, help="layer for the greedy comparison")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the greedy comparison")
    ap.add_argument("--json", default=None,
                    help="also write the rows to this file (a bare name goes under benchmarks/results/)")
    args = ap.parse_args(argv)

    from workers.sparsity.capture import capture_activations
    from workers.loading.data import token_windows
    from workers.loading.models import load_model
    from workers.sparsity.predictors.base import FitContext, fit_method
    from workers.loading.adapters import activation_fn
    from workers.sparsity.greedy import greedy_allocate, greedy_reference
    from workers.methods.svd.predictor import SVDPredictor
    from workers.methods.svd.calibration import Q_STEPS, calibration_costs
    from workers.sparsity.whitening import whitened_lowrank, whitening_factor

    print(device_line("cpu"), flush=True)
    lm = load_model(args.model)
    toks = token_windows(lm.tokenizer, "lambada", "calib", args.tokens, 512)
    t0 = time.perf_counter()
    cache = capture_activations(lm, toks, components=("ffn_in",), progress=False)
    capture_s = time.perf_counter() - t0
    layers = list(range(lm.dims.n_layers))
    ctx = FitContext(lm, cache, layers)
    act = activation_fn(ctx.act_name())
    print(f"{args.model}: {cache.n_tokens} calibration tokens, {len(layers)} layers, d={lm.dims.d} D={lm.dims.D}, "
          f"torch threads {torch.get_num_threads()} (capture {'cache hit' if cache.hit else f'{capture_s:.1f} s'})")

    # ---- greedy on one layer: the same cost arrays for every implementation -----------------------------------
    l = args.layer
    W = ctx.ffn_weights(l)
    X = ctx.inputs(l, "ffn_in")
    n1 = X.shape[0] // 2
    S, _ = whitening_factor(X[:n1])
    A, B = whitened_lowrank(W["gate"].double() @ S, S, args.rank)
    X2 = X[n1:]
    P = SVDPredictor(A, B, torch.zeros(B.shape[0])).proxy(X2)
    dmg = (act(X2 @ W["gate"].T) * (X2 @ W["up"].T)).abs() * W["down"].norm(dim=0)
    N2, D = P.shape
    c = calibration_costs(P, dmg, Q_STEPS)
    costs, free, sizes, nq = c["costs"], c["free"], c["sizes"], c["nq"]
    budget = args.sparsity * N2 * D - int(nq[free].sum())
    cmp = time_cpu({"argmin loop (reference)": lambda: greedy_reference(costs, budget, free, sizes),
                    "heap": lambda: greedy_allocate(costs, budget, free, sizes, impl="heap"),
                    "sort (default)": lambda: greedy_allocate(costs, budget, free, sizes, impl="sort")},
                   repeats=args.repeats)
    s_ref, s_heap, s_sort = (cmp.outputs[n] for n in ("argmin loop (reference)", "heap", "sort (default)"))
    same = bool(np.array_equal(s_sort, s_ref) and np.array_equal(s_heap, s_ref))
    n_steps = int((s_ref - free).sum())
    print(f"\ngreedy on layer {l} (rank {args.rank}, s={args.sparsity}, {D} neurons x {Q_STEPS} steps, "
          f"{n_steps} steps taken; identical allocations: {same}; {args.repeats} interleaved rounds)")
    print(cmp.table())

    # ---- every layer: whitened SVD + calibration, through the registered method -------------------------------
    sp = {layer: args.sparsity for layer in layers}
    full = {}
    for target in ("gate", "product"):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = fit_method("svd", ctx, sp, rank=args.rank, target=target)
        full[target] = (time.perf_counter() - t0, plan, time.process_time() - c0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nall {len(layers)} layers (rank {args.rank}, s={args.sparsity}, {cache.n_tokens} tokens), "
          f"SVD build + calibration incl. reading the cache (load average {load:.1f}, {os.cpu_count()} CPUs)")
    print(f"  {'target':<10}{'wall (s)':>10}{'CPU (s)':>10}{'per layer':>11}{'max layer':>11}{'mean off':>10}")
    for target, (t, plan, cpu) in full.items():
        fs = [plan.info[x]["fit_s"] for x in layers]
        off = float(np.mean([plan.info[x]["calib_offfrac"] for x in layers]))
        print(f"  {target:<10}{t:>10.2f}{cpu:>10.2f}{t / len(layers):>11.3f}{max(fs):>11.3f}{off:>10.4f}")
    common = dict(shape=f"{args.model} d={lm.dims.d} D={lm.dims.D}", dtype="fp32", batch=None,
                  device=device_name("cpu"))
    setting = dict(rank=args.rank, sparsity=args.sparsity)
    rows = [Row.measured("svd-greedy", name, t, **common,
                         extra=dict(setting, layer=l, tokens=N2, steps=n_steps, identical=same,
                                    speedup_vs_reference=round(cmp.ratio(name), 2)))
            for name, t in cmp.timings.items()]
    rows += [Row.measured("svd-fit", f"all layers, target={target}", unit="s", median=t, **common,
                          extra=dict(setting, layers=len(layers), tokens=cache.n_tokens, cpu_s=cpu,
                                     max_layer_s=max(plan.info[x]["fit_s"] for x in layers)))
             for target, (t, plan, cpu) in full.items()]
    if args.json:
        print("wrote", write_results(args.json, rows, command=command_line("benchmarks.experiments.svd"), device="cpu",
                                     meta=dict(threads=torch.get_num_threads(), load_avg=load)))
    return rows


if __name__ == "__main__":
    main()
