"""What a sparse setting's accuracy evaluation costs against dense, and whether the two execution modes agree.

The sweep's own units (``workers.units.Units``: collect, fit, eval) run in one process on one device; for each
task, dense and every (setting, mode) are evaluated back to back, so drift and load hit them alike. ``masked``
computes the FFN / head parts as dense products with the unselected entries zeroed, ``kernel`` with the
token-sparse products (``workers.sparsity.sparse_exec``); the selection is the same, so their accuracy values
may differ only by summation order. Bundles and activation caches stay under ``$CTXSPARSE_HOME`` (a re-run fits
nothing again). ``--batchings`` times each task under several scoring batchings, side by side (their order
reversed from one task to the next): ``N`` sequences per forward, ``tN`` forwards of at most N padded tokens (the
GPU sweep's is ``t32768``), either with ``@bf16`` (or ``@tf32``, ``@fp32``: the forward precision, ``--matmul``
where it is left out), ``+fused`` (the norms and rotary embedding as one kernel each,
``workers.evals.fused_forward``), ``+lmeval`` (generation tasks by lm-eval's own loop instead of batches refilled
as sequences finish, ``workers.evals.generation``), ``+eager`` (the sparse settings' masks made the way they were
before they were fused, the baseline of that change: the oracle and the threshold computing their scores from the
FFN input again, TEAL's and WINA's masked inputs in three or four eager kernels, top-k sorted by ``torch.topk``) and
``+torchtopk`` (only the top-k masks by ``torch.topk`` and a scatter instead of one Triton pass,
``kernels.topk_mask_triton``); each is compared with dense under the same batching and with the first.

    python -m benchmarks.eval_cost --device cuda --settings oracle:0.5,threshold:0.5,svd:0.5:256 \\
        --tasks perplexity,piqa:1000,arc_easy,lambada_openai:2000,gsm8k_cot:20 --json eval_cost.json
    python -m benchmarks.eval_cost --device cuda --settings oracle:0.5,teal:0.5 --modes masked --matmul tf32 \\
        --tasks hellaswag:2000,mmlu:20,piqa --batchings 32,t8192,t32768,t65536,t32768@bf16,t32768+fused --profile \\
        --json eval_batching.json
    python -m benchmarks.eval_cost --device cuda --settings '' --modes masked --matmul tf32 \\
        --tasks gsm8k_cot:256 --batchings 128,128+lmeval --json eval_generation.json

``--profile`` runs each (setting, mode, batching) of the first task once more under ``torch.profiler``, untimed,
and keeps its ops by device time: where a scoring forward's time goes.

Feeds: BENCHMARKS.md, "Scoring and evaluation cost".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from benchmarks.harness import command_line, device_line, task_limit, write_results
from workers.evals.suites import prepare_requests
from workers.evals.tasks import SuiteError, check_task_names
from workers.names import DENSE, MATMUL_BF16, MATMUL_FP32, MATMUL_TF32
from workers.sparsity.sparse_exec import EXEC_MODES as MODES
from workers.units import Units

OPTIONS = {"svd": {"target": "product"}}      # the settings the GPU sweep publishes
MATMULS = (MATMUL_FP32, MATMUL_TF32, MATMUL_BF16)
MASKS = ("eager", "torchtopk")                # the masks made another way (``_masks``)
SUFFIXES = {"fused", "lmeval", *MASKS}        # of a batching: fused norms and rotary; lm-eval's generation loop;
                                              # the masks made another way


def _setting(spec: str) -> dict:
    """``method:sparsity[:rank][:option=value]...`` (a value is read as JSON where it parses, else as a string)."""
    parts = spec.split(":")
    if len(parts) < 2:
        raise ValueError(f"setting {spec!r}: expected method:sparsity[:rank][:option=value]...")
    rank, options = None, dict(OPTIONS.get(parts[0], {}))
    for part in parts[2:]:
        key, eq, value = part.partition("=")
        if not eq:
            rank = int(part)
            continue
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return {"method": parts[0], "sparsity": float(parts[1]), "rank": rank, "options": options}


def _id(cfg: dict) -> str:
    return hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def _main_value(out) -> tuple[str, float, float | None]:
    """(metric, value, stderr) a task is judged by: ppl for perplexity, else the first accuracy row's."""
    rows = out.accuracy
    row = next((r for r in rows if r["metric"] == "ppl"), rows[0])
    return row["metric"], row["value"], row.get("stderr")


