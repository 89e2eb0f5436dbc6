"""GPU benchmark of the input-sparse (TEAL/WINA) column-sparse GEMV against dense cuBLAS.

    python -m benchmarks.input_sparse [--quick] [--json NAME] [--dtypes fp16,bf16] [--batches 1,2,4]
                                      [--tune] [--use-tuned] [--config JSON] [--determinism N] [--smoke]
                                      [--per-channel] [--paths mask,local,tile] [--tune-paths local|tile]
                                      [--proj NAMES] [--sparsities S,...] [--peer FILE[:FUNCTION]]

Every projection of Llama-2-7B and Llama-3-8B at batch 1/2/4: gate/up [in=d, out=D], down [in=D, out=d], q/o
(and Llama-2's k/v) [d, d], Llama-3's GQA k/v [d, 1024], and the fused QKV (one x, three output segments,
one threshold each; --per-channel also times each sparse point with that threshold given once per input channel,
as WINA runs). x is random normal; the threshold sits at the s-quantile of max_b |x[b, i]|, so s is the
fraction of w_t rows skipped (the union over the batch; at batch 1 the input sparsity itself); the per-token
sparsity is recorded too. Each point runs over L distinct weight copies (more bytes than the 60 MB L2), one
CUDA graph of L calls, replayed and timed with CUDA events (benchmarks.harness); µs per call = replay / L.
Dense baseline: F.linear on the usual [out, in] weight (cuBLAS). Bytes: the w_t rows actually needed
((1 - s) * in * out * elt) plus x and y; % of a measured device-to-device copy bandwidth.

--tune times a grid of launch configs on the batch-1 fp16 Llama-2 shapes at s = 0.5 and 0.7 and reports each
config's geometric-mean time over the per-point best; --use-tuned runs the benchmark with the winner (else the
frozen kernels.configs.INPUT_SPARSE). --determinism N checks N repeated calls are bit-identical.
--paths: the op's paths timed side by side at every sparse point (interleaved in one run): "mask" (the
masked-load kernel: w_t rows masked in the load, no compaction), "local" (each program compacts its own K
slice, then reads and multiplies only those rows; one launch), "tile" (the batch-1 tile kernel), "dense" (cuBLAS
on the masked x) and "auto" (the op's own choice, kernels.configs). --tune-paths local (or tile) times a grid of that
path's launch configs the same way (--use-tuned then uses its winner; for tile, the winner of each projection kind,
kernels.configs.tile_kind).
--smoke: CPU + Triton interpreter, tiny shapes (a check of this script). Imports only torch/triton/stdlib.
--proj: only these projections ("gate_up", "llama3-8b:k_v", ...); --sparsities: the sparse points.

--peer FILE[:FUNCTION] times another project's kernel, loaded from the file the user fetched (FUNCTION defaults to
``splitk_sparse_gemv``, TEAL's ``kernels/sparse_gemv.py``), beside ours and cuBLAS on the same weights, inputs and
thresholds, interleaved point by point, batch 1, fp16 only (that kernel adds fp16 atomics). The adapter
(``Peer``): TEAL's call is ``fn(x [1, 1, in], weight [out, in] column-major, threshold float, sparsity_bin)``, so
it gets ``x.view(1, 1, in)``, ``w_t.t()`` (our [in, out] row-major buffer seen as its column-major weight), the
threshold as a float (read once before timing) and ``sparsity_bin = round(100 s)`` (only its autotune key: one
tune per shape and sparsity, run eagerly before the graph is captured). The fused QKV runs as one call over all
out columns (the benchmark gives every segment the same threshold). Imports the file needs from its own
repository and does not use for that call (TEAL's ``compile_wrapper``, for its torch.compile wrappers) are
satisfied by an empty stand-in module. Its kernel zeroes y in an autotune pre_hook, a host call before each
launch: inside the graph that zero_ is captured as a memset, and the error column (read from the graph's own
output after the timed replays, like every variant's) shows it happened -- without it the atomics would pile up
over the replays. Its last column block reads past a row's end (only rows are masked), so each weight copy is
allocated with slack after it, as in a packed model buffer.
Every sparse row carries ``rel_err`` = ||y - ref|| / ||ref|| against the masked product in fp64 (cuBLAS: run on
the masked x).

Feeds: BENCHMARKS.md, "GPU kernels against cuBLAS and TEAL's kernel (one H200)".
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

MODELS = {  # d, D, q width, kv width
    "llama2-7b": (4096, 11008, 4096, 4096),
    "llama3-8b": (4096, 14336, 4096, 1024),
}
SPARSITIES = [0.0, 0.25, 0.4, 0.5, 0.7, 0.9]
SLACK = 4096  # elements allocated after each weight copy (a peer kernel's last column block reads past a row)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIN_BYTES = 1.2e9  # weight bytes per timed point (L copies): 20x the L2
SMOKE = False


def log(*a):
    print(*a, flush=True)


def projections(model, only=None):
    """(name, in, out, segment sizes or None); ``only``: names, bare or "model:name", to keep."""
    d, D, q, kv = MODELS[model]
    # gate_up: one of gate and up; gate|up: both in one launch sharing the mask (the decode runtime's)
    out = [("gate_up", d, D, None), ("gate|up", d, 2 * D, (D, D)), ("down", D, d, None)]
    out.append(("q_k_v_o" if kv == d else "q_o", d, d, None))
    if kv != d:
        out.append(("k_v", d, kv, None))
    out.append(("qkv_fused", d, q + 2 * kv, (q, kv, kv)))
    if only:
        out = [p for p in out if p[0] in only or f"{model}:{p[0]}" in only]
    return out


class Weights:
    """L copies of one projection: w_t [in, out] (sparse layout, each with SLACK elements after it) and
    W [out, in] (dense cuBLAS layout)."""

    def __init__(self, k, n, dtype, dev, n_layers=None):
        elt = torch.tensor([], dtype=dtype).element_size()
        self.L = n_layers or max(2, math.ceil(MIN_BYTES / (k * n * elt)))
        self.w_t = [(torch.randn(k * n + SLACK, device=dev, dtype=dtype) * k**-0.5)[:k * n].view(k, n)
                    for _ in range(self.L)]
        self.w = [w.t().contiguous() for w in self.w_t]
        self.elt = elt


def _stand_in(name):
    """An empty module for an import a peer file makes and the timed call does not use; any attribute is a
    fresh empty class (TEAL subclasses one)."""
    mod = types.ModuleType(name)

    def attr_of(attr):
        if attr.startswith("__"):              # module protocol (__file__, __path__, ...): a plain module's answer
            raise AttributeError(attr)
        return type(attr, (), {})

    mod.__getattr__ = attr_of
    return mod


@dataclass
class Peer:
    """Another project's input-sparse GEMV, adapted to ``call(x [1, in], w_t [in, out], threshold float, s)``
    -> y [1, out] (see the module docstring for TEAL's convention)."""

    name: str
    fn: Callable

    @classmethod
    def load(cls, spec):
        """``FILE[:FUNCTION]``: import FILE by path (stand-ins for missing imports of its repository)."""
        path, _, func = spec.partition(":")
        func = func or "splitk_sparse_gemv"
        stand_ins = []
        for _ in range(8):
            mspec = importlib.util.spec_from_file_location(f"peer_{Path(path).stem}", path)
            if mspec is None:
                raise FileNotFoundError(path)
            mod = importlib.util.module_from_spec(mspec)
            try:
                mspec.loader.exec_module(mod)
                break
            except ModuleNotFoundError as e:
                if not e.name or e.name in sys.modules:
                    raise
                sys.modules[e.name] = _stand_in(e.name)
                stand_ins.append(e.name)
        for name in stand_ins:                 # the peer module holds what it imported; nothing else sees them
            sys.modules.pop(name, None)
        return cls(name=f"{Path(path).stem}:{func}", fn=getattr(mod, func))

    def tuned(self):
        """The peer's autotuner choices so far ({autotuner: {key: config}}), where its kernels autotune."""
        out = {}
        for name, obj in getattr(self.fn, "__globals__", {}).items():
            cache = getattr(obj, "cache", None)
            if isinstance(cache, dict) and hasattr(obj, "configs"):
                out[name] = {str(k): str(v) for k, v in cache.items()}
        return out

    def call(self, x, w_t, threshold, s):
        return self.fn(x.view(1, 1, -1), w_t.t(), float(threshold), int(round(100 * s))).view(1, -1)


def make_x(batch, k, s, dtype, dev, gen):
    """x [batch, k] and the threshold (0-d fp32 device tensor) at the s-quantile of max_b |x[b, i]|."""
    x = torch.randn(batch, k, generator=gen).to(dtype).to(dev)
    if s <= 0:
        return x, torch.tensor(-1.0, device=dev)  # every channel active
    m = x.float().abs().amax(dim=0)
    t = torch.sort(m).values[min(k - 1, max(0, int(round(s * k)) - 1))]
    return x, t.to(dev).reshape(())


def needed_bytes(x, thr_list, sizes, k, elt):
    """Bytes of the w_t rows that must be read (per segment: rows active for some token) + x + y."""
    tot = 0
    for t, n in zip(thr_list, sizes):
        rows = int((x.float().abs() > t).any(dim=0).sum())
        tot += rows * n * elt
    return tot + x.numel() * elt + x.shape[0] * sum(sizes) * elt


def point_fn(op, W, x, thr, sizes, cfg, per_channel=False, peer=None, s=0.0, hold=None):
    """One replay's calls: dense F.linear over the L copies ("dense"), x @ w_t through cuBLAS ("dense_wt"),
    the peer's kernel ("peer"), or the input-sparse op. ``per_channel``: the same threshold passed as one per
    input channel ([nseg, in], as WINA runs): same rows read, plus the threshold loads. ``hold["y"]``: the
    output for the first copy (inside a captured graph: the graph's own output tensor)."""
    from kernels import input_sparse_triton as IS

    hold = {} if hold is None else hold
    if per_channel:
        thr = thr.float().reshape(1, 1).expand(len(sizes or (0,)), x.shape[1]).contiguous()
        if sizes is None:
            thr = thr[0]
    if op == "dense":
        def one(w):
            return F.linear(x, w)
        ws = W.w
    elif op == "dense_wt":
        def one(w):
            return x @ w
        ws = W.w_t
    elif op == "peer":
        t = float(thr)

        def one(w):
            return peer.call(x, w, t, s)
        ws = W.w_t
    elif sizes is None:
        def one(w):
            return IS.input_sparse_linear(x, w, thr, config=cfg)
        ws = W.w_t
    else:
        ths = thr if per_channel else (torch.stack([thr] * len(sizes)) if isinstance(thr, torch.Tensor)
                                        else [thr] * len(sizes))

        def one(w):
            return IS.input_sparse_linear_segments(x, w, ths, sizes, config=cfg)
        ws = W.w_t

    def fn():
        hold["y"] = one(ws[0])
        for w in ws[1:]:
            one(w)
    return fn


def masked_ref(x, thr, w_t):
    """The masked product in fp64 (x's entries with |x| <= thr zeroed), and that masked x in x's dtype."""
    xm = torch.where(x.float().abs() > thr, x, torch.zeros_like(x))
    return xm.double() @ w_t.double(), xm


def rel_err(y, ref):
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
def tune_candidates(batch):
    """Register-prefetched tensor-core (mma) configs with 16..64 weight elements per thread and tile, at 2 and 4
    programs per SM (ticket reduce), plus the best CUDA-core FMA and cp.async-pipelined dot configs of earlier
    tunes (kernels/NOTES.md)."""
    base = dict(reduce="ticket", dot=False, num_stages=1)
    c = []
    for bn in (64, 128, 256):
        for bk in (32, 64):
            for nw in (4, 8):
                if not 16 <= bk * bn // (32 * nw) <= 64:
                    continue
                for pps in (2, 4):
                    c.append(dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, progs_per_sm=pps, mma=True))
    fma = {1: [(64, 16, 4, 8), (64, 32, 8, 4), (128, 32, 4, 4)], 2: [(128, 16, 4, 4), (64, 32, 4, 4)],
           4: [(64, 16, 4, 4), (128, 16, 4, 4)]}[batch]
    for bn, bk, nw, pps in fma:
        c.append(dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, progs_per_sm=pps))
    c.append(dict(c[0], reduce="kernel"))
    c.append(dict(BLOCK_N=128, BLOCK_K=64, num_stages=5, progs_per_sm=2, num_warps=4, reduce="ticket", dot=True))
    return c


