"""Is the model-wide input-sparsity greedy a poor optimizer or a poor objective? Next-token KL to the dense model
on the greedy's own calibration tokens (or on held-out ones), for TEAL uniform and greedy "model" at the same
budgets.

    python -m benchmarks.input_kl --model smollm2-135m --budgets 0.25,0.35,0.4,0.5 --split heldout --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from workers.loading.data import token_windows
from workers.loading.models import load_model
from workers.sparsity import input_allocation as IA
from workers.sparsity.capture import capture_activations
from workers.sparsity.predictors import FitContext, fit_method
from workers.sparsity.sparse_exec import apply_sparsity


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.input_kl", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="0.25,0.35,0.4,0.5")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--split", default="calib", choices=("calib", "heldout"),
                    help="calib: the greedy's own tokens; heldout: the first tokens perplexity is measured on")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    cache = capture_activations(lm, token_windows(lm.tokenizer, "lambada", "calib", a.calib_tokens, 512),
                                progress=False)
    ctx = FitContext(lm, cache, list(range(lm.dims.n_layers)))
    toks = token_windows(lm.tokenizer, "lambada", a.split, IA.TOKENS, IA.SEQ)
    dense = [F.log_softmax(lm.model(input_ids=w[None]).logits.float(), -1) for w in toks.windows]

    def kl(plan) -> float:
        with apply_sparsity(lm.model, plan):
            return sum(F.kl_div(F.log_softmax(lm.model(input_ids=w[None]).logits.float(), -1), d,
                                log_target=True, reduction="none").sum(-1).mean().item()
                       for w, d in zip(toks.windows, dense)) / len(dense)

    rows = []
    for b in (float(x) for x in a.budgets.split(",")):
        row = {"budget": b, "uniform": kl(fit_method("teal", ctx, b)),
               "greedy_model": kl(fit_method("teal", ctx, b, greedy="model"))}
        rows.append(row)
        print(f"budget {b:.2f}: KL uniform {row['uniform']:.4f}  greedy model {row['greedy_model']:.4f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "split": a.split, "tokens": toks.n_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
