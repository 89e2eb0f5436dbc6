"""Distance to the dense model, beside perplexity: for each point, next-token KL(dense || sparse) and the NLL
change on the same tokens (calibration or held-out), so that settings can be compared by fidelity as well as by
perplexity. The points are ``benchmarks.quality``'s (method, sparsity, rank, allocation, options); fits and
allocation curves are cached under ``$CTXSPARSE_HOME``.

    python -m benchmarks.experiments.kl --model smollm2-135m --points '[{"method": "teal", "sparsity": 0.4},
        {"method": "teal", "sparsity": 0.4, "options": {"greedy": "model"}}]' --split heldout --threads 2

An experiment: whether the allocations lower the distance to dense.
Recorded: benchmarks/results/history-quality.md, "One sparsity per projection kind, allocated by end-to-end KL".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.quality import calib_context
from workers.loading.data import token_windows
from workers.loading.models import load_model
from workers.sparsity.allocation import next_token_logp, token_kl
from workers.sparsity.fit import fit_setting
from workers.sparsity.sparse_exec import apply_sparsity


@torch.no_grad()
def _logp(model, windows) -> list[torch.Tensor]:
    return [next_token_logp(model, w[None])[0] for w in windows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.kl", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--points", required=True, help="a JSON list of points, or a file holding one")
    ap.add_argument("--split", default="heldout", choices=("calib", "heldout"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    text = Path(a.points).read_text() if Path(a.points).is_file() else a.points
    try:
        points = json.loads(text)
        assert isinstance(points, list) and all(isinstance(p, dict) and "method" in p for p in points)
    except (json.JSONDecodeError, AssertionError):
        ap.error("--points must be a JSON list of {method, sparsity, ...} objects (or a file holding one)")
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    ctx = calib_context(lm, a.calib_tokens)
    toks = token_windows(lm.tokenizer, "lambada", a.split, a.tokens, 512)
    dense = _logp(lm.model, toks.windows)

    def nll(logps) -> float:     # mean next-token NLL of the text
        return sum(-lp[:-1].gather(-1, w[1:, None]).sum().item() for lp, w in zip(logps, toks.windows)) / sum(
            w.numel() - 1 for w in toks.windows)

    base_nll = nll(dense)
    rows = []
    for p in points:
        fitted = fit_setting(ctx, p["method"], p["sparsity"], p.get("rank"), p.get("attn_sparsity"),
                             p.get("allocation", "uniform"), p.get("options"))
        with apply_sparsity(lm.model, fitted.plan):
            sparse = _logp(lm.model, toks.windows)
        kl = sum(token_kl(s, d).sum().item() for s, d in zip(sparse, dense)) / sum(w.numel() for w in toks.windows)
        row = {**p, "kl": kl, "nll_change": nll(sparse) - base_nll}
        rows.append(row)
        print(f"{json.dumps(p, sort_keys=True)}: KL {kl:.4f}  NLL change {row['nll_change']:+.4f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "split": a.split, "tokens": toks.n_tokens, "dense_nll": base_nll,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