def local_candidates(batch):
    """The in-program compaction's launch configs (channels per K slice, column block, rows per step, warps)."""
    c = []
    for per in (256, 512, 1024, 2048):
        for bn in (128, 256):
            for br in (16, 32, 64):
                for nw in (4, 8):
                    if not 16 <= br * bn // (32 * nw) <= 128:
                        continue
                    c.append(dict(path="local", per=per, BLOCK_N=bn, BLOCK_R=br, num_warps=nw))
    return c


def tile_candidates(batch):
    """The tile kernel's launch configs. Compacted rows (compact=1): (channels per slice, BLOCK_N, BLOCK_R,
    warps, steps in flight, a scratch row per program); masked tiles (compact=0): (BLOCK_M, TILES, BLOCK_N,
    warps, reduce); the partials summed by the ticket or by a reduce launch."""
    c = []
    for ks, bn, br, nw, depth, private in ((1024, 128, 32, 4, 2, False), (1024, 128, 32, 4, 2, True),
                                           (512, 128, 32, 4, 1, False), (512, 128, 32, 4, 1, True),
                                           (512, 256, 32, 4, 1, True), (512, 256, 16, 4, 2, True),
                                           (1024, 256, 32, 8, 2, True), (1024, 128, 64, 4, 1, True),
                                           (4096, 32, 128, 4, 2, True), (4096, 64, 64, 4, 2, True),
                                           (4096, 32, 256, 8, 2, True), (2048, 64, 64, 4, 2, True),
                                           (256, 128, 32, 4, 2, True), (512, 64, 64, 4, 2, True)):
        c.append(dict(path="tile", compact=1.0, BLOCK_M=ks, TILES=1, BLOCK_N=bn, BLOCK_R=br, num_warps=nw,
                      depth=depth, order="col", private=private))
    c.append(dict(c[4], order="split"))
    for bm, tiles, bn, nw in ((128, 1, 128, 4), (64, 1, 256, 4), (128, 1, 256, 4), (64, 2, 128, 4), (32, 8, 128, 4),
                              (128, 1, 64, 4), (64, 1, 128, 2), (16, 1, 256, 4)):
        for red in ("kernel", "ticket"):
            c.append(dict(path="tile", compact=0.0, BLOCK_M=bm, TILES=tiles, BLOCK_N=bn, num_warps=nw,
                          order="col", reduce=red))
    return c


