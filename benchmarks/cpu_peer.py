"""Our CPU decode against llama.cpp on the same GGUF: greedy batch-1 decode, ms per token, at each thread count.

    make llama-cpp                                        # once: llama-cpp-python built from source
    python -m benchmarks.cpu_peer [--model smollm2-135m] [--threads 1,2] [--gen 64] [--repeats 5]
        [--sparse teal:0.35] [--calib-tokens 1024] [--random-plans dejavu:0.5:0.33,svd:0.5] [--rank 64]
        [--json NAME]

Runners, each decoding ``--gen`` tokens after the same prompt (the first ``--prompt`` tokens of a held-out
LAMBADA passage, token ids shared by all runners):

* ``llama.cpp``            llama-cpp-python on the GGUF file (``workers.decode.llama_cpp.LlamaCppRunner``, the
                           runner of the sweep's ``llama.cpp`` baseline row too); per token one ``eval`` of the
                           previous token and an argmax over the logits, as our runtime does
* ``ours fp32``            DecodeRuntime over the dequantized fp32 weights (the CPU row kernels, native glue)
* ``ours quant``           DecodeRuntime.from_gguf: the GGUF's blocks, fp32 activations (kernels.cpu_quant), every
                           decoder layer in one native call (workers.decode.native_layer)
* ``ours quant per-op``    the same blocks with ``fuse=False``: a native call per op, Python between them
* ``ours quant q8``        the same with 8-bit activations (llama.cpp's arithmetic; approximate)
* ``ours quant METHOD s=S`` with ``--sparse``: a plan fitted on ``--calib-tokens`` calibration tokens (as
                           benchmarks.cpu_ops --methods) over the GGUF's blocks: input sparsity (TEAL, WINA) every
                           layer in one native call, FFN / head predictors (threshold, SVD, Deja Vu) a call per op
                           on their layers (workers.decode.runtime.runs_on_blocks); with ``--fp32-sparse`` each plan
                           over the fp32 weights too (``ours fp32 METHOD``); an option ``head=RANK/K`` adds the
                           predicted output head (``teal:0.3:head=64/2048``; ``dense:0:head=64/2048``: the head
                           alone)
* ``ours quant METHOD s=S h=H (random)`` with ``--random-plans METHOD:S[:H]``: predictors with random weights of
                           rank ``--rank`` (workers.decode.latency.random_plan, the latency benchmark's shape plans:
                           real predictor GEMVs and active-set sizes, arbitrary sets; no fitting): ``dejavu``, top-k
                           of a fraction S of the FFN neurons kept out on every layer (and H of the heads), ``svd``,
                           the SVD predictors' positive-score rule (about half the neurons whatever S says); over the
                           blocks, paired with the dense rows of the same rounds
* ``--skip NAME,...``      leave runners out (e.g. ``ours quant per-op,ours quant q8,ours fp32``)

Every round runs every (runner, thread count) once, in an order that alternates between rounds; round 0 warms up.
Median, IQR and p10 of the per-round ms/token (p10 resists other processes' load better; the ratios to llama.cpp
are printed for both); llama.cpp's row also carries its own eval timer (``llama_perf``).
Each runner's speedup over ``ours quant`` (the blocks' dense, one native call a step) is also given as the median
(and range) of the per-round ratios, the two having run in the same rounds. The greedy tokens of each runner are
compared with ours fp32 (matching prefix length). ``--nll-tokens N``: each
runner's accuracy on the same text, untimed: the mean negative log-likelihood of N held-out tokens fed one decode
step at a time after the prompt (teacher forcing), so the 8-bit activations' error shows as a perplexity. The
load average is recorded: on a machine that other processes share the figures are indicative only.

Feeds: BENCHMARKS.md, "CPU decode against llama.cpp", "The predicted output head" and
"Input-sparse and sparse decode on the CPU".
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks.harness import Row, Timing, command_line, device_line, write_results
from workers.decode.llama_cpp import LlamaCppRunner, llama_cpp_missing


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


class OursRunner:
    """Our runtime's greedy decode (its own runtime per runner: a plan stays set)."""

    def __init__(self, rt, plan=None):
        self.rt = rt
        if plan is not None:
            rt.set_plan(plan)

    def nll(self, ids: list[int], prompt: int) -> float:
        rt = self.rt
        rt.setup(1, len(ids) + 1)
        logits = rt.prefill(torch.tensor([ids[:prompt]]))
        tot = 0.0
        for t in range(prompt, len(ids)):
            if t > prompt:
                rt.tok.fill_(ids[t - 1])
                logits = rt.step(keep_logits=True)
            tot += _nll(logits[0], ids[t])
        rt.cache = None
        return tot / (len(ids) - prompt)

    def run(self, ids: list[int], gen: int) -> tuple[float, list[int], None]:
        rt = self.rt
        if rt.cache is None or not rt.cache.fits(1, len(ids) + gen + 1):
            rt.setup(1, len(ids) + gen + 1)
        rt.prefill(torch.tensor([ids]))
        t0 = time.perf_counter()
        toks = rt.decode(gen + 1)                 # the prefill's argmax, then gen steps
        dt = time.perf_counter() - t0
        return dt, toks[0].tolist(), None


