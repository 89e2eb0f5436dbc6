"""Typed queries: idempotent registration, unit lifecycle, atomic finish, reads, read-only engine."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from db import queries as q
from db.engine import ReadOnlyDatabaseError, get_engine, session_scope
from db.models import AccuracyResult, Artifact, LatencyResult, LayerMetric, Model, Sweep
from db.schemas import AccuracyRow, LatencyRow
from tests.db.db_support import N_ACC, N_ART, N_LAT, N_LAYER, PROV, results, seed, uid, unit_spec

RESULT_TABLES = (AccuracyResult, LatencyResult, LayerMetric, Artifact)


def _counts(engine, unit_id=None) -> dict[str, int]:
    with session_scope(engine) as s:
        out = {}
        for t in RESULT_TABLES:
            stmt = select(func.count()).select_from(t)
            if unit_id is not None:
                stmt = stmt.where(t.unit_id == unit_id)
            out[t.__tablename__] = s.scalar(stmt)
        return out


def _status(engine, unit_id) -> str:
    with session_scope(engine) as s:
        return q.get_unit(s, unit_id).status


def test_upserts_and_sweep_are_idempotent(engine):
    with session_scope(engine) as s:
        m1 = q.upsert_model(s, name="a", fingerprint="fp1", family="llama", config={"d": 576}, n_params=135_000_000)
        m2 = q.upsert_model(s, name="renamed", fingerprint="fp1")
        d1 = q.upsert_dataset(s, name="lambada", fingerprint="dfp", n_tokens=400_000, split="test")
        d2 = q.upsert_dataset(s, name="lambada", fingerprint="dfp")
        s1, created1 = q.get_or_create_sweep(s, name="s", spec_hash="h" * 64, spec={"a": 1})
        s2, created2 = q.get_or_create_sweep(s, name="s", spec_hash="h" * 64, spec={"a": 1}, submission_id="raysubmit_2")
    assert (m1, d1, s1) == (m2, d2, s2)
    assert created1 and not created2
    with session_scope(engine) as s:
        [model] = q.list_models(s)
        assert (model.name, model.config, model.n_params) == ("a", {"d": 576}, 135_000_000)
        [sweep] = q.list_sweeps(s)
        assert sweep.submission_id == "raysubmit_2" and sweep.spec == {"a": 1} and sweep.status == "pending"


def test_register_units_idempotent_and_shared_between_sweeps(engine):
    model_id, sweep_a, ids = seed(engine, 5)
    with session_scope(engine) as s:
        assert q.register_units(s, sweep_a, [unit_spec(i, model_id) for i in range(5)]) == 0
        assert q.register_units(s, sweep_a, [unit_spec(i, model_id).model_dump() for i in range(4, 7)]) == 2
        sweep_b, _ = q.get_or_create_sweep(s, name="b", spec_hash="b" * 64, spec={})
        # overlapping sweep: units 5, 6 reused, 7 new; a duplicate inside one call is harmless
        assert q.register_units(s, sweep_b, [unit_spec(i, model_id) for i in (5, 6, 7, 7)]) == 3
    with session_scope(engine) as s:
        q.finish_unit(s, uid(5), **results(5))
    with session_scope(engine) as s:
        assert q.sweep_progress(s, sweep_a) == (1, 0, 7)
        assert q.sweep_progress(s, sweep_b) == (1, 0, 3)
        cached = {w.id: (w.n_units_done, w.n_units_total) for w in q.list_sweeps(s)}
        assert cached == {sweep_a: (1, 7), sweep_b: (1, 3)}
        assert [u.id for u in q.pending_units(s, sweep_b)] == [uid(6), uid(7)]
        assert [w.id for w in q.sweeps_for_unit(s, uid(5))] == [sweep_b, sweep_a]     # shared, newest first
        assert [w.id for w in q.sweeps_for_unit(s, uid(0))] == [sweep_a]
        assert q.sweeps_for_unit(s, uid(99)) == []
        assert q.unit_statuses(s, [uid(5), uid(6), uid(99)]) == {uid(5): "done", uid(6): "pending"}
        assert q.unit_ids_with_prefix(s, uid(5)[:12]) == [uid(5)] and q.unit_ids_with_prefix(s, "zz") == []
    with pytest.raises(q.SweepNotFound):
        with session_scope(engine) as s:
            q.register_units(s, 12345, [unit_spec(0, model_id)])


def test_unit_lifecycle_claim_fail_retry_finish(engine):
    _, sweep_id, ids = seed(engine, 3)
    u = ids[0]
    with session_scope(engine) as s:
        assert q.claim_unit(s, u, "host1/actor1", git_rev="abc", package_versions={"torch": "2.13.0"})
        assert not q.claim_unit(s, u, "host2/actor2")  # already running
        unit = q.get_unit(s, u)
        assert (unit.status, unit.attempts, unit.worker, unit.git_rev) == ("running", 1, "host1/actor1", "abc")
        assert q.fail_unit(s, u, "CUDA out of memory\n" + "x" * 50_000)
        assert q.get_unit(s, u).status == "failed" and len(q.get_unit(s, u).error) < 21_000
        assert not q.claim_unit(s, u, "host2", retry_failed=False)
        assert q.claim_unit(s, u, "host2")  # retry
        assert q.mark_running(s, u, "host3")  # the host2 actor died; host3 takes over
        assert q.get_unit(s, u).attempts == 3
        assert q.sweep_progress(s, sweep_id) == (0, 0, 3)
        assert q.claim_unit(s, ids[1], "host4") and q.fail_unit(s, ids[1], "boom")
        assert q.sweep_progress(s, sweep_id) == (0, 1, 3)
        assert [x.id for x in q.pending_units(s, sweep_id)] == [ids[2]]
        assert {x.id for x in q.pending_units(s, sweep_id, include_failed=True)} == {ids[1], ids[2]}
        assert q.pending_units(s, sweep_id, include_failed=True, max_attempts=1) == q.pending_units(s, sweep_id)
        assert q.finish_unit(s, u, **results(0), duration_s=12.5)
        unit = q.get_unit(s, u)
        assert (unit.status, unit.error, unit.duration_s) == ("done", None, 12.5)
        # a done unit can be neither claimed, re-run nor failed
        assert not q.claim_unit(s, u, "h") and not q.mark_running(s, u, "h") and not q.fail_unit(s, u, "late")
        assert q.get_unit(s, u).status == "done"
        assert q.sweep_progress(s, sweep_id) == (1, 1, 3)
        with pytest.raises(q.UnitNotFound):
            q.finish_unit(s, "e" * 16)
        with pytest.raises(q.UnitNotFound):
            q.claim_unit(s, "e" * 16, "h")


def test_finish_twice_writes_no_duplicates(engine):
    _, sweep_id, ids = seed(engine, 2)
    with session_scope(engine) as s:
        assert q.finish_unit(s, ids[0], **results(0), duration_s=1.0)
    expected = {"accuracy_results": N_ACC, "latency_results": N_LAT, "layer_metrics": N_LAYER, "artifacts": N_ART}
    assert _counts(engine) == expected
    with session_scope(engine) as s:
        assert not q.finish_unit(s, ids[0], **results(0), duration_s=2.0)
        assert not q.finish_unit(s, ids[0], **results(1))  # different values: still a no-op
    assert _counts(engine) == expected
    with session_scope(engine) as s:
        assert q.get_unit(s, ids[0]).duration_s == 1.0
        assert q.sweep_progress(s, sweep_id) == (1, 0, 2)


def test_finish_is_atomic_on_constraint_violation(engine):
    _, _, ids = seed(engine, 1)
    rows = results(0)
    # bypass pydantic: a latency row with a NULL in a NOT NULL column, written after the accuracy rows
    bad = LatencyRow.model_construct(**{**rows["latency_rows"][0].model_dump(), "tokens_per_s": None})
    rows["latency_rows"] = [rows["latency_rows"][1], bad]
    with session_scope(engine) as s:
        with pytest.raises(IntegrityError):
            q.finish_unit(s, ids[0], **rows)
        # the caller's transaction is still usable after the failed finish (SAVEPOINT)
        assert q.fail_unit(s, ids[0], "IntegrityError while writing results")
    assert _counts(engine, ids[0]) == dict.fromkeys(_counts(engine), 0)
    assert _status(engine, ids[0]) == "failed"
    with session_scope(engine) as s:  # and a correct retry then succeeds
        assert q.finish_unit(s, ids[0], **results(0))
    assert _status(engine, ids[0]) == "done" and _counts(engine, ids[0])["latency_results"] == N_LAT


def test_finish_is_atomic_on_crash_after_all_inserts(engine, monkeypatch):
    _, sweep_id, ids = seed(engine, 1)

    def crash(*a, **k):
        raise RuntimeError("worker killed")

    monkeypatch.setattr(q, "_refresh_sweep_counts", crash)  # runs after every insert of finish_unit
    with pytest.raises(RuntimeError, match="worker killed"):
        with session_scope(engine) as s:
            q.finish_unit(s, ids[0], **results(0))
    monkeypatch.undo()
    assert _counts(engine) == dict.fromkeys(_counts(engine), 0)
    assert _status(engine, ids[0]) == "pending"
    with session_scope(engine) as s:
        assert q.sweep_progress(s, sweep_id) == (0, 0, 1)


def test_finish_rejects_duplicate_rows_in_one_call(engine):
    _, _, ids = seed(engine, 1)
    rows = results(0)
    rows["accuracy_rows"] = rows["accuracy_rows"] + rows["accuracy_rows"][:1]
    with session_scope(engine) as s:
        with pytest.raises(ValueError, match="duplicate accuracy"):
            q.finish_unit(s, ids[0], **rows)
    assert _status(engine, ids[0]) == "pending"
    assert _counts(engine) == dict.fromkeys(_counts(engine), 0)


def test_read_queries(engine):
    model_id, sweep_id, ids = seed(engine, 4)
    with session_scope(engine) as s:
        other = q.upsert_model(s, name="gemma-3-270m", fingerprint="fp-gemma", family="gemma3")
        q.register_units(s, sweep_id, [unit_spec(10, other, device_type="cuda")])
        for i in (0, 1):
            q.finish_unit(s, ids[i], **results(i))
        q.finish_unit(s, uid(10), accuracy_rows=[
            AccuracyRow(suite="core", task="piqa", metric="acc", higher_is_better=True, value=0.7, n=200, **PROV),
            AccuracyRow(suite="core", task="piqa", metric="acc_norm", higher_is_better=True, value=0.71, n=200,
                        **PROV)])
    with session_scope(engine) as s:
        acc = q.accuracy_table(s, model_id=model_id)
        assert len(acc) == 2 * N_ACC
        assert {(r.model_name, r.method, r.rank, r.metric) for r in acc} == {("SmolLM2-135M", "svdp", 256, "acc")}
        assert {r.sparsity for r in acc} == {0.0, 0.1}
        assert acc[0].package_versions == PROV["package_versions"] and acc[0].git_rev == PROV["git_rev"]
        assert [r.metric for r in q.accuracy_table(s, model_id=other)] == ["acc", "acc_norm"]
        assert len(q.accuracy_table(s, sweep_id=sweep_id, task="piqa")) == 2 + 2
        assert len(q.accuracy_table(s, metric="acc_norm")) == 1
        assert q.accuracy_table(s, sweep_id=sweep_id + 1) == []
        lat = q.latency_table(s, device_type="cpu")
        assert len(lat) == 2 * N_LAT and {r.batch for r in lat} == {1, 4}
        assert len(q.latency_table(s, batch=4, runtime="ours-sparse", accelerator_name="x86", sweep_id=sweep_id)) == 2
        assert q.latency_table(s, device_type="npu") == []
        layers = q.layer_metrics_for(s, ids[0])
        assert [m.layer for m in layers] == list(range(N_LAYER)) and layers[0].component == "mlp"
        [art] = q.artifacts_for(s, ids[0])
        assert art.kind == "predictor" and art.uri.endswith("predictor.safetensors") and art.size_bytes == 1234
        assert q.artifacts_for(s, ids[0], kind="bundle") == []
        assert [m.name for m in q.list_models(s)] == ["SmolLM2-135M", "gemma-3-270m"]
        assert {u.id for u in q.units_for_model(s, model_id)} == set(ids)
        assert [u.id for u in q.units_for_model(s, other, "cuda")] == [uid(10)]
        assert q.units_for_model(s, model_id, "cuda") == []
        assert len(q.units_for_model(s, model_id, "cpu", status="done")) == 2
        assert q.sweep_progress(s, sweep_id) == (3, 0, 5)
        q.set_sweep_status(s, sweep_id, "done")
        [sweep] = q.list_sweeps(s)
        assert sweep.status == "done" and sweep.finished_at.tzinfo is not None  # UTC on both backends
        assert sweep.finished_at >= sweep.created_at
        assert (sweep.n_units_done, sweep.n_units_total) == (3, 5)
        with pytest.raises(ValueError):
            q.set_sweep_status(s, sweep_id, "finished")


def test_read_only_engine_refuses_writes(engine, db_url):
    seed(engine, 2)
    ro = get_engine(db_url, read_only=True)
    try:
        with session_scope(ro) as s:
            assert [m.name for m in q.list_models(s)] == ["SmolLM2-135M"]
            assert q.sweep_progress(s, q.list_sweeps(s)[0].id) == (0, 0, 2)
        with pytest.raises(ReadOnlyDatabaseError, match="read-only"):
            with session_scope(ro) as s:
                q.upsert_model(s, name="x", fingerprint="new")
        with pytest.raises(ReadOnlyDatabaseError, match="read-only"):
            with session_scope(ro) as s:
                q.finish_unit(s, uid(0), **results(0))
        with pytest.raises(ReadOnlyDatabaseError):
            with session_scope(ro) as s:
                s.add(Sweep(name="x", spec_hash="x", spec={}))
    finally:
        ro.dispose()
    with session_scope(engine) as s:  # nothing changed
        assert len(q.list_models(s)) == 1 and q.get_unit(s, uid(0)).status == "pending"
        assert s.scalar(select(func.count()).select_from(Model)) == 1


def test_register_many_units(engine):
    model_id, sweep_id, _ = seed(engine, 0)
    with session_scope(engine) as s:
        assert q.register_units(s, sweep_id, [unit_spec(i, model_id) for i in range(2500)]) == 2500
        assert q.register_units(s, sweep_id, [unit_spec(i, model_id) for i in range(2400, 2600)]) == 100
        assert q.sweep_progress(s, sweep_id) == (0, 0, 2600)
        assert len(q.pending_units(s, sweep_id)) == 2600
