"""What an accuracy evaluation costs per request, and how much of it is the host's: lm-eval as shipped (``HFLM``, its
per-request scoring loop, its Jinja templates compiled per use), ours through lm-eval's pass
(``run_suite(..., request_cache=False)``: one device round trip per batch, logits only where a continuation is
scored, templates compiled once) and ours from cached requests (``run_suite``: requests templated, tokenized and
ordered once per task and tokenizer, ``workers.evals.request_cache``), on the same model, tasks, items and batch
size, the paths interleaved (their order reversed every other repeat), medians over the repeats; also how far their
log-likelihoods and accuracies differ.

Host time = wall time - what the host waits for: for our paths the scoring forwards from upload to download (the
forward, the log-softmax and gather of the scored positions: ``workers.evals.scoring.device_clock``), for lm-eval's
the model's forward calls (hooks, synchronized on a GPU; its per-request log-softmax over every position counts as
host). What is left: templating, tokenization, batching, per-item metrics, aggregation, rows.
``cached cold`` is the first cached call of a task (it builds and stores the entry); the timed cached calls read it.

    python -m benchmarks.scoring --model smollm2-135m --device cuda \\
        --tasks piqa:1000,arc_easy,hellaswag:2000,mmlu:20,lambada_openai:2000 --repeats 2 --json scoring.json
    python -m benchmarks.scoring --device cpu --layers 1 --paths cached --profile cached.prof   # where it goes

Feeds: BENCHMARKS.md, "Scoring and evaluation cost".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.harness import command_line, device_line, task_limit, write_results
from workers.evals.tasks import SUITES, SuiteError, build_task, check_task_names

PATHS = ("lm-eval", "uncached", "cached")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class ForwardClock:
    """Seconds spent inside a module's forward calls (hooks; synchronized on a GPU)."""

    def __init__(self, module, device: str):
        self.seconds, self._t0, self.device = 0.0, 0.0, device
        self._hooks = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def _start(self, *_):
        _sync(self.device)
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        _sync(self.device)
        self.seconds += time.perf_counter() - self._t0


def _stock(model, tok, name: str, limit: int | None, batch: int) -> tuple[dict, float, int]:
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
    return lls, statistics.fmean(correct), len(lls)


def _ours(model, tok, name: str, limit: int | None, batch: int, cached: bool) -> tuple[dict, float, int]:
    from workers.evals.suites import run_suite

    rows = run_suite(model, tok, [name], limit, batch_size=batch, keep_items=True, request_cache=cached)
    row = next(r for r in rows if r.metric == "acc")
    lls = {(it.subtask, it.doc_id, i): ll for it in row.items for i, ll in enumerate(it.loglikelihoods)}
    return lls, row.value, sum(len(it.requests) for it in row.items)


def _run(path: str, lm, name: str, limit: int | None, batch: int):
    if path == "lm-eval":
        return _stock(lm.model, lm.tokenizer, name, limit, batch)
    return _ours(lm.model, lm.tokenizer, name, limit, batch, cached=path == "cached")