def _nll(logits: torch.Tensor, target: int) -> float:
    return -float(torch.log_softmax(logits.double(), -1)[target])


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _random_specs(s: str) -> list[tuple[str, float, float | None]]:
    """``METHOD:S[:H],...`` -> [(method, FFN sparsity, head sparsity or None)]; ``svd`` takes no heads."""
    out = []
    for part in (p.strip() for p in s.split(",") if p.strip()):
        f = part.split(":")
        try:
            method, sp, h = f[0], float(f[1]), (float(f[2]) if len(f) > 2 else None)
        except (IndexError, ValueError):
            raise SystemExit(f"--random-plans: METHOD:S[:H], got {part!r}") from None
        if method not in ("dejavu", "svd") or len(f) > 3 or (method == "svd" and h is not None) \
                or not 0 <= sp < 1 or not 0 <= (h or 0) < 1:
            raise SystemExit(f"--random-plans: dejavu:S[:H] or svd:S with sparsities in [0, 1), got {part!r}")
        out.append((method, sp, h))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a packaged model ref (its GGUF is what both decode)")
    ap.add_argument("--threads", type=_ints, default=[1, 2])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (a held-out LAMBADA passage)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sparse", default="", help="METHOD:S,... fitted plans (e.g. teal:0.3,teal:0.5)")
    ap.add_argument("--fp32-sparse", action="store_true", help="time the plans over the fp32 weights too")
    ap.add_argument("--random-plans", default="",
                    help="METHOD:S[:H],... predictor plans with random weights (dejavu: FFN top-k at S, heads at "
                         "H; svd: the positive-score rule)")
    ap.add_argument("--rank", type=int, default=64, help="the random predictors' rank")
    ap.add_argument("--skip", default="", help="runner names to leave out, comma separated")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--nll-tokens", type=int, default=0, help="teacher-forced decode NLL over this many tokens")
    ap.add_argument("--no-llama", action="store_true", help="ours only (without llama-cpp-python installed)")
    ap.add_argument("--json", default="cpu_peer", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    random_specs = _random_specs(args.random_plans)

    from benchmarks.cpu_ops import _methods, fitted_plans
    from workers.decode.latency import random_plan
    from workers.decode.quant_weights import with_activations
    from workers.decode.runtime import DecodeRuntime, runs_on_blocks
    from workers.loading.data import token_windows
    from workers.loading.models import load_model

    if not args.no_llama and (why := llama_cpp_missing()):
        raise SystemExit(f"{why} (or --no-llama)")
    if args.no_llama:
        peer = "not timed (--no-llama)"
    else:
        import llama_cpp

        peer = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
    print(device_line("cpu"), flush=True)
    print(f"llama.cpp: {peer}", flush=True)
    load0 = os.getloadavg()
    lm = load_model(args.model)
    gguf = lm.source
    text = token_windows(lm.tokenizer, "lambada", "heldout", 1024, 512).windows[0].tolist()
    ids = text[:args.prompt]
    n_ctx = max(args.prompt + args.gen, args.prompt + args.nll_tokens) + 8
    runners: dict[str, object] = {}
    if not args.no_llama:
        runners["llama.cpp"] = {t: LlamaCppRunner(gguf, t, n_ctx) for t in args.threads}
    fp32 = DecodeRuntime.from_hf(lm.model, torch.float32, "cpu", cpu_rows=True)
    runners["ours fp32"] = OursRunner(fp32)
    quant = DecodeRuntime.from_gguf(lm.model, gguf)
    runners["ours quant"] = OursRunner(quant)
    runners["ours quant per-op"] = OursRunner(DecodeRuntime(quant.weights, fuse=False))          # same blocks
    runners["ours quant q8"] = OursRunner(DecodeRuntime(with_activations(quant.weights, "q8")))   # same blocks
    plans = fitted_plans(lm, _methods(args.sparse), args.calib_tokens) if args.sparse else {}
    for method, s, h in random_specs:
        plan = random_plan(lm.model, s, h, rank=args.rank, mlp_rule="topk" if method == "dejavu" else "positive")
        plans[f"{method} s={s}" + (f" h={h}" if h is not None else "") + " (random)"] = plan
    for name, plan in plans.items():
        quantized = runs_on_blocks(plan)
        if quantized:
            runners[f"ours quant {name}"] = OursRunner(DecodeRuntime.from_gguf(lm.model, gguf), plan)
        if not quantized or args.fp32_sparse:
            runners[f"ours fp32 {name}"] = OursRunner(DecodeRuntime.from_hf(lm.model, torch.float32, "cpu",
                                                                            cpu_rows=True), plan)
    for n in [x.strip() for x in args.skip.split(",") if x.strip()]:
        if n not in runners:
            raise SystemExit(f"--skip {n!r}: no such runner ({', '.join(runners)})")
        del runners[n]
    keys = [(n, t) for t in args.threads for n in runners]
    times: dict = {k: [] for k in keys}
    own: dict = {k: [] for k in keys}
    tokens: dict = {}
    prev = torch.get_num_threads()
    try:
        for r in range(args.repeats + 1):                 # round 0 warms up
            for n, t in (keys if r % 2 == 0 else keys[::-1]):
                torch.set_num_threads(t)
                runner = runners[n][t] if isinstance(runners[n], dict) else runners[n]
                dt, toks, own_ms = runner.run(ids, args.gen)
                tokens[(n, t)] = toks
                if r:
                    times[(n, t)].append(dt / args.gen * 1e3)
                    if own_ms is not None:
                        own[(n, t)].append(own_ms)
    finally:
        torch.set_num_threads(prev)
    nll = {}
    if args.nll_tokens:
        torch.set_num_threads(1)
        for n, runner in runners.items():
            runner = runner[args.threads[0]] if isinstance(runner, dict) else runner
            nll[n] = runner.nll(text[:args.prompt + args.nll_tokens], args.prompt)
        torch.set_num_threads(prev)
        print("teacher-forced decode over", args.nll_tokens, "held-out tokens: perplexity",
              ", ".join(f"{n} {np.exp(v):.3f}" for n, v in nll.items()))
    load1 = os.getloadavg()
    rows = []
    print(f"{args.model}: greedy decode of {args.gen} tokens after {args.prompt}, {args.repeats} interleaved "
          f"rounds; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    ref_name = "ours fp32" if "ours fp32" in runners else next(n for n in runners if n.startswith("ours"))
    for t in args.threads:
        ref = tokens[(ref_name, t)]
        base = Timing.of(times[("llama.cpp", t)], "ms") if ("llama.cpp", t) in times else None
        dq = times.get(("ours quant", t))
        print(f"  {t} thread(s)       ms/token    IQR    p10   vs llama.cpp (median, p10)   tokens = {ref_name}"
              f"   vs ours quant (median of the rounds' ratios)")
        for n in runners:
            tm = Timing.of(times[(n, t)], "ms")
            same = _prefix(tokens[(n, t)], ref)
            extra = dict(threads=t, gen=args.gen, prompt=args.prompt, same_tokens_as=ref_name, same_tokens=same,
                         load_avg=[round(v, 2) for v in (*load0, *load1)])
            if n in nll:
                extra["decode_nll"] = round(nll[n], 5)
                extra["decode_ppl"] = round(float(np.exp(nll[n])), 4)
            if own[(n, t)]:
                extra["llama_perf_eval_ms"] = round(float(np.median(own[(n, t)])), 3)
            ratio = f"{base.median / tm.median:8.2f}x {base.p10 / tm.p10:8.2f}x" if base else f"{'-':>19}"
            paired = ""
            if dq and n != "ours quant":     # each round ran both: the ratio per round, then its median
                per = [a / b for a, b in zip(dq, times[(n, t)])]
                extra["vs_ours_quant"] = [round(float(np.median(per)), 4), round(min(per), 4), round(max(per), 4)]
                paired = f"{np.median(per):8.2f}x ({min(per):.2f}-{max(per):.2f})"
            print(f"  {n:<22}{tm.median:>8.2f}{tm.iqr:>7.2f}{tm.p10:>7.2f}   {ratio}              "
                  f"{same:>3}/{len(ref)}   {paired}")
            dtype = ("gguf, q8 act" if n in ("llama.cpp", "ours quant q8") else
                     "gguf, fp32 act" if n.startswith("ours quant") else "fp32")
            rows.append(Row.measured("cpu_peer", n, tm, shape=args.model, dtype=dtype, device="cpu", extra=extra))
    path = write_results(args.json, rows, command=command_line("benchmarks.cpu_peer"), device="cpu",
                         meta={"model": args.model, "gguf": os.path.basename(str(gguf)), "llama_cpp": peer})
    print(f"wrote {path}")
    for r in runners.get("llama.cpp", {}).values():
        r.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
