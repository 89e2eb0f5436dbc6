"""Engines, sessions and schema migration.

URL resolution: argument, else ``$CTXSPARSE_DB_URL``, else SQLite at
``$CTXSPARSE_HOME/ctxsparse.db`` (``CTXSPARSE_HOME`` defaults to ``~/.cache/ctxsparse``).

SQLite: WAL, busy_timeout 30 s, foreign keys on, and every read-write transaction starts
with ``BEGIN IMMEDIATE`` (takes the write lock up front, so concurrent writers wait on
busy_timeout instead of failing with "database is locked" when a deferred transaction
tries to upgrade a stale read snapshot). PostgreSQL: ``postgresql+psycopg://``.

``read_only=True`` opens SQLite with ``mode=ro`` and PostgreSQL with
``default_transaction_read_only = on``; a write then raises ``ReadOnlyDatabaseError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30.0


class ReadOnlyDatabaseError(RuntimeError):
    """A write was attempted through an engine opened with ``read_only=True``."""


def default_url() -> str:
    """``$CTXSPARSE_DB_URL``, else the SQLite file under ``$CTXSPARSE_HOME`` (``~/.cache/ctxsparse``)."""
    env = os.environ.get("CTXSPARSE_DB_URL")
    if env:
        return env
    home = os.environ.get("CTXSPARSE_HOME") or Path.home() / ".cache" / "ctxsparse"
    return f"sqlite:///{Path(home).expanduser() / 'ctxsparse.db'}"


def display_url(url: str | URL) -> str:
    """The URL with any password hidden."""
    return make_url(url).render_as_string(hide_password=True)


def _normalize(url: str | URL) -> URL:
    u = make_url(url)
    # Plain postgresql:// would pick psycopg2, which we don't ship.
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def get_engine(url: str | URL | None = None, *, read_only: bool = False, echo: bool = False) -> Engine:
    """Create an engine for ``url`` (see module docstring for the defaults)."""
    u = _normalize(url if url is not None else default_url())
    backend = u.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_engine(u, read_only=read_only, echo=echo)
    elif backend == "postgresql":
        engine = _postgres_engine(u, read_only=read_only, echo=echo)
    else:
        raise ValueError(f"unsupported database backend {backend!r} (use sqlite or postgresql)")
    if read_only:
        _translate_read_only_errors(engine)
    return engine


def _sqlite_engine(u: URL, *, read_only: bool, echo: bool) -> Engine:
    path = u.database
    in_memory = not path or path == ":memory:" or u.query.get("mode") == "memory"
    if read_only:
        if in_memory:
            raise ValueError("read_only=True needs a SQLite file, not an in-memory database")
        file_uri = Path(path).expanduser().resolve().as_uri()  # percent-encodes odd characters
        u = URL.create("sqlite", database=file_uri, query={"mode": "ro", "uri": "true"})
    elif not in_memory:
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        u = u.set(database=str(Path(path).expanduser()))

    engine = create_engine(
        u,
        echo=echo,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit transactions are not
        # usable with savepoints or BEGIN IMMEDIATE).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys = ON")
        if read_only:
            cur.execute("PRAGMA query_only = ON")
        elif not in_memory:
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(begin)

    return engine


def _postgres_engine(u: URL, *, read_only: bool, echo: bool) -> Engine:
    engine = create_engine(u, echo=echo, pool_pre_ping=True)
    if read_only:

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record) -> None:
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            dbapi_conn.execute("SET default_transaction_read_only = on")
            dbapi_conn.autocommit = autocommit

    return engine


_READ_ONLY_MESSAGES = (
    "attempt to write a readonly database",  # sqlite mode=ro
    "query_only",  # sqlite PRAGMA query_only
    "read-only transaction",  # postgresql
)


def _translate_read_only_errors(engine: Engine) -> None:
    @event.listens_for(engine, "handle_error")
    def _on_error(ctx) -> None:
        message = str(ctx.original_exception).lower()
        if any(m in message for m in _READ_ONLY_MESSAGES):
            raise ReadOnlyDatabaseError(
                f"this database connection is read-only (get_engine(read_only=True)); "
                f"refused: {ctx.statement.split(None, 1)[0] if ctx.statement else 'write'} "
                f"({ctx.original_exception})"
            ) from ctx.original_exception


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session in one transaction: commit on success, roll back on any exception.

    Objects stay readable after the block (``expire_on_commit=False``).
    """
    session = Session(engine, expire_on_commit=False)
    try:
        with session.begin():
            yield session
    finally:
        session.close()


# ---------------------------------------------------------------- migrations


def _alembic_config(connection: Connection | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextmanager
def _connect(engine_or_url: Engine | str | URL | None, *, read_only: bool = False) -> Iterator[Connection]:
    own = not isinstance(engine_or_url, Engine)
    engine = get_engine(engine_or_url, read_only=read_only) if own else engine_or_url
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        if own:
            engine.dispose()


def upgrade(engine_or_url: Engine | str | URL | None = None, revision: str = "head") -> None:
    """Run ``alembic upgrade <revision>`` on the database (creates it for SQLite)."""
    from alembic import command

    with _connect(engine_or_url) as conn:
        command.upgrade(_alembic_config(conn), revision)
        if conn.in_transaction():
            conn.commit()


def current_revision(engine_or_url: Engine | str | URL | None = None) -> str | None:
    """The database's Alembic revision (None when never migrated).

    Given a URL, connects read-only (a missing SQLite file is an error, not created).
    """
    from alembic.runtime.migration import MigrationContext

    with _connect(engine_or_url, read_only=True) as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head
