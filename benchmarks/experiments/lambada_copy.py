"""LAMBADA's last word, split by whether the word already occurs earlier in the passage (a copy) or not: accuracy
and mean log-likelihood of the target, dense against fitted bundles, on the same items.

    python -m benchmarks.experiments.lambada_copy --model gemma3-270m --limit 300 --bundle DIR [--bundle DIR ...]

A bundle directory is what a fit unit writes (``$CTXSPARSE_HOME/bundles/<fit unit>``) or ``ctxsparse bundle
export`` gives; each is applied as the evaluation units apply it (masked execution).

An experiment: why TEAL and WINA at 0.3 score LAMBADA better than dense.
Recorded: benchmarks/results/history-eval.md, "Gemma-3-270M: the whole sweep".
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from benchmarks.harness import command_line, write_results


def _copied(context: str, target: str) -> bool:
    return re.search(r"\b" + re.escape(target.strip()) + r"\b", context) is not None


def _split(items) -> dict:
    out = {}
    for name, keep in (("copy", True), ("no copy", False)):
        sel = [it for it in items if _copied(it.requests[0][0], it.requests[0][1]) == keep]
        out[name] = {"n": len(sel),
                     "acc": statistics.fmean(it.metrics["acc"] for it in sel) if sel else None,
                     "mean_ll": statistics.fmean(it.loglikelihoods[0] for it in sel) if sel else None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.lambada_copy",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--limit", type=int, default=300, help="first N LAMBADA items")
    p.add_argument("--bundle", action="append", default=[], help="a fitted bundle directory (repeatable)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    missing = [b for b in a.bundle if not Path(b).is_dir()]
    if missing:
        p.error(f"no bundle directory at {', '.join(missing)}")
    import torch

    from workers.evals.suites import run_suite
    from workers.loading.models import load_model
    from workers.sparsity.bundle import apply_bundle, load_bundle

    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device=a.device)

    def score(label: str) -> dict:
        rows = run_suite(lm.model, lm.tokenizer, ["lambada_openai"], a.limit, batch_size=a.batch_size,
                         keep_items=True)
        row = next(r for r in rows if r.metric == "acc")
        res = {"setting": label, "acc": row.value, "n": row.n, **_split(row.items)}
        print(f"{label:<40} acc {row.value:.3f}  " + "  ".join(
            f"{k}: n {v['n']} acc {v['acc']:.3f} ll {v['mean_ll']:.2f}" for k, v in res.items()
            if isinstance(v, dict) and v["n"]), flush=True)
        return res

    results = [score("dense")]
    for path in a.bundle:
        b = load_bundle(path)
        m = b.manifest
        levels = sorted(set(m["per_layer_sparsity"].values())) or [m["sparsity"]]    # (a bundle without per-layer)
        label = f"{m['method']} s={levels} ({Path(path).name[:12]})"
        with apply_bundle(lm.model, b, check_model=True, mode="masked"):
            results.append(score(label))
    if a.json:
        print("wrote", write_results(a.json, [], command=command_line("benchmarks.experiments.lambada_copy"),
                                     device=a.device, meta={"model": a.model, "limit": a.limit},
                                     sections={"settings": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
