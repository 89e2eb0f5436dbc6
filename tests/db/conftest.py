"""Fixtures for the SQL store tests: every test that uses ``db_url`` / ``engine`` runs on SQLite (a file in
tmp_path) and on PostgreSQL (one fresh empty schema per test, the URL sets it as search_path, in the session's
throwaway cluster: ``pg_cluster``, tests/conftest.py and tests/pg_support.py). The PG cases are marked
``postgres`` and run by default; they fail (never skip) when the PostgreSQL binaries are not installed, so a run
without them cannot pass with the PostgreSQL half unrun.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from db.engine import get_engine, upgrade


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    """URL of an empty database (no schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ctxsparse.db'}"
    return request.getfixturevalue("pg_cluster").empty_schema_url()


@pytest.fixture
def engine(db_url) -> Iterator[Engine]:
    """A read-write engine on a database migrated to head."""
    eng = get_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()
