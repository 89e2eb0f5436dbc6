"""Result sets: a sweep's rows exported as JSON lines load into another store (SQLite or PostgreSQL) with the same
results, loading twice adds nothing, and a bad file writes nothing and names its line."""
from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy import func, select

from db import queries as q
from db.__main__ import main as db_main
from db.engine import get_engine, session_scope, upgrade
from db.models import AccuracyResult, LatencyResult, LayerMetric, Sweep, WorkUnit
from db.resultset import FORMAT, ResultSetError, export_sweep, load_records, read_jsonl, write_jsonl
from tests.db.db_support import N_ACC, N_LAT, N_LAYER, finish_all, seed, uid
from tests.unit_configs import eval_config


def _source(tmp_path, n_done=3, n_units=4):
    """A SQLite store with two sweeps: 'a' (n_units units, the first n_done finished) and 'b' (one other unit)."""
    url = f"sqlite:///{tmp_path / 'source.db'}"
    eng = get_engine(url)
    upgrade(eng)
    seed(eng, n_units, sweep="sweep-a")
    finish_all(eng, list(range(n_done)))
    with session_scope(eng) as s:
        other = q.upsert_model(s, name="other", fingerprint="fp-other", family="qwen2")
        sid, _ = q.get_or_create_sweep(s, name="sweep-b", spec_hash="b" * 64, spec={"name": "sweep-b"})
        from tests.db.db_support import unit_spec
        q.register_units(s, sid, [unit_spec(99, other)])
    return url, eng


def _table_counts(eng) -> dict[str, int]:
    with session_scope(eng) as s:
        return {t.__tablename__: s.scalar(select(func.count()).select_from(t))
                for t in (WorkUnit, AccuracyResult, LatencyResult, LayerMetric, Sweep)}


def test_round_trip_into_another_store_gives_the_same_rows(tmp_path, db_url):
    src_url, src = _source(tmp_path)
    with session_scope(src) as s:
        n = write_jsonl(export_sweep(s, "sweep-a", "rev"), tmp_path / "a.jsonl")
    # header + model + sweep + 4 units + 4 memberships + the finished units' rows; nothing of sweep-b
    assert n == 1 + 1 + 1 + 4 + 4 + 3 * (N_ACC + N_LAT + N_LAYER)
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert lines[0]["format"] == FORMAT and lines[0]["sweep"] == "sweep-a"
    assert all(r["row"].get("fingerprint") != "fp-other" for r in lines[1:])

    dst = get_engine(db_url)
    upgrade(dst)
    with session_scope(dst) as s:       # the target already has a model (other ids): keys are remapped
        q.upsert_model(s, name="first", fingerprint="fp-first")
    with session_scope(dst) as s:
        added = load_records(s, read_jsonl(tmp_path / "a.jsonl"))
    assert added == {"models": 1, "datasets": 0, "sweeps": 1, "work_units": 4, "sweep_units": 4,
                     "accuracy_results": 3 * N_ACC, "latency_results": 3 * N_LAT, "layer_metrics": 3 * N_LAYER,
                     "request_scores": 0}
    with session_scope(dst) as s, session_scope(src) as s0:
        for i in range(4):
            a, b = q.get_unit(s, uid(i)), q.get_unit(s0, uid(i))
            assert (a.status, a.worker, a.config, a.duration_s) == (b.status, b.worker, b.config, b.duration_s)
        vals = sorted(s.execute(select(AccuracyResult.unit_id, AccuracyResult.task, AccuracyResult.value,
                                       AccuracyResult.higher_is_better)).all())
        vals0 = sorted(s0.execute(select(AccuracyResult.unit_id, AccuracyResult.task, AccuracyResult.value,
                                         AccuracyResult.higher_is_better)).all())
        assert vals == vals0 and len(vals) == 3 * N_ACC
        sw = s.scalars(select(Sweep).where(Sweep.name == "sweep-a")).one()
        assert (sw.n_units_total, sw.n_units_done) == (4, 3)
    before = _table_counts(dst)
    with session_scope(dst) as s:       # loading again adds nothing
        again = load_records(s, read_jsonl(tmp_path / "a.jsonl"))
    assert set(again.values()) == {0} and _table_counts(dst) == before
    dst.dispose()
    src.dispose()


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("break_it, match", [
    (lambda recs: [{"format": "something-else"}] + recs[1:], "not a ctxsparse result set"),
    (lambda recs: recs[:3] + [{"table": "nonsense", "row": {}}] + recs[3:], r":4: expected"),
    (lambda recs: [recs[0]] + [r for r in recs[1:] if r["table"] != "models"], "does not carry"),
    (lambda recs: recs[:-1] + [recs[2]], r"sweeps row after"),
    (lambda recs: recs[:4] + [{**recs[4], "row": {**recs[4]["row"], "colour": "red"}}] + recs[5:],
     r"no column\(s\) \['colour'\]"),
])
def test_a_bad_file_writes_nothing_and_names_the_line(tmp_path, break_it, match):
    _, src = _source(tmp_path)
    with session_scope(src) as s:
        recs = list(export_sweep(s, "sweep-a"))
    src.dispose()
    _write(tmp_path / "bad.jsonl", break_it(recs))
    dst = get_engine(f"sqlite:///{tmp_path / 'dst.db'}")
    upgrade(dst)
    before = _table_counts(dst)
    with pytest.raises(ResultSetError, match=match):
        with session_scope(dst) as s:
            load_records(s, read_jsonl(tmp_path / "bad.jsonl"), "bad.jsonl")
    assert _table_counts(dst) == before
    dst.dispose()


