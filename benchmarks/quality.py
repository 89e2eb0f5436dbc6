"""Quality of one sweep point on a real model: fit a method, apply it, measure perplexity and per-layer metrics.

``Workbench`` holds what every point of a model shares (the loaded model, the calibration activations, the
held-out tokens and held-out activations); ``run_point`` fits one (method, sparsity, rank, options) and
measures it, in one process. The fit is ``workers.sparsity.fit``, the same pipeline a sweep's fit unit runs
(``workers.units``); here it is followed by a sparse perplexity run. Points are validated before the model
loads: a bad one (an unknown allocation, say) is an error, exit 2.

    python -m benchmarks.quality --model smollm2-135m --methods oracle,static,threshold,svd,dejavu \\
        --sparsity 0.3,0.5,0.7 --heldout-tokens 8192 --jsonl results.jsonl

Feeds: BENCHMARKS.md, "Quality of the methods on SmolLM2 and Gemma-3".
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

from workers.evals.perplexity import perplexity
from workers.loading.data import token_windows
from workers.loading.models import load_model
from workers.sparsity.capture import capture_activations
from workers.sparsity.fit import ALLOCATIONS, check_allocation, fit_setting, greedy_curves, layer_quality, mean_mlp
from workers.sparsity.predictors import FitContext
from workers.sparsity.sparse_exec import apply_sparsity

log = logging.getLogger(__name__)


@dataclass
class Workbench:
    lm: object
    calib: object            # ActivationCache of the calibration split
    heldout: object          # TokenSet for perplexity
    heldout_cache: object    # ActivationCache of held-out tokens, for per-layer metrics
    dense_ppl: float | None = None
    _curves: dict | None = None

    @property
    def ctx(self) -> FitContext:
        return FitContext(self.lm, self.calib, list(range(self.lm.dims.n_layers)))

    def curves(self):
        """The greedy allocation's damage curves, measured once per workbench."""
        if self._curves is None:
            self._curves = greedy_curves(self.ctx)
        return self._curves


def calib_context(lm, calib_tokens: int, source: str = "lambada", seq_len: int = 512,
                  progress: bool = False) -> FitContext:
    """Every layer of ``lm`` with the activations of its first ``calib_tokens`` calibration tokens (cached)."""
    calib = capture_activations(lm, token_windows(lm.tokenizer, source, "calib", calib_tokens, seq_len),
                                progress=progress)
    return FitContext(lm, calib, list(range(lm.dims.n_layers)))


def prepare(model: str = "smollm2-135m", source: str = "lambada", calib_tokens: int = 16384,
            heldout_tokens: int = 8192, metric_tokens: int = 2048, seq_len: int = 512, progress: bool = True,
            lm=None) -> Workbench:
    lm = lm or load_model(model)
    calib = calib_context(lm, calib_tokens, source, seq_len, progress).cache
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
    stderr_nll: float | None     # None for a single window
    n_tokens: int
    mlp_sparsity: float          # realized in the perplexity run (up/down pairs skipped)
    gate_sparsity: float
    head_sparsity: float
    mean_recall: float
    mean_precision: float
    mean_auc: float
    fit_s: float
    eval_s: float
    threads: int                 # torch's thread count during the point (results depend on it)
    layers: list = field(default_factory=list)
    per_layer_sparsity: dict = field(default_factory=dict)
    input_sparsity: float = 0.0      # realized fraction of projection inputs dropped (TEAL, WINA)
    input_by_proj: dict = field(default_factory=dict)
    weight_skipped: float = 0.0      # fraction of decoder projection weights not read per token (predictors as read)
    predictor_frac_ffn: float = 0.0  # the predictors' own weights / the FFN weights of the predicted layers

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
    check_allocation(allocation)
    if wb.dense_ppl is None:
        dense_perplexity(wb)
    fitted = fit_setting(wb.ctx, method, sparsity, rank, attn_sparsity, allocation, options, curves=wb.curves)
    layers = layer_quality(fitted.plan, wb.heldout_cache, wb.lm, attn_sparsity)
    t0 = time.time()
    with apply_sparsity(wb.lm.model, fitted.plan) as applied:
        p = perplexity(wb.lm.model, wb.heldout)
    eval_s = time.time() - t0
    return PointResult(
        model=wb.lm.ref, method=method, sparsity=sparsity, rank=rank, attn_sparsity=attn_sparsity,
        allocation=allocation, options=dict(options),
        ppl=p.ppl, dense_ppl=wb.dense_ppl, nll=p.nll, stderr_nll=p.stderr_nll, n_tokens=p.n_tokens,
        mlp_sparsity=applied.stats.mlp_sparsity(), gate_sparsity=applied.stats.gate_sparsity(),
        head_sparsity=applied.stats.head_sparsity(),
        mean_recall=mean_mlp(layers, "recall"), mean_precision=mean_mlp(layers, "precision"),
        mean_auc=mean_mlp(layers, "auc"), fit_s=fitted.fit_s, eval_s=eval_s, threads=torch.get_num_threads(),
        layers=[q.row() for q in layers], per_layer_sparsity=fitted.per_layer,
        input_sparsity=applied.stats.input_sparsity(), input_by_proj=applied.stats.inputs.per_projection(),
        weight_skipped=applied.stats.weight_skipped(), predictor_frac_ffn=applied.stats.predictor_frac_ffn())


