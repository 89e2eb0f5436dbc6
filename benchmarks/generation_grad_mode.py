"""The refilled generation loop (``workers.evals.generation.refilling_greedy``) under ``torch.inference_mode`` (what
it runs, ``generation.GRAD_MODE``) against ``torch.no_grad``, side by side: interleaved repeats
(``harness.time_cpu``), the same prompts, the tokens compared.

    python -m benchmarks.generation_grad_mode --device cpu --threads 2 --json generation_grad_mode_cpu.json

A decode step is hundreds of small ops, each paying autograd's bookkeeping under ``no_grad`` (version counters,
view tracking); ``inference_mode`` skips it.

Feeds: BENCHMARKS.md, "Scoring and evaluation cost".
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import Row, device_line, time_cpu, write_results

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generation_grad_mode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="sequences per batch")
    ap.add_argument("--new", type=int, default=24, help="new tokens per prompt (no stop string)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = ap.parse_args(argv)
    from workers.evals import generation as G
    from workers.loading.models import load_model

    torch.set_num_threads(a.threads)
    print(device_line(a.device), flush=True)
    lm = load_model(a.model, device=a.device)
    tok = lm.tokenizer
    prompts = [tok.encode(f"Question {i}: what is {i} plus {i + 3}? Let's think step by step.")
               for i in range(a.prompts)]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def run(mode):
        def go():
            saved, G.GRAD_MODE = G.GRAD_MODE, MODES[mode]
            try:
                return G.refilling_greedy(lm.model, prompts, a.rows, a.new, lambda t: False, eos, pad)
            finally:
                G.GRAD_MODE = saved
        return go

    cmp = time_cpu({m: run(m) for m in MODES}, repeats=a.repeats, warmup=1, baseline="no_grad")
    same = cmp.outputs["no_grad"] == cmp.outputs["inference_mode"]
    rows = []
    for m, t in cmp.timings.items():
        ratio = cmp.ratio(m)
        rows.append(Row.measured("generation_grad_mode", m, t, shape=f"{a.prompts} prompts x {a.new} new",
                                 dtype=str(next(lm.model.parameters()).dtype).replace("torch.", ""),
                                 batch=a.rows, device=a.device, extra={"x_no_grad": round(ratio, 3),
                                                                      "same_tokens": same,
                                                                      "samples_s": list(t.samples)}))
        print(f"{m:<15} " + ", ".join(f"{x:.2f}" for x in t.samples) + f" s   median {t.median:.3f} s   "
              f"{ratio:.3f}x no_grad", flush=True)
    print(f"same tokens: {same}")
    if a.json:
        print(f"wrote {write_results(a.json, rows, device=a.device, meta={'model': a.model, 'threads': a.threads})}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