def test_cli_export_load_and_errors(tmp_path, capsys):
    src_url, src = _source(tmp_path)
    src.dispose()
    out, dst = tmp_path / "a.jsonl", f"sqlite:///{tmp_path / 'cli.db'}"
    assert db_main(["export", "sweep-a", str(out), src_url]) == 0
    assert db_main(["load", str(out), dst]) == 0
    assert "4 work_units" in capsys.readouterr().out
    assert db_main(["export", "no-such-sweep", str(tmp_path / "x.jsonl"), src_url]) == 1
    err = capsys.readouterr().err
    assert "no sweep 'no-such-sweep'" in err and "sweep-a" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists() and not list(tmp_path.glob("*.tmp"))    # nothing half-written
    (tmp_path / "junk.jsonl").write_text('{"format": "ctxsparse-resultset-1"}\nnot json\n')
    assert db_main(["load", str(tmp_path / "junk.jsonl"), dst]) == 1
    assert "junk.jsonl:2: not JSON" in capsys.readouterr().err
    assert db_main(["load", str(tmp_path / "missing.jsonl"), dst]) == 1
    assert "missing.jsonl" in capsys.readouterr().err


def test_cli_takes_the_store_as_db_or_last_and_refuses_two(tmp_path, capsys, monkeypatch):
    """``--db URL`` as every ctxsparse command takes it, or the URL last; both: the same one or a usage error
    (exit 2, nothing written); neither: $CTXSPARSE_DB_URL."""
    src_url, src = _source(tmp_path)
    src.dispose()
    out, dst, other = tmp_path / "a.jsonl", f"sqlite:///{tmp_path / 'dst.db'}", tmp_path / "other.db"
    assert db_main(["export", "sweep-a", str(out), "--db", src_url]) == 0
    assert db_main(["load", "--db", dst, str(out)]) == 0
    assert "4 work_units" in capsys.readouterr().out
    assert db_main(["load", str(out), dst, "--db", dst]) == 0                   # the same URL twice: fine
    assert "0 work_units" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        db_main(["load", str(out), dst, "--db", f"sqlite:///{other}"])
    assert e.value.code == 2 and "two different store URLs" in capsys.readouterr().err
    assert not other.exists()
    monkeypatch.setenv("CTXSPARSE_DB_URL", f"sqlite:///{other}")
    assert db_main(["load", str(out)]) == 0 and other.exists()
    assert "4 work_units" in capsys.readouterr().out


