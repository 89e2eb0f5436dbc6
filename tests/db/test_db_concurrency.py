"""Concurrent writers: threads (both backends) and spawned processes (SQLite) finishing
distinct and overlapping units. Afterwards every unit is done exactly once, row counts are
exact and no writer saw an error ("database is locked" included)."""

from __future__ import annotations

import multiprocessing as mp
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import func, select

from db import queries as q
from db.engine import get_engine, session_scope, upgrade
from db.models import AccuracyResult, Artifact, LatencyResult, LayerMetric
from tests.db.db_support import N_ACC, N_ART, N_LAT, N_LAYER, finish_all, seed, uid, unit_spec

N_UNITS = 24


def _plan(n_workers: int, seed_: int) -> list[list[int]]:
    """Each unit goes to two different workers (overlap), in a shuffled order per worker."""
    rng = random.Random(seed_)
    plans: list[list[int]] = [[] for _ in range(n_workers)]
    for i in range(N_UNITS):
        for w in rng.sample(range(n_workers), 2):
            plans[w].append(i)
    for p in plans:
        rng.shuffle(p)
    return plans


def _check(engine, sweep_id: int, outcomes: list[tuple[str, bool]]) -> None:
    winners: dict[str, int] = {}
    for unit_id, won in outcomes:
        winners[unit_id] = winners.get(unit_id, 0) + int(won)
    assert len(outcomes) == 2 * N_UNITS
    assert winners == {uid(i): 1 for i in range(N_UNITS)}, "each unit must be finished by exactly one writer"
    with session_scope(engine) as s:
        assert q.sweep_progress(s, sweep_id) == (N_UNITS, 0, N_UNITS)
        [sweep] = q.list_sweeps(s)
        assert (sweep.n_units_done, sweep.n_units_total) == (N_UNITS, N_UNITS)
        for table, per_unit in ((AccuracyResult, N_ACC), (LatencyResult, N_LAT), (LayerMetric, N_LAYER),
                                (Artifact, N_ART)):
            assert s.scalar(select(func.count()).select_from(table)) == N_UNITS * per_unit, table.__tablename__
            per = s.execute(select(table.unit_id, func.count()).group_by(table.unit_id)).all()
            assert {u: n for u, n in per} == {uid(i): per_unit for i in range(N_UNITS)}


@pytest.mark.parametrize("n_threads", [8])
def test_threads_finish_distinct_and_overlapping_units(engine, n_threads):
    _, sweep_id, _ = seed(engine, N_UNITS)
    with ThreadPoolExecutor(n_threads) as pool:
        futures = [pool.submit(finish_all, engine, plan) for plan in _plan(n_threads, seed_=1)]
        outcomes = [o for f in futures for o in f.result()]  # re-raises any writer's error
    _check(engine, sweep_id, outcomes)


def test_threads_claim_each_unit_once(engine):
    _, sweep_id, ids = seed(engine, N_UNITS)

    def claim_all(worker: str) -> list[str]:
        got = []
        for unit_id in random.Random(worker).sample(ids, len(ids)):
            with session_scope(engine) as s:
                if q.claim_unit(s, unit_id, worker):
                    got.append(unit_id)
        return got

    with ThreadPoolExecutor(6) as pool:
        claims = list(pool.map(claim_all, [f"w{i}" for i in range(6)]))
    claimed = [u for c in claims for u in c]
    assert sorted(claimed) == sorted(ids)
    with session_scope(engine) as s:
        assert q.pending_units(s, sweep_id) == []
        assert {u.attempts for u in q.units_for_model(s, q.list_models(s)[0].id)} == {1}


def test_processes_finish_overlapping_units_sqlite(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'mp.db'}"
    engine = get_engine(url)
    upgrade(engine)
    _, sweep_id, _ = seed(engine, N_UNITS)
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        outcomes = [o for r in pool.starmap(finish_all, [(url, plan) for plan in _plan(4, seed_=2)]) for o in r]
    _check(engine, sweep_id, outcomes)
    engine.dispose()


def test_resubmission_while_units_finish(engine):
    """A sweep re-registered (resubmitted) and a second overlapping sweep registered while
    writers finish its units: no deadlock, no error, counters exact."""
    model_id, _, _ = seed(engine, N_UNITS)

    def register(name: str) -> None:
        for _ in range(3):
            with session_scope(engine) as s:
                sid, _ = q.get_or_create_sweep(s, name=name, spec_hash=name * 8, spec={})
                order = random.Random(name).sample(range(N_UNITS), N_UNITS)
                q.register_units(s, sid, [unit_spec(i, model_id) for i in order])

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(finish_all, engine, plan) for plan in _plan(6, seed_=3)]
        futures += [pool.submit(register, "sweep-a"), pool.submit(register, "sweep-b")]
        outcomes = [o for f in futures for o in (f.result() or [])]
    winners = [u for u, won in outcomes if won]
    assert sorted(winners) == sorted(uid(i) for i in range(N_UNITS))
    with session_scope(engine) as s:
        sweeps = {w.name: w for w in q.list_sweeps(s)}
        for w in sweeps.values():
            assert q.sweep_progress(s, w.id) == (N_UNITS, 0, N_UNITS)
            assert (w.n_units_done, w.n_units_total) == (N_UNITS, N_UNITS), w.name