def _batching(spec: str, matmul: str) -> dict:
    """``N``: N sequences per forward; ``tN``: forwards of at most N padded tokens (``scoring.token_batches``);
    either one ``@fp32|@tf32|@bf16``: the forward precision (``suites.matmul``) instead of ``matmul``; then
    ``+fused``: the norms and rotary embedding fused (``workers.evals.fused_forward``), ``+lmeval``: generation by
    lm-eval's own loop (``scoring.GENERATION_LOOPS``), ``+eager``: the masks made as before they were fused
    (``_masks``), ``+torchtopk``: the top-k masks by ``torch.topk`` (``_masks``); any of them, each once, but not both
    of the last two."""
    spec, _, extra = spec.partition("+")
    suffixes = extra.split("+") if extra else []
    if not set(suffixes) <= SUFFIXES or len(set(suffixes)) != len(suffixes):
        raise ValueError(f"batching {spec}+{extra}: suffixes are {sorted(SUFFIXES)}, each at most once")
    if len(set(suffixes) & set(MASKS)) > 1:
        raise ValueError(f"batching {spec}+{extra}: one way of making the masks, of {list(MASKS)}")
    size, _, precision = spec.partition("@")
    precision = precision or matmul
    if precision not in MATMULS:
        raise ValueError(f"batching {spec!r}: precision {precision!r} is not one of {MATMULS}")
    try:
        n = int(size[1:] if size.startswith("t") else size)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"batching {spec!r}: N (sequences per forward) or tN (padded tokens per forward), N >= 1")
    return {("batch_tokens" if size.startswith("t") else "batch_size"): n,
            **({"matmul": precision} if precision != MATMUL_FP32 else {}),
            **({"fused": True} if "fused" in suffixes else {}),
            **({"generation": "lm_eval"} if "lmeval" in suffixes else {}),
            **({"masks": s for s in suffixes if s in MASKS})}


def _forward(batching: dict) -> dict:
    """What of a batching (``_batching``) changes how it runs rather than its batches: precision, fusion, the
    generation loop."""
    return {k: v for k, v in batching.items() if k in ("matmul", "fused", "generation", "masks")}


@contextmanager
def _masks(how: str | None):
    """Inside the block, the sparse settings' masks are made another way (``MASKS``). ``"eager"``: as they were
    before they were fused: the oracle's and the threshold's scores computed again from the FFN input
    (``MLPPredictor.reads_ffn`` off), TEAL's and WINA's masked inputs by eager abs / multiply / compare / where
    (``input_sparse._one_pass`` off), top-k sorted by ``torch.topk`` (``base.topk_mask``). ``"torchtopk"``: only the
    top-k masks, by ``torch.topk`` and a scatter (``base.torch_topk_mask``) instead of one Triton pass. The same
    selections (the test suite checks each against its fused form); only the time differs."""
    if how is None:
        yield
        return
    if how not in MASKS:
        raise ValueError(f"masks {how!r}: one of {list(MASKS)}")
    from workers.sparsity import input_sparse
    from workers.sparsity.predictors import base
    from workers.methods.oracle.predictor import OracleMLP
    from workers.methods.threshold.predictor import GateThreshold

    def sorted_topk_mask(values, k):         # base.topk_mask as it was: the same set, the k values sorted
        m = torch.zeros_like(values, dtype=torch.bool)
        if k:
            m.scatter_(1, values.topk(k, dim=1).indices, True)
        return m

    saved = (OracleMLP.reads_ffn, GateThreshold.reads_ffn, input_sparse._one_pass, base.topk_mask)
    if how == "eager":
        OracleMLP.reads_ffn = GateThreshold.reads_ffn = False
        input_sparse._one_pass = lambda x: False
        base.topk_mask = sorted_topk_mask
    else:
        base.topk_mask = base.torch_topk_mask
    try:
        yield
    finally:
        OracleMLP.reads_ffn, GateThreshold.reads_ffn, input_sparse._one_pass, base.topk_mask = saved


