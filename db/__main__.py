"""``python -m db upgrade [URL]`` / ``python -m db current [URL]``.

URL defaults to ``$CTXSPARSE_DB_URL``, else the SQLite file under ``$CTXSPARSE_HOME``.
Exit status 0 on success, 1 with a one-line message on stderr otherwise.
"""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from db.engine import current_revision, default_url, head_revision, upgrade


def _safe(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m db", description="ctxsparse SQL store migrations")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("upgrade", "migrate the database to the newest schema"),
                        ("current", "print the database's schema revision")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("url", nargs="?", default=None,
                       help="SQLAlchemy URL (default: $CTXSPARSE_DB_URL or the SQLite file under $CTXSPARSE_HOME)")
    args = parser.parse_args(argv)
    url = args.url or default_url()
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


if __name__ == "__main__":
    sys.exit(main())