def adopt_tile_kinds(table):
    """Per projection kind (configs.tile_kind), the tuned tile config with the best geometric-mean time over
    that kind's points, written into configs.INPUT_SPARSE_TILE for this run -> {kind: config}."""
    from kernels import configs as C

    by_kind = {}
    for row in table:
        for key, t in row["times"].items():
            model, name = key.split("@")[0].split(":")
            k, n = next((k, n) for nm, k, n, _ in projections(model) if nm == name)
            by_kind.setdefault(C.tile_kind(k, n), {}).setdefault(json.dumps(row["config"], sort_keys=True), []).append(t)
    won = {}
    for kind, cands in by_kind.items():
        best = min(cands, key=lambda c: sum(math.log(max(t, 1e-9)) for t in cands[c]) / len(cands[c]))
        cfg = {kk: v for kk, v in json.loads(best).items() if kk != "path"}
        C.INPUT_SPARSE_TILE[kind] = cfg
        won[kind] = cfg
        log(f"tile config for {kind}: {cfg}")
    return won


CANDIDATES = {"local": local_candidates, "tile": tile_candidates}


def tune(args, copy_bw, dev, candidates=tune_candidates):
    """-> ({b_pad: best config}, table). Batch 1 by default on the Llama-2 gate/up, down and q shapes (--proj
    for others, the fused QKV and Llama-3's k/v included) at s = --tune-sparsities; batch 2 and 4 on the same
    shapes at those union sparsities (fp16)."""
    from benchmarks.harness import time_graph

    gen = torch.Generator().manual_seed(1)
    dtype = torch.float16
    pts = [(model, name, k, n, sz) for model in (args.models if args.proj else ["llama2-7b"])
           for name, k, n, sz in projections(model, args.proj) if args.proj or sz is None]
    best_cfg, table = {}, []
    for batch in args.tune_batches:
        cands = candidates(batch)
        res = {i: {} for i in range(len(cands))}
        for model, name, k, n, sizes in pts:
            W = Weights(k, n, dtype, dev)
            for s in args.tune_sparsities:
                x, thr = make_x(batch, k, s, dtype, dev, gen)
                key = f"{model}:{name}@{s}"
                for i, cfg in enumerate(cands):
                    try:
                        t = time_graph(point_fn("sparse", W, x, thr, sizes, cfg), reps=args.reps,
                                       per_replay=W.L).median
                    except Exception as e:  # noqa: BLE001 (a config that does not fit the chip: recorded)
                        log(f"  cfg {i} failed: {type(e).__name__}: {str(e)[:120]}")
                        t = math.inf
                    res[i][key] = t
                best_i = min(res, key=lambda i: res[i][key])
                log(f"tune B={batch} {key}: best {res[best_i][key]:.2f} us  {cands[best_i]}")
            del W
            torch.cuda.empty_cache()
        keys = list(res[0])
        best = {kk: min(res[i][kk] for i in res) for kk in keys}
        score = {i: math.exp(sum(math.log(res[i][kk] / best[kk]) for kk in keys) / len(keys)) for i in res}
        order = sorted(score, key=score.get)
        log(f"\nB={batch} rank  score  " + "  ".join(f"{kk:>12}" for kk in keys) + "  config")
        for i in order[:12]:
            log(f"{order.index(i):4d}  {score[i]:.3f}  " + "  ".join(f"{res[i][kk]:12.2f}" for kk in keys)
                + f"  {cands[i]}")
        best_cfg[batch] = cands[order[0]]
        table += [dict(batch=batch, config=cands[i], score=score[i], times=res[i]) for i in order]
    return best_cfg, table


