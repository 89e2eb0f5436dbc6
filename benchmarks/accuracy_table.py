"""The accuracy tables of a published result set: for each model, one row per setting, perplexity, decoder bytes
skipped and each multiple-choice task with its standard error, their mean and its change from dense.

    python -m benchmarks.accuracy_table benchmarks/results/h200-equal-bytes-smollm2.jsonl \\
        [--tasks piqa,arc_easy,arc_challenge,hellaswag,winogrande] [--metric acc_norm|acc]

Reads the file ``python -m db export`` writes (plain or gzipped; no store needed). ``--metric acc_norm``
(default): a task's length-normalized accuracy where lm-eval reports one (PIQA, ARC, HellaSwag), its accuracy
elsewhere (Winogrande); ``acc``: plain accuracy everywhere. A mean's standard error is that of the average of
independent tasks, sqrt(Σ se²) / n; the change from dense is unpaired (both rows' errors combined).

Feeds: BENCHMARKS.md, "Quality of the methods on SmolLM2 and Gemma-3".
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import defaultdict

TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")


def read_rows(path: str) -> dict[str, list[dict]]:
    """{table: [row, ...]} of a result-set file."""
    opener = gzip.open if path.endswith(".gz") else open
    out: dict[str, list[dict]] = defaultdict(list)
    with opener(path, "rt") as f:
        for line in f:
            rec = json.loads(line)
            if "table" in rec:
                out[rec["table"]].append(rec["row"])
    return out


def setting_name(cfg: dict) -> str:
    if cfg["method"] == "dense":
        return "dense"
    opts = ", ".join(f"{k} {v}" for k, v in sorted((cfg.get("options") or {}).items()))
    name = f"{cfg['method']} s={cfg['sparsity']}"
    return f"{name} ({opts})" if opts else name


def settings(rows: dict[str, list[dict]], tasks, metric: str) -> dict[str, dict[str, dict]]:
    """{model: {setting: {"bytes", "ppl", task: (value, stderr, n, metric)}}} over the set's evaluation rows (a set
    without a models table: one model, "?")."""
    units = {u["id"]: u for u in rows["work_units"]}
    names = {m["id"]: m["name"] for m in rows.get("models", [])}
    best: dict = {}
    for r in rows["accuracy_results"]:
        u = units.get(r["unit_id"])
        if u is None or u["kind"] != "eval":
            continue
        fit = units.get(u["config"].get("fit_unit"))
        name = setting_name(fit["config"]) if fit is not None else "dense"
        key = (names.get(u.get("model_id"), "?"), name, r["task"], r["metric"])
        if key not in best or r["n"] > best[key]["n"]:       # a sharded task: its assembled row
            best[key] = r
    out: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for (model, name, task, m), r in best.items():
        if m == "weight_skipped":
            out[model][name]["bytes"] = r["value"]
        elif m == "ppl":
            out[model][name]["ppl"] = r["value"]
        elif task in tasks and m in (metric, "acc"):
            cur = out[model][name].get(task)
            if cur is None or m == metric:                 # acc_norm where the task has it
                out[model][name][task] = (r["value"], r["stderr"], r["n"], m)
    return out


def mean_se(vals) -> tuple[float, float]:
    return sum(v for v, _ in vals) / len(vals), math.sqrt(sum(s * s for _, s in vals)) / len(vals)


def table(per: dict[str, dict], tasks) -> str:
    dense = per.get("dense", {})
    d_mean = mean_se([dense[t][:2] for t in tasks]) if all(t in dense for t in tasks) else None
    head = ["setting", "bytes skipped", "ppl (Δ)"] + list(tasks) + ["mean", "Δ mean"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(per, key=lambda n: (n != "dense", per[n].get("bytes") or 0, n))
    for name in order:
        row = per[name]
        if not all(t in row for t in tasks):
            continue
        ppl = row.get("ppl")
        dppl = f" ({100 * (ppl / dense['ppl'] - 1):+.1f} %)" if ppl and dense.get("ppl") and name != "dense" else ""
        cells = [name, f"{100 * row['bytes']:.1f} %" if row.get("bytes") is not None else "–",
                 f"{ppl:.2f}{dppl}" if ppl else "–"]
        cells += [f"{100 * row[t][0]:.1f} ({100 * row[t][1]:.1f})" for t in tasks]
        m, se = mean_se([row[t][:2] for t in tasks])
        cells.append(f"{100 * m:.2f} ({100 * se:.2f})")
        cells.append("–" if d_mean is None or name == "dense" else
                     f"{100 * (m - d_mean[0]):+.2f} ({100 * math.hypot(se, d_mean[1]):.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    metrics = {t: next(row[t][3] for row in per.values() if t in row) for t in tasks
               if any(t in row for row in per.values())}
    lines.append("")
    lines.append("metrics: " + ", ".join(f"{t} {m}" for t, m in metrics.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_table", description=__doc__.splitlines()[0])
    ap.add_argument("resultset")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--metric", default="acc_norm", choices=("acc_norm", "acc"))
    a = ap.parse_args(argv)
    tasks = tuple(t for t in a.tasks.split(",") if t)
    try:
        rows = read_rows(a.resultset)
    except (OSError, ValueError) as e:
        print(f"accuracy_table: cannot read {a.resultset}: {e}", file=sys.stderr)
        return 2
    if not rows.get("accuracy_results"):
        print(f"accuracy_table: {a.resultset} has no accuracy rows", file=sys.stderr)
        return 2
    for model, per in sorted(settings(rows, tasks, a.metric).items()):
        print(f"{model}\n\n{table(per, tasks)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
