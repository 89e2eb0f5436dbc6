"""Where a decode step's time goes: each part of a decoder layer timed alone, per layer, against the time its
bytes take at the measured copy bandwidth; and the whole step beside their sum.

    python -m benchmarks.layer_costs [--shape llama2-7b] [--prompt 128] [--reps 30] [--json NAME]
    python -m benchmarks.layer_costs --device cpu --model smollm2-135m [--threads 1]   # real weights, the CPU
    python -m benchmarks.layer_costs --device cpu --model smollm2-135m --gguf [--activations q8]   # its GGUF blocks
    python -m benchmarks.layer_costs --smoke      # CPU, a tiny random Llama: checks the script runs

Every part runs on the runtime's own weights of every layer in turn (so no part is served from L2), the calls
of all layers in one CUDA graph, replayed ``--reps`` times; µs per layer is the replay time over the layer
count (``benchmarks.harness.time_graph``; on the CPU each replay of the calls is timed with the host clock).
Parts (batch 1): the residual add + norm and the attention over a cache of ``--prompt`` positions with each glue
(``glue`` "torch": the torch functions, compiled on CUDA; "kernel": the one-launch Triton attention on CUDA, the
native norm and attention on the CPU), the QKV and O projections, the FFN dense (the runtime's dense path) and on random
active sets of 50 % and 10 % of the neurons (the fused kernel + reduce, without and with programmatic dependent
launch), the Deja Vu predictor GEMVs + top-k of one layer's set, the O projection's candidates (the down kernel over every
head, on CUDA in several launch configs; cuBLAS and the gather-GEMV kernel over a W_o [out, in] copy; QKV through
the gather-GEMV kernel), and the LM head + argmax once per step. The
step itself is ``bench_decode``'s p50 for the dense runtime with each glue. "unexplained" is the step per
layer minus the dense parts' sum: launch gaps and what the graph cannot overlap (on the CPU: the Python between
the native calls). ``--gguf`` (CPU, a packaged GGUF model): the runtime over the file's quantized blocks
(``DecodeRuntime.from_gguf``, ``--activations`` fp32 or q8); the parts are then the glue, the three quantized
projections, the whole layer in one native call and every layer in one call (workers.decode.native_layer), and
the step is timed per op (``fuse`` off) and with the one call (what the runtime makes); the sparse parts are left
out (dense plans only). Writes
``benchmarks/results/<--json>`` (default ``layer_costs_<shape>.json``).

Feeds: BENCHMARKS.md, "CPU kernels: the GGUF's quantized blocks and the fp32 rows" and "GPU kernels against cuBLAS and
TEAL's kernel (one H200)" (the O projection).
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks.harness import Row, command_line, copy_bandwidth, device_line, device_name, time_graph, write_results
from kernels import ops
from kernels.quant import QuantWeight
from workers.decode.glue import glue_fns
from workers.decode.latency import bench_decode, random_plan, shape_model
from workers.decode.runtime import DecodeRuntime
from workers.decode.select import ActiveSetSelector
from workers.decode.timing import pick_cpu_dense


def _nbytes(t) -> int:
    """Bytes a product reads of a weight (a tensor, or GGUF blocks)."""
    return t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()


def _random_sets(D: int, k: int, n: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randperm(D, generator=g)[:k].sort().values.to(torch.int32).to(device) for _ in range(n)]


@torch.no_grad()
def layer_parts(rt: DecodeRuntime, model, prompt: int) -> dict[str, tuple[list, float]]:
    """{part: (calls, bytes each layer must read[, layers the calls cover, when not one each])} on ``rt``'s
    weights (``model``: the HF model they came from, for the random predictors); the cache filled to ``prompt``
    positions."""
    w, b, dims = rt.weights, rt.blocks, rt.dims
    dev, dt = w.device, w.dtype
    es = 1 if w.quantized else w.lm_head.element_size()      # quantized: nbytes() counts the blocks' bytes
    d, D, H, KV, hd = dims.d, dims.D, dims.n_heads, dims.n_kv_heads, dims.head_dim
    nk, eps, layers = w.norm_kind, w.eps, w.layers
    rt.set_plan(None)
    rt.setup(1, prompt + 8)
    rt.prefill(torch.zeros(1, prompt, dtype=torch.long, device=dev))
    cache = rt.cache
    glue = {g: glue_fns(dev.type == "cuda", g) for g in ("torch", "kernel")}
    compiled = glue["torch"]
    x = torch.randn(1, d, device=dev, dtype=dt)
    y = torch.randn(1, d, device=dev, dtype=dt)
    h = torch.randn(1, d, device=dev, dtype=dt)
    a = torch.randn(1, H * hd, device=dev, dtype=dt)
    qkv = torch.randn(1, (H + 2 * KV) * hd, device=dev, dtype=dt)
    q, k, v = (qkv[:, : H * hd].view(1, H, hd), qkv[:, H * hd: (H + KV) * hd].view(1, KV, hd),
               qkv[:, (H + KV) * hd:].view(1, KV, hd))
    kv_bytes = 2 * KV * (prompt + 1) * hd * es

    def attn(fn):
        return [lambda l=l, L=L: fn(q, k, v, cache.k[l], cache.v[l], cache.pos, *(L.rope or (None, None)), L.qn,
                                    L.kn, eps, L.window) for l, L in enumerate(layers)]

    parts = {}
    for g, fns in glue.items():
        parts[f"add + norm, glue {g}"] = ([lambda L=L, f=fns["add_norm"]: f(x, y, L.n2, L.n2b, nk, eps)
                                           for L in layers], 0.0)
        parts[f"attention, glue {g}"] = (attn(fns["attn"]), kv_bytes)
    L0 = layers[0]
    parts.update({
        "qkv": ([lambda L=L: b.linear(h, L.w_qkv, L.b_qkv) for L in layers], _nbytes(L0.w_qkv)),
        "o": ([lambda L=L: b.linear_t(a, L.w_o_t, L.b_o) for L in layers], _nbytes(L0.w_o_t)),
        "ffn dense": ([lambda L=L: b.ffn_dense_(L, h, compiled["act_mul"]) for L in layers],
                      sum(_nbytes(t) for t in (L0.w_gate, L0.w_up, L0.w_down_t) if t is not None)),
    })
    if w.quantized:            # dense plans only: the whole layer in one native call instead of the sparse parts
        from workers.decode import native_layer

        try:
            nat = native_layer.build(w, cache)
        except ValueError as e:
            print(f"no one-call layer here: {e}")
        else:
            nl = len(layers)
            parts["layer, one native call"] = ([lambda l=l: nat.run(l, l + 1, x, prompt) for l in range(nl)],
                                               L0.nbytes() + kv_bytes)
            # every layer in one call (what the step makes), per layer
            parts["every layer, one native call"] = ([lambda: nat.run(0, nl, x, prompt)], L0.nbytes() + kv_bytes, nl)
        return parts
    # the O projection's candidates: the down kernel over every head (the runtime's o_proj "kernel"; on CUDA also
    # other launch configs: BLOCK_D x BLOCK_R x K splits x warps), and cuBLAS over a W_o [out, in] copy
    o_bytes = layers[0].w_o_t.numel() * es
    head_out = ops.backend(a).head_sparse_out
    o_cfgs = [None] + ([(64, 64, 8, 4), (128, 64, 16, 4), (64, 32, 16, 4), (128, 32, 8, 4), (256, 32, 8, 8),
                        (128, 128, 4, 8), (64, 128, 8, 4)] if dev.type == "cuda" else [])
    for c in o_cfgs:
        cfg = None if c is None else dict(BLOCK_D=c[0], BLOCK_R=c[1], splits=c[2], num_warps=c[3])
        parts["o, down kernel" + ("" if c is None else " {}x{}s{}w{}".format(*c))] = (
            [lambda L=L, cfg=cfg: head_out(a, L.w_o_t, b.q_all, None, hd, L.b_o, config=cfg) for L in layers],
            o_bytes)
    if dev.type == "cuda":
        w_o = [L.w_o_t.t().contiguous() for L in layers]
        parts["o, cuBLAS over W_o [out, in]"] = ([lambda i=i: torch.nn.functional.linear(a, w_o[i])
                                                  for i in range(len(layers))], o_bytes)
        # the gather-GEMV kernel (one dot per weight row, the gate/up half of the sparse FFN) over every row of
        # W_o [out, in] and of W_qkv: rows per program x warps
        gg = ops.backend(a).gather_gemv
        all_o = torch.arange(d, device=dev, dtype=torch.int32)
        all_qkv = torch.arange(layers[0].w_qkv.shape[0], device=dev, dtype=torch.int32)
        for br, nw in ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8)):
            cfg = dict(BLOCK_R=br, BLOCK_K=None, num_warps=nw)
            parts[f"o, gather-GEMV over W_o [out, in] r{br}w{nw}"] = (
                [lambda i=i, cfg=cfg: gg(a, w_o[i], all_o, config=cfg) for i in range(len(layers))], o_bytes)
            parts[f"qkv, gather-GEMV r{br}w{nw}"] = (
                [lambda L=L, cfg=cfg: gg(h, L.w_qkv, all_qkv, config=cfg) for L in layers],
                layers[0].w_qkv.numel() * es)
    if w.gated:
        ffn = ops.backend(h).sparse_ffn
        for s in (0.5, 0.9):
            kk = max(1, int(round(D * (1 - s))))
            sets = _random_sets(D, kk, len(layers), dev)
            for pdl in ((False, True) if dev.type == "cuda" else (False,)):
                cfg = {"fused": {"pdl": pdl}}
                parts[f"ffn s={s}" + (" pdl" if pdl else "")] = (
                    [lambda L=L, idx=sets[i], cfg=cfg: ffn(h, L.w_gate, L.w_up, L.w_down_t, idx, None, w.act,
                                                           config=cfg)
                     for i, L in enumerate(layers)], 3 * d * kk * es)
    rt.set_plan(random_plan(model, 0.5, None, rank=256))
    preds = [rt.sparse_plan.mlp[l] for l in range(len(layers))]
    parts["mlp predictor + top-k"] = ([lambda p=p: rt.selector.select(p, x, D) for p in preds], 256 * (d + D) * es)
    if dev.type == "cuda":     # the one-CTA radix select the multi-CTA one replaced
        one = ActiveSetSelector("triton-1cta")
        parts["mlp predictor + top-k, one-CTA select"] = ([lambda p=p: one.select(p, x, D) for p in preds],
                                                          256 * (d + D) * es)
    rt.set_plan(None)
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layer_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama2-7b", help="random weights of this shape (CUDA)")
    ap.add_argument("--model", default=None, help="a model ref (load_model) instead of --shape: real weights")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gen", type=int, default=32, help="tokens of the whole-step timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--gguf", action="store_true", help="CPU: the runtime over the model's GGUF blocks")
    ap.add_argument("--activations", default="fp32", choices=("fp32", "q8"), help="with --gguf")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny random Llama: checks the script runs")
    a = ap.parse_args(argv)
    if a.gguf and (a.device != "cpu" or not a.model or a.smoke):
        print("--gguf needs --device cpu and --model (a packaged GGUF model)")
        return 2
    if a.smoke:
        import transformers as tf

        from workers.decode.weights import random_hf_model

        dev = "cpu"
        model = random_hf_model(tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                                torch.float32, dev)
        a.reps, a.gen, a.prompt = 2, 4, min(a.prompt, 16)
        bw = None
    elif a.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.layer_costs needs a CUDA GPU (or --device cpu, or --smoke)")
        return 2
    else:
        dev = a.device
        if a.threads:
            torch.set_num_threads(a.threads)
        lm = None
        if a.model:
            from workers.loading.models import load_model

            lm = load_model(a.model, dtype="float16" if dev == "cuda" else "float32", device=dev)
            model = lm.model
        else:
            model = shape_model(a.shape, device=dev)
        bw = copy_bandwidth(device=dev) if dev == "cuda" else None
    if a.gguf:
        rt = DecodeRuntime.from_gguf(model, lm.source, activations=a.activations, cpu_rows=True)
    else:
        rt = DecodeRuntime.from_hf(model)
    if dev == "cpu" and rt.cpu_rows is None:
        pick_cpu_dense(rt)
    nl = len(rt.layers)
    print(device_line(dev), flush=True)
    rows, accel = [], device_name(dev) if dev == "cuda" else "cpu"
    meta = dict(shape="tiny" if a.smoke else a.model or a.shape, prompt=a.prompt, layers=nl,
                copy_bw_gbps=None if bw is None else round(bw, 1), threads=torch.get_num_threads(),
                cpu_rows=rt.cpu_rows, gguf=a.gguf, activations=a.activations if a.gguf else None,
                load_avg=round(os.getloadavg()[0], 2))
    out = a.json or f"layer_costs_{meta['shape']}{'_gguf' if a.gguf else ''}.json"
    us: dict[str, float] = {}
    for name, (calls, nbytes, *per) in layer_parts(rt, model, a.prompt).items():
        with torch.no_grad():     # as in the decode step
            t = time_graph(lambda calls=calls: [c() for c in calls], reps=a.reps,
                           per_replay=(per or [len(calls)])[0], device=dev)
        us[name] = t.median
        rows.append(Row.measured("layer_costs", name, t, nbytes=nbytes or None, copy_bw_gbps=bw,
                                 shape=meta["shape"], device=accel,
                                 extra=dict(us_at_copy_bw=nbytes / bw / 1e3 if bw else None)))
        floor = f"{nbytes / bw / 1e3:7.2f}" if bw else "      -"
        print(f"{name:<28} {t.median:8.2f} us/layer   bytes at copy bw {floor} us", flush=True)
    h = torch.randn(1, rt.dims.d, device=dev, dtype=rt.dtype)
    head = time_graph(lambda: rt.blocks.logits(h).argmax(-1), reps=a.reps, device=dev)
    rows.append(Row.measured("layer_costs", "lm head + argmax (per step)", head, nbytes=_nbytes(rt.lm_head),
                             copy_bw_gbps=bw, shape=meta["shape"], device=accel))
    print(f"{'lm head + argmax (per step)':<28} {head.median:8.2f} us", flush=True)
    # (glue, o_proj, fuse): quantized, fuse runs each layer in one native call (where it builds)
    steps = ([("torch", "torch", False), ("kernel", "torch", False)]
             + ([("kernel", "torch", True)] if "every layer, one native call" in us else []) if a.gguf else
             [("torch", "torch", True), ("kernel", "torch", True), ("kernel", "kernel", True)])
    for glue, o, fuse in steps:
        rt.configure(glue=glue, o_proj=o, fuse=fuse)
        r = bench_decode(rt, None, device=dev, batch=1, prompt_len=a.prompt, gen_len=a.gen,
                         repeats=2 if a.smoke else 3)[0]
        step_us = r["p50_ms_per_token"] * 1e3
        native = a.gguf and fuse
        parts = (["every layer, one native call"] if native else
                 [f"add + norm, glue {glue}", f"add + norm, glue {glue}", "qkv", f"attention, glue {glue}",
                  "o" if o == "torch" else "o, down kernel", "ffn dense"])
        summed = sum(us[p] for p in parts)
        per_layer = (step_us - head.median) / nl
        key = f"glue_{glue}_o_{o}" + ("_native_layer" if native else "")
        meta[f"step_us_{key}"] = step_us
        meta[f"unexplained_us_per_layer_{key}"] = per_layer - summed
        print(f"dense step, glue {glue}, o {o}{', native layers' if native else ''}: {step_us:8.1f} us = "
              f"{nl} x {per_layer:.2f} us/layer + head; "
              f"parts sum {summed:.2f} us/layer; unexplained {per_layer - summed:+.2f} us/layer", flush=True)
    path = write_results(out, rows, command=command_line("benchmarks.layer_costs"), device=dev, meta=meta)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
