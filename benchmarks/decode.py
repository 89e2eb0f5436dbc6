"""Decode benchmark on a GPU: our runtime dense / sparse vs Hugging Face ``generate``, 7B-class shapes.

    python -m benchmarks.decode [--shape llama2-7b] [--prompts 128,512,1024] [--gen 64] [--quick]
        [--select-impl auto,triton-1cta] [--input-path auto|mask|local] [--points dense,mlp.5,...]
        [--glue torch,kernel] [--o-proj torch,kernel] [--hf eager,static,static-compile] [--no-hf] [--json NAME]
    python -m benchmarks.decode --diag       # dense variants and the per-layer selection costs only
    python -m benchmarks.decode --select     # top-k candidates alone: µs per layer
    python -m benchmarks.decode --smoke --points dense,mlp.5 --prompts 16 --gen 4   # CPU, a tiny random Llama:
                                             # checks the script runs (its timings mean nothing)

Writes ``benchmarks/results/decode_<shape>.json`` (or ``--json NAME``; ``decode_select.json`` for ``--select``)
after every point: one ``benchmarks.harness.Row`` per measured point (ms per token, p50 / p90; bytes read per
token and their fraction of the measured copy bandwidth; the bench_decode fields, bytes breakdown and the ideal
speedup from bytes in ``extra``), and prints a table. Imports no Ray / DB (runs on the GPU image).

Hugging Face baselines (``--hf``): ``eager`` (``generate`` with its default dynamic cache), ``static``
(``cache_implementation="static"``, compiling disabled) and ``static-compile`` (the static cache with the decode
forward compiled by HF's ``CompileConfig``, mode "reduce-overhead"; its first, warm-up repeat pays the compile).
A baseline that fails is an error row with its traceback; the others still run.

``--glue torch,kernel`` runs every point with each glue (the runtime's ``glue`` option: the compiled torch norms
and attention, or the decode attention as one Triton launch; default ``auto``, the runtime's own: the kernel on
CUDA), one after the other per point, on runtimes that share the weights; points of the second are named
``NAME [glue kernel]``. ``--o-proj torch,kernel`` likewise for the dense O projection (cuBLAS, or the down kernel
over every head: the runtime's ``o_proj``), and ``--select-impl`` for the top-k (``select_impl``); with several,
every combination runs. Speedups in the table are over the fastest dense row at each prompt length.

Feeds: BENCHMARKS.md, "GPU decode, end to end (one H200)" and "GPU kernels against cuBLAS and TEAL's kernel (one H200)"
(the top-k select).
"""
from __future__ import annotations

import argparse
import time
import traceback

import torch

from benchmarks.harness import (
    Row, command_line, copy_bandwidth, device_line, device_name, time_graph, write_results,
)
from benchmarks.shape_plans import rank_shape_plan, rotated_shape_plan
from kernels import ops
from workers.decode.blocks import O_PROJ
from workers.decode.glue import GLUES, resolve_glue
from workers.decode.latency import (
    bench_decode, calibrated_input_plan, decode_bytes, random_plan, runtime_for, shape_model,
)
from workers.decode.runtime import DecodeRuntime
from workers.decode.select import SELECT_IMPLS

_MAIN_FIELDS = ("p50_ms_per_token", "p90_ms_per_token", "accelerator_name", "batch", "point")
# HF baselines: point name -> (cache, compile)
HF_BASELINES = {"hf-generate": ("dynamic", False), "hf-static": ("static", False),
                "hf-static-compile": ("static", True)}
_HF_ARG = {"eager": "hf-generate", "static": "hf-static", "static-compile": "hf-static-compile"}


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def decode_row(r: dict, shape: str, device: str, copy_bw: float | None = None, nbytes: float | None = None,
               dtype: str = "fp16") -> Row:
    """A bench_decode row (plus ``point``) as a harness Row in ms per token; an error row keeps no timing."""
    extra = {k: v for k, v in r.items() if k not in _MAIN_FIELDS}
    return Row.measured("decode", r["point"], unit="ms", median=r.get("p50_ms_per_token"),
                        p90=r.get("p90_ms_per_token"), nbytes=nbytes, copy_bw_gbps=copy_bw, shape=shape,
                        dtype=dtype, batch=r.get("batch", 1), device=device, extra=extra)


