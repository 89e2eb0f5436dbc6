"""Multiple-choice suites on a real model from the command line: accuracy per task with its standard error.

    python -m benchmarks.suites --model smollm2-135m --tasks piqa,arc_easy,copa --limit 200 [--json out.json]

Feeds: BENCHMARKS.md, "Scripts and result files" (no figure of its own: docs/evaluation.md runs it, accuracy outside a
sweep).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from workers.evals.suites import format_table, run_suite
from workers.evals.tasks import SUITES, SuiteError, check_task_names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suites", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model ref for workers.loading.models.load_model (default smollm2-135m)")
    p.add_argument("--tasks", default="piqa,arc_easy,copa", help=f"comma list of: {','.join(SUITES)}")
    p.add_argument("--limit", type=int, default=None, help="first N items of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--list", action="store_true", help="list the known tasks and exit")
    a = p.parse_args(argv)
    if a.list:
        for t in SUITES.values():
            print(f"{t.name:<14} lm-eval {t.lm_eval_task:<14} metrics {','.join(t.metrics):<13} split {t.split}"
                  f" (upstream {t.upstream_split})")
        return 0
    try:
        names = check_task_names(a.tasks)
    except SuiteError as e:
        p.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from workers.loading.models import DEFAULT_MODEL, load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    lm = load_model(a.model or DEFAULT_MODEL, dtype=a.dtype, device=a.device)
    load_s = time.time() - t0
    rows = run_suite(lm.model, lm.tokenizer, names, a.limit, batch_size=a.batch_size, seed=a.seed)
    print(f"\nmodel {lm.ref} ({a.dtype}, {a.device}) fingerprint {lm.fingerprint[:12]}  "
          f"lm-eval {rows[0].lm_eval_version}  limit {a.limit}")
    print(format_table(rows))
    print(f"load {load_s:.1f} s, evaluation {rows[0].seconds:.1f} s")
    if a.json:
        payload = {"model": lm.ref, "model_fingerprint": lm.fingerprint, "dtype": a.dtype, "device": a.device,
                   "limit": a.limit, "batch_size": a.batch_size, "seed": a.seed,
                   "rows": [r.row() for r in rows]}
        Path(a.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
