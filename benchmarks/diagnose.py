"""Why a predictor's perplexity disagrees with its recall: per-token measurements on held-out tokens.

For one fitted setting, per layer, from the held-out activation cache (dense inputs):
- the per-token kept fraction of FFN neurons (mean, p1, p5, min) and how many tokens keep under 10 %;
- the kept fraction at window position 0 (the first token of each window) against the rest;
- the per-token lost damage: the fraction of the FFN output's energy sum_i (|inter_i|·‖W_down[:, i]‖)² that the
  skipped neurons carry (mean, p99, max), at position 0 and elsewhere;
and end to end, the per-token NLL increase of the sparse model over dense, at position 0..3 and after.

    python -m benchmarks.diagnose --model gemma3-270m --method svd --sparsity 0.5 --rank 256 \\
        --calib-tokens 8192 --heldout-tokens 2048 --json benchmarks/results/diagnose_gemma3_svd.json

Feeds: BENCHMARKS.md, "Scripts and result files" (no figure of its own: docs/methods.md runs it to explain a setting).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.quality import Workbench, prepare
from kernels.common import apply_act
from workers.sparsity.fit import fit_setting
from workers.sparsity.predictors.base import predictor_inputs
from workers.sparsity.metrics import topk_mask
from workers.sparsity.predictors.base import k_for
from workers.sparsity.bundle import load_bundle, save_bundle
from workers.sparsity.sparse_exec import SparseFFN, apply_sparsity


def _q(t: torch.Tensor, q: float) -> float:
    return float(torch.quantile(t.float(), q)) if t.numel() else float("nan")


def layer_diagnostics(plan, cache, lm, seq_len: int, max_tokens: int = 2048) -> list[dict]:
    ad = lm.adapter
    act = ad.act_name(lm.model.config)
    rows = []
    for l, pred in sorted(plan.mlp.items()):
        inter = cache.load(l, "inter", max_tokens=max_tokens)
        T, D = inter.shape
        down = ad.ffn_weights(ad.decoder_layers(lm.model)[l])["down"].float()
        contrib = (inter.abs() * down.norm(dim=0)[None, :]) ** 2                 # [T, D] energy per neuron
        with torch.no_grad():
            x = predictor_inputs(cache, l, pred.input_kind, max_tokens)
            mask = pred.mask(x)
            if l in plan.seq_filter:
                g = apply_act(cache.load(l, "gate", max_tokens=max_tokens), act)
                mask = mask & (g.abs() > plan.seq_filter[l])
        kept = mask.float().mean(1)
        lost = (contrib * (~mask)).sum(1) / contrib.sum(1).clamp_min(1e-30)
        pos0 = (torch.arange(T) % seq_len) == 0
        resid = cache.load(l, "residual", max_tokens=max_tokens).norm(dim=1)
        rows.append({
            "layer": l, "kept_mean": float(kept.mean()), "kept_p1": _q(kept, 0.01), "kept_p5": _q(kept, 0.05),
            "kept_min": float(kept.min()), "tokens_kept_lt_10pct": int((kept < 0.1).sum()),
            "kept_pos0": float(kept[pos0].mean()), "kept_rest": float(kept[~pos0].mean()),
            "lost_mean": float(lost.mean()), "lost_p99": _q(lost, 0.99), "lost_max": float(lost.max()),
            "lost_pos0": float(lost[pos0].mean()), "lost_rest": float(lost[~pos0].mean()),
            "resid_norm_pos0": float(resid[pos0].mean()), "resid_norm_rest_median": _q(resid[~pos0], 0.5),
            "n_tokens": T,
        })
    return rows


def token_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [n_windows, seq_len-1] of next-token prediction."""
    out = []
    with torch.no_grad():
        for w in windows:
            logits = model(w[None]).logits[0, :-1].float()
            out.append(F.cross_entropy(logits, w[1:], reduction="none"))
    return torch.stack(out)