def _profiled(units, cfg: dict, device: str, top: int = 25) -> list[dict]:
    """One more run of an eval unit under torch.profiler: its ``top`` ops by time on the device (CPU time on a
    CPU), with their calls and share of the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        units.run("eval", _id(cfg), cfg)
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ev = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in ev) or 1
    ev.sort(key=lambda e: -getattr(e, attr))
    return [{"op": e.key, "calls": e.count, "ms": getattr(e, attr) / 1e3, "share": getattr(e, attr) / total}
            for e in ev[:top]]


def _report(a, lm, fits: dict, tasks: list, modes: list, rows: list, final: bool, profiles=()) -> None:
    """Sums, ratios to dense (under the same batching) and to the first batching, and mode agreement over the
    tasks measured so far; written after every task (a cut run keeps what it measured), printed at the end."""
    done = [t for t in tasks if any(r["task"] == t[0] for r in rows)]
    summary = []
    dense_s = {(r["task"], r["batching"]): r["seconds"] for r in rows if r["setting"] == DENSE}
    first = {(r["setting"], r["mode"], r["task"]): r["seconds"] for r in rows if r["batching"] == a.batchings[0]}
    for label in fits:
        for mode in (["masked"] if label == DENSE else modes):
            for b in a.batchings:
                mine = [r for r in rows if r["setting"] == label and r["mode"] == mode and r["batching"] == b
                        and (r["task"], b) in dense_s]
                if not mine:
                    continue
                total = sum(r["seconds"] for r in mine)
                base = [first.get((label, mode, r["task"])) for r in mine]
                summary.append({"setting": label, "mode": mode, "batching": b, "seconds": total,
                                "x_dense": total / sum(dense_s[(r["task"], b)] for r in mine),
                                "x_dense_by_task": {r["task"]: r["seconds"] / dense_s[(r["task"], b)] for r in mine},
                                "x_first_batching": sum(base) / total if None not in base else None})
    agree = []
    if set(modes) == set(MODES):
        by = {(r["setting"], r["mode"], r["task"], r["batching"]): r for r in rows}
        for label in fits:
            for name, _ in done:
                for b in a.batchings:
                    if label != DENSE and all((label, md, name, b) in by for md in MODES):
                        m, k = by[(label, "masked", name, b)], by[(label, "kernel", name, b)]
                        agree.append({"setting": label, "task": name, "batching": b, "masked": m["value"],
                                      "kernel": k["value"], "diff": k["value"] - m["value"]})
    if final:
        print("\nsetting                mode     batching  seconds  x dense  first batching / this")
        for s in summary:
            xb = "" if s["x_first_batching"] is None else f"{s['x_first_batching']:.2f}"
            print(f"{s['setting']:<22} {s['mode']:<7} {s['batching']:<9} {s['seconds']:8.1f}  {s['x_dense']:.2f}"
                  f"     {xb}")
        if agree:
            print("largest |kernel - masked| per task:",
                  {t: max(abs(g["diff"]) for g in agree if g["task"] == t) for t, _ in done})
        for pr in profiles:
            print(f"\nprofile: {pr['task']} {pr['setting']} {pr['mode']} {pr['batching']}")
            for op in pr["ops"][:12]:
                print(f"  {100 * op['share']:5.1f} %  {op['ms']:9.1f} ms  {op['calls']:7d}  {op['op'][:70]}")
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.eval_cost"), device=a.device,
                             meta={"model": a.model, "fingerprint": lm.fingerprint, "threads": a.threads,
                                   "matmul": a.matmul, "complete": final},
                             sections={"evals": rows, "summary": summary, "agreement": agree,
                                       "profile": list(profiles),
                                       "median_x_dense": {f"{s['setting']} {s['mode']} {s['batching']}":
                                                          statistics.median(s["x_dense_by_task"].values())
                                                          for s in summary}})
        if final:
            print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--settings", default="oracle:0.5,threshold:0.5,svd:0.5:256",
                   help="comma list of method:sparsity[:rank][:option=value]... (dense is always measured)")
    p.add_argument("--tasks", default="perplexity,piqa:1000,arc_easy,lambada_openai:2000,gsm8k_cot:20",
                   help="comma list of task[:limit]; 'perplexity' is the held-out run")
    p.add_argument("--modes", default="masked,kernel")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--heldout-tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per generation batch (and per forward "
                   "where --batchings does not say)")
    p.add_argument("--batchings", default="32", help="comma list of N (sequences per forward) and tN (padded tokens "
                   "per forward), each with an optional @fp32|@tf32|@bf16 (its forward precision) and +fused, "
                   "timed side by side")
    p.add_argument("--matmul", default=MATMUL_FP32, choices=MATMULS, help="the eval forwards' precision where a "
                   "batching does not give its own (suites.matmul)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    p.add_argument("--profile", action="store_true", help="also run each (setting, mode, batching) of the first "
                   "task once more under torch.profiler, untimed: its ops by device time (the result's 'profile')")
    a = p.parse_args(argv)
    try:
        settings = [_setting(s) for s in a.settings.split(",") if s]
        tasks = [task_limit(t) for t in a.tasks.split(",") if t]   # 'perplexity': the held-out run
        modes = [m for m in a.modes.split(",") if m]
        a.batchings = [b for b in a.batchings.split(",") if b]
        batchings = {b: {"batch_size": a.batch_size, **_batching(b, a.matmul)} for b in a.batchings}
        if not a.batchings or len(batchings) != len(a.batchings):
            raise ValueError(f"--batchings {','.join(a.batchings)!r}: give each batching once")
        if not set(modes) <= set(MODES):
            raise ValueError(f"modes must be among {MODES}, got {modes}")
        check_task_names([n for n, _ in tasks if n != "perplexity"])
    except (ValueError, SuiteError) as e:
        p.error(str(e))

    print(device_line(a.device), flush=True)
    units = Units(device=a.device)
    lm = units.lm(a.model)
    data = {"source": "lambada", "calib_tokens": a.calib_tokens, "metric_tokens": 1024, "seq_len": 512}
    base = {"model": a.model, "model_fp": lm.fingerprint, "data": data, "threads": a.threads, "seed": 0}
    fits, rows, profiles = {}, [], []
    for st in [{"method": DENSE, "sparsity": 0.0, "rank": None, "options": {}}, *settings]:
        cfg = {**base, **st, "attn_sparsity": None}
        t0 = time.time()
        out = units.run("fit", _id(cfg), cfg)
        label = st["method"] if st["method"] == DENSE else f"{st['method']} s={st['sparsity']}" + (
            f" r={st['rank']}" if st["rank"] else "") + "".join(
            f" {k}={v}" for k, v in st["options"].items() if OPTIONS.get(st["method"], {}).get(k) != v)
        fits[label] = _id(cfg)
        print(f"fit {label}: {time.time() - t0:.1f} s {out.summary}", flush=True)

    ppl_cfg = {"tokens": a.heldout_tokens, "seq_len": 512}
    # untimed: each task once on two items for every setting and mode under each forward option of the batchings
    # (lm-eval builds its templates and reads the data on a task's first call in a process, and a Triton kernel
    # compiles on its first call: the fused norms, a sparse setting's masks; that cost would otherwise land on
    # whichever run came first), and its requests built once into the request cache (as a sweep's first unit of
    # the task does; every timed run reads them)
    forwards = {json.dumps(_forward(b), sort_keys=True) for b in batchings.values()}
    for name, limit in tasks:
        if name != "perplexity":
            for fw in sorted(forwards):
                fw = json.loads(fw)
                for label, fit_id in fits.items():
                    for mode in (["masked"] if label == DENSE else modes):
                        with _masks(fw.get("masks")):
                            units.run("eval", "warm", {**base, "fit_unit": fit_id, "exec_mode": mode, "suite": name,
                                                       "limit": 2, "batch_size": a.batch_size,
                                                       **{k: v for k, v in fw.items() if k != "masks"}})
            t0 = time.time()
            how = prepare_requests(lm.model, lm.tokenizer, [name], limit)[name]
            print(f"requests of {name}: {how} ({time.time() - t0:.1f} s)", flush=True)
    for i, (name, limit) in enumerate(tasks):
        order = a.batchings if i % 2 == 0 else a.batchings[::-1]     # side by side: the order alternates
        for b in (order if name != "perplexity" else a.batchings[:1]):   # perplexity runs its own windows
            for label, fit_id in fits.items():
                for mode in (["masked"] if label == DENSE else modes):
                    cfg = {**base, "fit_unit": fit_id, "exec_mode": mode, **_forward(batchings[b])}
                    cfg.update({"suite": "perplexity", "perplexity": ppl_cfg} if name == "perplexity"
                               else {"suite": name, "limit": limit, **batchings[b]})
                    if a.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    masks = cfg.pop("masks", None)      # how the masks are made, not a unit config key
                    t0 = time.perf_counter()
                    with _masks(masks):
                        out = units.run("eval", _id({**cfg, "masks": masks}), cfg)
                    if a.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    metric, value, stderr = _main_value(out)
                    rows.append({"task": name, "limit": limit, "setting": label, "mode": mode, "batching": b,
                                 "seconds": dt, "metric": metric, "value": value, "stderr": stderr})
                    if a.profile and i == 0:
                        with _masks(masks):
                            profiles.append({"task": name, "setting": label, "mode": mode, "batching": b,
                                             "ops": _profiled(units, cfg, a.device)})
                    print(f"{name:<11} {label:<22} {mode:<7} {b:<7} {dt:7.2f} s  {metric} {value:.4f}", flush=True)
        _report(a, lm, fits, tasks, modes, rows, final=False, profiles=profiles)

    _report(a, lm, fits, tasks, modes, rows, final=True, profiles=profiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
