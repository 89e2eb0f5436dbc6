"""Greedy allocation over per-layer damage curves measured with the method's own predictors (SVDP r256) instead of
the oracle's: each layer alone sparsified by SVDP fitted at s = 0.1 … 0.9, next-token KL to the dense model on 256
calibration tokens, the same interpolation and greedy as workers.sparsity.allocation, then SVDP fitted at the
allocated budgets (mean 0.5) and held-out perplexity on 8,192 tokens. Not an allocation option: it allocated worse
than uniform on Gemma-3.

    python -m benchmarks.experiments.method_allocation --model gemma3-270m --calib-tokens 8192 --json OUT.json

An experiment: whether the method's own damage curves allocate better than the oracle's.
Recorded: benchmarks/results/history-quality.md, "Allocation on Gemma-3".
"""
import argparse
import json
import time

import torch

from benchmarks.quality import calib_context
from workers.evals.perplexity import perplexity
from workers.loading.data import token_windows
from workers.loading.models import load_model
from workers.sparsity.allocation import DEFAULT_POINTS, allocate, curve_on_grid, next_token_logp, token_kl
from workers.sparsity.predictors import SparsityPlan, fit_method
from workers.sparsity.sparse_exec import apply_sparsity


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.method_allocation",
                                 description="greedy allocation over SVDP's own single-layer damage curves")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--heldout-tokens", type=int, default=8192, help="tokens of the held-out perplexity")
    ap.add_argument("--rank", type=int, default=256, help="the SVDP predictors' rank")
    ap.add_argument("--json", default=None, help="output file (default: method_allocation_MODEL.json)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, calib_tokens = a.model, a.calib_tokens
    lm = load_model(model)
    ctx = calib_context(lm, calib_tokens)
    ids = token_windows(lm.tokenizer, "lambada", "calib", 256, 256).windows
    held = token_windows(lm.tokenizer, "lambada", "heldout", a.heldout_tokens, 512)
    t0 = time.time()
    with torch.no_grad():
        dense = next_token_logp(lm.model, ids)
    plans = {s: fit_method("svd", ctx, s, rank=a.rank) for s in DEFAULT_POINTS}
    print("fits", round(time.time() - t0), flush=True)
    curves = {}
    for l in ctx.layers:
        measured = [0.0]
        for s in DEFAULT_POINTS:
            p = plans[s]
            one = SparsityPlan(mlp={l: p.mlp[l]}, mlp_mode=p.mlp_mode, seq_filter=p.seq_filter)
            with torch.no_grad(), apply_sparsity(lm.model, one):
                measured.append(token_kl(next_token_logp(lm.model, ids), dense).mean().item())
        curves[l] = curve_on_grid(DEFAULT_POINTS, measured[1:])
        print(l, [round(m, 4) for m in measured], flush=True)
    print("curves", round(time.time() - t0), flush=True)
    alloc = allocate(curves, 0.5)
    plan = fit_method("svd", ctx, alloc, rank=a.rank)
    with torch.no_grad():
        with apply_sparsity(lm.model, plan) as applied:
            r = perplexity(lm.model, held)
            sp = applied.stats.mlp_sparsity()
        d = perplexity(lm.model, held)
    res = {"alloc": alloc, "ppl": r.ppl, "dense": d.ppl, "mlp_sparsity": sp, "delta": r.ppl / d.ppl - 1}
    print(json.dumps(res), flush=True)
    with open(a.json or f"method_allocation_{model}.json", "w") as f:
        json.dump({"curves": curves, "0.5": res}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
