"""GPU benchmark of the sparse FFN / head-sparse attention kernels against dense cuBLAS.

    python -m benchmarks.kernels [--quick] [--json NAME] [--dtypes fp16,bf16] [--tune] [--determinism N]
    python -m benchmarks.kernels --smoke        # CPU, Triton interpreter, tiny shapes: checks the script runs

Timing (``benchmarks.harness.time_graph``): each op runs over L layers of distinct weights (so the 60 MB L2
cannot serve a repeat), captured once in a CUDA graph; the graph is replayed ``reps`` times, each replay timed
with CUDA events; per-op time = replay time / L; median, p10 and p90 over the replays. Bytes counted are the
ones the op must read (active weight rows, plus x, biases and output, which are negligible); achieved GB/s is
over that, and its fraction of the device-to-device copy bandwidth measured at start
(``benchmarks.harness.copy_bandwidth``, bytes read + written). Sparsity at batch > 1 is the sparsity of the
union of the batch's active sets (what is read). ``--json NAME`` writes ``benchmarks.harness.Row`` rows
(op = variant; d, D, sparsity, k, speedup over dense in ``extra``) to ``benchmarks/results/NAME``, which
``ctxsparse ingest-kernels`` loads into the store. Imports only torch/triton/numpy/stdlib.

Feeds: BENCHMARKS.md, "GPU kernels against cuBLAS and TEAL's kernel (one H200)".
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    Row, command_line, copy_bandwidth, device_line, device_name, time_graph, write_results,
)
from workers.decode.shapes import attn_shape, ffn_shape

# views of the one shape table (workers.decode.shapes): name -> (d, D, gated, act) / (d, heads, kv heads, head dim)
FFN_SHAPES = {n: ffn_shape(n) for n in ("llama2-7b", "llama3-8b", "mistral-7b", "qwen2-7b", "opt-6.7b")}
ATTN_SHAPES = {n: attn_shape(n) for n in ("llama2-7b", "llama3-8b")}
SPARSITIES = [0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95]
BATCHES = [1, 2, 4, 8]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
L2_BYTES = 60e6
DEV = "cuda"
SMOKE = False  # --smoke: CPU + Triton interpreter, tiny shapes, wall-clock timing (CI check of this script)


def log(*a):
    print(*a, flush=True)


def time_layers(fns, reps=30):
    """Timing (µs per op) of one CUDA graph that runs every fn in ``fns`` once (one fn per layer)."""
    return time_graph(lambda: [f() for f in fns], reps=1 if SMOKE else reps, per_replay=len(fns), device=DEV)


# ---------------------------------------------------------------------------------------------
class Layers:
    """L layers of random weights for one FFN shape, in both layouts (dense: nn.Linear layout)."""

    def __init__(self, d, D, gated, dtype, n_layers):
        self.d, self.D, self.gated, self.dtype, self.L = d, D, gated, dtype, n_layers
        s_in, s_out = d**-0.5, D**-0.5
        mk = lambda shape, sc: (torch.randn(shape, device=DEV, dtype=dtype) * sc)  # noqa: E731
        self.w1 = [mk((D, d), s_in) for _ in range(n_layers)]            # gate / fc1
        self.w2 = [mk((D, d), s_in) for _ in range(n_layers)] if gated else None  # up
        self.wdt = [mk((D, d), s_out) for _ in range(n_layers)]          # W_down^T (sparse layout)
        self.wd = [w.t().contiguous() for w in self.wdt]                 # W_down [d, D] (dense layout)
        self.b1 = None if gated else [mk((D,), 0.1) for _ in range(n_layers)]
        self.b2 = None if gated else [mk((d,), 0.1) for _ in range(n_layers)]

    def free(self):
        for k in ("w1", "w2", "wdt", "wd", "b1", "b2"):
            setattr(self, k, None)
        torch.cuda.empty_cache()


def make_sets(D, k, n_layers, gen):
    return [torch.randperm(D, generator=gen)[:k].to(torch.int32).to(DEV) for _ in range(n_layers)]


def ffn_bytes(d, k, gated, elt, batch):
    mats = 3 if gated else 2
    return mats * k * d * elt + 2 * batch * d * elt + k * 4


# ---------------------------------------------------------------------------------------------
def run_ffn(args, rows, copy_bw, accel, save=None):
    from kernels import configs as C
    from kernels import ffn_triton as T
    from kernels import npu as NP
    from kernels import ops

    gen = torch.Generator().manual_seed(0)
    shapes = args.shapes
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        elt = torch.tensor([], dtype=dtype).element_size()
        for sname in shapes:
            d, D, gated, act = FFN_SHAPES[sname]
            min_bytes = ffn_bytes(d, int(D * (1 - max(args.sparsities))), gated, elt, 1)
            n_layers = max(args.layers, math.ceil(3 * L2_BYTES / max(min_bytes, 1)))
            n_layers = 2 if SMOKE else min(n_layers, 32)
            lay = Layers(d, D, gated, dtype, n_layers)
            log(f"\n== {sname} d={d} D={D} {dname} {'gated/' + act if gated else 'fc1/' + act}, {n_layers} layers")
            for batch in args.batches:
                xs = [torch.randn((batch, d), device=DEV, dtype=dtype) for _ in range(n_layers)]
                if gated:
                    dense_fns = [(lambda i=i: F.linear(
                        F.silu(F.linear(xs[i], lay.w1[i])) * F.linear(xs[i], lay.w2[i]), lay.wd[i]))
                        for i in range(n_layers)]
                else:
                    dense_fns = [(lambda i=i: F.linear(
                        torch.relu(F.linear(xs[i], lay.w1[i], lay.b1[i])), lay.wd[i], lay.b2[i]))
                        for i in range(n_layers)]
                t_dense = time_layers(dense_fns, args.reps)
                b_dense = ffn_bytes(d, D, gated, elt, batch)
                rows.append(row(accel, sname, d, D, dname, batch, 0.0, "dense", t_dense, b_dense, copy_bw,
                                t_dense.median, D))
                log(f"  B={batch} dense {t_dense.median:8.1f} us  {b_dense / t_dense.median / 1e3:7.0f} GB/s")
                for s in args.sparsities:
                    k = max(1, int(round(D * (1 - s))))
                    sets = make_sets(D, k, n_layers, gen)
                    variants = {}
                    if gated:
                        variants["torch_index"] = [(lambda i=i: NP.sparse_ffn(
                            xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i], None, act)) for i in range(n_layers)]
                        variants["triton"] = [(lambda i=i: T.sparse_ffn(
                            xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i], None, act)) for i in range(n_layers)]
                        if not args.quick or batch == 1:
                            thr = [seq_threshold(xs[i], lay.w1[i], sets[i], act) for i in range(n_layers)]
                            variants["triton_seq50"] = [(lambda i=i: T.sparse_ffn(
                                xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i], None, act, threshold=thr[i]))
                                for i in range(n_layers)]
                            cw = [lay.wdt[i].float().norm(dim=1) for i in range(n_layers)]  # c_i = ‖W_down[:, i]‖
                            dthr = [damage_threshold(xs[i], lay.w1[i], lay.w2[i], sets[i], act, cw[i])
                                    for i in range(n_layers)]
                            variants["triton_damage50"] = [(lambda i=i: ops.damage_filter_ffn(
                                xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i], None, act, dthr[i], cw[i]))
                                for i in range(n_layers)]
                    else:
                        variants["torch_index"] = [(lambda i=i: NP.sparse_mlp(
                            xs[i], lay.w1[i], lay.b1[i], lay.wdt[i], lay.b2[i], sets[i], None, act))
                            for i in range(n_layers)]
                        variants["triton"] = [(lambda i=i: T.sparse_mlp(
                            xs[i], lay.w1[i], lay.b1[i], lay.wdt[i], lay.b2[i], sets[i], None, act))
                            for i in range(n_layers)]
                    line = []
                    for vname, fns in variants.items():
                        try:
                            t = time_layers(fns, args.reps)
                        except Exception as e:  # keep the rest of the run
                            log(f"  FAILED {sname} B={batch} s={s} {vname}: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        if vname == "triton_seq50":
                            nb = (k + 2 * (k // 2)) * d * elt + 2 * batch * d * elt + k * 8
                        elif vname == "triton_damage50":
                            nb = (2 * k + k // 2) * d * elt + 2 * batch * d * elt + k * 8
                        else:
                            nb = ffn_bytes(d, k, gated, elt, batch)
                        vn = vname
                        if vname == "triton":
                            vn = "triton_" + C.ffn_path(batch, d)
                        r = row(accel, sname, d, D, dname, batch, s, vn, t, nb, copy_bw, t_dense.median, k)
                        rows.append(r)
                        line.append(f"{vn} {r.median:7.1f}us {r.gbps:6.0f}GB/s {100 * r.frac_copy_bw:3.0f}% "
                                    f"x{r.extra['speedup_vs_dense']:4.2f}")
                    log(f"  B={batch} s={s:4.2f} k={k:5d} | " + " | ".join(line))
                    del sets
            lay.free()
            if save:  # partial results survive a later failure
                save(complete=False)


def seq_threshold(x, w_gate, idx, act):
    """Threshold that keeps about half the predicted rows (median of max_b |act(gate)|)."""
    from kernels import reference as R

    a = R.gather_gemv(x, w_gate, idx, None, act=act, out_dtype=torch.float32).abs().max(dim=0).values
    return float(a.median())


def damage_threshold(x, w_gate, w_up, idx, act, weight):
    """Damage-filter threshold that keeps about half the predicted rows (median of max_b |act(gate)·up|·c_i)."""
    from kernels import reference as R

    h = R.gated_gather_gemv(x, w_gate, w_up, idx, None, act=act, out_dtype=torch.float32)
    return float((h.abs() * weight.index_select(0, idx.long())).max(dim=0).values.median())


def row(accel, sname, d, D, dname, batch, s, variant, timing, nbytes, copy_bw, t_dense, k) -> Row:
    """One kernels row: op = the variant; extra holds what the store's ingest reads besides the Row fields
    (device_type, d, D, sparsity) and k, speedup over dense at the same batch."""
    return Row.measured("kernels", variant, timing, nbytes=nbytes, copy_bw_gbps=copy_bw, shape=sname, dtype=dname,
                        batch=batch, device=accel,
                        extra=dict(device_type=DEV, d=d, D=D, sparsity=s, k=k,
                                   speedup_vs_dense=round(t_dense / timing.median, 3)))


# ---------------------------------------------------------------------------------------------
def run_attn(args, rows, copy_bw, accel):
    from kernels import attn_triton as A

    gen = torch.Generator().manual_seed(1)
    dtype, dname = torch.float16, "fp16"
    for sname, (d, nh, nkv, hd) in ATTN_SHAPES.items():
        n_layers = 2 if SMOKE else 16
        wqkv = [torch.randn(((nh + 2 * nkv) * hd, d), device=DEV, dtype=dtype) * d**-0.5 for _ in range(n_layers)]
        wo = [torch.randn((d, nh * hd), device=DEV, dtype=dtype) * d**-0.5 for _ in range(n_layers)]
        wot = [w.t().contiguous() for w in wo]
        xs = [torch.randn((1, d), device=DEV, dtype=dtype) for _ in range(n_layers)]
        at = [torch.randn((1, nh * hd), device=DEV, dtype=dtype) for _ in range(n_layers)]
        dense = [(lambda i=i: (F.linear(xs[i], wqkv[i]), F.linear(at[i], wo[i]))) for i in range(n_layers)]
        t_dense = time_layers(dense, args.reps)
        nb_dense = ((nh + 2 * nkv) * hd + nh * hd) * d * 2
        rows.append(row(accel, sname + "-attn", d, nh, dname, 1, 0.0, "attn_dense", t_dense, nb_dense, copy_bw,
                        t_dense.median, nh))
        log(f"\n== attention projections {sname} H={nh} KV={nkv}: dense {t_dense.median:.1f} us")
        for s in (0.0, 0.5, 0.7):
            kq = int(round(nh * (1 - s)))
            qsets = [torch.randperm(nh, generator=gen)[:kq].to(torch.int32).to(DEV) for _ in range(n_layers)]

            def fn(i):
                kv_idx, kv_count, _ = A.kv_heads_for(qsets[i], None, nh, nkv)
                A.head_sparse_qkv(xs[i], wqkv[i], qsets[i], None, kv_idx, kv_count, nh, nkv, hd)
                return A.head_sparse_out(at[i][:, : kq * hd], wot[i], qsets[i], None, hd)

            t = time_layers([lambda i=i: fn(i) for i in range(n_layers)], args.reps)
            kv_act = [len(set((qsets[i] // (nh // nkv)).tolist())) for i in range(n_layers)]
            nb = (2 * kq * hd + 2 * statistics.mean(kv_act) * hd) * d * 2
            r = row(accel, sname + "-attn", d, nh, dname, 1, s, "attn_triton", t, nb, copy_bw, t_dense.median, kq)
            rows.append(r)
            log(f"  s={s:.2f} heads={kq}: {r.median:6.1f} us  {r.gbps:5.0f} GB/s  "
                f"x{r.extra['speedup_vs_dense']:4.2f} vs dense")
        del wqkv, wo, wot
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
def determinism(n_runs, accel):
    from kernels import ffn_triton as T

    d, D = (72, 200) if SMOKE else (4096, 11008)
    g = torch.Generator(device=DEV).manual_seed(3)
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        wg, wu, wdt = (torch.randn((D, d), device=DEV, dtype=dtype, generator=g) * 0.02 for _ in range(3))
        idx = torch.randperm(D, device=DEV, generator=g)[: D // 2].to(torch.int32)
        for batch in (1, 4):
            x = torch.randn((batch, d), device=DEV, dtype=dtype, generator=g)
            h = torch.randn((batch, idx.shape[0]), device=DEV, dtype=dtype, generator=g)
            ref_down = T.gather_down(h, wdt, idx)
            ref_ffn = T.sparse_ffn(x, wg, wu, wdt, idx)
            same_down = sum(torch.equal(T.gather_down(h, wdt, idx), ref_down) for _ in range(n_runs))
            same_ffn = sum(torch.equal(T.sparse_ffn(x, wg, wu, wdt, idx), ref_ffn) for _ in range(n_runs))
            key = f"{str(dtype)[6:]} B={batch}"
            out[key] = (same_down, same_ffn)
            log(f"determinism {key}: gather_down {same_down}/{n_runs} bit-identical, "
                f"sparse_ffn {same_ffn}/{n_runs} bit-identical")
    return out


# ---------------------------------------------------------------------------------------------
def tune_candidates(batch):
    """Hand-picked configs (registers checked offline: none of these spills on sm_90)."""
    cands = []
    if batch == 1:  # run 3 narrowed this to the front-runners plus fewer, larger programs (fewer partials)
        for br, nw, pps, ed, rb in ((2, 8, 2, True, None), (2, 8, 2, True, 32), (2, 8, 2, True, 64),
                                    (1, 4, 3, True, None), (1, 4, 2, True, None), (8, 4, 2, False, None),
                                    (2, 8, 1, True, None), (2, 16, 1, True, None), (4, 16, 1, True, None),
                                    (4, 16, 1, True, 64), (4, 32, 1, True, None)):
            cfg = dict(BLOCK_R=br, num_warps=nw, progs_per_sm=pps, early_down=ed)
            if rb:
                cfg["reduce_block"] = rb
            cands.append(("fused", {"fused": cfg}))
        for dbd, dbr, dsp, dw in ((128, 64, 8, 4), (128, 32, 64, 4)):
            cands.append(("down", {"down": dict(BLOCK_D=dbd, BLOCK_R=dbr, splits=dsp, num_warps=dw)}))
        for gbr, gw in ((2, 4), (4, 4)):
            cands.append(("gather", {"gather": dict(BLOCK_R=gbr, BLOCK_K=None, num_warps=gw)}))
        return cands
    if batch == 2:
        for br, nw, ed in ((2, 4, False), (4, 4, False), (1, 4, True), (1, 8, True), (2, 8, True), (2, 16, True)):
            cands.append(("fused", {"fused": dict(BLOCK_R=br, num_warps=nw, progs_per_sm=2, early_down=ed)}))
    for gbr, gbk, gw, dot in ((4, 1024, 4, False), (2, 1024, 4, False), (16, 256, 4, True), (32, 256, 4, True),
                              (64, 256, 8, True), (32, 512, 8, True), (16, 512, 4, True)):
        cands.append(("gather", {"gather": dict(BLOCK_R=gbr, BLOCK_K=gbk, num_warps=gw, dot=dot)}))
    for dbd, dbr, dsp, dw, dot in ((128, 32, 64, 4, False), (256, 16, 32, 4, False), (128, 32, 16, 4, True),
                                   (256, 32, 16, 4, True), (256, 64, 8, 8, True), (128, 32, 32, 4, True),
                                   (512, 16, 16, 4, True)):
        cands.append(("down", {"down": dict(BLOCK_D=dbd, BLOCK_R=dbr, splits=dsp, num_warps=dw, dot=dot)}))
    return cands


def tune_ops(args, copy_bw):
    """Whole-op timings at batch 1: non-gated MLP (opt-6.7b) fused vs split-with-tl.dot, and the gated FFN's
    two front-running fused configs vs split-with-tl.dot."""
    from kernels import ffn_triton as T

    gen = torch.Generator().manual_seed(5)
    dot = {"gather": dict(BLOCK_R=32, BLOCK_K=256, num_warps=4, dot=True),
           "down": dict(BLOCK_D=128, BLOCK_R=32, splits=16, num_warps=4, dot=True)}
    dot2 = {"gather": dict(BLOCK_R=64, BLOCK_K=256, num_warps=8, dot=True),
            "down": dict(BLOCK_D=128, BLOCK_R=32, splits=32, num_warps=4, dot=True)}
    res = []
    for sname in (["opt-6.7b", "llama2-7b", "llama3-8b"] if not SMOKE else ["tiny-opt", "tiny"]):
        d, D, gated, act = FFN_SHAPES[sname]
        nl = 2 if SMOKE else 16
        lay = Layers(d, D, gated, torch.float16, nl)
        xs = [torch.randn((1, d), device=DEV, dtype=torch.float16) for _ in range(nl)]
        if gated:
            cands = [("fused", {"fused": dict(BLOCK_R=1, num_warps=4, progs_per_sm=3, early_down=True)}),
                     ("fused", {"fused": dict(BLOCK_R=2, num_warps=8, progs_per_sm=2, early_down=True)}),
                     ("split", dot), ("split", dot2)]
        else:
            cands = [("fused", {"fused": dict(BLOCK_R=br, num_warps=nw, progs_per_sm=pps, early_down=True)})
                     for br, nw, pps in ((1, 4, 3), (2, 8, 2), (2, 4, 3), (4, 8, 2), (2, 8, 3), (4, 16, 2))]
            cands += [("split", dot), ("split", dot2)]
        for s in (0.3, 0.5, 0.7, 0.9):
            k = int(round(D * (1 - s)))
            sets = make_sets(D, k, nl, gen)
            line = []
            for path, cfg in cands:
                if gated:
                    fns = [(lambda i=i, p=path, c=cfg: T.sparse_ffn(xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i],
                                                                     None, act, path=p, config=c)) for i in range(nl)]
                else:
                    fns = [(lambda i=i, p=path, c=cfg: T.sparse_mlp(xs[i], lay.w1[i], lay.b1[i], lay.wdt[i], lay.b2[i],
                                                                     sets[i], None, act, path=p, config=c))
                           for i in range(nl)]
                try:
                    t = time_layers(fns, 15).median
                except Exception as e:
                    log(f"  skip {path} {cfg}: {type(e).__name__}: {str(e)[:150]}")
                    continue
                res.append(dict(shape=sname, s=s, path=path, cfg=cfg, us=t))
                line.append(f"{path}{list(cfg.values())[0] if path == 'fused' else ''} {t:.1f}")
            log(f"tune-op {sname} B=1 s={s}: " + " | ".join(line))
        lay.free()
    return res


def apply_tuned_ops(res):
    from kernels import configs as C

    for gated, shapes in ((False, ("opt-6.7b", "tiny-opt")), (True, ("llama2-7b", "llama3-8b", "tiny"))):
        rs = [r for r in res if r["shape"] in shapes]
        if not rs:
            continue
        best = {}
        for r in rs:
            key = (r["shape"], r["s"])
            best[key] = min(best.get(key, 1e30), r["us"])
        score = {}
        for r in rs:
            ck = json.dumps([r["path"], r["cfg"]], sort_keys=True)
            score.setdefault(ck, []).append(r["us"] / best[(r["shape"], r["s"])])
        full = max(map(len, score.values()))
        ck = min(score, key=lambda c: statistics.mean(score[c]) if len(score[c]) == full else 1e9)
        path, cfg = json.loads(ck)
        log(f"chosen batch-1 {'gated FFN' if gated else 'non-gated MLP'}: {path} {cfg} "
            f"(mean time / per-point best = {statistics.mean(score[ck]):.3f})")
        if gated:
            if path == "fused":
                C.FUSED[1] = dict(cfg["fused"])
            else:
                C.FUSED.pop(1, None)
                C.GATHER[1], C.DOWN[1] = dict(cfg["gather"]), dict(cfg["down"])
        else:
            C.MLP_B1 = dict(path=path, **cfg)
    log("FUSED = " + repr(C.FUSED))
    log("MLP_B1 = " + repr(C.MLP_B1))
    log("GATHER[1] = " + repr(C.GATHER[1]) + "  DOWN[1] = " + repr(C.DOWN[1]))


def apply_tuned(results):
    """Pick, per batch and kind, the config with the smallest mean (time / best time) over the tuned
    shapes and sparsities; install it in kernels.configs (this process only) and print the tables
    to freeze in code. Batch 2 keeps the fused path only where it beat gather + down."""
    from kernels import configs as C

    by = {}
    for r in results:
        by.setdefault((r["batch"], r["kind"]), []).append(r)
    best_t = {}
    for r in results:
        key = (r["shape"], r["batch"], r["s"], r["kind"])
        best_t[key] = min(best_t.get(key, 1e30), r["us"])
    chosen = {}
    for (batch, kind), rs in by.items():
        score = {}
        for r in rs:
            ck = json.dumps(r["cfg"], sort_keys=True)
            score.setdefault(ck, []).append(r["us"] / best_t[(r["shape"], r["batch"], r["s"], kind)])
        ck = min(score, key=lambda c: statistics.mean(score[c]) if len(score[c]) == max(map(len, score.values()))
                 else 1e9)
        chosen[(batch, kind)] = (json.loads(ck)[kind], statistics.mean(score[ck]))
    tables = {"fused": C.FUSED, "gather": C.GATHER, "down": C.DOWN}
    for (batch, kind), (cfg, sc) in sorted(chosen.items()):
        bp = C.b_pad(batch)
        tables[kind][bp] = dict(cfg)
        log(f"chosen B={batch} {kind}: {cfg}  (mean time / per-point best = {sc:.3f})")
    # batch 2: fused vs split on summed per-point times
    if (2, "fused") in chosen and (2, "gather") in chosen:
        tot = {"fused": 0.0, "split": 0.0}
        for r in results:
            if r["batch"] != 2:
                continue
            if r["kind"] == "fused" and r["cfg"]["fused"] == chosen[(2, "fused")][0]:
                tot["fused"] += r["us"]
            if r["kind"] in ("gather", "down") and r["cfg"][r["kind"]] == chosen[(2, r["kind"])][0]:
                tot["split"] += r["us"]
        if tot["split"] < tot["fused"]:
            C.FUSED.pop(2, None)
        log(f"batch 2: fused {tot['fused']:.1f} us vs split {tot['split']:.1f} us (summed over tuned points)")
    log("FUSED = " + repr(C.FUSED))
    log("GATHER = " + repr(C.GATHER))
    log("DOWN = " + repr(C.DOWN))
    return {f"{b}/{k}": v[0] for (b, k), v in chosen.items()}


def tune(args, copy_bw):
    """Hand-picked config sweep (never inside a capture); prints the best per (shape, batch, s)."""
    from kernels import ffn_triton as T

    gen = torch.Generator().manual_seed(2)
    dtype = torch.float16
    results = []
    for sname in args.tune_shapes:
        d, D, gated, act = FFN_SHAPES[sname]
        nl = 2 if SMOKE else 16
        lay = Layers(d, D, True, dtype, nl)
        for batch in args.tune_batches:
            xs = [torch.randn((batch, d), device=DEV, dtype=dtype) for _ in range(nl)]
            for s in args.tune_sparsities:
                k = int(round(D * (1 - s)))
                sets = make_sets(D, k, nl, gen)
                nb = ffn_bytes(d, k, True, 2, batch)
                cands = tune_candidates(batch)
                if SMOKE:
                    cands = [c for i, c in enumerate(cands) if i % 9 == 0]
                best = {}
                for kind, cfg in cands:
                    try:
                        if kind == "fused":
                            fns = [(lambda i=i, cfg=cfg: T.sparse_ffn(xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i],
                                                                       None, act, path="fused", config=cfg))
                                   for i in range(nl)]
                            byts = nb
                        elif kind == "gather":
                            fns = [(lambda i=i, cfg=cfg: T.gated_gather_gemv(xs[i], lay.w1[i], lay.w2[i], sets[i],
                                                                              None, act, torch.float32,
                                                                              config=cfg["gather"]))
                                   for i in range(nl)]
                            byts = 2 * k * d * 2
                        else:
                            hs = [torch.randn((batch, k), device=DEV, dtype=torch.float32) for _ in range(nl)]
                            fns = [(lambda i=i, cfg=cfg, hs=hs: T.gather_down(hs[i], lay.wdt[i], sets[i],
                                                                               config=cfg["down"]))
                                   for i in range(nl)]
                            byts = k * d * 2
                        t = time_layers(fns, 15).median
                    except Exception as e:  # a config that does not compile / fit is skipped
                        log(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    results.append(dict(shape=sname, batch=batch, s=s, kind=kind, cfg=cfg, us=t,
                                        pct=100 * byts / t / 1e3 / copy_bw))
                    if kind not in best or t < best[kind][0]:
                        best[kind] = (t, cfg)
                msg = " | ".join(f"{kd}: {v[0]:.1f}us {list(v[1].values())[0]}" for kd, v in best.items())
                log(f"tune {sname} B={batch} s={s}: {msg}")
        lay.free()
    return results


# ---------------------------------------------------------------------------------------------
def profile(args, copy_bw):
    """Batch 1, llama2/llama3: whole fused op vs its reduce kernel alone (on a filled workspace); the op with
    the reduce launched by programmatic dependent launch (``pdl``; sm_90+, elsewhere the same launch)."""
    from kernels import configs as C
    from kernels import ffn_triton as T
    from kernels._launch import launch_reduce

    gen = torch.Generator().manual_seed(4)
    out = []
    for sname in ("llama2-7b", "llama3-8b") if not SMOKE else ("tiny",):
        d, D, _, act = FFN_SHAPES[sname]
        nl = 2 if SMOKE else 16
        lay = Layers(d, D, True, torch.float16, nl)
        xs = [torch.randn((1, d), device=DEV, dtype=torch.float16) for _ in range(nl)]
        for s in (0.5, 0.7, 0.9):
            k = int(round(D * (1 - s)))
            sets = make_sets(D, k, nl, gen)
            # the whole op, without and with programmatic dependent launch of the reduce, alternating 3 rounds
            pdl_us = {False: [], True: []}
            for rnd in range(3):
                for pdl in ((False, True) if rnd % 2 == 0 else (True, False)):
                    ov = {"fused": {"pdl": pdl}}
                    pdl_us[pdl].append(time_layers(
                        [lambda i=i, ov=ov: T.sparse_ffn(xs[i], lay.w1[i], lay.w2[i], lay.wdt[i], sets[i], None,
                                                         act, config=ov) for i in range(nl)], args.reps).median)
            t_all, t_pdl = statistics.median(pdl_us[False]), statistics.median(pdl_us[True])
            cfg = C.FUSED.get(1)
            if cfg is None:  # --apply-tuned chose the split path at batch 1: no fused op to split up
                log("profile: batch 1 does not use the fused kernel with these configs; skipped")
                return out
            nsplit = min(cfg.get("nsplit") or cfg["progs_per_sm"] * C.num_sms(0 if not SMOKE else None),
                         -(-k // cfg["BLOCK_R"]))
            wss = [torch.randn((nsplit, 1, d), device=DEV) for _ in range(nl)]
            ys = [torch.empty((1, d), device=DEV, dtype=torch.float16) for _ in range(nl)]
            t_red = time_layers([lambda i=i: launch_reduce(wss[i], nsplit, None, ys[i], cfg.get("reduce_block"))
                                 for i in range(nl)], args.reps).median
            nb = ffn_bytes(d, k, True, 2, 1)
            log(f"profile {sname} s={s}: op {t_all:.1f} us = reduce alone {t_red:.1f} us + rest {t_all - t_red:.1f} us;"
                f" with PDL {t_pdl:.1f} us; bytes at copy BW {nb / copy_bw / 1e3:.1f} us; nsplit {nsplit}")
            out.append(dict(shape=sname, s=s, us_op=t_all, us_op_pdl=t_pdl, us_reduce=t_red, nsplit=nsplit,
                            us_bytes_at_copy_bw=nb / copy_bw / 1e3, rounds=pdl_us))
        lay.free()
    return out


# ---------------------------------------------------------------------------------------------
def main(argv=None):
    global DEV, SMOKE, FFN_SHAPES, ATTN_SHAPES
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="llama2-7b + llama3-8b, batch 1 and 4, s in .5/.7/.9")
    ap.add_argument("--json", help="write the rows to this JSON file (a bare name goes under benchmarks/results/)")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--shapes", default=",".join(FFN_SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sparsities", default=",".join(map(str, SPARSITIES)))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-attn", action="store_true")
    ap.add_argument("--no-ffn", action="store_true")
    ap.add_argument("--determinism", type=int, default=0, help="N repeated runs checked bit-for-bit")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--tune-batches", default="1,2,4,8")
    ap.add_argument("--tune-sparsities", default="0.5,0.7,0.9")
    ap.add_argument("--apply-tuned", action="store_true", help="use the tuned configs for the rest of this run")
    ap.add_argument("--tune-ops", action="store_true", help="batch-1 whole-op tune: MLP and FFN, fused vs split")
    ap.add_argument("--profile", action="store_true",
                    help="batch-1 time split: fused kernel vs reduce kernel; the op with PDL off/on")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU + Triton interpreter, tiny shapes: checks the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        DEV, SMOKE = "cpu", True
        FFN_SHAPES = {"tiny": (72, 200, True, "silu"), "tiny-opt": (72, 200, False, "relu")}
        ATTN_SHAPES = {"tiny": (72, 6, 2, 12)}
        smoke = dict(shapes=",".join(FFN_SHAPES), tune_shapes="tiny", batches="1,3", tune_batches="1,2",
                     sparsities="0,0.5,0.95", tune_sparsities="0.5")
        for k, v in smoke.items():          # the smoke's points, where the command line did not name others
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
        args.layers, args.reps = 2, 1
    elif not torch.cuda.is_available():
        log("benchmarks.kernels needs a CUDA GPU (or --smoke)")
        return 2
    args.dtypes = args.dtypes.split(",")
    args.shapes = args.shapes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sparsities = [float(s) for s in args.sparsities.split(",")]
    args.tune_shapes = args.tune_shapes.split(",")
    args.tune_batches = [int(b) for b in args.tune_batches.split(",")]
    args.tune_sparsities = [float(s) for s in args.tune_sparsities.split(",")]
    if args.quick:
        args.shapes, args.batches, args.sparsities = ["llama2-7b", "llama3-8b"], [1, 4], [0.5, 0.7, 0.9]
    import triton

    accel = device_name(DEV) if not SMOKE else "cpu (Triton interpreter)"
    t0 = time.time()
    copy_bw = copy_bandwidth(device=DEV) if not SMOKE else copy_bandwidth(1 << 20, reps=3, device=DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if not SMOKE else 0
    log(device_line(DEV))
    log(f"device {accel}, {sms} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}; copy bandwidth {copy_bw:.0f} GB/s (read+write)")
    rows, extra = [], {}

    def save(complete=True):
        if args.json:
            return write_results(args.json, rows, command=command_line("benchmarks.kernels"), device=DEV,
                                 meta=dict(copy_bw_gbps=round(copy_bw, 1), seconds=round(time.time() - t0),
                                           complete=complete), sections=extra)
    if args.tune:
        extra["tune"] = tune(args, copy_bw)
        if args.apply_tuned:
            extra["chosen"] = apply_tuned(extra["tune"])
    if args.tune_ops:
        extra["tune_ops"] = tune_ops(args, copy_bw)
        if args.apply_tuned:
            apply_tuned_ops(extra["tune_ops"])
    if args.profile:
        extra["profile"] = profile(args, copy_bw)
    if args.determinism:
        extra["determinism"] = determinism(args.determinism, accel)
    if not args.no_ffn:
        run_ffn(args, rows, copy_bw, accel, save)
    if not args.no_attn:
        run_attn(args, rows, copy_bw, accel)
    path = save()
    if path:
        log(f"wrote {len(rows)} rows to {path}")
    summary(rows)
    log(f"bench took {time.time() - t0:.0f} s")
    return 0


def _is_sparse_main(r):
    return r.op in ("triton_fused", "triton_split")


def summary(rows):
    """Batch-1 table for the goal shapes, and the crossover batch per (shape, s)."""
    def key(r, *more):
        return (r.shape, r.dtype, r.batch, *more)

    def sp(r):
        return r.extra["sparsity"]

    dense = {key(r): r for r in rows if r.op == "dense"}
    index = {key(r, sp(r)): r for r in rows if r.op == "torch_index"}
    seq = {key(r, sp(r)): r for r in rows if r.op == "triton_seq50"}
    dmg = {key(r, sp(r)): r for r in rows if r.op == "triton_damage50"}
    nan = float("nan")

    def us(r):
        return r.median if r else nan

    def x(r):
        return r.extra["speedup_vs_dense"] if r else nan

    log("\nshape      dtype B   s   | dense us | triton us  x dense  %copyBW | index us x dense | seq50 us x dense"
        " | damage50 us x dense")
    for r in rows:
        if r.batch == 1 and _is_sparse_main(r) and r.shape in ("llama2-7b", "llama3-8b", "tiny"):
            k = key(r, sp(r))
            dn, ix, sq, dm = dense.get(k[:3]), index.get(k), seq.get(k), dmg.get(k)
            log(f"{r.shape:10s} {r.dtype} 1 {sp(r):4.2f} | {us(dn):8.1f} | "
                f"{r.median:8.1f}  {x(r):6.2f}  {100 * r.frac_copy_bw:6.1f} | "
                f"{us(ix):8.1f} {x(ix):6.2f} | {us(sq):8.1f} {x(sq):6.2f} | {us(dm):8.1f} {x(dm):6.2f}")
    cross, seen = {}, set()
    for r in rows:
        if _is_sparse_main(r):
            k = (r.shape, r.dtype, sp(r))
            seen.add(k)
            if x(r) < 1.0:
                cross[k] = min(cross.get(k, 99), r.batch)
    if seen:
        log("\ncrossover (smallest batch where dense is faster; '-' = sparse faster at every batch run):")
        for k in sorted(seen):
            log(f"  {k[0]:10s} {k[1]} s={k[2]:4.2f}: {cross.get(k, '-')}")


if __name__ == "__main__":
    sys.exit(main())
