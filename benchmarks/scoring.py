"""What an accuracy evaluation costs per request: lm-eval as shipped (``HFLM``, its per-request scoring loop, its
Jinja templates compiled per use) against ours (``workers.evals.suites.run_suite``: one device round trip per
batch, logits only where a continuation is scored, templates compiled once), on the same model, tasks, items and
batch size, the two interleaved (ABBA over the repeats); also how far their log-likelihoods and accuracies differ.

    python -m benchmarks.scoring --model smollm2-135m --device cuda \\
        --tasks piqa:1000,arc_easy,hellaswag:2000,mmlu:20,lambada_openai:2000 --repeats 2 --json scoring.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.harness import command_line, task_limit, write_results
from workers.evals.tasks import SUITES, SuiteError, build_task, check_task_names


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _stock(model, tok, name: str, limit: int | None, batch: int) -> tuple[dict, float]:
    """lm-eval as a user runs it on an existing model: {(member, doc, choice): ll}, accuracy over all items."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    members = SUITES[name].members()
    tasks = [build_task(name, m) for m in members] if members else [build_task(name)]
    out = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=batch), tasks=tasks,
                                  limit=limit, task_manager=TaskManager(include_defaults=False),
                                  bootstrap_iters=1000, log_samples=True, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    lls, correct = {}, []
    for leaf, samples in out["samples"].items():
        for s in samples:
            for i, r in enumerate(s["resps"]):
                lls[(leaf if members else None, s["doc_id"], i)] = float(r[0][0])
            correct.append(float(s["acc"]))
    return lls, statistics.fmean(correct)


def _ours(model, tok, name: str, limit: int | None, batch: int) -> tuple[dict, float, int]:
    from workers.evals.suites import run_suite

    rows = run_suite(model, tok, [name], limit, batch_size=batch, keep_items=True)
    row = next(r for r in rows if r.metric == "acc")
    lls = {(it.subtask, it.doc_id, i): ll for it in row.items for i, ll in enumerate(it.loglikelihoods)}
    return lls, row.value, sum(len(it.requests) for it in row.items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scoring", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tasks", default="piqa:1000,arc_easy,hellaswag:2000,mmlu:20,lambada_openai:2000",
                   help="comma list of task[:limit] (multiple-choice and LAMBADA tasks)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward, both paths")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    try:
        tasks = [task_limit(t) for t in a.tasks.split(",") if t]
        check_task_names([n for n, _ in tasks])
        bad = [n for n, _ in tasks if SUITES[n].output_type == "generate_until"]
        if bad:
            raise SuiteError(f"generation tasks are scored by lm-eval's own loop in both paths: {bad}")
    except SuiteError as e:
        p.error(str(e))
    os.environ["DISABLE_MULTIPROC"] = "1"
    import torch

    from workers.loading.models import load_model

    torch.set_num_threads(a.threads)
    lm = load_model(a.model, dtype=a.dtype, device=a.device)
    for name, _ in tasks:                      # untimed: data reads and first-call costs of each task, both paths
        _stock(lm.model, lm.tokenizer, name, 2, a.batch_size)
        _ours(lm.model, lm.tokenizer, name, 2, a.batch_size)
    rows = []
    for name, limit in tasks:
        secs: dict[str, list[float]] = {"lm-eval": [], "ours": []}
        for rep in range(a.repeats):
            order = ("lm-eval", "ours") if rep % 2 == 0 else ("ours", "lm-eval")
            for path in order:
                _sync(a.device)
                t0 = time.perf_counter()
                if path == "lm-eval":
                    ref, ref_acc = _stock(lm.model, lm.tokenizer, name, limit, a.batch_size)
                else:
                    got, acc, n_req = _ours(lm.model, lm.tokenizer, name, limit, a.batch_size)
                _sync(a.device)
                secs[path].append(time.perf_counter() - t0)
        if set(ref) != set(got):
            raise SystemExit(f"{name}: the two paths scored different requests")
        diff = max(abs(ref[k] - got[k]) for k in ref)
        row = {"task": name, "limit": limit, "requests": n_req,
               "lm_eval_s": statistics.median(secs["lm-eval"]), "ours_s": statistics.median(secs["ours"]),
               "lm_eval_ms_per_request": 1e3 * statistics.median(secs["lm-eval"]) / n_req,
               "ours_ms_per_request": 1e3 * statistics.median(secs["ours"]) / n_req,
               "speedup": statistics.median(secs["lm-eval"]) / statistics.median(secs["ours"]),
               "max_abs_ll_diff": diff, "acc_lm_eval": ref_acc, "acc_ours": acc,
               "seconds": secs}
        rows.append(row)
        print(f"{name:<15} {n_req:>6} requests  lm-eval {row['lm_eval_s']:7.2f} s "
              f"({row['lm_eval_ms_per_request']:.2f} ms/req)  ours {row['ours_s']:7.2f} s "
              f"({row['ours_ms_per_request']:.2f} ms/req)  x{row['speedup']:.2f}  max|dll| {diff:.1e}  "
              f"acc {ref_acc:.4f} / {acc:.4f}", flush=True)
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.scoring"), device=a.device,
                             meta={"model": a.model, "fingerprint": lm.fingerprint, "dtype": a.dtype,
                                   "batch_size": a.batch_size, "threads": a.threads},
                             sections={"tasks": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
