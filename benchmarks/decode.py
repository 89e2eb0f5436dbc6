"""H200 decode benchmark (issue 8): our runtime dense / sparse vs Hugging Face ``generate``, 7B-class shapes.

    python -m benchmarks.decode --out DIR [--shape llama2-7b] [--prompts 128,512,1024] [--gen 64] [--quick]
        [--select-impl auto|torch|triton] [--points dense,mlp.5,...] [--no-hf]
    python -m benchmarks.decode --out DIR --select     # top-k candidates alone: µs per layer -> select_bench.json

Writes ``DIR/decode_<shape>.json`` (one row per measured point: the LatencyRow fields plus details, and the
ideal speedup from bytes) after every point, and prints a table. Imports no Ray / DB (runs on the GPU image).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

from workers.decode.latency import bench_decode, decode_bytes, random_plan, runtime_for, shape_model


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 20."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(25):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    ts = sorted(ts[5:])
    del a, b
    return 2 * (1 << 30) / ts[len(ts) // 2]


@torch.no_grad()
def checks(model, rt) -> dict:
    """Dense runtime logits vs HF; greedy at s=0 (plan keeps every neuron and head) == dense."""
    ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    ref = model(ids).logits.float()
    rt.set_plan(None)
    rt.setup(1, 64)
    lg = rt.prefill(ids[:, :24]).float()
    err = [(lg - ref[:, 23]).norm().item() / ref[:, 23].norm().item()]
    for t in range(24, 32):
        rt.tok.copy_(ids[:, t])
        lg = rt.step(keep_logits=True).float()
        err.append((lg - ref[:, t]).norm().item() / ref[:, t].norm().item())
    dense = rt.generate(ids[:, :24], 24)
    rt.set_plan(random_plan(model, 0.0, 0.0), overlap=True)
    s0 = rt.generate(ids[:, :24], 24)
    rt.set_plan(None)
    return dict(max_rel_logit_err=max(err), greedy_s0_equal_dense=bool((s0 == dense).all().item()))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--prompts", default="128,512,1024")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--diag", action="store_true", help="only the dense variants and the selection costs")
    ap.add_argument("--select", action="store_true", help="only the top-k selection candidates (µs per layer)")
    ap.add_argument("--select-impl", default="auto", choices=("auto", "torch", "triton"),
                    help="the runtime's top-k (DecodeRuntime.select_impl)")
    ap.add_argument("--points", default=None, help="comma-separated point names to run (default: all)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.select:
        return select_bench(a.out)
    path = os.path.join(a.out, f"decode_{a.shape}.json")
    meta = dict(shape=a.shape, gen_len=a.gen, repeats=a.repeats, rank=a.rank, torch=torch.__version__,
                select_impl=a.select_impl,
                device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"))
    meta["copy_bw"] = bw = copy_bandwidth()
    rows = []

    def dump():
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    t0 = time.time()
    model = shape_model(a.shape)
    rt = runtime_for(model, "cuda")
    rt.select_impl = a.select_impl
    meta["build_s"] = time.time() - t0
    try:
        meta["checks"] = checks(model, rt)
    except Exception:
        meta["checks"] = {"error": traceback.format_exc()[-2000:]}
    print("checks", meta["checks"], flush=True)
    dump()
    if a.diag:
        diag(model, rt, meta, rows, dump, a)
        return
    points = [("dense", None, None, True, "exact"),
              ("mlp.5", 0.5, None, True, "exact"), ("mlp.7", 0.7, None, True, "exact"),
              ("mlp.9", 0.9, None, True, "exact"), ("mlp.5+h.5", 0.5, 0.5, True, "exact"),
              ("mlp.5+h.5 kv-active", 0.5, 0.5, True, "active"),
              ("mlp.5 inline", 0.5, None, False, "exact"), ("mlp.9 inline", 0.9, None, False, "exact"),
              ("mlp.5+h.5 inline", 0.5, 0.5, False, "exact")]
    prompts = [int(p) for p in a.prompts.split(",")]
    if a.quick:
        points, prompts = points[:2], prompts[:1]
    if a.points:
        want = a.points.split(",")
        points = [p for p in points if p[0] in want]
    for P in prompts:
        for name, ms, hs, ov, kv in points:
            t1 = time.time()
            try:
                plan = random_plan(model, ms, hs, rank=a.rank) if (ms or hs) else None
                row = bench_decode(rt, plan, device="cuda", batch=1, prompt_len=P, gen_len=a.gen,
                                   repeats=a.repeats, overlap=ov, kv_mode=kv, detail=True)[0]
                ctx = P + a.gen // 2
                dense_b = decode_bytes(rt, 0, 0, 0, ctx)
                sp_b = decode_bytes(rt, ms or 0, hs or 0, a.rank, ctx, kv_mode=kv)
                row.update(point=name, mlp_sparsity=ms, head_sparsity_target=hs, bytes=sp_b,
                           dense_bytes=dense_b["total"], ideal_speedup=dense_b["total"] / sp_b["total"],
                           floor_ms=sp_b["total"] / bw * 1e3, floor_ms_4300=sp_b["total"] / 4.3e12 * 1e3,
                           wall_s=time.time() - t1)   # floor: the bytes at the measured copy bandwidth
            except Exception:
                row = dict(point=name, prompt_len=P, error=traceback.format_exc()[-3000:])
            rows.append(row)
            dump()
            print(P, name, {k: row.get(k) for k in ("p50_ms_per_token", "p90_ms_per_token", "ideal_speedup",
                                                   "realized_sparsity", "error")}, flush=True)
        if not a.no_hf:
            t1 = time.time()
            try:
                row = bench_decode(model, None, device="cuda", batch=1, prompt_len=P, gen_len=min(a.gen, 32),
                                   runtime="hf-generate", repeats=2, warmup=1, detail=True)[0]
                row.update(point="hf-generate", wall_s=time.time() - t1)
            except Exception:
                row = dict(point="hf-generate", prompt_len=P, error=traceback.format_exc()[-3000:])
            rows.append(row)
            dump()
            print(P, "hf", row.get("p50_ms_per_token"), row.get("error"), flush=True)
    # table
    print(f"\ncopy bw {bw / 1e9:.0f} GB/s  device {meta['device']}  checks {meta['checks']}")
    dense = {r["prompt_len"]: r.get("p50_ms_per_token") for r in rows if r.get("point") == "dense"}
    hf = {r["prompt_len"]: r.get("p50_ms_per_token") for r in rows if r.get("point") == "hf-generate"}
    print(f"{'P':>5} {'point':<22} {'p50':>7} {'p90':>7} {'floor':>6} {'speedup':>7} {'ideal':>6} {'frac':>5} {'vsHF':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['prompt_len']:>5} {r['point']:<22} ERROR")
            continue
        P, p50 = r["prompt_len"], r["p50_ms_per_token"]
        sp = dense.get(P, float("nan")) / p50 if dense.get(P) else float("nan")
        ideal = r.get("ideal_speedup", float("nan"))
        print(f"{P:>5} {r['point']:<22} {p50:7.3f} {r['p90_ms_per_token']:7.3f} {r.get('floor_ms', float('nan')):6.3f} "
              f"{sp:7.2f} {ideal:6.2f} {sp / ideal:5.2f} {hf.get(P, float('nan')) / p50:5.1f}")


def _time(fn, n=200):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    ts = []
    for _ in range(n // 10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 100)   # us per call
    return sorted(ts)[len(ts) // 2]


@torch.no_grad()
def diag(model, rt, meta, rows, dump, a):
    """Where the dense step's time goes: dense FFN through cuBLAS vs the fused kernel, glue compiled or not;
    and what one layer's predictor (GEMVs + top-k) costs alone."""
    for name, ffn, comp in (("dense kernel-ffn compiled", "auto", True), ("dense cublas-ffn compiled", "torch", True),
                            ("dense kernel-ffn eager-glue", "auto", False)):
        rt.ffn_dense, rt.compile, rt._fns = ffn, comp, None
        row = bench_decode(rt, None, device="cuda", batch=1, prompt_len=128, gen_len=a.gen, repeats=a.repeats,
                           detail=True)[0]
        row.update(point=name)
        rows.append(row)
        dump()
        print(name, row["p50_ms_per_token"], flush=True)
    rt.ffn_dense, rt.compile, rt._fns = "auto", True, None
    plan = random_plan(model, 0.5, 0.5, rank=a.rank)
    rt.set_plan(plan)
    x = torch.randn(1, rt.dims.d, device="cuda", dtype=rt.dtype)
    mp, hp = rt.mlp_pred[0], rt.head_pred[0]
    sc = mp.scores(x)
    us = dict(mlp_scores=_time(lambda: mp.scores(x)), mlp_topk=_time(lambda: torch.topk(sc[0], mp.k, sorted=False)),
              mlp_select=_time(lambda: rt._select(mp, x, rt.dims.D)),
              head_select=_time(lambda: rt._select(hp, x, rt.dims.n_heads)))
    meta["selection_us_per_layer"] = us
    dump()
    print("selection us/layer", us, flush=True)


