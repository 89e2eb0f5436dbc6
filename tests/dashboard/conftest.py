"""Stores for the dashboard tests, filled by real tiny sweeps (tests/sweep_support.py).

Most tests read the session's one shared sweep (``tiny_sweep``, tests/conftest.py): one sweep with latency rows, a
failed fit and its failed dependants, and cuda units left pending. The slow and browser tests also use
``sweep_dbs``, which runs the tiny SmolLM2 sweep twice more through the Ray driver (minutes on 2 cores):
  1. with ``latency=None`` into ``nolat.db``: a model with accuracy rows and no latency rows;
  2. into a copy of that database, with latency on and one more setting whose fit must fail (``threshold`` given
     an option it does not take): ``full.db``. Fit and eval units of the first sweep are found done and reused,
     the latency units run, and the failing fit (and the units that depend on it) are recorded as failed with
     their error text: the store holds two sweeps, latency rows and real failures.
     Actors get half a CPU there: the 2-CPU test cluster then holds collector, fitter and bencher at once.
The sweeps use their own ``CTXSPARSE_HOME`` whose model / activation caches link to the usual ones, so the bundle
files are the test run's own (a test may damage one to check the sha256 guard, then restores it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from dashboard.screenshots import APP as SCREENSHOTS_APP
from tests.sweep_support import FAILING_METHOD, TINY_SPEC, copy_sqlite, home_set_to, private_home, run_tiny_sweep

APP = str(SCREENSHOTS_APP)          # the one app path (dashboard.screenshots serves the same file)


@dataclass(frozen=True)
class SweepDBs:
    full: str            # SQLAlchemy URLs
    nolat: str
    home: Path           # CTXSPARSE_HOME of the sweeps (their bundles)
    outcomes: tuple


@pytest.fixture(scope="session")
def sweep_dbs(ray_local, tmp_path_factory) -> SweepDBs:
    root = tmp_path_factory.mktemp("dashboard")
    home = private_home(root)
    nolat, full = root / "nolat.db", root / "full.db"
    with home_set_to(home):
        first = run_tiny_sweep(f"sqlite:///{nolat}", latency=None)
        copy_sqlite(nolat, full)
        methods = TINY_SPEC["methods"] + [FAILING_METHOD]
        resources = {**TINY_SPEC["resources"], "cpus_per_actor": 0.5}
        second = run_tiny_sweep(f"sqlite:///{full}", methods=methods, resources=resources)
    return SweepDBs(f"sqlite:///{full}", f"sqlite:///{nolat}", home, (first, second))


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory) -> str:
    """A migrated store with no rows."""
    from db.engine import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard-empty') / 'empty.db'}"
    upgrade(url)
    return url


@pytest.fixture(autouse=True)
def _fresh_caches():
    import streamlit as st

    st.cache_data.clear()
    yield
    st.cache_data.clear()


@pytest.fixture
def app(monkeypatch):
    """``app(url)`` -> an AppTest of dashboard/app.py reading ``url`` (not yet run)."""
    from streamlit.testing.v1 import AppTest

    def make(url: str) -> AppTest:
        monkeypatch.setenv("CTXSPARSE_DB_URL", url)
        return AppTest.from_file(APP, default_timeout=60)

    return make
