"""The ``ctxsparse`` command line.

Sweeps (a thin layer over Ray's job API and the store):
  ctxsparse submit SPEC [--address URL] [--follow]   validate, check, then `ray job submit` the driver
  ctxsparse status [SWEEP] [--address URL]           sweeps, progress, failures, and the Ray job state of each
                                                     sweep (from --address, $RAY_ADDRESS, or the head that
                                                     `ray start` started on this machine; stderr says which, or
                                                     that no Ray cluster is reachable)
  ctxsparse logs SWEEP|SUBMISSION_ID [--address URL] [--follow] the driver's log
  ctxsparse resume SWEEP [--address URL]             submit a stored sweep again (finished units skipped)
  ctxsparse pareto MODEL [--metric M] [--device cpu|cuda|npu] [--threads N]   the Pareto front from the store
  ctxsparse bundle export UNIT|--best MODEL --out PATH          a setting's predictor bundle (folder or .tar.gz)
  ctxsparse bundle download SRC --out DIR                       unpack + verify a bundle archive (file or URL)
  ctxsparse generate --model REF --bundle DIR --prompt TEXT [--tokens N] [--device cpu|cuda] [--threads N]
                    [--weights auto|gguf|float] [--head-candidates K|all]
                                                                greedy continuation with the bundle; tokens/s
                                                                dense vs sparse on that device, at the thread
                                                                count the sweep timed the setting at (on the CPU,
                                                                first the line of `ctxsparse kernels`)
Single steps:
  ctxsparse ppl     [--model REF] [--source SRC] [--tokens N] [--seq-len L] [--dtype D]
  ctxsparse capture [--model REF] [--source SRC] [--tokens N] [--store-dtype D]
  ctxsparse ingest-kernels FILE   load GPU kernel benchmark rows into the store
  ctxsparse kernels [--json]      which CPU kernels run here: the native build and its instruction set, or the
                                  torch fallback and why

Every command takes --db URL (the store's SQLAlchemy URL; default $CTXSPARSE_DB_URL, else SQLite under
$CTXSPARSE_HOME): ppl, capture, generate, kernels and bundle download never read or write the store and ignore it.

Errors (a bad spec, an unknown model or unit, a missing data file, an unreachable store or cluster, a damaged
bundle) print one message and exit with status 2; `submit` finds them before a job exists. `submit` never starts
a second live job for a sweep: while an attempt waits or runs it names that attempt and submits nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

from workers.names import DEVICE_TYPES

def _load(args):
    from workers.loading.models import load_model

    t0 = time.time()
    lm = load_model(args.model, dtype=args.dtype)
    print(f"model {lm.ref} ({lm.family}, d={lm.dims.d}, D={lm.dims.D}, {lm.dims.n_layers} layers) "
          f"fingerprint {lm.fingerprint[:12]} loaded in {time.time() - t0:.1f}s", flush=True)
    return lm


def cmd_ppl(args) -> int:
    from workers.loading.data import token_windows
    from workers.evals.perplexity import perplexity

    lm = _load(args)
    toks = token_windows(lm.tokenizer, args.source, "heldout", args.tokens, args.seq_len)
    t0 = time.time()
    p = perplexity(lm.model, toks)
    out = {"model": lm.ref, "source": args.source, "split": "heldout", "tokens": p.n_tokens,
           "seq_len": args.seq_len, "dtype": args.dtype, "ppl": round(p.ppl, 3), "nll": round(p.nll, 5),
           "stderr_nll": None if p.stderr_nll is None else round(p.stderr_nll, 5), "seconds": round(time.time() - t0, 1),
           "data_fingerprint": toks.fingerprint[:12]}
    print(json.dumps(out))
    return 0


def cmd_capture(args) -> int:
    from workers.sparsity.capture import capture_activations
    from workers.loading.data import token_windows

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


def cmd_kernels(args) -> int:
    """Which CPU kernels run here; exit 0 either way (a fallback is information, not an error)."""
    from kernels import cpu, native

    st = native.native_status()
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(native.describe(st))
    for name in cpu.LIBRARIES:
        lib = st[name]
        if lib.get("built"):
            print(f"  {name}: built, {lib['isa']} (asked for: {lib.get('requested')}; flags {lib.get('flags', '')})")
        elif lib.get("disabled"):
            print(f"  {name}: off ({cpu.NATIVE_ENV}=0): its ops run on the torch fallback")
        else:
            print(f"  {name}: not built, its ops run on the torch fallback (slow): {lib.get('error')}")
    return 0


def cmd_ingest_kernels(args) -> int:
    from orchestrator.ingest import ingest_kernel_results

    n, new = ingest_kernel_results(args.file, args.db)
    print(json.dumps({"file": args.file, "rows": n, "units_added": new}))
    return 0


# ---------------------------------------------------------------------------------------------- sweeps
def _address(args) -> str:
    return args.address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"


def _client(args):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(_address(args))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"cannot reach the Ray cluster at {_address(args)} ({e}); start one with "
                           "`ray start --head` or pass --address") from None


def _job_status(client, sid: str) -> str | None:
    try:
        return str(client.get_job_status(sid).value)
    except RuntimeError:   # no such job
        return None


LIVE = ("PENDING", "RUNNING")


def _attempts(client, sid: str) -> list[tuple[int, str, str]]:
    """Every attempt of one sweep on the cluster, oldest first: ``(number, submission id, status)``. The first
    attempt is ``sid`` (number 1), its resubmissions ``sid-r2``, ``sid-r3``, ... (one listing, so a deleted
    attempt leaves no blind spot)."""
    found = []
    for job in client.list_jobs():
        j = job.submission_id or ""
        n = 1 if j == sid else int(j[len(sid) + 2:]) if re.fullmatch(re.escape(sid) + r"-r[0-9]+", j) else None
        if n is not None:
            found.append((n, j, str(job.status.value)))
    return sorted(found)


def submit_spec(args, spec, resume: bool = False) -> int:
    """Submit the sweep as a Ray job, unless one of its attempts is still waiting or running (never two live
    jobs for one sweep), or (for ``submit``, not ``resume``) its last attempt succeeded."""
    base = f"ctxsparse-{spec.name}-{spec.spec_hash()[:12]}"
    client = _client(args)
    attempts = _attempts(client, base)
    live = [a for a in attempts if a[2] in LIVE]
    last = attempts[-1] if attempts else None
    if live or (last and last[2] == "SUCCEEDED" and not resume):
        _, sid, status = live[-1] if live else last
        print(json.dumps({"submission_id": sid, "status": status, "submitted": False,
                          "note": "this sweep was already submitted; not submitting it twice"}))
        if live:
            print(f"attempt {sid} of this sweep is {status}: not submitting another; follow it with "
                  f"`ctxsparse logs {sid} --follow`", file=sys.stderr)
        return _follow(client, sid) if args.follow else 0
    previous, sid = None, base
    if last is not None:          # every attempt has ended: a new id for the resubmission, same units
        previous = {"submission_id": last[1], "status": last[2]}
        sid = f"{base}-r{last[0] + 1}"
        print(f"previous attempt {last[1]} ended {last[2]}; submitting again as {sid} (finished units are "
              "skipped)", file=sys.stderr)
    env = {"CTXSPARSE_SPEC": json.dumps(spec.canonical()), "CTXSPARSE_SUBMISSION_ID": sid}
    for var in ("CTXSPARSE_DB_URL", "CTXSPARSE_HOME"):
        if os.environ.get(var):
            env[var] = os.environ[var]
    if args.db:
        env["CTXSPARSE_DB_URL"] = args.db
    runtime_env = {"env_vars": env}
    if args.working_dir:
        runtime_env["working_dir"] = args.working_dir
    submit_job(client, entrypoint="python -m orchestrator.driver -", submission_id=sid, runtime_env=runtime_env,
               metadata={"sweep": spec.name, "spec_hash": spec.spec_hash()})
    print(json.dumps({"submission_id": sid, "status": "PENDING", "submitted": True, "address": _address(args),
                      "previous": previous}))
    return _follow(client, sid) if args.follow else 0


AGENT_NOT_UP = "No available agent to submit job"    # Ray's answer while the head's job agent is starting
AGENT_WAIT_S = 60.0


def submit_job(client, wait_s: float = AGENT_WAIT_S, pause_s: float = 2.0, **job) -> str:
    """``client.submit_job(**job)``, asked again every ``pause_s`` for up to ``wait_s`` while Ray answers that no
    job agent is available yet (a cluster seconds after ``ray start``: Ray says to try again later); any other
    error, or that one after ``wait_s``, is raised."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if AGENT_NOT_UP not in str(e) or time.monotonic() + pause_s > deadline:
                raise
            print(f"Ray's job agent is not up yet; asking again in {pause_s:g} s", file=sys.stderr)
            time.sleep(pause_s)


