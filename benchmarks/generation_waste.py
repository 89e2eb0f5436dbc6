"""How much of a GSM8K generation batch's work its answers use, in lm-eval's loop and in batches refilled as
sequences finish, side by side on the same items.

lm-eval's loop (``--loops lm_eval``) ends a batch of greedy ``generate_until`` requests only once every sequence
has emitted the same stop string, or after ``max_gen_toks`` new tokens (256): every sequence of the batch is
computed for as many steps as the batch runs. The refilled loop (``rounds``, ``workers.evals.generation``, what
``ScoringLM`` runs by default) retires finished sequences and refills their rows. For each loop the script runs
the first ``--limit`` items at ``--batch`` sequences per batch and reports:
- its seconds and its steps (one decoder forward of the batch each);
- the tokens each answer needed (its text up to the first stop string, re-tokenized; the whole generation for an
  answer that never stopped);
- the useful fraction: needed tokens over the sequence-steps computed;
- whether the texts of the two loops are equal, item by item.

    python -m benchmarks.generation_waste --device cpu --limit 16 --batch 16 --threads 2 \\
        --json generation_waste_cpu.json

``--loops rounds_reprefill,rounds --repeats 2`` times the refilled loop as it was (every row prefilled again each
round) beside the one that keeps the cache of the rows still going, interleaved. ``--max-gen-toks N`` ends every
answer after N new tokens instead of the task's 256 (both loops): a check of the script on a small model, whose
answers may never stop.

Feeds: BENCHMARKS.md, "Scoring and evaluation cost".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.harness import command_line, device_line, write_results

TASK = "gsm8k_cot"
MAX_GEN = 256          # the task's max_gen_toks
REPREFILL = "rounds_reprefill"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation_waste", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=16, help="the first N GSM8K items")
    p.add_argument("--batch", type=int, default=16, help="sequences per generation batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loops", default="lm_eval,rounds", help="comma list of generation loops, run in this order "
                   f"(scoring.GENERATION_LOOPS, or {REPREFILL}: the refilled loop prefilling every row again each "
                   "round)")
    p.add_argument("--repeats", type=int, default=1, help="run the loops this many times, the order reversed "
                   "every other time (seconds: the median)")
    p.add_argument("--max-gen-toks", type=int, default=MAX_GEN,
                   help=f"new tokens at most per answer (default: the task's, {MAX_GEN})")
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    if a.limit < 1 or a.batch < 1 or a.repeats < 1 or a.max_gen_toks < 1:
        p.error("--limit, --batch, --repeats and --max-gen-toks must be at least 1")
    from workers.evals.scoring import GENERATION_LOOPS

    a.loops = [x for x in a.loops.split(",") if x]
    known = (*GENERATION_LOOPS, REPREFILL)
    if not a.loops or not set(a.loops) <= set(known) or len(set(a.loops)) != len(a.loops):
        p.error(f"--loops: each of {known} at most once")
    from lm_eval.models.huggingface import HFLM

    from workers.units import Units

    torch.set_num_threads(a.threads)
    print(device_line(a.device), flush=True)
    lm = Units(device=a.device).lm(a.model)
    model, tok = lm.model, lm.tokenizer
    results, times = {}, {loop: [] for loop in a.loops}
    order = [a.loops if k % 2 == 0 else a.loops[::-1] for k in range(a.repeats)]
    # the answers' length limit: lm-eval's model class gives it to both loops (``max_gen_toks``, the task's 256)
    real_max_gen = HFLM.__dict__["max_gen_toks"]
    if a.max_gen_toks != MAX_GEN:
        HFLM.max_gen_toks = property(lambda self: a.max_gen_toks)
    try:
        for loop in (x for loops in order for x in loops):
            _run_loop(a, loop, model, tok, results, times)
    finally:
        HFLM.max_gen_toks = real_max_gen
    if len(results) == 2:
        a_, b_ = (results[k]["texts"] for k in a.loops)
        same = sum(x == y for x, y in zip(a_, b_))
        print(f"texts equal in both loops: {same} of {len(a_)}; steps {a.loops[0]} / {a.loops[1]}: "
              f"{results[a.loops[0]]['steps'] / max(1, results[a.loops[1]]['steps']):.2f}, seconds (median of "
              f"{a.repeats}): {results[a.loops[0]]['seconds'] / results[a.loops[1]]['seconds']:.2f}")
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.generation_waste"), device=a.device,
                             meta={"model": a.model, "threads": a.threads, "limit": a.limit, "batch": a.batch,
                                   "repeats": a.repeats, "max_gen_toks": a.max_gen_toks},
                             sections={"loops": results})
        print(f"wrote {path}")
    return 0


def _run_loop(a, loop: str, model, tok, results: dict, times: dict) -> None:
    """One run of ``loop`` on the first ``a.limit`` items: its seconds, steps and useful fraction into ``results``."""
    from workers.evals import generation
    from workers.evals.suites import run_suite

    steps: list[tuple[int, int]] = []        # lm-eval's loop: (sequences, steps) per batch
    stats: dict[str, int] = {}               # the refilled loop's counts
    real_generate, real_refilling = model.generate, generation.refilling_greedy

    def counted(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        steps.append((int(out.shape[0]), int(out.shape[1] - kwargs["input_ids"].shape[1])))
        return out

    def refilling(*args, **kwargs):
        return real_refilling(*args[:7], stats=stats, keep_cache=loop != REPREFILL)

    model.generate, generation.refilling_greedy = counted, refilling
    try:
        t0 = time.perf_counter()
        rows = run_suite(model, tok, [TASK], limit=a.limit, batch_size=a.batch, keep_items=True,
                         generation="rounds" if loop == REPREFILL else loop)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        times[loop].append(time.perf_counter() - t0)
        seconds = statistics.median(times[loop])
    finally:
        model.generate, generation.refilling_greedy = real_generate, real_refilling
    if loop == "lm_eval":
        n_steps, computed = sum(s for _, s in steps), sum(b * s for b, s in steps)
    else:
        n_steps, computed = stats["steps"], stats["row_steps"]
    # the texts lm-eval kept are cut at the first stop string; one that never stopped is the whole generation
    texts = [it.outputs["raw"] for it in rows[0].items]
    needed = [min(len(tok.encode(t, add_special_tokens=False)), a.max_gen_toks) for t in texts]
    useful = sum(needed) / computed if computed else 0.0
    results[loop] = {"seconds": seconds, "runs_s": times[loop], "steps": n_steps, "sequence_steps": computed,
                     "useful_fraction": useful, "needed_tokens": needed, "texts": texts, "counts": stats or None,
                     "steps_per_batch": steps or None, "scores": [(r.metric, r.value) for r in rows]}
    print(f"{TASK} by {loop}: first {a.limit} items, {a.batch} rows, {times[loop][-1]:.1f} s, {n_steps} steps; "
          f"useful fraction {useful:.2f} ({sum(needed)} of {computed} sequence-steps)", flush=True)
    print(f"  tokens the answers needed: median {statistics.median(needed):.0f}, mean "
          f"{statistics.mean(needed):.1f}; scores {results[loop]['scores']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
