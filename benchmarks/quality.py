"""Quality of one sweep point on a real model: fit a method, apply it, measure perplexity and per-layer metrics.

``Workbench`` holds what every point of a model shares (the loaded model, the calibration activations, the
held-out tokens and held-out activations); ``run_point`` fits one (method, sparsity, rank, options) and
measures it, in one process: the tool behind the issue-3 measurements. A sweep splits the same steps into
units run by Ray actors (``workers.units``).

    python -m benchmarks.quality --model smollm2-135m --methods oracle,static,threshold,svd,dejavu \\
        --sparsity 0.3,0.5,0.7 --heldout-tokens 8192 --jsonl results.jsonl
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from workers.sparsity.allocation import allocate, damage_curves
from workers.sparsity.capture import capture_activations
from workers.loading.data import token_windows
from workers.evals.perplexity import perplexity
from workers.sparsity.metrics import plan_quality
from workers.loading.models import load_model
from workers.sparsity.predictors import FitContext, fit_method
from workers.sparsity.sparse_exec import apply_sparsity

log = logging.getLogger(__name__)


@dataclass
class Workbench:
    lm: object
    calib: object            # ActivationCache of the calibration split
    heldout: object          # TokenSet for perplexity
    heldout_cache: object    # ActivationCache of held-out tokens, for per-layer metrics
    damage_tokens: object = None   # TokenSet (calibration split) for the allocation's damage curves
    dense_ppl: float | None = None
    _curves: dict | None = None

    @property
    def ctx(self) -> FitContext:
        return FitContext(self.lm, self.calib, list(range(self.lm.dims.n_layers)))

    def curves(self):
        if self._curves is None:
            if self.damage_tokens is None:
                self.damage_tokens = token_windows(self.lm.tokenizer, self.calib.manifest["data_source"], "calib",
                                                   256, 256)
            self._curves = damage_curves(self.ctx, self.damage_tokens)
        return self._curves


def prepare(model: str = "smollm2-135m", source: str = "lambada", calib_tokens: int = 16384,
            heldout_tokens: int = 8192, metric_tokens: int = 2048, seq_len: int = 512, progress: bool = True,
            lm=None) -> Workbench:
    lm = lm or load_model(model)
    calib = capture_activations(lm, token_windows(lm.tokenizer, source, "calib", calib_tokens, seq_len),
                                progress=progress)
    held = token_windows(lm.tokenizer, source, "heldout", heldout_tokens, seq_len)
    held_metric = token_windows(lm.tokenizer, source, "heldout", metric_tokens, seq_len)
    held_cache = capture_activations(lm, held_metric, progress=progress)
    return Workbench(lm, calib, held, held_cache)


@dataclass
class PointResult:
    model: str
    method: str
    sparsity: float
    rank: int | None
    attn_sparsity: float | None
    allocation: str
    options: dict
    ppl: float
    dense_ppl: float
    nll: float
    stderr_nll: float
    n_tokens: int
    mlp_sparsity: float          # realized in the perplexity run (up/down pairs skipped)
    gate_sparsity: float
    head_sparsity: float
    mean_recall: float
    mean_precision: float
    mean_auc: float
    fit_s: float
    eval_s: float
    layers: list = field(default_factory=list)
    per_layer_sparsity: dict = field(default_factory=dict)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("layers")
        return d


def dense_perplexity(wb: Workbench):
    p = perplexity(wb.lm.model, wb.heldout)
    wb.dense_ppl = p.ppl
    return p


def run_point(wb: Workbench, method: str, sparsity: float, rank: int | None = None,
              attn_sparsity: float | None = None, allocation: str = "uniform", **options) -> PointResult:
    if wb.dense_ppl is None:
        dense_perplexity(wb)
    ctx = wb.ctx
    if allocation == "uniform":
        per_layer = {l: sparsity for l in ctx.layers}
    elif allocation == "greedy":
        per_layer = allocate(wb.curves(), sparsity)
    else:
        raise ValueError("allocation must be 'uniform' or 'greedy'")
    if attn_sparsity is not None:
        options["attn_sparsity"] = attn_sparsity
    t0 = time.time()
    plan = fit_method(method, ctx, per_layer, rank=rank, **options)
    fit_s = time.time() - t0
    act = wb.lm.adapter.act_name(wb.lm.model.config)
    layers = plan_quality(plan, wb.heldout_cache, act, attn_target=attn_sparsity)
    t0 = time.time()
    with apply_sparsity(wb.lm.model, plan) as applied:
        p = perplexity(wb.lm.model, wb.heldout)
    eval_s = time.time() - t0
    mlp = [q for q in layers if q.component == "mlp"]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return PointResult(
        model=wb.lm.ref, method=method, sparsity=sparsity, rank=rank, attn_sparsity=attn_sparsity,
        allocation=allocation, options={k: v for k, v in options.items() if k != "attn_sparsity"},
        ppl=p.ppl, dense_ppl=wb.dense_ppl, nll=p.nll, stderr_nll=p.stderr_nll, n_tokens=p.n_tokens,
        mlp_sparsity=applied.stats.mlp_sparsity(), gate_sparsity=applied.stats.gate_sparsity(),
        head_sparsity=applied.stats.head_sparsity(),
        mean_recall=mean([q.recall for q in mlp]), mean_precision=mean([q.precision for q in mlp]),
        mean_auc=mean([q.auc for q in mlp]), fit_s=fit_s, eval_s=eval_s, layers=[q.row() for q in layers],
        per_layer_sparsity=per_layer)


def _point_key(p: dict) -> str:
    return json.dumps([p["method"], p["sparsity"], p.get("rank"), p.get("attn_sparsity"),
                       p.get("allocation", "uniform"), p.get("options") or {}], sort_keys=True)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fit + evaluate sparsity methods on a real model")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="oracle,static,threshold,svd,dejavu")
    ap.add_argument("--sparsity", default="0.3,0.5,0.7")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--attn-sparsity", type=float, default=None)
    ap.add_argument("--allocation", default="uniform", choices=["uniform", "greedy"])
    ap.add_argument("--options", default="{}", help="JSON dict of method options")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--heldout-tokens", type=int, default=8192)
    ap.add_argument("--points", default=None,
                    help="JSON file: a list of {method, sparsity, rank?, attn_sparsity?, allocation?, options?} "
                         "(replaces --methods/--sparsity/...)")
    ap.add_argument("--jsonl", default=None, help="append one JSON line per point")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    wb = prepare(args.model, calib_tokens=args.calib_tokens, heldout_tokens=args.heldout_tokens)
    dense = dense_perplexity(wb)
    print(f"dense ppl {dense.ppl:.3f} on {dense.n_tokens} held-out tokens", flush=True)
    print(f"{'method':<10} {'s':>5} {'rank':>5} {'ppl':>8} {'Δppl%':>7} {'mlp_sp':>7} {'recall':>7} {'auc':>6} "
          f"{'fit_s':>7} {'eval_s':>7}", flush=True)
    if args.points:
        with open(args.points) as f:
            points = json.load(f)
    else:
        points = [{"method": m, "sparsity": s, "rank": args.rank, "attn_sparsity": args.attn_sparsity,
                   "allocation": args.allocation, "options": json.loads(args.options)}
                  for m in args.methods.split(",") for s in _floats(args.sparsity)]
    done = set()
    if args.jsonl and os.path.exists(args.jsonl):   # resume: points already measured are skipped
        with open(args.jsonl) as f:
            done = {_point_key(json.loads(line)) for line in f if line.strip()}
    for pt in points:
        pt = {"rank": None, "attn_sparsity": None, "allocation": "uniform", "options": {}, **pt}
        if _point_key(pt) in done:
            print(f"skip (done): {pt}", flush=True)
            continue
        method, s = pt.pop("method"), pt.pop("sparsity")
        opts = pt.pop("options", {}) or {}
        r = run_point(wb, method, s, **pt, **opts)
        print(f"{method:<10} {s:>5.2f} {str(r.rank):>5} {r.ppl:>8.2f} {100 * (r.ppl / r.dense_ppl - 1):>7.1f} "
              f"{r.mlp_sparsity:>7.3f} {r.mean_recall:>7.3f} {r.mean_auc:>6.3f} {r.fit_s:>7.1f} {r.eval_s:>7.1f} "
              f"{r.allocation} attn={r.attn_sparsity} head_sp={r.head_sparsity:.3f} {json.dumps(r.options)}",
              flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
