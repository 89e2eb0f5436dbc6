"""Deja Vu predictors on a real model: recall by sparsity and input kind, and the head predictors' recall.

    python -m benchmarks.experiments.dejavu --model smollm2-135m --tokens 16384 --sparsities 0.3,0.5,0.7

An experiment: how well the Deja Vu predictors recall the oracle set, by input kind.
Recorded: benchmarks/results/history-quality.md, "Deja Vu internals".
"""
from __future__ import annotations

import torch

from workers.methods.dejavu.fit import DEFAULTS, INITS, default_dense_attn_layers, default_rank, fit_dejavu
from workers.sparsity.predictors.base import FitContext


def main(argv=None) -> None:
    """``python -m benchmarks.experiments.dejavu``: recall by sparsity and input kind on SmolLM2."""
    import argparse
    import statistics

    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.dejavu", description=main.__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", default="all", help="'all' or comma-separated layer indices")
    ap.add_argument("--sparsities", default="0.3,0.5,0.7")
    ap.add_argument("--kinds", default="ffn_in,residual,lookahead")
    ap.add_argument("--attn", default="0.3,0.5", help="head-predictor sparsities ('' = none)")
    ap.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--init", default=DEFAULTS["init"], choices=INITS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from workers.sparsity.capture import capture_activations
    from workers.loading.data import token_windows
    from workers.loading.models import load_model

    lm = load_model(args.model)
    toks = token_windows(lm.tokenizer, "lambada", "calib", args.tokens, 512)
    cache = capture_activations(lm, toks, progress=False)
    layers = list(range(lm.dims.n_layers)) if args.layers == "all" else [int(v) for v in args.layers.split(",")]
    ctx = FitContext(lm=lm, cache=cache, layers=layers, seed=0)
    rank = args.rank or default_rank(lm.dims.d)
    print(f"model {args.model}: d={lm.dims.d} D={lm.dims.D} H={lm.dims.n_heads} L={lm.dims.n_layers}; "
          f"{cache.n_tokens} calibration tokens (last {DEFAULTS['val_frac']:.0%} held out); rank {rank}; "
          f"init {args.init}; {len(layers)} layers; {torch.get_num_threads()} threads", flush=True)
    print("recall = share of the oracle top-k set (top-k |act(gate)*up|) kept by the predicted top-k, on the "
          "held-out tokens; init = before training (epoch 0); trained>init = layers where an epoch beat it")
    print(f"{'s':>5} {'input_kind':>10} {'chance':>7} {'init':>7} {'recall':>7} {'min':>7} {'trained>init':>12} "
          f"{'epochs':>6} {'fit_s':>7} {'s/layer':>7}")
    for s in [float(v) for v in args.sparsities.split(",") if v]:
        for kind in [v for v in args.kinds.split(",") if v]:
            plan = fit_dejavu(ctx, {l: s for l in layers}, rank=rank, input_kind=kind, epochs=args.epochs,
                              init=args.init)
            infos = [plan.info[l] for l in layers]
            rec = [i["best_val_recall"] for i in infos]
            fit = sum(i["fit_s"] for i in infos)
            print(f"{s:5.2f} {kind:>10} {1 - s:7.3f} "
                  f"{statistics.mean(i['val_recall_history'][0] for i in infos):7.4f} "
                  f"{statistics.mean(rec):7.4f} {min(rec):7.4f} "
                  f"{sum(i['best_epoch'] > 0 for i in infos):>5d} of {len(infos):<3d} "
                  f"{statistics.mean(i['epochs_run'] for i in infos):6.1f} {fit:7.1f} {fit / len(infos):7.1f}",
                  flush=True)
    attn = [float(v) for v in args.attn.split(",") if v]
    if attn:
        print(f"\nheads (label: top {DEFAULTS['attn_label_frac']:.0%}; input {DEFAULTS['attn_input_kind']}; "
              f"dense layers {default_dense_attn_layers(lm.dims.n_layers)})")
        print(f"{'s_attn':>6} {'k':>3} {'chance':>7} {'init':>7} {'rec_label':>9} {'rec_topk':>8} {'layers':>6} "
              f"{'epochs':>6} {'fit_s':>7}")
        for sa in attn:
            plan = fit_dejavu(ctx, {}, rank=rank, attn_sparsity=sa, epochs=args.epochs, init=args.init)
            infos = [plan.info[l]["attn"] for l in sorted(plan.attn)]
            k = infos[0]["k"]
            print(f"{sa:6.2f} {k:3d} {k / lm.dims.n_heads:7.3f} "
                  f"{statistics.mean(i['val_recall_history'][0] for i in infos):7.4f} "
                  f"{statistics.mean(i['best_val_recall'] for i in infos):9.4f} "
                  f"{statistics.mean(i['val_recall_topk'] for i in infos):8.4f} {len(infos):6d} "
                  f"{statistics.mean(i['epochs_run'] for i in infos):6.1f} "
                  f"{sum(i['fit_s'] for i in infos):7.1f}", flush=True)


if __name__ == "__main__":
    main()