def adopt(best, cfgs):
    """Tuned winners into ``cfgs`` {batch: config}: a batch uses the winner tuned at its B_PAD (or the largest
    tuned below it)."""
    from kernels import configs as C

    for b in cfgs:
        tb = [t for t in best if t <= C.b_pad(b)]
        if tb:
            cfgs[b] = dict(best[max(tb)])


VARIANT = {"mask": "input_sparse", "local": "input_sparse_local", "tile": "input_sparse_tile",
           "dense": "input_sparse_dense", "auto": "input_sparse_auto"}   # auto: the op's own choice


def bench(args, copy_bw, dev, path_cfgs):
    from benchmarks.harness import Row, time_graph

    rows = []
    gen = torch.Generator().manual_seed(2)
    for model in args.models:
        for name, k, n, sizes in projections(model, args.proj):
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                W = Weights(k, n, dtype, dev, 2 if SMOKE else None)
                segs = sizes or (n,)
                for batch in args.batches:
                    cfg = path_cfgs["mask"].get(batch)
                    x0 = torch.randn(batch, k, generator=gen).to(dtype).to(dev)
                    td = time_graph(point_fn("dense", W, x0, None, None, cfg), reps=args.reps, per_replay=W.L,
                                    device=dev)
                    dense_bytes = k * n * W.elt + x0.numel() * W.elt + batch * n * W.elt
                    shape = f"{model}:{name}[{k}x{n}]"
                    base = dict(model=model, proj=name, k=k, n=n, layers=W.L)
                    rows.append(Row.measured("input_sparse", "cublas_dense", td, nbytes=dense_bytes,
                                             copy_bw_gbps=copy_bw, shape=shape, dtype=dname, batch=batch,
                                             device=str(dev), extra=base))
                    if args.peer or "dense" in args.paths:   # x @ w_t through cuBLAS: the dense path's product
                        tw = time_graph(point_fn("dense_wt", W, x0, None, None, cfg), reps=args.reps,
                                        per_replay=W.L, device=dev)
                        rows.append(Row.measured("input_sparse", "cublas_dense_wt", tw, nbytes=dense_bytes,
                                                 copy_bw_gbps=copy_bw, shape=shape, dtype=dname, batch=batch,
                                                 device=str(dev), extra=dict(base, dense_us=round(td.median, 3))))
                        log(f"{shape:32s} {dname} B={batch} cuBLAS F.linear {td.median:8.2f} us, x @ w_t "
                            f"{tw.median:8.2f} us")
                    for s in args.sparsities:
                        x, thr = make_x(batch, k, s, dtype, dev, gen)
                        per_tok = float((x.float().abs() <= thr).float().mean()) if s > 0 else 0.0
                        nb = needed_bytes(x, [thr] * len(segs), segs, k, W.elt)
                        ref, xm = masked_ref(x, thr, W.w_t[0])
                        pt = dict(base, s=s, s_per_token=round(per_tok, 4), dense_us=round(td.median, 3),
                                  segments=sizes)
                        err_d = rel_err(F.linear(xm, W.w[0]), ref)
                        rows.append(Row.measured("input_sparse", "cublas_masked_x", td, nbytes=dense_bytes,
                                                 copy_bw_gbps=copy_bw, shape=shape, dtype=dname, batch=batch,
                                                 device=str(dev), extra=dict(pt, rel_err=err_d)))
                        variants = [(path, path_cfgs[path].get(batch)) for path in args.paths]
                        if args.peer and batch == 1 and dtype == torch.float16:
                            variants.append(("peer", None))
                        for path, pc in variants:
                            hold = {}
                            if path == "peer":
                                f = point_fn("peer", W, x, thr, sizes, None, peer=args.peer, s=s, hold=hold)
                            else:
                                f = point_fn("sparse", W, x, thr, sizes, pc, hold=hold)
                            ts = time_graph(f, reps=args.reps, per_replay=W.L, device=dev)
                            err = rel_err(hold["y"], ref)
                            if path == "peer":
                                pc = args.peer.tuned()
                            r = Row.measured("input_sparse", VARIANT.get(path, "peer"), ts, nbytes=nb,
                                             copy_bw_gbps=copy_bw, shape=shape, dtype=dname, batch=batch,
                                             device=str(dev),
                                             extra=dict(pt, path=path, x_cublas=round(td.median / ts.median, 3),
                                                        rel_err=err, config=pc,
                                                        **({"peer": args.peer.name} if path == "peer" else {})))
                            rows.append(r)
                            log(f"{shape:32s} {dname} B={batch} s={s:.2f} {path:6s}: {ts.median:8.2f} us"
                                f"  dense {td.median:8.2f}  x{td.median / ts.median:5.2f}"
                                f"  {100 * (r.frac_copy_bw or 0):5.1f}% copy BW  err {err:.2e}")
                        if args.per_channel:
                            tp = time_graph(point_fn("sparse", W, x, thr, sizes, cfg, per_channel=True),
                                            reps=args.reps, per_replay=W.L, device=dev)
                            rows.append(Row.measured(
                                "input_sparse", "input_sparse_per_channel", tp, nbytes=nb, copy_bw_gbps=copy_bw,
                                shape=shape, dtype=dname, batch=batch, device=str(dev),
                                extra=dict(model=model, proj=name, k=k, n=n, s=s, layers=W.L,
                                           dense_us=round(td.median, 3), scalar_us=round(ts.median, 3),
                                           x_cublas=round(td.median / tp.median, 3), segments=sizes, config=cfg)))
                            log(f"{'':32s} per-channel thresholds: {tp.median:8.2f} us"
                                f"  ({tp.median / ts.median:5.3f} of one threshold)")
                del W
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def determinism(n_runs, dev, cfgs):
    """n_runs repeated calls per case; every output must equal the first bit for bit."""
    from kernels import input_sparse_triton as IS

    gen = torch.Generator().manual_seed(3)
    out = []
    for model in ("llama2-7b",):
        for name, k, n, sizes in projections(model):
            for dname, dtype in DTYPES.items():
                w_t = (torch.randn(k, n, generator=gen) * k**-0.5).to(dtype).to(dev)
                for batch in (1, 4):
                    x, thr = make_x(batch, k, 0.5, dtype, dev, gen)
                    for tag, by_batch in cfgs.items():
                        cfg = by_batch.get(batch)
                        if sizes is None:
                            f = lambda: IS.input_sparse_linear(x, w_t, thr, config=cfg)  # noqa: E731
                        else:
                            ths = torch.stack([thr] * len(sizes))
                            f = lambda: IS.input_sparse_linear_segments(x, w_t, ths, sizes, config=cfg)  # noqa: E731
                        first = f()
                        same = sum(bool(torch.equal(f(), first)) for _ in range(n_runs - 1)) + 1
                        out.append(dict(proj=name, dtype=dname, batch=batch, config=tag, runs=n_runs, identical=same))
                        log(f"determinism {name} {dname} B={batch} {tag}: {same}/{n_runs} bit-identical")
    return out


