"""Input sparsity over a GGUF's blocks, group by group: every decoder layer of one token in one native call
(kernels.cpu_quant.LayerStack) with none, one or all of the QKV, O, gate|up and down groups input-sparse.

    python -m benchmarks.quant_sparse_layers [--model smollm2-135m] [--sparsity 0.3,0.5] [--threads 1,2]
        [--rounds 15] [--dense-above 0.6,1] [--json NAME]

The plan: TEAL-style thresholds per (layer, projection) at each ``--sparsity`` (workers.decode.latency.
calibrated_input_plan: the quantile of each projection's |input| over one 128-token prefill). The stream is the
embedding of a real token after the prompt "The capital of France is" (random streams are no stand-in: they lose
their scale over 30 layers and the active sets collapse). Each configuration runs all layers per call, 10 calls
a round; rounds interleave the configurations; the minimum over rounds of the per-call time (1 thread: the
thread's CPU time, which other processes' load does not inflate; several threads: wall time), with the share of
each group's inputs that were active. The dense row of each thread count is the baseline: the same call with
no sparse group. ``--dense-above``: the share of active inputs above which a group runs its dense rows on the
masked input (kernels.cpu_quant.DENSE_ABOVE; 1: never); several values time each sparse configuration at each,
side by side.

Feeds: BENCHMARKS.md, "CPU kernels: the GGUF's quantized blocks and the fp32 rows".
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import Row, Timing, command_line, device_line, write_results

GROUPS = ("qkv", "o", "gu", "down")
CONFIGS = ((), ("qkv",), ("o",), ("gu",), ("down",), GROUPS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sparsity", default="0.3,0.5")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dense-above", default=None, help="comma-separated shares (default: the kernels' own)")
    ap.add_argument("--json", default="quant_sparse_layers")
    a = ap.parse_args(argv)

    from kernels import cpu_quant
    from workers.decode import native_layer
    from workers.decode.latency import calibrated_input_plan
    from workers.decode.runtime import DecodeRuntime
    from workers.loading.models import load_model

    print(device_line("cpu"), flush=True)
    lm = load_model(a.model)
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    rows = []
    prev = torch.get_num_threads()
    for s in (float(v) for v in a.sparsity.split(",")):
        rt = DecodeRuntime.from_gguf(lm.model, lm.source).set_plan(calibrated_input_plan(lm.model, s, 128))
        rt.setup(1, 64)
        rt.prefill(ids)
        n = len(rt.weights.layers)
        stack = native_layer.build(rt.weights, rt.cache)
        full = {l: native_layer.native_groups(rt.weights, rt.sparse_plan, l) for l in range(n)}
        if any(v is None for v in full.values()):
            raise SystemExit("a layer's groups are not all native: nothing to compare")
        x = rt.blocks.embed(rt.tok, rt.cache.pos).contiguous()
        pos = int(rt.cache.pos)
        dims = rt.weights.dims
        n_in = torch.tensor([dims.d] * 3 + [dims.n_heads * dims.head_dim] + [dims.d] * 2 + [dims.D],
                            dtype=torch.float64)
        for t in (int(v) for v in a.threads.split(",")):
            torch.set_num_threads(t)
            clock = time.thread_time if t == 1 else time.perf_counter
            cfgs, active = {"dense": None}, {"dense": [0.0] * 7}
            shares = ([float(v) for v in a.dense_above.split(",")] if a.dense_above
                      else [cpu_quant.DENSE_ABOVE])
            for c in CONFIGS[1:]:
                groups = {l: {g: full[l][g] for g in c} for l in range(n)}
                for v in shares:
                    name = "+".join(c) + (f" >{v:g}" if len(shares) > 1 else "")
                    counts = torch.zeros(n, 7, dtype=torch.float64)
                    stack.run(0, n, x, pos, sparse=cpu_quant.SparseLayers(n, groups, counts, dense_above=v))
                    cfgs[name] = cpu_quant.SparseLayers(n, groups, dense_above=v)
                    active[name] = (counts.sum(0) / n_in / n).tolist()
            ms = {k: [] for k in cfgs}
            for _ in range(a.rounds):
                for k, sp in cfgs.items():
                    t0 = clock()
                    for _ in range(10):
                        stack.run(0, n, x, pos, sparse=sp)
                    ms[k].append((clock() - t0) / 10 * 1e3)
            base = min(ms["dense"])
            print(f"s={s} {t} thread(s), {n} layers per call: ms (min over {a.rounds} rounds), vs dense, active share "
                  "q k v o gate up down")
            for k in cfgs:
                tm = Timing.of(ms[k], "ms")
                print(f"  {k:<18} {min(ms[k]):7.3f} {base / min(ms[k]):6.2f}x   "
                      + " ".join(f"{v:.2f}" for v in active[k]))
                rows.append(Row.measured("quant_sparse_layers", k, tm, shape=a.model, dtype="gguf, fp32 act",
                                         device="cpu", extra=dict(sparsity=s, threads=t, min_ms=min(ms[k]),
                                                                  vs_dense=base / min(ms[k]), active=active[k])))
    torch.set_num_threads(prev)
    print("wrote", write_results(a.json, rows, command=command_line("benchmarks.quant_sparse_layers"), device="cpu",
                                 meta={"model": a.model}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