def time_per_call(fn, calls: int = 10, reps: int = 20):
    """µs per call of ``fn``: ``calls`` calls in one CUDA graph, ``reps`` replays (the harness's graph timer)."""
    return time_graph(lambda: [fn() for _ in range(calls)], reps=reps, per_replay=calls)


@torch.no_grad()
def checks(model, rt) -> dict:
    """Dense runtime logits vs HF; greedy at s=0 (plan keeps every neuron and head: runs the dense step) ==
    dense."""
    ids = torch.randint(0, min(32000, model.config.vocab_size), (1, 32),
                        generator=torch.Generator().manual_seed(1)).to(rt.device)
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
    s0_dense_path = rt.sparse_plan.dense
    s0 = rt.generate(ids[:, :24], 24)
    # a LaRoSA plan at s = 0: every rotation and adapter folded into the weights, nothing dropped
    rot = rotated_shape_plan(model, 0.0)
    for per in rot.part("larosa").sparsity.values():
        per.update(dict.fromkeys(per, 0.0))
    rt.set_plan(rot)
    rt.setup(1, 64)
    lg = rt.prefill(ids[:, :24]).float()
    rot_err = [(lg - ref[:, 23]).norm().item() / ref[:, 23].norm().item()]
    for t in range(24, 32):
        rt.tok.copy_(ids[:, t])
        lg = rt.step(keep_logits=True).float()
        rot_err.append((lg - ref[:, t]).norm().item() / ref[:, t].norm().item())
    rt.set_plan(None)
    return dict(max_rel_logit_err=max(err), greedy_s0_equal_dense=bool((s0 == dense).all().item()),
                s0_runs_dense_step=s0_dense_path, rotated_s0_max_rel_logit_err=max(rot_err))


POINTS = [("dense", None, None, True, "exact"),
          ("mlp.5", 0.5, None, True, "exact"), ("mlp.7", 0.7, None, True, "exact"),
          ("mlp.9", 0.9, None, True, "exact"), ("mlp.5+h.5", 0.5, 0.5, True, "exact"),
          # batch 4 with uncorrelated tokens keeps about s^4 skipped: 0.75 -> union 0.32, 0.8 -> 0.41, 0.85 -> 0.52
          ("mlp.75", 0.75, None, True, "exact"), ("mlp.8", 0.8, None, True, "exact"),
          ("mlp.85", 0.85, None, True, "exact"),
          ("mlp.5+h.5 kv-active", 0.5, 0.5, True, "active"),
          ("mlp.5 inline", 0.5, None, False, "exact"), ("mlp.9 inline", 0.9, None, False, "exact"),
          ("mlp.5+h.5 inline", 0.5, 0.5, False, "exact"),
          # input sparsity on all seven projections, thresholds calibrated on a prefill: TEAL's |x| ("in")
          # and WINA's |x_i|·‖W[:, i]‖ (one threshold per input channel in the kernels)
          ("in.4", None, None, True, "exact"), ("in.5", None, None, True, "exact"),
          ("in.7", None, None, True, "exact"),
          # the same layers unfused (the norms, act·up and residual adds as their own launches)
          ("in.4 unfused", None, None, True, "exact"), ("in.5 unfused", None, None, True, "exact"),
          ("wina.5", None, None, True, "exact"),
          # the FFN predictors' positive-score rule (a compaction, no top-k): about half the neurons
          ("mlp.5 pos", 0.5, None, True, "exact"),
          # at equal bytes with in.N (N = decoder bytes skipped, extra bytes charged): LaRoSA (a rotation per
          # layer folded into the weights, a per-token top-k, an adapter between layers) and R-Sparse (kept rows
          # plus rank-r factors, ρ = 0.95): benchmarks.shape_plans
          ("larosa.4", None, None, True, "exact"), ("larosa.5", None, None, True, "exact"),
          # LaRoSA's rotation "none": each token's top-k of the plain inputs, no adapter
          ("larosa-none.4", None, None, True, "exact"), ("larosa-none.5", None, None, True, "exact"),
          ("rsparse.4", None, None, True, "exact"), ("rsparse.5", None, None, True, "exact")]
