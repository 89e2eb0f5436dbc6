"""How much of a GSM8K generation batch's work its answers use. lm-eval's loop (what a sweep runs) ends a batch of
greedy ``generate_until`` requests only once every sequence has emitted the same stop string, or after
``max_gen_toks`` new tokens (256). Every sequence of the batch is computed for as many steps as the batch runs.
This script runs the first ``--limit`` items at ``--batch`` sequences per batch and reports:
- the steps each batch ran;
- the tokens each answer needed (its text up to the first stop string, re-tokenized; the whole generation for an
  answer that never stopped);
- the useful fraction: needed tokens over sequences × steps.

A generation loop that retired finished sequences and refilled their rows would need about "needed / batch" steps
instead.

    python -m benchmarks.generation_waste --device cpu --limit 16 --batch 16 --threads 2 \\
        --json generation_waste_cpu.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.harness import command_line, write_results

TASK = "gsm8k_cot"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation_waste", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=16, help="the first N GSM8K items")
    p.add_argument("--batch", type=int, default=16, help="sequences per generation batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    if a.limit < 1 or a.batch < 1:
        p.error("--limit and --batch must be at least 1")
    from workers.evals.suites import run_suite
    from workers.units import Units

    torch.set_num_threads(a.threads)
    lm = Units(device=a.device).lm(a.model)
    model, tok = lm.model, lm.tokenizer
    steps: list[tuple[int, int]] = []        # (sequences, steps) per batch
    real_generate = model.generate

    def counted(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        steps.append((int(out.shape[0]), int(out.shape[1] - kwargs["input_ids"].shape[1])))
        return out

    model.generate = counted
    try:
        t0 = time.perf_counter()
        rows = run_suite(model, tok, [TASK], limit=a.limit, batch_size=a.batch, keep_items=True)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        model.generate = real_generate
    # the texts lm-eval kept are cut at the first stop string; one that never stopped is the whole generation
    needed = []
    for it in rows[0].items:
        needed.append(min(len(tok.encode(it.outputs["raw"], add_special_tokens=False)), max(s for _, s in steps)))
    computed = sum(b * s for b, s in steps)
    useful = sum(needed) / computed if computed else 0.0
    print(f"{TASK}, first {a.limit} items, {a.batch} per batch, {seconds:.1f} s")
    print(f"  steps per batch: {[s for _, s in steps]}")
    print(f"  tokens the answers needed: median {statistics.median(needed):.0f}, mean {statistics.mean(needed):.1f}, "
          f"sorted {sorted(needed)}")
    print(f"  useful fraction of the computed sequence-steps: {useful:.2f} ({sum(needed)} of {computed})")
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.generation_waste"), device=a.device,
                             meta={"model": a.model, "threads": a.threads, "limit": a.limit, "batch": a.batch},
                             sections={"seconds": seconds, "steps_per_batch": steps, "needed_tokens": needed,
                                       "useful_fraction": useful,
                                       "scores": [(r.metric, r.value) for r in rows]})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