def test_request_scores_of_assembled_tasks_stay_out_unless_asked(tmp_path):
    """Task A's unit is done (assembled from its two shards): its shards' scores are left out of the export, as
    nothing reads them again. Task B's unit is not done: its done shard's scores travel, so a store that loads the
    file can assemble B. ``request_scores="all"`` (``--request-scores all``, ``--all-request-scores``) exports
    every shard's, ``"none"`` none (a running sweep's rows without its shards' scores)."""
    from tests.db.db_support import unit_spec

    eng = get_engine(f"sqlite:///{tmp_path / 'shards.db'}")
    upgrade(eng)
    task_a, task_b = eval_config("f1", "mmlu"), eval_config("f1", "hellaswag")
    cfgs = {"a": task_a, "a0": {**task_a, "shard": [0, 2]}, "a1": {**task_a, "shard": [1, 2]},
            "b": task_b, "b0": {**task_b, "shard": [0, 2]}, "b1": {**task_b, "shard": [1, 2]}}
    ids = {k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in cfgs}
    with session_scope(eng) as s:
        model = q.upsert_model(s, name="m", fingerprint="fp-m", family="llama")
        sid, _ = q.get_or_create_sweep(s, name="sh", spec_hash="c" * 64, spec={"name": "sh"})
        q.register_units(s, sid, [unit_spec(i, model, id=ids[k], config=c) for i, (k, c) in enumerate(cfgs.items())])
    for k in ("a0", "a1", "b0", "a"):
        with session_scope(eng) as s:
            q.mark_running(s, ids[k], worker="w")
        with session_scope(eng) as s:
            scores = [{"request": r, "loglikelihood": -1.0 - r, "greedy": r % 2 == 0} for r in range(5)] \
                if "shard" in cfgs[k] else []
            assert q.finish_unit(s, ids[k], request_scores=scores, duration_s=1.0)

    def exported(**kw) -> dict[str, int]:
        with session_scope(eng) as s:
            recs = list(export_sweep(s, "sh", **kw))
        per: dict[str, int] = {}
        for r in recs[1:]:
            if r["table"] == "request_scores":
                per[r["row"]["unit_id"]] = per.get(r["row"]["unit_id"], 0) + 1
        return per

    assert exported() == {ids["b0"]: 5}
    assert exported(request_scores="all") == {ids["a0"]: 5, ids["a1"]: 5, ids["b0"]: 5}
    assert exported(request_scores="none") == {}
    with pytest.raises(ResultSetError, match=r"request_scores is one of \['unassembled', 'all', 'none'\], not 'some'"):
        exported(request_scores="some")
    src = f"sqlite:///{tmp_path / 'shards.db'}"
    assert db_main(["export", "sh", str(tmp_path / "lean.jsonl"), src]) == 0
    assert db_main(["export", "sh", str(tmp_path / "full.jsonl"), src, "--all-request-scores"]) == 0
    assert db_main(["export", "sh", str(tmp_path / "all.jsonl"), src, "--request-scores", "all"]) == 0
    assert db_main(["export", "sh", str(tmp_path / "none.jsonl"), src, "--request-scores", "none"]) == 0
    count = {k: (tmp_path / f"{k}.jsonl").read_text().count('"request_scores"') for k in ("lean", "full", "all", "none")}
    assert count == {"lean": 5, "full": 15, "all": 15, "none": 0}
    assert (tmp_path / "none.jsonl").read_text().count('"work_units"') == 6       # every unit still travels
    with pytest.raises(SystemExit):
        db_main(["export", "sh", str(tmp_path / "x.jsonl"), src, "--request-scores", "some"])
    eng.dispose()