EQUAL_BYTES = ("in.", "wina.", "larosa.", "larosa-none.", "rsparse.")   # points named by their bytes skipped
# "NAME@PATH" (e.g. in.5@local): the point with the runtime's input_path set to PATH
POINTS += [(f"{p[0]}@{path}",) + p[1:] for p in POINTS if p[0].startswith(("in.", "wina."))
           for path in ops.INPUT_PATHS if path != "auto"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None,
                    help="result file (a bare name goes under benchmarks/results/); default decode_<shape>.json "
                         "(decode_<shape>_bf16.json in bf16)")
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="weights, activations and KV cache")
    ap.add_argument("--prompts", default="128,512,1024")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hf", default="eager,static,static-compile",
                    help="Hugging Face baselines: eager (dynamic cache), static (static cache), static-compile "
                         "(static cache, compiled forward)")
    ap.add_argument("--no-hf", action="store_true", help="no Hugging Face baseline")
    ap.add_argument("--diag", action="store_true", help="only the dense variants and the selection costs")
    ap.add_argument("--select", action="store_true", help="only the top-k selection candidates (µs per layer)")
    ap.add_argument("--select-impl", default="auto",
                    help=f"comma-separated top-k implementations to run every point with (DecodeRuntime's "
                         f"select_impl: {', '.join(SELECT_IMPLS)})")
    ap.add_argument("--input-path", default="auto", choices=ops.INPUT_PATHS,
                    help="the input-sparse kernel (DecodeRuntime's input_path)")
    ap.add_argument("--points", default=None, help="comma-separated point names to run (default: all)")
    ap.add_argument("--glue", default="auto",
                    help=f"comma-separated runtime glue settings to run every point with ({', '.join(GLUES)})")
    ap.add_argument("--o-proj", default="auto",
                    help=f"comma-separated dense O projection paths to run every point with ({', '.join(O_PROJ)})")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together (the FFN runs the union of their active sets; the Hugging "
                         "Face baselines run at batch 1 only)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, a tiny random Llama instead of --shape: checks the script runs (timings mean nothing)")
    a = ap.parse_args(argv)
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, not {a.batch}")
    unknown = sorted(set(a.points.split(",")) - {p[0] for p in POINTS}) if a.points else []
    if unknown:
        ap.error(f"--points: unknown {unknown}; known: {', '.join(p[0] for p in POINTS)}")
    glues = [v for v in a.glue.split(",") if v]
    if not glues or any(v not in GLUES for v in glues):
        ap.error(f"--glue: {a.glue!r}; each must be one of {', '.join(GLUES)}")
    oprojs = [v for v in a.o_proj.split(",") if v]
    if not oprojs or any(v not in O_PROJ for v in oprojs):
        ap.error(f"--o-proj: {a.o_proj!r}; each must be one of {', '.join(O_PROJ)}")
    selects = [v for v in a.select_impl.split(",") if v]
    if not selects or any(v not in SELECT_IMPLS for v in selects):
        ap.error(f"--select-impl: {a.select_impl!r}; each must be one of {', '.join(SELECT_IMPLS)}")
    variants = [(g, o, si) for g in glues for o in oprojs for si in selects]
    try:
        hf_points = [] if a.no_hf or a.batch > 1 else [_HF_ARG[v] for v in a.hf.split(",") if v]
    except KeyError as e:
        ap.error(f"--hf: unknown baseline {e.args[0]!r} (known: {', '.join(_HF_ARG)})")
    if a.smoke and (a.select or a.diag):
        ap.error("--smoke runs the points (not --select or --diag)")
    if not a.smoke and not torch.cuda.is_available():
        print("benchmarks.decode needs a CUDA GPU (or --smoke)")
        return 2
    device = "cpu" if a.smoke else "cuda"
    command = command_line("benchmarks.decode")
    if a.select:
        select_bench(a.json or "decode_select.json", command)
        return 0
    shape = "tiny" if a.smoke else a.shape
    out = a.json or f"decode_{shape}{'' if a.dtype == 'fp16' else '_' + a.dtype}.json"
    dev = device_name(device)
    print(device_line(device), flush=True)
    meta = dict(shape=shape, gen_len=a.gen, repeats=a.repeats, rank=a.rank, select_impl=a.select_impl,
                input_path=a.input_path, batch=a.batch)
    meta["copy_bw_gbps"] = bw = round(copy_bandwidth() if not a.smoke else
                                      copy_bandwidth(1 << 20, reps=3, device=device), 1)
    rows: list[Row] = []

    def dump():
        return write_results(out, rows, command=command, device=device, meta=meta)

    t0 = time.time()
    if a.smoke:                # fp32: the CPU kernels' dtype
        import transformers as tf

        from workers.decode.weights import random_hf_model

        model = random_hf_model(tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                                torch.float32, device)
        a.rank = min(a.rank, 32)
    else:
        model = shape_model(a.shape, dtype=DTYPES[a.dtype])
    rt = runtime_for(model, device).configure(select_impl=selects[0], input_path=a.input_path,
                                              glue=glues[0], o_proj=oprojs[0])
    runtimes = {v: rt if v == variants[0] else DecodeRuntime(rt.weights, select_impl=v[2],
                                                             input_path=a.input_path, glue=v[0], o_proj=v[1])
                for v in variants}

    def suffix(v) -> str:       # " [glue kernel, o torch]": what differs from the first variant
        d = [f"{k} {x}" for k, x, x0 in zip(("glue", "o", "select"), v, variants[0]) if x != x0]
        return f" [{', '.join(d)}]" if d else ""

    meta["build_s"] = time.time() - t0
    for v, r_ in runtimes.items():
        key = "checks" + suffix(v)
        try:
            meta[key] = checks(model, r_)
        except Exception:
            meta[key] = {"error": traceback.format_exc()[-2000:]}
        print(key, meta[key], flush=True)
    dump()
    if a.diag:
        diag(model, rt, meta, rows, dump, a, dev)
        return 0
    points = list(POINTS)
    prompts = [int(p) for p in a.prompts.split(",")]
    if a.quick:
        points, prompts = points[:2], prompts[:1]
    if a.points:
        points = [p for p in points if p[0] in a.points.split(",")]
    for P in prompts:
        for (name, ms, hs, ov, kv), v in ((p, v) for p in points for v in variants):
            rt = runtimes[v]
            pname = name + suffix(v)
            t1 = time.time()
            nbytes = None
            base, _, ipath = name.partition("@")
            rt.input_path = ipath or a.input_path
            unfused = base.endswith(" unfused")
            base = base.removesuffix(" unfused")
            if rt.blocks.fuse == unfused:
                rt.configure(fuse=not unfused)
            try:
                score = "wina" if base.startswith("wina.") else "abs"
                ins = float("0." + base.split(".")[1]) if base.startswith(EQUAL_BYTES) else 0.0  # in.5: 0.5
                if base.startswith(("larosa.", "larosa-none.")):
                    plan = rotated_shape_plan(model, ins, rotation="none" if "-none" in base else "layer")
                elif base.startswith("rsparse."):
                    plan = rank_shape_plan(model, ins)
                elif ins:
                    plan = calibrated_input_plan(model, ins, score=score)
                else:
                    rule = "positive" if base.endswith(" pos") else "topk"
                    plan = random_plan(model, ms, hs, rank=a.rank, mlp_rule=rule) if (ms or hs) else None
                r = bench_decode(rt, plan, device=device, batch=a.batch, prompt_len=P, gen_len=a.gen,
                                 repeats=a.repeats, overlap=ov, kv_mode=kv, detail=True)[0]
                ctx = (P + a.gen // 2) * a.batch      # the KV cache read per step grows with the batch
                # batch > 1 reads the rows of the union of the batch's sets: the realized (union) sparsity
                union = r.get("realized_sparsity") if a.batch > 1 and ms and not hs else None
                mlp_s = union if union is not None else ms or 0
                dense_b = decode_bytes(rt, 0, 0, 0, ctx)
                sp_b = decode_bytes(rt, mlp_s, hs or 0, a.rank, ctx, kv_mode=kv, input_sparsity=ins)
                nbytes = sp_b["total"]
                r.update(point=pname, glue=resolve_glue(v[0], rt.device.type),
                         o_proj="kernel" if rt.blocks.o_kernel(a.batch) else "torch", mlp_sparsity=ms,
                         head_sparsity_target=hs, bytes=sp_b,
                         dense_bytes=dense_b["total"], ideal_speedup=dense_b["total"] / sp_b["total"],
                         floor_ms=sp_b["total"] / (bw * 1e9) * 1e3, floor_ms_4300=sp_b["total"] / 4.3e12 * 1e3,
                         wall_s=time.time() - t1)   # floor: the bytes at the measured copy bandwidth
            except Exception:
                r = dict(point=pname, prompt_len=P, error=traceback.format_exc()[-3000:])
            rows.append(decode_row(r, shape, dev, bw, nbytes, "fp32" if a.smoke else a.dtype))
            dump()
            print(P, r["point"], {k: r.get(k) for k in ("p50_ms_per_token", "p90_ms_per_token", "ideal_speedup",
                                                 "realized_sparsity", "error")}, flush=True)
        for name in hf_points:
            rows.append(decode_row(hf_point(model, name, P, a.gen, device), shape, dev,
                                   dtype="fp32" if a.smoke else a.dtype))
            dump()
            print(P, name, rows[-1].median, rows[-1].extra.get("error"), flush=True)
    print(f"wrote {len(rows)} rows to {dump()}")
    table(rows, bw, dev, meta["checks"])
    return 0


def hf_point(model, name: str, prompt_len: int, gen: int, device: str = "cuda") -> dict:
    """One Hugging Face baseline row (``HF_BASELINES[name]``): 2 repeats after one warm-up; an error row
    (the traceback under ``error``) when it fails."""
    cache, compile_ = HF_BASELINES[name]
    t1 = time.time()
    try:
        r = bench_decode(model, None, device=device, batch=1, prompt_len=prompt_len, gen_len=min(gen, 32),
                         runtime="hf-generate", repeats=2, warmup=1, detail=True, hf_cache=cache,
                         hf_compile=compile_)[0]
        r.update(point=name, wall_s=time.time() - t1)
    except Exception:
        r = dict(point=name, prompt_len=prompt_len, hf_cache=cache, hf_compile=compile_,
                 error=traceback.format_exc()[-3000:])
    return r


def table(rows: list[Row], bw: float, dev: str, checks_: dict) -> None:
    print(f"\ncopy bw {bw:.0f} GB/s  device {dev}  checks {checks_}")
    dense: dict = {}              # the fastest dense row per prompt length
    for r in rows:
        if r.op.startswith("dense") and r.median:
            P = r.extra["prompt_len"]
            dense[P] = min(dense.get(P, r.median), r.median)
    hf = {r.extra["prompt_len"]: r.median for r in rows if r.op == "hf-generate" and r.median}
    hf_best: dict = {}            # the fastest HF baseline per prompt length
    for r in rows:
        if r.op in HF_BASELINES and r.median:
            P = r.extra["prompt_len"]
            hf_best[P] = min(hf_best.get(P, r.median), r.median)
    nan = float("nan")
    print(f"{'P':>5} {'point':<22} {'p50':>7} {'p90':>7} {'floor':>6} {'speedup':>7} {'ideal':>6} {'frac':>5} "
          f"{'vsHF':>5} {'vsBestHF':>8}")
    for r in rows:
        P = r.extra["prompt_len"]
        if "error" in r.extra:
            print(f"{P:>5} {r.op:<22} ERROR")
            continue
        sp = dense[P] / r.median if dense.get(P) else nan
        ideal = r.extra.get("ideal_speedup", nan)
        print(f"{P:>5} {r.op:<22} {r.median:7.3f} {r.p90:7.3f} {r.extra.get('floor_ms', nan):6.3f} "
              f"{sp:7.2f} {ideal:6.2f} {sp / ideal:5.2f} {hf.get(P, nan) / r.median:5.1f} "
              f"{hf_best.get(P, nan) / r.median:8.2f}")


@torch.no_grad()
def diag(model, rt, meta, rows, dump, a, dev):
    """Where the dense step's time goes: dense FFN through cuBLAS vs the fused kernel, glue compiled or not,
    attention compiled or one kernel (glue "kernel"); and what one layer's predictor (GEMVs + top-k) costs alone."""
    for name, ffn, comp, glue in (("dense kernel-ffn compiled", "auto", True, "torch"),
                                 ("dense kernel-ffn compiled glue-kernel", "auto", True, "kernel"),
                                 ("dense cublas-ffn compiled", "torch", True, "torch"),
                                 ("dense kernel-ffn eager-glue", "auto", False, "torch")):
        rt.configure(ffn_dense=ffn, compile=comp, glue=glue)
        r = bench_decode(rt, None, device="cuda", batch=1, prompt_len=128, gen_len=a.gen, repeats=a.repeats,
                         detail=True)[0]
        r.update(point=name)
        rows.append(decode_row(r, a.shape, dev, dtype=a.dtype))
        dump()
        print(name, r["p50_ms_per_token"], flush=True)
    rt.configure(ffn_dense="auto", compile=True, glue="auto")
    plan = random_plan(model, 0.5, 0.5, rank=a.rank)
    rt.set_plan(plan)
    x = torch.randn(1, rt.dims.d, device="cuda", dtype=rt.dtype)
    mp, hp = rt.sparse_plan.mlp[0], rt.sparse_plan.heads[0]      # the runtime's own copies of the predictors
    sc = mp.scores(x)
    sel = rt.selector
    fns = dict(mlp_scores=lambda: mp.scores(x), mlp_topk=lambda: torch.topk(sc[0], mp.k, sorted=False),
               mlp_select=lambda: sel.select(mp, x, rt.dims.D), head_select=lambda: sel.select(hp, x, rt.dims.n_heads))
    us = {k: time_per_call(fn).median for k, fn in fns.items()}
    meta["selection_us_per_layer"] = us
    dump()
    print("selection us/layer", us, flush=True)


@torch.no_grad()
def select_bench(out: str, command: str, ns: tuple = (11008, 14336, 18944), n_heads: int = 32) -> list[Row]:
    """Per-layer cost (µs, CUDA graph of 10 calls, median) of the top-k candidates on fp16 scores of the FFNs of
    Llama-2 / Llama-3 / Qwen2 (n = 11008 / 14336 / 18944) at s = .5/.7/.9 and of the heads (32, k = 16), and
    whether each gives the reference's set: torch.topk / sort / kthvalue, the one-CTA radix select, and the
    multi-CTA select over chunks of 512-2048 entries."""
    from kernels import ops
    from kernels import reference as ref
    from kernels.select_triton import topk_select      # the multi-CTA launch options
    from workers.sparsity.predictors.base import k_for

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = device_name("cuda")
    rows: list[Row] = []
    for N, sp in [(n, sp) for n in ns for sp in (0.5, 0.7, 0.9)] + [(n_heads, 0.5)]:
        k = k_for(sp, N)
        sc = torch.randn(1, N, device="cuda", dtype=torch.float16, generator=g)
        want = ref.topk_select(sc, k)
        cands = {"torch.topk": lambda: torch.topk(sc, k, dim=-1, sorted=False).indices,
                 "torch.topk fp32": lambda: torch.topk(sc.float(), k, dim=-1, sorted=False).indices,
                 "torch.sort": lambda: torch.sort(sc, dim=-1, descending=True).indices[:, :k],
                 "torch.kthvalue+compact": lambda: ops.compact(sc[0] >= torch.kthvalue(sc[0], N - k + 1).values)}
        cands["triton one-CTA"] = lambda: ops.topk_select(sc, k, multi=False)
        if N >= 1024:
            for c in (512, 1024, 2048):
                for w in (2, 4, 8):
                    cands[f"triton multi chunk={c} warps={w}"] = (
                        lambda c=c, w=w: topk_select(sc, k, multi=True, chunk=c, num_warps=w))
        cands["triton default"] = lambda: ops.topk_select(sc, k)         # what the runtime calls
        for name, fn in cands.items():
            extra, timing = dict(n=N, k=k, sparsity=sp), None
            try:
                r = fn()
                if name.startswith("triton"):
                    extra["equal_reference"] = bool(torch.equal(r, want))
                elif name != "torch.kthvalue+compact":
                    got = sc[0].index_select(0, r[0].long()).float().sort().values
                    ref_vals = sc[0].float().index_select(0, want[0].long()).sort().values
                    extra["same_values"] = bool(torch.equal(got, ref_vals))
                timing = time_per_call(fn)
            except Exception:
                extra["error"] = traceback.format_exc()[-1500:]
            row = (Row.measured("decode-select", name, timing, shape=f"n={N}", dtype="fp16", batch=1, device=dev,
                                extra=extra) if timing else
                   Row("decode-select", name, shape=f"n={N}", dtype="fp16", device=dev, extra=extra))
            rows.append(row)
            print(name, N, k, row.median, {k_: v for k_, v in extra.items() if k_ != "error"}, flush=True)
    print("wrote", write_results(out, rows, command=command))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