def nll_by_position(wb: Workbench, plan, mode: str) -> dict:
    win, skip = wb.heldout.windows, max(wb.heldout.prefix_len - 1, 0)     # targets of prefix tokens don't count
    dense = token_nll(wb.lm.model, win)[:, skip:]
    with apply_sparsity(wb.lm.model, plan, mode=mode):
        sparse = token_nll(wb.lm.model, win)[:, skip:]
    d = sparse - dense
    return {"dnll_pos0_3": [float(d[:, i].mean()) for i in range(4)], "dnll_rest": float(d[:, 4:].mean()),
            "dnll_mean": float(d.mean()), "ppl_dense": float(dense.mean().exp()), "ppl_sparse": float(sparse.mean().exp()),
            "dnll_p99_token": _q(d.flatten(), 0.99), "dnll_max_token": float(d.max())}


def onpolicy_diagnostics(wb: Workbench, plan, target: float, n_windows: int = 2) -> list[dict]:
    """The same per-layer measures on the inputs each layer sees *inside the sparse model* (every layer
    sparsified): what the predictor picks there against the oracle set and lost energy on those inputs."""
    acc: dict[int, dict] = {}

    def hook(mod, args, out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        pin = x if mod.predictor.input_kind == "ffn_in" else None
        if pin is None:
            return
        mask = mod.predictor.mask(pin)
        if mod.filter_threshold is not None:
            mask = mask & (apply_act(x @ mod.w_gate.t(), mod.act).abs() > mod.filter_threshold)
        inter = apply_act(x @ mod.w_gate.t(), mod.act) * (x @ mod.w_up.t())
        contrib = (inter.abs() * mod.w_down_t.norm(dim=1)[None, :]) ** 2
        oracle = topk_mask(inter.abs(), k_for(target, inter.shape[1]))
        a = acc.setdefault(mod.layer, {"lost": [], "lost_oracle": [], "recall": [], "kept": [], "dy": [], "dy_or": [],
                                       "y": []})
        y = inter @ mod.w_down_t
        a["y"].append(y)
        a["dy"].append((inter * (~mask)) @ mod.w_down_t)
        a["dy_or"].append((inter * (~oracle)) @ mod.w_down_t)
        tot = contrib.sum(1).clamp_min(1e-30)
        a["lost"].append((contrib * (~mask)).sum(1) / tot)
        a["lost_oracle"].append((contrib * (~oracle)).sum(1) / tot)
        a["recall"].append((mask & oracle).sum(1).float() / oracle.sum(1).clamp_min(1))
        a["kept"].append(mask.float().mean(1))

    with apply_sparsity(wb.lm.model, plan, mode="masked"), torch.no_grad():
        hs = [m.register_forward_hook(hook) for m in wb.lm.model.modules() if isinstance(m, SparseFFN)]
        try:
            for w in wb.heldout.windows[:n_windows]:
                wb.lm.model(w[None])
        finally:
            for h in hs:
                h.remove()
    rows = []
    for l, a in sorted(acc.items()):
        c = {k: torch.cat(v) for k, v in a.items()}
        ynorm = c["y"].square().sum(1).mean()
        for key, dy in (("", c["dy"]), ("_oracle", c["dy_or"])):
            # relative error of the FFN output, and the share of it that is one direction common to all tokens
            c["relerr" + key] = dy.square().sum(1).mean() / ynorm
            c["biaserr" + key] = dy.mean(0).square().sum() / ynorm
            # per token (what a norm after the FFN, as in Gemma-3, sees): ‖Δy_t‖² / ‖y_t‖²
            c["tokerr" + key] = dy.square().sum(1) / c["y"].square().sum(1).clamp_min(1e-30)
        rows.append({"tokerr_mean": float(c["tokerr"].mean()), "tokerr_p99": _q(c["tokerr"], 0.99),
                     "tokerr_oracle_mean": float(c["tokerr_oracle"].mean()), "tokerr_oracle_p99": _q(c["tokerr_oracle"], 0.99),
                     "relerr": float(c["relerr"]), "relerr_oracle": float(c["relerr_oracle"]),
                     "biaserr": float(c["biaserr"]), "biaserr_oracle": float(c["biaserr_oracle"]),"layer": l, "lost_mean": float(c["lost"].mean()), "lost_oracle_mean": float(c["lost_oracle"].mean()),
                     "recall": float(c["recall"].mean()), "kept_mean": float(c["kept"].mean()),
                     "kept_p1": _q(c["kept"], 0.01)})
    return rows


def _fit(wb: Workbench, pt: dict, cache_dir: str | None):
    path = None
    if cache_dir:
        key = hashlib.sha256(json.dumps([wb.lm.fingerprint, wb.calib.path.name, pt], sort_keys=True).encode()).hexdigest()
        path = Path(cache_dir) / key[:20]
        if path.exists():
            return load_bundle(path).plan(wb.lm.model)
    plan = fit_setting(wb.ctx, pt["method"], pt["sparsity"], pt.get("rank"), None, pt.get("allocation", "uniform"),
                       pt.get("options", {}), curves=wb.curves).plan
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_bundle(plan, wb.lm, path, method=pt["method"], sparsity=pt["sparsity"], rank=pt.get("rank"),
                    options=pt.get("options", {}))
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--points", default='[{"method": "svd", "sparsity": 0.5, "rank": 256}]',
                    help="JSON list of {method, sparsity, rank, options}")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-nll", action="store_true")
    ap.add_argument("--plan-cache", default=None, help="folder to keep fitted plans in (keyed by point)")
    a = ap.parse_args(argv)
    try:
        points = json.loads(a.points)
    except json.JSONDecodeError as e:
        print(f"--points is not JSON: {e}", file=sys.stderr)
        return 2
    wb = prepare(a.model, calib_tokens=a.calib_tokens, heldout_tokens=a.heldout_tokens,
                 metric_tokens=a.heldout_tokens, seq_len=a.seq_len)
    results = []
    for pt in points:
        plan = _fit(wb, pt, a.plan_cache)
        res = {"point": pt, "layers": layer_diagnostics(plan, wb.heldout_cache, wb.lm, a.seq_len)}
        if not a.no_nll:
            res["nll"] = nll_by_position(wb, plan, "masked")
        if plan.mlp:
            res["onpolicy"] = onpolicy_diagnostics(wb, plan, pt["sparsity"])
        results.append(res)
        print(json.dumps({"point": pt, **res.get("nll", {})}))
        for r in res["layers"]:
            print("  L%02d kept %.3f p1 %.3f min %.3f (<10%%: %d) pos0 %.3f | lost %.3f p99 %.3f max %.3f pos0 %.3f"
                  " | resid pos0 %.0f rest %.0f" % (
                      r["layer"], r["kept_mean"], r["kept_p1"], r["kept_min"], r["tokens_kept_lt_10pct"],
                      r["kept_pos0"], r["lost_mean"], r["lost_p99"], r["lost_max"], r["lost_pos0"],
                      r["resid_norm_pos0"], r["resid_norm_rest_median"]), flush=True)
        for r in res.get("onpolicy", []):
            print("  on-policy L%02d lost %.3f (oracle %.3f) relerr %.3f (oracle %.3f) biaserr %.4f (oracle %.4f)"
                  " tokerr %.3f p99 %.3f (oracle %.3f p99 %.3f) recall %.3f kept %.3f p1 %.3f" % (
                      r["layer"], r["lost_mean"], r["lost_oracle_mean"], r["relerr"], r["relerr_oracle"], r["biaserr"],
                      r["biaserr_oracle"], r["tokerr_mean"], r["tokerr_p99"], r["tokerr_oracle_mean"],
                      r["tokerr_oracle_p99"], r["recall"], r["kept_mean"], r["kept_p1"]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"model": a.model, "calib_tokens": a.calib_tokens, "heldout_tokens": a.heldout_tokens,
                           "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