def main(argv=None):
    global SMOKE, MIN_BYTES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1, fp16, s in {0, .5, .7}")
    ap.add_argument("--json", default=None, help="result file name under benchmarks/results/ (or a path)")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-batches", default="1,2,4")
    ap.add_argument("--use-tuned", action="store_true", help="benchmark with the --tune winner")
    ap.add_argument("--config", default=None, help="JSON launch-config override for the benchmark")
    ap.add_argument("--determinism", type=int, default=0)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--per-channel", action="store_true",
                    help="also time every sparse point with one threshold per input channel (WINA's form)")
    ap.add_argument("--paths", default="mask,local,tile", help="the op's paths timed side by side")
    ap.add_argument("--tune-paths", default="", help="paths whose launch configs to tune (local, tile)")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    ap.add_argument("--proj", default="", help="only these projections (gate_up, llama3-8b:k_v, ...)")
    ap.add_argument("--sparsities", default="", help="the sparse points (default 0,.25,.4,.5,.7,.9)")
    ap.add_argument("--tune-sparsities", default="0.5,0.7")
    ap.add_argument("--peer", default=None, help="FILE[:FUNCTION]: another project's kernel timed beside ours")
    args = ap.parse_args(argv)
    try:
        args.dtypes = [d for d in args.dtypes.split(",") if d]
        args.batches = [int(b) for b in args.batches.split(",") if b]
        args.models = [m for m in args.models.split(",") if m]
        args.tune_batches = [int(b) for b in args.tune_batches.split(",") if b]
        args.paths = [p for p in args.paths.split(",") if p]
        args.tune_paths = [p for p in args.tune_paths.split(",") if p]
        args.proj = {p for p in args.proj.split(",") if p}
        args.tune_sparsities = [float(v) for v in args.tune_sparsities.split(",") if v]
        sparsities = [float(v) for v in args.sparsities.split(",") if v]
        bad = ([d for d in args.dtypes if d not in DTYPES] + [m for m in args.models if m not in MODELS]
               + [p for p in args.paths if p not in VARIANT] + [p for p in args.tune_paths if p not in CANDIDATES])
        if bad or not all(1 <= b <= 8 for b in args.batches):
            raise ValueError(f"unknown dtypes/models/paths {bad} or batch outside 1..8")
        override = json.loads(args.config) if args.config else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.sparsities = sparsities or ([0.0, 0.5, 0.7] if args.quick else SPARSITIES)
    if args.quick:
        args.dtypes, args.batches = ["fp16"], [1]
    if args.smoke:
        SMOKE = True
        os.environ.setdefault("TRITON_INTERPRET", "1")
        for m in list(MODELS):
            MODELS[m] = tuple(max(16, v // 64) for v in MODELS[m])
        MIN_BYTES = 0
        args.reps = 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
    if dev.type != "cuda" and not SMOKE:
        print("error: no CUDA device (use --smoke for the CPU check)", file=sys.stderr)
        return 2
    from benchmarks.harness import command_line, copy_bandwidth, device_line, write_results
    from kernels import configs as C

    if args.peer:
        args.peer = Peer.load(args.peer)

    log(device_line(str(dev)))
    copy_bw = copy_bandwidth(device=str(dev)) if dev.type == "cuda" else None
    log(f"copy bandwidth: {copy_bw} GB/s")
    sections = {}
    cfgs = {b: dict(C.INPUT_SPARSE.get(C.b_pad(b), C.INPUT_SPARSE[max(C.INPUT_SPARSE)]), path="mask")
            for b in range(1, 9)}
    if override:
        cfgs = {b: dict(c, **override) for b, c in cfgs.items()}
    if args.tune and dev.type == "cuda":
        best, table = tune(args, copy_bw, dev)
        sections["tune"] = table
        log(f"tuned best: {best}")
        if args.use_tuned:
            adopt(best, cfgs)
    path_cfgs = {"mask": cfgs, "dense": {b: dict(path="dense") for b in cfgs}, "auto": {b: None for b in cfgs}}
    for path in CANDIDATES:
        path_cfgs[path] = {b: dict(path=path) for b in cfgs}   # the frozen config for each shape
        if path in args.tune_paths and dev.type == "cuda":
            best_p, table_p = tune(args, copy_bw, dev, candidates=CANDIDATES[path])
            sections[f"tune_{path}"] = table_p
            log(f"tuned {path} best: {best_p}")
            if args.use_tuned and path == "tile":
                sections["tile_kinds"] = adopt_tile_kinds(table_p)
            elif args.use_tuned:
                adopt(best_p, path_cfgs[path])
    if args.determinism:
        det = {"used": cfgs, "local": path_cfgs["local"], "tile": path_cfgs["tile"],
               "split_ticket": {b: dict(c, progs_per_sm=4, reduce="ticket") for b, c in cfgs.items()},
               "split_kernel": {b: dict(c, progs_per_sm=4, reduce="kernel") for b, c in cfgs.items()}}
        sections["determinism"] = determinism(args.determinism, dev, det)
    rows = [] if args.no_bench else bench(args, copy_bw, dev, path_cfgs)
    if rows:
        summary(rows)
    name = args.json or f"h200_input_sparse_{_dt.date.today().isoformat()}.json"
    if not SMOKE or args.json:
        path = write_results(name, rows, command=command_line("benchmarks.input_sparse"), device=str(dev),
                             meta=dict(copy_bw_gbps=copy_bw, configs={b: cfgs[b] for b in args.batches},
                                       peer=args.peer.name if args.peer else None,
                                       path_configs={p: {b: c[b] for b in args.batches} for p, c in path_cfgs.items()},
                                       min_bytes=MIN_BYTES), sections=sections)
        log(f"wrote {path}")
    return 0


def summary(rows):
    """One line per (shape, dtype, batch, s): cuBLAS and every variant's µs (rel err), the fastest of ours
    against cuBLAS and against the peer."""
    pts, order = {}, []
    for r in rows:
        if r.op == "cublas_dense" or "s" not in r.extra:
            continue
        key = (r.shape, r.dtype, r.batch, r.extra["s"])
        if key not in pts:
            pts[key] = {"cublas": r.extra["dense_us"]}
            order.append(key)
        if r.op != "cublas_masked_x":
            pts[key][r.extra["path"]] = (r.median, r.extra.get("rel_err"))
    log("\nshape                           dtype B    s  cuBLAS  " + "  ".join(f"{v:>17s}" for v in (*VARIANT, "peer"))
        + "  best/cuBLAS  peer/best")
    for key in order:
        p = pts[key]
        ours = [p[v][0] for v in VARIANT if v in p]
        best = min(ours) if ours else math.nan
        cells = "  ".join((f"{p[v][0]:7.2f} ({p[v][1]:.0e})" if v in p else f"{'-':>17s}") for v in (*VARIANT, "peer"))
        log(f"{key[0]:31s} {key[1]:4s} {key[2]} {key[3]:4.2f} {p['cublas']:7.2f}  {cells}  {p['cublas'] / best:11.2f}"
            f"  {(p['peer'][0] / best if 'peer' in p else math.nan):9.2f}")


if __name__ == "__main__":
    sys.exit(main())
