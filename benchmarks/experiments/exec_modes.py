"""How far the two evaluation paths' selections drift apart on a real model, layer by layer.

``masked`` and ``kernel`` (``workers.sparsity.sparse_exec``) compute the same function with a different summation
order. In layer 0 both see the same input and select the same (token, neuron) pairs; from there on a rounding
difference in one layer's output can flip a neuron at the selection boundary of the next, and each flip changes
that layer's output by far more than rounding. This measures, for one fitted setting on one held-out window, the
fraction of pairs selected differently per layer, the largest logit difference and both perplexities.

    python -m benchmarks.experiments.exec_modes --model smollm2-135m --method oracle --sparsity 0.5 --threads 2

An experiment: why the two execution modes' perplexities differ.
Recorded: benchmarks/results/history-eval.md, "SmolLM2 on GPU actors through Ray, real weights, full-size suites".
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.quality import calib_context
from workers.evals.perplexity import perplexity
from workers.loading.data import token_windows
from workers.loading.models import load_model
from workers.sparsity.fit import fit_setting
from workers.sparsity.sparse_exec import EXEC_MODES, apply_sparsity


@torch.no_grad()
def _run(lm, plan, mode: str, window: torch.Tensor, toks):
    """(each layer's selection on ``window``, its logits, the perplexity of ``toks``) in ``mode``. The selections
    are read at the predictor's rule (``select``), which both paths end in: the kernel path's ``mask`` (scores from
    the FFN input) and the masked path's selection from the FFN's own activations (the oracle, the threshold)."""
    masks: dict[int, list] = {}
    originals = {l: p.select for l, p in plan.mlp.items()}
    for l, p in plan.mlp.items():
        p.select = lambda s, f=originals[l], l=l: masks.setdefault(l, []).append(f(s)) or masks[l][-1]
    try:
        with apply_sparsity(lm.model, plan, mode=mode):
            logits = lm.model(input_ids=window).logits
            masks_window = {l: v[0] for l, v in masks.items()}
            ppl = perplexity(lm.model, toks).ppl
    finally:
        for p in plan.mlp.values():
            del p.select                    # the instance attribute: the class's method again
    return masks_window, logits, ppl


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.exec_modes", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="oracle")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--options", default="{}", help="JSON dict of method options")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    ctx = calib_context(lm, a.calib_tokens)
    plan = fit_setting(ctx, a.method, a.sparsity, a.rank, options=json.loads(a.options)).plan
    if not plan.mlp:
        ap.error(f"{a.method} has no per-token FFN selection to compare")
    toks = token_windows(lm.tokenizer, "lambada", "heldout", a.heldout_tokens, 512)
    window = toks.windows[:1]
    (mm, lm_, pm), (mk, lk, pk) = (_run(lm, plan, mode, window, toks) for mode in EXEC_MODES[::-1])
    if sorted(mm) != sorted(plan.mlp) or sorted(mk) != sorted(plan.mlp):
        raise SystemExit(f"a layer's selection was not seen (masked {sorted(mm)}, kernel {sorted(mk)}, plan "
                         f"{sorted(plan.mlp)})")
    flips = {l: (mm[l] ^ mk[l]).float().mean().item() for l in sorted(mm)}
    out = {"model": a.model, "method": a.method, "sparsity": a.sparsity, "rank": a.rank,
           "threads": torch.get_num_threads(), "ppl": {"masked": pm, "kernel": pk},
           "max_logit_diff": (lm_ - lk).abs().max().item(), "pairs_selected_differently": flips}
    print(f"ppl masked {pm:.4f} kernel {pk:.4f} ({100 * (pk / pm - 1):+.2f} %); largest logit difference "
          f"{out['max_logit_diff']:.3g}")
    print("pairs selected differently, by layer:", " ".join(f"{l}:{v:.1e}" for l, v in flips.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