def _point_key(p: dict) -> str:
    return json.dumps([p["method"], p["sparsity"], p.get("rank"), p.get("attn_sparsity"),
                       p.get("allocation", "uniform"), p.get("options") or {}], sort_keys=True)


def check_point(pt) -> dict:
    """A point with its defaults filled in; ValueError if it is not one (before anything is loaded)."""
    if not isinstance(pt, dict) or "method" not in pt or "sparsity" not in pt:
        raise ValueError(f"a point is a dict with method and sparsity, not {pt!r}")
    unknown = set(pt) - {"method", "sparsity", "rank", "attn_sparsity", "allocation", "options"}
    if unknown:
        raise ValueError(f"point {pt}: unknown keys {sorted(unknown)}")
    pt = {"rank": None, "attn_sparsity": None, "allocation": "uniform", "options": {}, **pt}
    check_allocation(pt["allocation"])
    return pt


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fit + evaluate sparsity methods on a real model")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="oracle,static,threshold,svd,dejavu")
    ap.add_argument("--sparsity", default="0.3,0.5,0.7")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--attn-sparsity", type=float, default=None)
    ap.add_argument("--allocation", default="uniform", choices=list(ALLOCATIONS))
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
    if args.points:
        with open(args.points) as f:
            points = json.load(f)
    else:
        points = [{"method": m, "sparsity": s, "rank": args.rank, "attn_sparsity": args.attn_sparsity,
                   "allocation": args.allocation, "options": json.loads(args.options)}
                  for m in args.methods.split(",") for s in _floats(args.sparsity)]
    try:
        points = [check_point(pt) for pt in points]
    except ValueError as e:
        print(f"{args.points or 'points'}: {e}", file=sys.stderr)
        return 2
    wb = prepare(args.model, calib_tokens=args.calib_tokens, heldout_tokens=args.heldout_tokens)
    dense = dense_perplexity(wb)
    print(f"dense ppl {dense.ppl:.3f} on {dense.n_tokens} held-out tokens", flush=True)
    print(f"{'method':<10} {'s':>5} {'rank':>5} {'ppl':>8} {'Δppl%':>7} {'mlp_sp':>7} {'recall':>7} {'auc':>6} "
          f"{'fit_s':>7} {'eval_s':>7}", flush=True)
    done = set()
    if args.jsonl and os.path.exists(args.jsonl):   # resume: points already measured are skipped
        with open(args.jsonl) as f:
            done = {_point_key(json.loads(line)) for line in f if line.strip()}
    for pt in points:
        if _point_key(pt) in done:
            print(f"skip (done): {pt}", flush=True)
            continue
        method, s = pt.pop("method"), pt.pop("sparsity")
        opts = pt.pop("options", {}) or {}
        r = run_point(wb, method, s, **pt, **opts)
        print(f"{method:<10} {s:>5.2f} {str(r.rank):>5} {r.ppl:>8.2f} {100 * (r.ppl / r.dense_ppl - 1):>7.1f} "
              f"{r.mlp_sparsity:>7.3f} {r.mean_recall:>7.3f} {r.mean_auc:>6.3f} {r.fit_s:>7.1f} {r.eval_s:>7.1f} "
              f"{r.allocation} attn={r.attn_sparsity} head_sp={r.head_sparsity:.3f} "
              f"in_sp={r.input_sparsity:.3f} w_skip={r.weight_skipped:.3f} pred/ffn={r.predictor_frac_ffn:.3f} "
              f"{json.dumps(r.options)}",
              flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
