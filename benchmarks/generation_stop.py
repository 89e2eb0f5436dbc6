"""GSM8K generation with each sequence stopping on its own (``workers.evals.generation``, what a sweep runs) against
lm-eval's own loop, which ends a batch only once every sequence has emitted the same stop string: seconds, tokens
generated per batch, and whether the texts and scores are equal. Both run in one process on the same model, in
alternating order over ``--repeats`` rounds.

    python -m benchmarks.generation_stop --device cpu --limit 16 --batch 16 --threads 2 \\
        --json generation_stop_cpu.json
    python -m benchmarks.generation_stop --device cuda --limit 256 --batch 128 --json generation_stop_h200.json
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation_stop", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=16, help="the first N GSM8K items")
    p.add_argument("--batch", type=int, default=16, help="sequences per generation batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds; each runs both, the order alternating")
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    if a.limit < 1 or a.batch < 1 or a.repeats < 1:
        p.error("--limit, --batch and --repeats must be at least 1")
    from lm_eval.models.huggingface import HFLM

    from workers.evals.scoring import scoring_lm
    from workers.evals.suites import run_suite
    from workers.units import Units

    torch.set_num_threads(a.threads)
    lm = Units(device=a.device).lm(a.model)
    model, cls = lm.model, scoring_lm()
    ours = cls._model_generate
    widths: list[int] = []
    real_generate = model.generate

    def counted(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        widths.append(int(out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    model.generate = counted
    runs = {"each sequence stops": ours, "lm-eval's loop": HFLM._model_generate}
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {}
    answers: dict[str, list] = {}
    try:
        for r in range(a.repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                cls._model_generate = runs[name]
                widths.clear()
                t0 = time.perf_counter()
                rows = run_suite(model, lm.tokenizer, [TASK], limit=a.limit, batch_size=a.batch, keep_items=True)
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - t0)
                tokens[name] = list(widths)
                answers[name] = [(x.metric, x.value, [it.outputs for it in x.items]) for x in rows]
                print(f"{name:<20} {seconds[name][-1]:8.1f} s  new tokens per batch {widths}", flush=True)
    finally:
        cls._model_generate = ours
        model.generate = real_generate
    same = answers["each sequence stops"] == answers["lm-eval's loop"]
    med = {k: statistics.median(v) for k, v in seconds.items()}
    speedup = med["lm-eval's loop"] / med["each sequence stops"]
    print(f"texts and scores equal: {same}; median seconds {med}; {speedup:.2f}x")
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.generation_stop"), device=a.device,
                             meta={"model": a.model, "threads": a.threads, "limit": a.limit, "batch": a.batch},
                             sections={"seconds": seconds, "new_tokens_per_batch": tokens, "equal": same,
                                       "speedup": speedup,
                                       "scores": {k: [(m, v) for m, v, _ in ans] for k, ans in answers.items()}})
        print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