def _truncate(lm, layers: int) -> None:
    """Keep the first ``layers`` decoder layers (a cheap forward, so that the host's share shows in a profile)."""
    import torch

    decoder = lm.adapter.decoder_layers(lm.model)
    del decoder[layers:]
    lm.model.config.num_hidden_layers = layers
    if getattr(lm.model.config, "layer_types", None):
        lm.model.config.layer_types = lm.model.config.layer_types[:layers]
    assert isinstance(decoder, torch.nn.ModuleList) and len(decoder) == layers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scoring", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tasks", default="piqa:1000,arc_easy,hellaswag:2000,mmlu:20,lambada_openai:2000",
                   help="comma list of task[:limit] (multiple-choice and LAMBADA tasks)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list among {PATHS}")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward, every path")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N decoder layers (profiling the host's share; values change)")
    p.add_argument("--profile", default=None, help="write a cProfile of one more (untimed) cached call per task "
                                                   "to this file and print its top functions")
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    try:
        tasks = [task_limit(t) for t in a.tasks.split(",") if t]
        check_task_names([n for n, _ in tasks])
        bad = [n for n, _ in tasks if SUITES[n].output_type == "generate_until"]
        if bad:
            raise SuiteError(f"generation tasks are scored by lm-eval's own loop in every path: {bad}")
        paths = [x for x in a.paths.split(",") if x]
        if not paths or not set(paths) <= set(PATHS):
            raise SuiteError(f"--paths must be among {PATHS}, got {paths}")
        if a.profile and "cached" not in paths:
            raise SuiteError("--profile profiles the cached path: give it in --paths")
    except SuiteError as e:
        p.error(str(e))
    os.environ["DISABLE_MULTIPROC"] = "1"
    import torch

    from workers.evals import request_cache
    from workers.loading.models import load_model

    torch.set_num_threads(a.threads)
    print(device_line(a.device), flush=True)
    lm = load_model(a.model, dtype=a.dtype, device=a.device)
    if a.layers:
        _truncate(lm, a.layers)
    from workers.evals.scoring import device_clock

    clock = ForwardClock(lm.model, a.device)
    profiler = None
    if a.profile:
        import cProfile

        profiler = cProfile.Profile()
    for name, _ in tasks:                      # untimed: data reads and first-call costs of each task, every path
        for path in paths:
            _run(path, lm, name, 2, a.batch_size)
    rows = []
    for name, limit in tasks:
        cold = None
        if "cached" in paths:                  # builds (or reads) the entry the timed cached calls read
            _sync(a.device)
            t0 = time.perf_counter()
            _run("cached", lm, name, limit, a.batch_size)
            cold = time.perf_counter() - t0
        secs: dict[str, list[float]] = {x: [] for x in paths}
        host: dict[str, list[float]] = {x: [] for x in paths}
        got: dict[str, tuple] = {}
        reads = request_cache.counts["read"]
        for rep in range(a.repeats):
            for path in (paths if rep % 2 == 0 else paths[::-1]):
                _sync(a.device)
                fwd0, dev0 = clock.seconds, device_clock["seconds"]
                t0 = time.perf_counter()
                got[path] = _run(path, lm, name, limit, a.batch_size)
                _sync(a.device)
                dt = time.perf_counter() - t0
                secs[path].append(dt)
                waited = (clock.seconds - fwd0) if path == "lm-eval" else (device_clock["seconds"] - dev0)
                host[path].append(dt - waited)
        if "cached" in paths and request_cache.counts["read"] - reads != a.repeats:
            raise SystemExit(f"{name}: the timed cached calls did not all read the stored requests")
        if profiler is not None:               # one more cached call, untimed: the profiler's overhead stays out
            profiler.enable()
            _run("cached", lm, name, limit, a.batch_size)
            profiler.disable()
        n_req = {got[x][2] for x in paths}
        if len(n_req) != 1 or len({frozenset(got[x][0]) for x in paths}) != 1:
            raise SystemExit(f"{name}: the paths scored different requests")
        n_req = n_req.pop()
        row = {"task": name, "limit": limit, "requests": n_req, "cached_cold_s": cold, "seconds": secs,
               "host_seconds": host}
        for x in paths:
            key = x.replace("-", "_")
            row[f"{key}_s"] = statistics.median(secs[x])
            row[f"{key}_ms_per_request"] = 1e3 * statistics.median(secs[x]) / n_req
            row[f"{key}_host_ms_per_request"] = 1e3 * statistics.median(host[x]) / n_req
            row[f"acc_{key}"] = got[x][1]
        ref = got[paths[0]][0]
        row["max_abs_ll_diff"] = {x: max(abs(ref[k] - got[x][0][k]) for k in ref) for x in paths[1:]}
        rows.append(row)
        text = "  ".join(f"{x} {row[x.replace('-', '_') + '_ms_per_request']:.2f} ms/req "
                         f"(host {row[x.replace('-', '_') + '_host_ms_per_request']:.3f})" for x in paths)
        diffs = " ".join(f"{x} {d:.1e}" for x, d in row["max_abs_ll_diff"].items())
        print(f"{name:<15} {n_req:>6} requests  {text}"
              + (f"  cached cold {cold:.2f} s" if cold is not None else "")
              + f"  max|dll| vs {paths[0]}: {diffs or '-'}  acc " + " / ".join(f"{got[x][1]:.4f}" for x in paths),
              flush=True)
    if profiler is not None:
        import pstats

        profiler.dump_stats(a.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.scoring"), device=a.device,
                             meta={"model": a.model, "fingerprint": lm.fingerprint, "dtype": a.dtype,
                                   "batch_size": a.batch_size, "threads": a.threads, "layers": a.layers,
                                   "paths": paths},
                             sections={"tasks": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
