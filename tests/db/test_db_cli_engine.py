"""``python -m db``, engine URL resolution and SQLite settings, provenance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from db import provenance
from db.engine import default_url, get_engine, head_revision

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "db", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_cli_upgrade_then_current(db_url):
    if db_url.startswith("sqlite"):  # a fresh path whose folder does not exist yet
        db_url = db_url.replace("ctxsparse.db", "fresh/sub/ctxsparse.db")
    up = _cli("upgrade", db_url)
    assert up.returncode == 0, up.stderr
    assert f"at revision {head_revision()}" in up.stdout
    cur = _cli("current", "--db", db_url)                # the URL as every ctxsparse command takes it
    assert cur.returncode == 0 and "up to date" in cur.stdout, cur.stderr


def test_cli_uses_ctxsparse_home_by_default(tmp_path):
    env = {"CTXSPARSE_HOME": str(tmp_path / "home"), "CTXSPARSE_DB_URL": ""}
    assert _cli("upgrade", env_extra=env).returncode == 0
    assert (tmp_path / "home" / "ctxsparse.db").exists()


@pytest.mark.parametrize("url, reason", [
    ("nosuchdriver://x/y", "unsupported database backend"),
    ("not a url", "Could not parse"),
    ("postgresql://user:s3cret@127.0.0.1:1/nodb", "OperationalError"),
])
def test_cli_bad_url_fails_clearly(url, reason):
    r = _cli("upgrade", url)
    assert r.returncode != 0
    assert r.stderr.startswith("error: cannot upgrade database") and reason in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "s3cret" not in r.stderr


def test_cli_current_does_not_create_a_missing_sqlite_file(tmp_path):
    r = _cli("current", f"sqlite:///{tmp_path / 'missing' / 'x.db'}")
    assert r.returncode != 0 and "unable to open database file" in r.stderr
    assert not (tmp_path / "missing").exists()


def test_default_url_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("CTXSPARSE_DB_URL", raising=False)
    monkeypatch.delenv("CTXSPARSE_HOME", raising=False)
    assert default_url() == f"sqlite:///{Path.home() / '.cache' / 'ctxsparse' / 'ctxsparse.db'}"
    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path))
    assert default_url() == f"sqlite:///{tmp_path / 'ctxsparse.db'}"
    monkeypatch.setenv("CTXSPARSE_DB_URL", "postgresql+psycopg://u@h/db")
    assert default_url() == "postgresql+psycopg://u@h/db"
    assert get_engine("postgresql://u@h/db").dialect.driver == "psycopg"  # never psycopg2


def test_sqlite_connection_settings(tmp_path):
    engine = get_engine(f"sqlite:///{tmp_path / 'a' / 'x.db'}")
    with engine.connect() as conn:
        pragmas = {p: conn.execute(text(f"PRAGMA {p}")).scalar() for p in ("journal_mode", "foreign_keys",
                                                                            "busy_timeout")}
    assert pragmas == {"journal_mode": "wal", "foreign_keys": 1, "busy_timeout": 30000}
    engine.dispose()
    with pytest.raises(ValueError, match="in-memory"):
        get_engine("sqlite://", read_only=True)


def test_provenance(monkeypatch, tmp_path):
    versions = provenance.package_versions()
    assert versions["sqlalchemy"] and versions["pydantic"]
    assert "surely-not-installed-pkg" not in provenance.package_versions(("surely-not-installed-pkg", "pydantic"))
    assert set(provenance.stamp()) == {"package_versions", "git_rev"}
    # the env var wins where set (inside the checkout too: a shipped tree names the shipment's commit) ...
    provenance.git_rev.cache_clear()
    monkeypatch.setenv("CTXSPARSE_GIT_REV", "cafe01")
    assert provenance.git_rev() == "cafe01"
    monkeypatch.delenv("CTXSPARSE_GIT_REV")
    # ... outside a git checkout: the env var, else "unknown"
    monkeypatch.setattr(provenance, "_PROJECT_ROOT", tmp_path)
    provenance.git_rev.cache_clear()
    try:
        monkeypatch.setenv("CTXSPARSE_GIT_REV", "deadbeef")
        assert provenance.git_rev() == "deadbeef"
        provenance.git_rev.cache_clear()
        monkeypatch.delenv("CTXSPARSE_GIT_REV")
        assert provenance.git_rev() == "unknown"
    finally:
        provenance.git_rev.cache_clear()


def test_git_rev_in_checkout():
    provenance.git_rev.cache_clear()
    rev = provenance.git_rev()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout with a commit")
    assert rev.split("-")[0] == head.stdout.strip()
