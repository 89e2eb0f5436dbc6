"""GPU benchmark of the input-sparse (TEAL/WINA) column-sparse GEMV against dense cuBLAS.

    python -m benchmarks.input_sparse [--quick] [--json NAME] [--dtypes fp16,bf16] [--batches 1,2,4]
                                      [--tune] [--use-tuned] [--config JSON] [--determinism N] [--smoke]
                                      [--per-channel] [--paths mask,local] [--tune-paths local]

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
--paths: the kernel paths timed side by side at every sparse point (interleaved in one run): "mask" (the
masked-load kernel: w_t rows masked in the load, no compaction) and "local" (each program compacts its own K
slice, then reads and multiplies only those rows; one launch). --tune-paths local times a grid of the local
path's launch configs the same way (--use-tuned then uses its winner).
--smoke: CPU + Triton interpreter, tiny shapes (a check of this script). Imports only torch/triton/stdlib.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

MODELS = {  # d, D, q width, kv width
    "llama2-7b": (4096, 11008, 4096, 4096),
    "llama3-8b": (4096, 14336, 4096, 1024),
}
SPARSITIES = [0.0, 0.25, 0.4, 0.5, 0.7, 0.9]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIN_BYTES = 1.2e9  # weight bytes per timed point (L copies): 20x the L2
SMOKE = False


def log(*a):
    print(*a, flush=True)


def projections(model):
    """(name, in, out, segment sizes or None)."""
    d, D, q, kv = MODELS[model]
    out = [("gate_up", d, D, None), ("down", D, d, None)]
    out.append(("q_k_v_o" if kv == d else "q_o", d, d, None))
    if kv != d:
        out.append(("k_v", d, kv, None))
    out.append(("qkv_fused", d, q + 2 * kv, (q, kv, kv)))
    return out


class Weights:
    """L copies of one projection: w_t [in, out] (sparse layout) and W [out, in] (dense cuBLAS layout)."""

    def __init__(self, k, n, dtype, dev, n_layers=None):
        elt = torch.tensor([], dtype=dtype).element_size()
        self.L = n_layers or max(2, math.ceil(MIN_BYTES / (k * n * elt)))
        self.w_t = [(torch.randn(k, n, device=dev, dtype=dtype) * k**-0.5) for _ in range(self.L)]
        self.w = [w.t().contiguous() for w in self.w_t]
        self.elt = elt


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


def point_fn(op, W, x, thr, sizes, cfg, per_channel=False):
    """One replay's calls: dense F.linear over the L copies, or the input-sparse op. ``per_channel``: the same
    threshold passed as one per input channel ([nseg, in], as WINA runs): same rows read, plus the threshold
    loads."""
    from kernels import input_sparse_triton as IS

    if per_channel:
        thr = thr.float().reshape(1, 1).expand(len(sizes or (0,)), x.shape[1]).contiguous()
        if sizes is None:
            thr = thr[0]
    if op == "dense":
        def fn():
            for w in W.w:
                F.linear(x, w)
    elif sizes is None:
        def fn():
            for w in W.w_t:
                IS.input_sparse_linear(x, w, thr, config=cfg)
    else:
        ths = thr if per_channel else (torch.stack([thr] * len(sizes)) if isinstance(thr, torch.Tensor)
                                        else [thr] * len(sizes))

        def fn():
            for w in W.w_t:
                IS.input_sparse_linear_segments(x, w, ths, sizes, config=cfg)
    return fn


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


CANDIDATES = {"local": local_candidates}


def tune(args, copy_bw, dev, candidates=tune_candidates):
    """-> ({b_pad: best config}, table). Batch 1 on the Llama-2 gate/up, down and q shapes at s = .5/.7;
    batch 2 and 4 on the same shapes at union s = .5/.7 (fp16)."""
    from benchmarks.harness import time_graph

    gen = torch.Generator().manual_seed(1)
    dtype = torch.float16
    pts = [(name, k, n) for name, k, n, sz in projections("llama2-7b") if sz is None]
    best_cfg, table = {}, []
    for batch in args.tune_batches:
        cands = candidates(batch)
        res = {i: {} for i in range(len(cands))}
        for name, k, n in pts:
            W = Weights(k, n, dtype, dev)
            for s in (0.5, 0.7):
                x, thr = make_x(batch, k, s, dtype, dev, gen)
                for i, cfg in enumerate(cands):
                    try:
                        t = time_graph(point_fn("sparse", W, x, thr, None, cfg), reps=args.reps,
                                       per_replay=W.L).median
                    except Exception as e:  # noqa: BLE001 (a config that does not fit the chip: recorded)
                        log(f"  cfg {i} failed: {type(e).__name__}: {str(e)[:120]}")
                        t = math.inf
                    res[i][f"{name}@{s}"] = t
                log(f"tune B={batch} {name} s={s}: best {min(res[i][f'{name}@{s}'] for i in res):.2f} us")
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


VARIANT = {"mask": "input_sparse", "local": "input_sparse_local"}


def bench(args, copy_bw, dev, path_cfgs):
    from benchmarks.harness import Row, time_graph

    rows = []
    gen = torch.Generator().manual_seed(2)
    for model in args.models:
        for name, k, n, sizes in projections(model):
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
                    rows.append(Row.measured("input_sparse", "cublas_dense", td, nbytes=dense_bytes,
                                             copy_bw_gbps=copy_bw, shape=shape, dtype=dname, batch=batch,
                                             device=str(dev), extra=dict(model=model, proj=name, k=k, n=n,
                                                                         layers=W.L)))
                    for s in args.sparsities:
                        x, thr = make_x(batch, k, s, dtype, dev, gen)
                        per_tok = float((x.float().abs() <= thr).float().mean()) if s > 0 else 0.0
                        nb = needed_bytes(x, [thr] * len(segs), segs, k, W.elt)
                        for path in args.paths:
                            pc = path_cfgs[path].get(batch)
                            ts = time_graph(point_fn("sparse", W, x, thr, sizes, pc), reps=args.reps,
                                            per_replay=W.L, device=dev)
                            r = Row.measured("input_sparse", VARIANT[path], ts, nbytes=nb, copy_bw_gbps=copy_bw,
                                             shape=shape, dtype=dname, batch=batch, device=str(dev),
                                             extra=dict(model=model, proj=name, k=k, n=n, s=s, path=path,
                                                        s_per_token=round(per_tok, 4), layers=W.L,
                                                        dense_us=round(td.median, 3),
                                                        x_cublas=round(td.median / ts.median, 3), segments=sizes,
                                                        config=pc))
                            rows.append(r)
                            log(f"{shape:32s} {dname} B={batch} s={s:.2f} {path:6s}: {ts.median:8.2f} us"
                                f"  dense {td.median:8.2f}  x{td.median / ts.median:5.2f}"
                                f"  {100 * (r.frac_copy_bw or 0):5.1f}% copy BW")
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
                            ths = torch.stack([thr] * 3)
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
    ap.add_argument("--paths", default="mask,local", help="kernel paths timed side by side")
    ap.add_argument("--tune-paths", default="", help="paths whose launch configs to tune (local)")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = ap.parse_args(argv)
    try:
        args.dtypes = [d for d in args.dtypes.split(",") if d]
        args.batches = [int(b) for b in args.batches.split(",") if b]
        args.models = [m for m in args.models.split(",") if m]
        args.tune_batches = [int(b) for b in args.tune_batches.split(",") if b]
        args.paths = [p for p in args.paths.split(",") if p]
        args.tune_paths = [p for p in args.tune_paths.split(",") if p]
        bad = ([d for d in args.dtypes if d not in DTYPES] + [m for m in args.models if m not in MODELS]
               + [p for p in args.paths if p not in VARIANT] + [p for p in args.tune_paths if p not in CANDIDATES])
        if bad or not all(1 <= b <= 8 for b in args.batches):
            raise ValueError(f"unknown dtypes/models/paths {bad} or batch outside 1..8")
        override = json.loads(args.config) if args.config else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.sparsities = [0.0, 0.5, 0.7] if args.quick else SPARSITIES
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
    from benchmarks.harness import command_line, copy_bandwidth, write_results
    from kernels import configs as C

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
    path_cfgs = {"mask": cfgs}
    for path in CANDIDATES:
        path_cfgs[path] = {b: dict(path=path) for b in cfgs}   # the frozen config for each shape
        if path in args.tune_paths and dev.type == "cuda":
            best_p, table_p = tune(args, copy_bw, dev, candidates=CANDIDATES[path])
            sections[f"tune_{path}"] = table_p
            log(f"tuned {path} best: {best_p}")
            if args.use_tuned:
                adopt(best_p, path_cfgs[path])
    if args.determinism:
        det = {"used": cfgs, "local": path_cfgs["local"],
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
                                       path_configs={p: {b: c[b] for b in args.batches} for p, c in path_cfgs.items()},
                                       min_bytes=MIN_BYTES), sections=sections)
        log(f"wrote {path}")
    return 0


def summary(rows):
    log("\nproj                          dtype B     s  path        us   dense   x cuBLAS  %copyBW")
    for r in rows:
        if r.op not in VARIANT.values():
            continue
        e = r.extra
        log(f"{r.shape:30s} {r.dtype:4s} {r.batch} {e['s']:5.2f} {e['path']:6s} {r.median:7.2f} {e['dense_us']:7.2f}"
            f"  {e['x_cublas']:7.2f}  {100 * (r.frac_copy_bw or 0):6.1f}")


if __name__ == "__main__":
    sys.exit(main())
