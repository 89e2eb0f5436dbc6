"""The ``ctxsparse`` command line.

  ctxsparse ppl     [--model REF] [--source SRC] [--tokens N] [--seq-len L] [--dtype D]
  ctxsparse capture [--model REF] [--source SRC] [--tokens N] [--store-dtype D]
  ctxsparse demo    load the default model, capture activations, print held-out perplexity
  ctxsparse ingest-kernels FILE [--db URL]   load GPU kernel benchmark rows into the store
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _load(args):
    from workers.models import load_model

    t0 = time.time()
    lm = load_model(args.model, dtype=args.dtype)
    print(f"model {lm.ref} ({lm.family}, d={lm.dims.d}, D={lm.dims.D}, {lm.dims.n_layers} layers) "
          f"fingerprint {lm.fingerprint[:12]} loaded in {time.time() - t0:.1f}s", flush=True)
    return lm


def cmd_ppl(args) -> int:
    from workers.data import token_windows
    from workers.evaluate import perplexity

    lm = _load(args)
    toks = token_windows(lm.tokenizer, args.source, "heldout", args.tokens, args.seq_len)
    t0 = time.time()
    p = perplexity(lm.model, toks)
    out = {"model": lm.ref, "source": args.source, "split": "heldout", "tokens": p.n_tokens,
           "seq_len": args.seq_len, "dtype": args.dtype, "ppl": round(p.ppl, 3), "nll": round(p.nll, 5),
           "stderr_nll": round(p.stderr_nll, 5), "seconds": round(time.time() - t0, 1),
           "data_fingerprint": toks.fingerprint[:12]}
    print(json.dumps(out))
    return 0


def cmd_capture(args) -> int:
    from workers.capture import capture_activations
    from workers.data import token_windows

    lm = _load(args)
    toks = token_windows(lm.tokenizer, args.source, "calib", args.tokens, args.seq_len)
    for attempt in ("first", "second"):
        t0 = time.time()
        cache = capture_activations(lm, toks, dtype=args.store_dtype)
        print(json.dumps({"call": attempt, "cache_hit": cache.hit, "seconds": round(time.time() - t0, 2),
                          "tokens": cache.n_tokens, "layers": len(cache.layers),
                          "disk_mb": round(cache.size_bytes() / 2**20, 1), "shards": len(cache.manifest["shards"]),
                          "tokens_per_s": cache.manifest["tokens_per_s"], "path": cache.path.name[:16]}), flush=True)
        if not args.twice:
            break
    return 0


def cmd_demo(args) -> int:
    args.twice = True
    rc = cmd_capture(args)
    return rc or cmd_ppl(args)


def cmd_ingest_kernels(args) -> int:
    from orchestrator.ingest import ingest_kernel_results

    n, new = ingest_kernel_results(args.file, args.db)
    print(json.dumps({"file": args.file, "rows": n, "units_added": new}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ctxsparse", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, tokens):
        sp.add_argument("--model", default="smollm2-135m", help="model ref (default: smollm2-135m)")
        sp.add_argument("--source", default="lambada", help="text source (default: lambada)")
        sp.add_argument("--tokens", type=int, default=tokens, help=f"token budget (default: {tokens})")
        sp.add_argument("--seq-len", type=int, default=512)
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    sp = sub.add_parser("ppl", help="held-out perplexity")
    common(sp, 2048)
    sp.set_defaults(fn=cmd_ppl)
    sp = sub.add_parser("capture", help="collect activations into the cache")
    common(sp, 16384)
    sp.add_argument("--store-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    sp.add_argument("--twice", action="store_true", help="call twice to show the cache hit")
    sp.set_defaults(fn=cmd_capture)
    sp = sub.add_parser("demo", help="load, capture (twice: cache hit), perplexity")
    common(sp, 2048)
    sp.add_argument("--store-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    sp.set_defaults(fn=cmd_demo)
    sp = sub.add_parser("ingest-kernels", help="load `kernels.bench --json` results into the SQL store")
    sp.add_argument("file")
    sp.add_argument("--db", default=None, help="SQLAlchemy URL (default: $CTXSPARSE_DB_URL or SQLite)")
    sp.set_defaults(fn=cmd_ingest_kernels)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, RuntimeError, KeyError, FileNotFoundError) as e:
        print(f"ctxsparse {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