def _timed_under(tmp_path, isa: str | None, flags: str | None, ms: float) -> str:
    """A result-set file of a store whose one latency unit (uid(0), the same id in every such store: the build is
    not part of a unit's config) wrote its sparse row and the dense row paired with it under the CPU build ``isa``."""
    from db.schemas import LatencyRow
    from tests.db.db_support import PROV

    url = f"sqlite:///{tmp_path / f'timed-{isa}.db'}"
    eng = get_engine(url)
    upgrade(eng)
    seed(eng, 1, sweep="lat")
    with session_scope(eng) as s:
        q.mark_running(s, uid(0), worker="w")
        q.finish_unit(s, uid(0), latency_rows=[
            LatencyRow(device_type="cpu", accelerator_name="AMD EPYC 7B13", batch=1, prompt_len=8, gen_len=4,
                       p50_ms_per_token=ms * k, p90_ms_per_token=ms * k, tokens_per_s=1000 / (ms * k), runtime=rt,
                       threads=2, cpu_flags=flags, isa=isa, **PROV)
            for rt, k in (("ctxsparse-sparse", 1.0), ("ctxsparse-dense-paired", 1.5))])
        path = tmp_path / f"timed-{isa}.jsonl"
        write_jsonl(export_sweep(s, "lat", "rev"), path)
    eng.dispose()
    return str(path)


def test_the_cpu_build_travels_and_two_builds_of_one_unit_load_side_by_side(tmp_path, db_url):
    """Export -> load keeps each latency row's cpu_flags and isa; the same unit timed under another build (a store of
    an AVX2 machine, one of the scalar build) loads beside it, each file twice adds nothing; a file written before
    the columns existed loads with them NULL, and again adds nothing."""
    avx2 = _timed_under(tmp_path, "avx2", "avx2 f16c fma", 4.0)
    scalar = _timed_under(tmp_path, "scalar", "avx2 f16c fma", 9.0)
    dst = get_engine(db_url)
    upgrade(dst)

    def load(path) -> dict[str, int]:
        with session_scope(dst) as s:
            return load_records(s, read_jsonl(path))

    def builds() -> set[tuple]:
        with session_scope(dst) as s:
            return {(r.unit_id, r.runtime, r.isa, r.cpu_flags, r.p50_ms_per_token) for r in q.latency_table(s)}

    assert load(avx2)["latency_results"] == 2
    assert builds() == {(uid(0), "ctxsparse-sparse", "avx2", "avx2 f16c fma", 4.0),
                        (uid(0), "ctxsparse-dense-paired", "avx2", "avx2 f16c fma", 6.0)}
    added = load(scalar)
    assert (added["work_units"], added["latency_results"]) == (0, 2)          # the unit is known; its other build
    assert {(rt, isa, ms) for _, rt, isa, _, ms in builds()} == {
        ("ctxsparse-sparse", "avx2", 4.0), ("ctxsparse-dense-paired", "avx2", 6.0),
        ("ctxsparse-sparse", "scalar", 9.0), ("ctxsparse-dense-paired", "scalar", 13.5)}
    assert load(avx2)["latency_results"] == load(scalar)["latency_results"] == 0
    older = tmp_path / "older.jsonl"            # the same file as an older ctxsparse wrote it: no such columns
    _write(older, [{**r, "row": {k: v for k, v in r["row"].items() if k not in ("cpu_flags", "isa")}}
                   if r.get("table") == "latency_results" else r for _, r in read_jsonl(avx2)])
    assert '"isa"' not in older.read_text()
    assert load(older)["latency_results"] == 2 and load(older)["latency_results"] == 0
    assert {(rt, isa, flags) for _, rt, isa, flags, _ in builds() if isa is None} == {
        ("ctxsparse-sparse", None, None), ("ctxsparse-dense-paired", None, None)}
    dst.dispose()
