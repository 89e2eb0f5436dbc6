"""The session's throwaway PostgreSQL cluster (the ``pg_cluster`` fixture in tests/conftest.py).

``initdb`` as a non-root user (created with ``useradd`` when we run as root and it is missing) into a temp dir
that user owns, ``pg_ctl start`` on a free 127.0.0.1 port with its unix socket in that dir, one database
(``ctxsparse_test``); stopped and deleted at the end of the session. Every server log line starts with the
database it concerns (``db=NAME``), so a test can read the lines of its own database; connections are logged.
A run without the PostgreSQL binaries fails (never skips): a suite cannot pass with the PostgreSQL half unrun.
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.net_support import free_port

PG_USER = os.environ.get("CTXSPARSE_TEST_PG_USER", "ctxpg")
TEST_DB = "ctxsparse_test"


class PgUnavailable(RuntimeError):
    """No PostgreSQL binaries, or the throwaway cluster did not start (the message says which and how to fix)."""


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
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100 "
                "-c log_line_prefix='db=%d ' -c log_connections=on")
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.log), "-o", opts, "-w", "-t", "30", "start")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop", timeout=30)
        except (subprocess.SubprocessError, OSError):
            pass

    @property
    def log(self) -> Path:
        return self.root / "log"

    def log_lines(self, dbname: str) -> list[str]:
        """The server log's lines about database ``dbname``."""
        prefix = f"db={dbname} "
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith(prefix)]

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

    def empty_schema_url(self, dbname: str = TEST_DB) -> str:
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


def start_cluster() -> PgCluster:
    """A started cluster with the database ``TEST_DB``; PgUnavailable when that cannot be."""
    bindir = _pg_bindir()
    if bindir is None:
        raise PgUnavailable("PostgreSQL binaries (initdb, pg_ctl) not found: install PostgreSQL (`make test` does, "
                            "on Debian/Ubuntu) or set CTXSPARSE_PG_BINDIR to the folder that holds them")
    run_as = None
    root = Path(tempfile.mkdtemp(prefix="ctxsparse-pg-"))
    if os.geteuid() == 0:  # initdb refuses to run as root
        run_as = PG_USER
        _ensure_user(run_as)
        pw = pwd.getpwnam(run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = PgCluster(bindir=bindir, root=root, port=free_port(), run_as=run_as)
    try:
        cluster.start()
        cluster.create_database(TEST_DB)
    except subprocess.CalledProcessError as exc:
        log = cluster.log.read_text() if cluster.log.exists() else ""
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        raise PgUnavailable(f"could not start PostgreSQL: {exc.stderr}\n{log}") from None
    return cluster


def remove_cluster(cluster: PgCluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)
