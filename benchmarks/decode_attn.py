"""One decode position's attention on a GPU: the one-launch Triton kernel (``kernels.ops.decode_attention``,
the runtime's ``glue="kernel"``) against the torch function the runtime compiles (``glue="torch"``).

    python -m benchmarks.decode_attn [--shapes llama2-7b,llama3-8b] [--prompts 128,1024] [--layers 32]
        [--rounds 3] [--json NAME]

Per shape, prompt length and head set (every head; half the heads, compact, as the head-sparse step passes
them): ``--layers`` calls on as many separate caches (one per layer, like a decode step; each cache holds the
prompt plus 64 positions, as the runtime sizes it) captured in one CUDA graph, replayed; µs per layer, the
median over ``--rounds`` rounds that alternate the order of the paths. The kernel runs with its own choice of
cache splits (flash-decoding above MIN_CHUNK positions per split) and with one split.
Both write the cache at the position and read the positions before it (RoPE from fp32 tables, fp16, batch 1).
Also reports each case's relative error of the kernel against the torch function, and the KV bytes read per
layer at the measured time (GB/s). Writes ``benchmarks/results/<--json>`` (default ``decode_attn.json``).

    python -m benchmarks.decode_attn --smoke      # CPU, a tiny shape, the kernel in Triton's interpreter and the
                                                  # torch function uncompiled: checks the script runs

Feeds: BENCHMARKS.md, "GPU kernels against cuBLAS and TEAL's kernel (one H200)".
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.harness import Row, command_line, device_line, device_name, time_graph, write_results
from kernels import decode_attn_triton, reference
from workers.decode.glue import glue_fns
from workers.decode.shapes import attn_shape


SMOKE_SHAPE = (64, 4, 2, 16)       # --smoke: (d, heads, KV heads, head dim)


def _case(shape: str, prompt: int, layers: int, heads: str, max_len: int, device: str = "cuda"):
    _, H, KV, hd = SMOKE_SHAPE if shape == "tiny" else attn_shape(shape)
    g = torch.Generator(device=device).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=device, generator=g, dtype=torch.float16)

    caches = [(r(1, KV, max_len, hd), r(1, KV, max_len, hd)) for _ in range(layers)]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], 1)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    S = H if heads == "all" else H // 2
    qkv = r(1, (S + 2 * KV) * hd)
    q = qkv[:, : S * hd].view(1, S, hd)
    k = qkv[:, S * hd: (S + KV) * hd].view(1, KV, hd)
    v = qkv[:, (S + KV) * hd:].view(1, KV, hd)
    kw = dict(cos_t=cos, sin_t=sin)
    if heads != "all":
        kw.update(q_idx=torch.arange(0, H, 2, device=device, dtype=torch.int32),
                  q_count=torch.tensor([S], device=device, dtype=torch.int32), n_heads=H)
    pos = torch.tensor([prompt], device=device)
    return q, k, v, caches, pos, kw, (H, KV, hd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_attn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--heads", default="all,half", help="all: every head; half: half of them, compact")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tune", default="",
                    help="extra kernel configs to time, e.g. '64x4,128x8s8' (BLOCK_N x num_warps, optionally s and the "
                         "number of splits of the cached positions)")
    ap.add_argument("--json", default="decode_attn.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, a tiny shape (the kernel in Triton's interpreter, the torch function uncompiled): "
                         "checks the script runs; its timings mean nothing")
    a = ap.parse_args(argv)
    if a.smoke:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--smoke runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1 before starting")
        a.shapes = "tiny"
    elif not torch.cuda.is_available():
        print("benchmarks.decode_attn needs a CUDA GPU (or --smoke)")
        return 2
    device = "cpu" if a.smoke else "cuda"
    prompts = [int(p) for p in a.prompts.split(",")]
    # the runtime's torch attention, compiled as it does on CUDA (on the CPU it runs uncompiled)
    compiled = glue_fns(not a.smoke, "torch")["attn"]

    def one_split(*args, **kw):
        return decode_attn_triton.decode_attention(*args, **kw, config={"nsplit": 1})

    impls = {"torch compiled": compiled, "kernel": decode_attn_triton.decode_attention, "kernel 1 split": one_split}
    for spec in filter(None, a.tune.split(",")):
        try:
            tile, _, ns = spec.partition("s")
            bn, nw = (int(v) for v in tile.split("x"))
            cfg = dict(BLOCK_N=bn, num_warps=nw, **({"nsplit": int(ns)} if ns else {}))
        except ValueError:
            ap.error(f"--tune: {spec!r} is not BLOCK_NxWARPS[sNSPLIT] (e.g. 32x4 or 128x8s8)")

        def tuned(*args, _cfg=cfg, **kw):
            return decode_attn_triton.decode_attention(*args, **kw, config=_cfg)

        impls[f"kernel {spec}"] = tuned
    dev, command, rows = device_name(device), command_line("benchmarks.decode_attn"), []
    print(device_line(device), flush=True)
    for shape in a.shapes.split(","):
        for heads in a.heads.split(","):
            for P in prompts:
                max_len = P + 64
                q, k, v, caches, pos, kw, (H, KV, hd) = _case(shape, P, a.layers, heads, max_len, device)
                nsplit = decode_attn_triton.splits_for(1, q.shape[1], max_len, q,
                                                       decode_attn_triton.block_n_for(q.shape[2]))
                want = reference.decode_attention(q, k, v, *[c.clone() for c in caches[0]], pos, **kw)
                got = decode_attn_triton.decode_attention(q, k, v, *[c.clone() for c in caches[0]], pos, **kw)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                times: dict[str, list[float]] = {n: [] for n in impls}
                for rnd in range(a.rounds):
                    for name in (list(impls) if rnd % 2 == 0 else list(impls)[::-1]):
                        fn = impls[name]
                        t = time_graph(lambda fn=fn: [fn(q, k, v, kc, vc, pos, **kw) for kc, vc in caches],
                                       reps=2 if a.smoke else 20, per_replay=a.layers, device=device)
                        times[name].append(t.median)
                kv_bytes = 2 * KV * (P + 1) * hd * 2
                for name, ts in times.items():
                    us = statistics.median(ts)
                    rows.append(Row.measured("decode_attn", name, unit="us", median=us, nbytes=kv_bytes, shape=shape,
                                             dtype="fp16", batch=1, device=dev,
                                             extra=dict(prompt_len=P, heads=heads, layers=a.layers, rounds=ts,
                                                        max_len=max_len, kernel_nsplit=nsplit,
                                                        rel_err_kernel_vs_torch=err)))
                    print(f"{shape:<10} {heads:<5} P={P:<5} {name:<15} {us:7.2f} us/layer "
                          f"({kv_bytes / us / 1e3:6.1f} GB/s of KV)  kernel err {err:.1e}, {nsplit} split(s)",
                          flush=True)
                write_results(a.json, rows, command=command, device=device)
    print(f"wrote {len(rows)} rows to {write_results(a.json, rows, command=command, device=device)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