@torch.no_grad()
def select_bench(out_dir: str, n: int = 11008, n_heads: int = 32) -> dict:
    """Per-layer cost (µs, CUDA graph of 10 calls, median) of the top-k candidates on fp16 scores of a Llama-2
    FFN (n = 11008) at s = .5/.7/.9 and of the heads (32, k = 16), and whether each gives the reference's set."""
    from kernels import ops
    from kernels import reference as ref
    from kernels.select_triton import topk_select
    from workers.sparsity.predictors.base import k_for

    g = torch.Generator(device="cuda").manual_seed(0)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows=[])
    for N, sp in [(n, 0.5), (n, 0.7), (n, 0.9), (n_heads, 0.5)]:
        k = k_for(sp, N)
        sc = torch.randn(1, N, device="cuda", dtype=torch.float16, generator=g)
        want = ref.topk_select(sc, k)
        cands = {"torch.topk": lambda: torch.topk(sc, k, dim=-1, sorted=False).indices,
                 "torch.topk fp32": lambda: torch.topk(sc.float(), k, dim=-1, sorted=False).indices,
                 "torch.sort": lambda: torch.sort(sc, dim=-1, descending=True).indices[:, :k],
                 "torch.kthvalue+compact": lambda: ops.compact(sc[0] >= torch.kthvalue(sc[0], N - k + 1).values)}
        for bits in (1, 2):
            for w in (4, 8, 16, 32):
                cands[f"triton bits={bits} warps={w}"] = (lambda bits=bits, w=w: topk_select(sc, k, bits=bits,
                                                                                            num_warps=w))
        cands["triton default"] = lambda: topk_select(sc, k)
        for name, fn in cands.items():
            row = dict(n=N, k=k, sparsity=sp, cand=name)
            try:
                r = fn()
                if name.startswith("triton"):
                    row["equal_reference"] = bool(torch.equal(r, want))
                elif name != "torch.kthvalue+compact":
                    got = sc[0].index_select(0, r[0].long()).float().sort().values
                    row["same_values"] = bool(torch.equal(got, sc[0].float().index_select(0, want[0].long()).sort().values))
                row["us"] = _time(fn)
            except Exception:
                row["error"] = traceback.format_exc()[-1500:]
            res["rows"].append(row)
            print(row, flush=True)
    with open(os.path.join(out_dir, "select_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