def _follow(client, sid: str) -> int:
    import asyncio

    async def tail():
        async for chunk in client.tail_job_logs(sid):
            print(chunk, end="", flush=True)

    asyncio.run(tail())
    status = _job_status(client, sid)
    print(f"job {sid}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


def _local_checks(args, spec) -> None:
    """Before any job exists: the files the spec names, and the store the job will write to (when a URL is given
    here: without one the job uses the cluster's own default), so such mistakes are one message, exit 2."""
    from db.store import open_store
    from orchestrator.spec import check_inputs

    if args.skip_local_checks:
        return
    check_inputs(spec)
    if args.db or os.environ.get("CTXSPARSE_DB_URL"):
        open_store(args.db, migrate=False)


def cmd_submit(args) -> int:
    from orchestrator.spec import load_spec

    spec = load_spec(args.spec)            # SpecError (a ValueError) names the field: exit 2
    _local_checks(args, spec)
    return submit_spec(args, spec)


def _store(args):
    """The store, read-only, once it is reachable and migrated."""
    from db.store import Store, open_store

    open_store(args.db)                    # StoreError: one message, exit 2
    return Store(args.db, read_only=True)


def _find_sweep(store, ref: str):
    sweeps = store.sweeps()
    hits = [s for s in sweeps if ref in (str(s.id), s.name, s.submission_id) or
            (s.submission_id or "").startswith(ref)]
    if not hits:
        raise KeyError(f"no sweep {ref!r} in the store (known: {', '.join(s.name for s in sweeps) or 'none'})")
    return hits[0]   # newest first


def cmd_resume(args) -> int:
    from orchestrator.spec import parse_spec

    sweep = _find_sweep(_store(args), args.sweep)
    spec = parse_spec(sweep.spec, f"stored spec of sweep {sweep.name}")
    _local_checks(args, spec)
    return submit_spec(args, spec, resume=True)


def cmd_status(args) -> int:
    store = _store(args)
    out = []
    for sw, prog, failed in store.sweep_statuses([_find_sweep(store, args.sweep)] if args.sweep else None):
        failures = [{"unit": u.id[:12], "kind": u.kind, "method": u.method, "error": (u.error or "")[-300:]}
                    for u in failed]
        out.append({"sweep": sw.name, "id": sw.id, "status": sw.status, "done": prog.done, "total": prog.total,
                    "failed": prog.failed, "submission_id": sw.submission_id, "failures": failures[:5]})
    found = _status_client(args)
    if found is None:
        print(f"Ray job state: {NO_CLUSTER}", file=sys.stderr)
    else:
        client, where = found
        print(f"Ray job state: from {where}", file=sys.stderr)
        for o in out:
            if o["submission_id"]:
                o["ray_job"] = _job_status(client, o["submission_id"])
    print(json.dumps(out, indent=1))
    return 0


NO_CLUSTER = "no Ray cluster reachable (set --address or RAY_ADDRESS)"


def _status_client(args):
    """``(client, where)`` of the Ray job API that ``status`` asks, else None: ``--address`` or ``$RAY_ADDRESS``
    (one that does not answer is an error, as for every command), else the head that ``ray start`` recorded on
    this machine (Ray's address file in its temp folder, what ``ray status`` and ``ray job`` find by default), when
    it answers. Ray's last resort, any ``gcs_server`` process of the machine, is not asked: it may belong to an
    unrelated cluster (docs/cli.md: two local clusters)."""
    import socket

    if args.address or os.environ.get("RAY_ADDRESS"):
        how = "--address" if args.address else "$RAY_ADDRESS"
        return _client(args), f"{_address(args)} ({how})"
    try:
        from ray._private.services import find_bootstrap_address

        gcs = find_bootstrap_address(None)
    except (ImportError, AttributeError, OSError):
        return None
    host, _, port = (gcs or "").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:                                  # the file of a head that has stopped
        return None
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(gcs)
    except Exception:  # noqa: BLE001  (a head that stopped since: Ray's RpcError, a timeout, ...; nothing to ask)
        return None
    return client, f"{client.get_address()} (the local head at {gcs}, from Ray's address file)"


def cmd_logs(args) -> int:
    sid = args.ref
    if not sid.startswith("ctxsparse-") or args.db:
        try:
            sid = _find_sweep(_store(args), args.ref).submission_id or sid
        except KeyError:
            pass
    client = _client(args)
    if _job_status(client, sid) is None:
        raise KeyError(f"no Ray job {sid!r} at {_address(args)}")
    if args.follow:
        return _follow(client, sid)
    print(client.get_job_logs(sid), end="")
    return 0


def cmd_pareto(args) -> int:
    from db.front.pareto import format_front

    _, front = _store(args).front(args.model, args.metric, args.device, args.batch, args.threads)
    print(format_front(front, args.model))
    return 0


def cmd_bundle(args) -> int:
    from orchestrator import bundles
    from workers.sparsity.bundle import MEASURED

    if args.action == "download":
        out, m = bundles.download(args.src, args.out)
    else:
        if bool(args.unit) == bool(args.best):
            raise ValueError("bundle export: give a fit unit id or --best MODEL (one of them)")
        store = _store(args)
        unit = (bundles.resolve_unit(store, args.unit) if args.unit else
                bundles.best_unit(store, args.best, args.metric, args.device, args.max_loss, args.by, args.threads))
        out, m = bundles.export(store, unit, args.out, store.measurement(unit, args.device, args.threads))
    measured = m.get(MEASURED) or {}
    print(json.dumps({"bundle": str(out), "model": m["model"]["ref"], "fingerprint": m["model"]["fingerprint"][:12],
                      "method": m["method"], "sparsity": m["sparsity"], "rank": m["rank"],
                      "attn_sparsity": m["attn_sparsity"], "unit": (m.get("unit_id") or "")[:12],
                      "measured_on": measured.get("device_type"), "threads": measured.get("threads"),
                      "speedup_vs_dense": measured.get("speedup_vs_dense"),
                      "speedup_spread": [measured.get("speedup_min"), measured.get("speedup_max")]}))
    return 0


def cmd_generate(args) -> int:
    from workers.decode.generate import run_bundle

    if args.device == "cpu":
        from kernels.native import describe

        print(describe(), flush=True)
    res = run_bundle(args.model, args.bundle, args.prompt, tokens=args.tokens, device=args.device,
                     repeats=args.repeats, threads=args.threads, weights=args.weights,
                     head_candidates=args.head_candidates)
    print(res.text)
    print(res.summary())
    return 0


def _positive(v: str, what: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{what}, not {v!r}")
    return n


def _candidates(v: str):
    return v if v == "all" else _positive(v, "a candidate count >= 1 or 'all'")


def _threads(v: str) -> int:
    return _positive(v, "a thread count >= 1")


def _store_option() -> argparse.ArgumentParser:
    """The --db parent of every leaf command (`bundle export`, not `bundle`); those that never use the store
    accept it and ignore it."""
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--db", default=None, metavar="URL",
                       help="the store's SQLAlchemy URL (default: $CTXSPARSE_DB_URL, else SQLite under "
                            "$CTXSPARSE_HOME); commands that never use the store ignore it")
    return store


def _add_model_args(sp, tokens: int) -> None:
    """The model, text and window options of `ppl` and `capture`."""
    sp.add_argument("--model", default="smollm2-135m", help="model ref (default: smollm2-135m)")
    sp.add_argument("--source", default="lambada", help="text source (default: lambada)")
    sp.add_argument("--tokens", type=int, default=tokens, help=f"token budget (default: {tokens})")
    sp.add_argument("--seq-len", type=int, default=512)
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_address(sp, default="$RAY_ADDRESS or http://127.0.0.1:8265") -> None:
    sp.add_argument("--address", default=None, help=f"Ray dashboard address (default: {default})")


def _add_step_parsers(sub, db: dict) -> None:
    """`ppl` and `capture`."""
    sp = sub.add_parser("ppl", help="held-out perplexity", **db)
    _add_model_args(sp, 2048)
    sp.set_defaults(fn=cmd_ppl)
    sp = sub.add_parser("capture", help="collect activations into the cache", **db)
    _add_model_args(sp, 16384)
    sp.add_argument("--store-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    sp.add_argument("--twice", action="store_true", help="call twice to show the cache hit")
    sp.set_defaults(fn=cmd_capture)


def _add_sweep_parsers(sub, db: dict) -> None:
    """`submit`, `resume`, `status`, `logs` and `pareto`."""
    sp = sub.add_parser("submit", help="validate a sweep spec and submit it as a Ray job", **db)
    sp.add_argument("spec")
    _add_address(sp)
    sp.add_argument("--follow", action="store_true", help="stream the job's log until it ends")
    sp.add_argument("--working-dir", default=None, help="upload this folder as the job's working_dir")
    sp.add_argument("--skip-local-checks", action="store_true",
                    help="do not check the spec's files and the --db store from here (when only the cluster sees them)")
    sp.set_defaults(fn=cmd_submit)
    sp = sub.add_parser("resume", help="submit a stored sweep again; finished units are skipped", **db)
    sp.add_argument("sweep", help="sweep name, id or submission id")
    _add_address(sp)
    sp.add_argument("--follow", action="store_true")
    sp.add_argument("--working-dir", default=None)
    sp.add_argument("--skip-local-checks", action="store_true")
    sp.set_defaults(fn=cmd_resume)
    sp = sub.add_parser("status", help="sweeps and their progress (from the store)", **db)
    sp.add_argument("sweep", nargs="?")
    _add_address(sp, "$RAY_ADDRESS, else the head `ray start` started on this machine, where one answers")
    sp.set_defaults(fn=cmd_status)
    sp = sub.add_parser("logs", help="a sweep's driver log (from Ray)", **db)
    sp.add_argument("ref", help="sweep name/id or Ray submission id")
    _add_address(sp)
    sp.add_argument("--follow", action="store_true")
    sp.set_defaults(fn=cmd_logs)
    sp = sub.add_parser("pareto", help="the Pareto front of a model from the store", **db)
    sp.add_argument("model", help="model name or fingerprint prefix")
    sp.add_argument("--metric", default=None, help="e.g. perplexity/lambada-heldout/ppl, mc/mean/acc")
    sp.add_argument("--device", default="cpu", choices=list(DEVICE_TYPES))
    sp.add_argument("--batch", type=int, default=1)
    sp.add_argument("--threads", type=_threads, default=None,
                    help="the thread count the latencies were measured at (default: the largest with rows)")
    sp.set_defaults(fn=cmd_pareto)


def _add_bundle_parser(sub, db: dict) -> None:
    """`bundle export` and `bundle download`."""
    sp = sub.add_parser("bundle", help="export or download a predictor bundle")
    bsub = sp.add_subparsers(dest="action", required=True)
    be = bsub.add_parser("export", help="a fit unit's bundle (or the best on a front) to a folder or .tar.gz", **db)
    be.add_argument("unit", nargs="?", help="fit unit id (or a unique prefix)")
    be.add_argument("--best", metavar="MODEL", help="the fastest setting within --max-loss of dense (never the oracle)")
    be.add_argument("--by", default="latency", choices=["latency", "sparsity"],
                    help="latency: fastest front setting on --device; sparsity: sparsest setting (any device)")
    be.add_argument("--metric", default=None)
    be.add_argument("--device", default="cpu", choices=list(DEVICE_TYPES))
    be.add_argument("--max-loss", type=float, default=0.05, help="relative accuracy loss allowed (0.05 = 5%%)")
    be.add_argument("--threads", type=_threads, default=None,
                    help="choose on the front timed at this thread count (default: the largest with rows); the "
                         "bundle records it for `generate`")
    be.add_argument("--out", required=True)
    be.set_defaults(fn=cmd_bundle)
    bd = bsub.add_parser("download", help="unpack and verify a bundle archive (path or http(s) URL)", **db)
    bd.add_argument("src")
    bd.add_argument("--out", required=True)
    bd.set_defaults(fn=cmd_bundle)


def _add_generate_parser(sub, db: dict) -> None:
    """`generate`."""
    sp = sub.add_parser("generate", help="greedy text with a bundle on the decode runtime; tokens/s dense vs sparse",
                        **db)
    sp.add_argument("--model", required=True, help="model ref the bundle was fitted on (e.g. smollm2-135m)")
    sp.add_argument("--bundle", required=True, help="bundle folder (from `ctxsparse bundle export`)")
    sp.add_argument("--prompt", required=True, help="text to continue")
    sp.add_argument("--tokens", type=int, default=32, help="tokens to generate (default: 32)")
    sp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    sp.add_argument("--repeats", type=int, default=7, help="timed rounds of dense and sparse, interleaved (default: 7)")
    sp.add_argument("--threads", type=_threads, default=None,
                    help="CPU threads (default: the count the bundle's setting was timed at in the sweep, which "
                         "`bundle export` records; else every core)")
    sp.add_argument("--weights", default="auto", choices=["auto", "gguf", "float"],
                    help="what the CPU decodes: the GGUF's quantized blocks or the float weights (default: what "
                         "the sweep timed the setting on, as the bundle records; else the GGUF's blocks for a "
                         "model loaded from one)")
    sp.add_argument("--head-candidates", type=_candidates, default=None, metavar="K",
                    help="the predicted head's candidate count for this run: an int, or 'all' (the dense head); "
                         "no refit (default: the bundle's)")
    sp.set_defaults(fn=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ctxsparse", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    db = {"parents": [_store_option()]}
    _add_step_parsers(sub, db)
    _add_sweep_parsers(sub, db)
    _add_bundle_parser(sub, db)
    _add_generate_parser(sub, db)
    sp = sub.add_parser("ingest-kernels", help="load `benchmarks.kernels --json` results into the SQL store", **db)
    sp.add_argument("file")
    sp.set_defaults(fn=cmd_ingest_kernels)
    sp = sub.add_parser("kernels", help="which CPU kernels run here: the native build and its instruction set, or "
                        "the torch fallback", **db)
    sp.add_argument("--json", action="store_true", help="kernels.native.native_status() as JSON")
    sp.set_defaults(fn=cmd_kernels)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return args.fn(args)
    except (ValueError, RuntimeError, LookupError, OSError, SQLAlchemyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, SQLAlchemyError):      # the store failed mid-command: its own message, one line
            from orchestrator.driver import reason

            msg = f"the store failed: {reason(getattr(e, 'orig', None) or e)}"
        print(f"ctxsparse {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
