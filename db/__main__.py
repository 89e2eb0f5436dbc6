"""``python -m db upgrade [--db URL]`` / ``python -m db current [--db URL]``; a sweep's rows as JSON lines:
``python -m db export SWEEP FILE [--db URL]`` and ``python -m db load FILE [--db URL]`` (see ``db.resultset``).

``--db URL``, as every ``ctxsparse`` command takes it; the URL may also come last, without ``--db`` (both: they
must be the same). It defaults to ``$CTXSPARSE_DB_URL``, else the SQLite file under ``$CTXSPARSE_HOME``.
Exit status 0 on success, 1 with a one-line message on stderr otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from db.engine import current_revision, default_url, display_url, head_revision, upgrade
from db.resultset import REQUEST_SCORES


def _safe(url: str) -> str:
    try:
        return display_url(url)
    except ArgumentError:
        return url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m db", description="ctxsparse SQL store migrations")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("upgrade", "migrate the database to the newest schema"),
                        ("current", "print the database's schema revision"),
                        ("export", "write one sweep's rows (units, results, models) as JSON lines"),
                        ("load", "insert a result-set file's rows that the store lacks (migrates it first)")):
        p = sub.add_parser(name, help=help_)
        if name == "export":
            p.add_argument("sweep", help="sweep name (the newest of that name) or id")
            p.add_argument("file", help="the .jsonl file to write")
            p.add_argument("--request-scores", choices=REQUEST_SCORES, default="unassembled",
                           help="the task shards' scored requests to write: of shards whose task is not assembled "
                                "yet (default: a store that loads the file can still assemble it; an assembled "
                                "task's rows hold what they give), of every shard, or none (rows of a sweep that "
                                "still runs, without its shards' millions of scores)")
            p.add_argument("--all-request-scores", dest="request_scores", action="store_const", const="all",
                           help="the same as --request-scores all")
        elif name == "load":
            p.add_argument("file", help="a .jsonl file written by export")
        p.add_argument("--db", dest="db", default=None, metavar="URL",
                       help="SQLAlchemy URL (default: $CTXSPARSE_DB_URL or the SQLite file under $CTXSPARSE_HOME)")
        p.add_argument("url", nargs="?", default=None, help="the same URL, given without --db")
    args = parser.parse_args(argv)
    if args.db and args.url and args.db != args.url:
        parser.error(f"two different store URLs: --db {_safe(args.db)} and {_safe(args.url)}; give one")
    url = args.db or args.url or default_url()
    if args.command in ("export", "load"):
        return _resultset(args, url)
    try:
        if args.command == "upgrade":
            upgrade(url)
            print(f"{_safe(url)}: at revision {current_revision(url)} (head {head_revision()})")
        else:
            rev = current_revision(url)
            state = "up to date" if rev == head_revision() else f"head is {head_revision()}"
            print(f"{_safe(url)}: revision {rev or 'none (empty database)'} ({state})")
    except (SQLAlchemyError, ValueError, OSError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        action = "upgrade" if args.command == "upgrade" else "read the revision of"
        print(f"error: cannot {action} database {_safe(url)}: {type(exc).__name__}: {reason}",
              file=sys.stderr)
        return 1
    return 0


def _resultset(args, url: str) -> int:
    from db.engine import get_engine, session_scope
    from db.resultset import ResultSetError, export_sweep, load_records, read_jsonl, write_jsonl

    try:
        if args.command == "export":
            rev = current_revision(url)
            if rev is None:
                raise ResultSetError("the store is empty (no schema)")
            with session_scope(get_engine(url, read_only=True)) as s:
                sweep = int(args.sweep) if args.sweep.isdigit() else args.sweep
                n = write_jsonl(export_sweep(s, sweep, rev, args.request_scores), args.file)
            print(f"{args.file}: {n - 1} rows of sweep {args.sweep} from {_safe(url)}")
        else:
            records = read_jsonl(args.file)
            upgrade(url)
            with session_scope(get_engine(url)) as s:
                added = load_records(s, records, args.file)
            print(f"{_safe(url)}: loaded {args.file}: " +
                  ", ".join(f"{n} {t}" for t, n in added.items()) + " new")
    except (ResultSetError, SQLAlchemyError, ValueError, OSError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"error: cannot {args.command} {args.file} ({_safe(url)}): {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
