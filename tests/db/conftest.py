"""Fixtures for the SQL store tests: every test that uses ``db_url`` / ``engine`` runs on
SQLite (a file in tmp_path) and on PostgreSQL (a throwaway cluster started here).

The PostgreSQL cluster is session-scoped: ``initdb`` as a non-root user (created with
``useradd`` when we run as root and it is missing) into a temp dir that user owns,
``pg_ctl start`` on a free 127.0.0.1 port with its unix socket in that dir, one database,
and one fresh empty schema per test (the URL sets it as search_path); stopped and
deleted at the end. The PG cases are marked
``postgres`` and run by default; they fail (never skip) when the PostgreSQL binaries are
not installed, so a run without them cannot pass with the PostgreSQL half unrun.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine

from db.engine import get_engine, upgrade
from tests.net_support import free_port

PG_USER = os.environ.get("CTXSPARSE_TEST_PG_USER", "ctxpg")


def _pg_bindir() -> Path | None:
    explicit = os.environ.get("CTXSPARSE_PG_BINDIR")
    candidates = [explicit] if explicit else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    candidates += ["/usr/local/pgsql/bin"]
    which = shutil.which("initdb")
    if which:
        candidates.append(str(Path(which).parent))
    for c in candidates:
        if c and (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    return None


@dataclass
class PgCluster:
    bindir: Path
    root: Path
    port: int
    run_as: str | None  # None: we are not root, run as ourselves
    _counter = itertools.count()

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        kw: dict = {}
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout, check=True, **kw,
        )

    def start(self) -> None:
        self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync", "--no-instructions")
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50")
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.root / "log"), "-o", opts, "-w", "-t", "30", "start")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop", timeout=30)
        except (subprocess.SubprocessError, OSError):
            pass

    def url(self, dbname: str = "postgres", schema: str | None = None) -> str:
        url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"
        return url if schema is None else f"{url}?options=-csearch_path%3D{schema}"

    def _execute(self, sql: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
                             autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, name: str) -> str:
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def empty_schema_url(self, dbname: str) -> str:
        """A fresh empty schema in ``dbname``, made the connection's search_path by the URL:
        as good as a new database for our purposes, and 200x faster to create."""
        schema = f"t{os.getpid()}_{next(self._counter)}"
        self._execute(f'CREATE SCHEMA "{schema}"', dbname)
        return self.url(dbname, schema)


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    bindir = _pg_bindir()
    if bindir is None:
        pytest.fail("PostgreSQL binaries (initdb, pg_ctl) not found: install PostgreSQL (`make test` does, on "
                    "Debian/Ubuntu) or set CTXSPARSE_PG_BINDIR to the folder that holds them", pytrace=False)
    run_as = None
    root = Path(tempfile.mkdtemp(prefix="ctxsparse-pg-"))
    if os.geteuid() == 0:  # initdb refuses to run as root
        run_as = PG_USER
        _ensure_user(run_as)
        pw = pwd.getpwnam(run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = PgCluster(bindir=bindir, root=root, port=free_port(), run_as=run_as)
    try:
        try:
            cluster.start()
        except subprocess.CalledProcessError as exc:
            log = (root / "log").read_text() if (root / "log").exists() else ""
            pytest.fail(f"could not start PostgreSQL: {exc.stderr}\n{log}")
        cluster.create_database("ctxsparse_test")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    """URL of an empty database (no schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ctxsparse.db'}"
    return request.getfixturevalue("pg_cluster").empty_schema_url("ctxsparse_test")


@pytest.fixture
def engine(db_url) -> Iterator[Engine]:
    """A read-write engine on a database migrated to head."""
    eng = get_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()
