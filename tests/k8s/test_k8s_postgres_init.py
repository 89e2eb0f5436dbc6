"""The read-only role script of k8s/postgres-init, run the way the postgres image runs it, on a
throwaway PostgreSQL: the dashboard's role can read every table, including those the migrations
create afterwards, and can write none."""
from __future__ import annotations

import os
import shutil
import subprocess

import psycopg
import pytest

from tests.k8s.conftest import K8S

pytestmark = pytest.mark.postgres

SCRIPT = K8S / "postgres-init" / "10-ctxsparse-readonly-role.sh"
OWNER, DB, RO = "ctxsparse", "ctxsparse_k8s", "ctxsparse_ro"


def test_readonly_role_reads_migrated_tables_and_writes_nothing(pg_cluster):
    assert shutil.which("psql"), "psql not found on PATH: install the PostgreSQL client (`make test` does)"
    # What the image does before running init scripts: the superuser POSTGRES_USER and POSTGRES_DB.
    pg_cluster._execute(f"CREATE ROLE {OWNER} SUPERUSER LOGIN")
    pg_cluster._execute(f'CREATE DATABASE {DB} OWNER {OWNER} TEMPLATE template0')
    env = {"PATH": os.environ["PATH"], "PGHOST": "127.0.0.1", "PGPORT": str(pg_cluster.port),
           "POSTGRES_USER": OWNER, "POSTGRES_DB": DB, "CTXSPARSE_RO_PASSWORD": "it's a 'quoted' pw"}
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr

    # Then the migration Job, as the owner.
    from db.engine import upgrade

    upgrade(f"postgresql+psycopg://{OWNER}@127.0.0.1:{pg_cluster.port}/{DB}")

    with psycopg.connect(host="127.0.0.1", port=pg_cluster.port, user=RO, dbname=DB, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")]
        assert {"sweeps", "work_units", "accuracy_results", "latency_results"} <= set(tables)
        for t in tables:
            conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()
        assert conn.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        # The role's read-only default is a session setting it may turn off; the grants still hold.
        conn.execute("SET default_transaction_read_only = off")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM sweeps")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE public.x (i int)")
