"""Tasks split into shards in a sweep: the spec's ``shards`` (validated, left out of the canonical spec at its
default), the plan (a spec without shards keeps its unit ids; a sharded task's own unit keeps the unsharded id and
depends on its shard units), and the evaluator actor's own code on a real SQLite store with a real (tiny) model:
no task row while a shard is missing, the assembled rows equal the unsharded unit's, and running any of it again
(a resumed sweep) adds nothing.

The actor is the class the Ray actors are made of (``workers.actors._UnitActor``), run in this process: its
store, its ``Units`` and the model are real; only Ray's process around it is left out (the Ray path of a sharded
sweep: tests/orchestrator/test_sweep_shards.py, slow).
"""
from __future__ import annotations

import copy
import hashlib

import pytest
from sqlalchemy import func, select

from db import queries
from db.engine import get_engine, session_scope, upgrade
from db.models import AccuracyResult, RequestScore
from orchestrator.plan import plan_units, without_needless_shards
from orchestrator.spec import SpecError, parse_spec

IDS_SPEC = {"name": "ids", "models": ["smollm2-135m"], "methods": [{"name": "threshold", "sparsity": [0.5]}],
            "suites": {"perplexity": {"tokens": 256, "seq_len": 256},
                       "tasks": [{"name": "mmlu", "limit": 2}, {"name": "hellaswag", "limit": 8},
                                 {"name": "gsm8k_cot", "limit": 1}]},
            "latency": {"devices": ["cpu"], "prompt_len": [16], "gen_len": 4, "repeats": 1},
            "resources": {"torch_threads": 1}}
DESCRIBED = {"smollm2-135m": {"fingerprint": "fp", "calib_fp": "c", "heldout_fp": "h"}}
# IDS_SPEC's hash and unit ids as computed before tasks could be split (known answers: they must never move)
IDS_SPEC_HASH = "834bd4591002a8820ecd46b69d382c0f202c25734e676741088910af6f3b2084"
IDS_UNITS_HASH = "f055e41fa158b275becf8a4618ed98ec8d87decbdd3fbd020d8639eb62d59d8f"   # sha256 of the ids joined
IDS_HELLASWAG = {"dense": "782356670e70eebe97abf2b207076604a3ae09a9",
                 "threshold": "141c2daea746541afdedd068f71ab79f40f05185"}


def _spec(**task_fields):
    d = copy.deepcopy(IDS_SPEC)
    d["suites"]["tasks"][1].update(task_fields)
    return parse_spec(d)


def _ids_hash(units) -> str:
    return hashlib.sha256(" ".join(u.id for u in units).encode()).hexdigest()


def _error(**task_fields) -> str:
    with pytest.raises(SpecError) as e:
        _spec(**task_fields)
    return str(e.value)


def test_unsharded_specs_keep_their_hash_and_unit_ids():
    spec = parse_spec(IDS_SPEC)
    assert spec.spec_hash() == IDS_SPEC_HASH == _spec(shards=1).spec_hash()
    assert _ids_hash(plan_units(spec, DESCRIBED, cpu_cores=2)) == IDS_UNITS_HASH
    assert _ids_hash(plan_units(_spec(shards=1), DESCRIBED, cpu_cores=2)) == IDS_UNITS_HASH
    assert "shards" not in spec.canonical()["suites"]["tasks"][1]
    assert _spec(shards=4).canonical()["suites"]["tasks"][1] == {"name": "hellaswag", "limit": 8, "shards": 4}


def test_a_sharded_task_keeps_the_unsharded_id_and_waits_for_its_shards():
    plain = plan_units(parse_spec(IDS_SPEC), DESCRIBED, cpu_cores=2)
    units = plan_units(_spec(shards=3), DESCRIBED, cpu_cores=2)
    assert len(units) == len(plain) + 2 * 3
    hellaswag = lambda u: u.kind == "eval" and u.config.suite == "hellaswag"     # noqa: E731
    others = [u for u in units if not hellaswag(u)]
    assert [u.id for u in others] == [u.id for u in plain if not hellaswag(u)]
    for method, task_id in IDS_HELLASWAG.items():
        mine = [u for u in units if u.method == method and hellaswag(u)]
        shards, (task,) = mine[:3], mine[3:]
        assert task.id == task_id and task.config.shard is None and task.shards == tuple(u.id for u in shards)
        assert "shard" not in task.config.canonical()
        assert [u.config.shard for u in shards] == [(0, 3), (1, 3), (2, 3)]
        assert [u.config.canonical()["shard"] for u in shards] == [[0, 3], [1, 3], [2, 3]]
        assert all(u.config.whole == task.config for u in shards)
        assert task.deps == (task.config.fit_unit, *task.shards) and all(u.deps == task.deps[:1] for u in shards)
        assert len({u.id for u in mine}) == 4 and [u.label.split()[-2:] for u in shards][0] == ["shard", "1/3"]
    done_task = next(u for u in units if u.shards and u.method == "dense")
    kept = without_needless_shards(units, {done_task.id})
    assert {u.id for u in units} - {u.id for u in kept} == set(done_task.shards)


@pytest.mark.parametrize("value", [0, -2, 65, 1.5, "2", True, None])
def test_bad_shard_values_are_refused_with_the_field_named(value):
    msg = _error(shards=value)
    assert "suites.tasks.1.shards:" in msg and "a whole number of units from 1 (not split) to 64" in msg
    assert repr(value) in msg


def test_shards_only_for_packaged_log_likelihood_tasks_with_enough_items():
    msg = _error(name="gsm8k_cot", limit=4, shards=2)
    assert "suites.tasks.1.shards:" in msg and "gsm8k_cot is a generation task" in msg and "mmlu" in msg
    assert "9 shards for 8 item(s) of hellaswag (its limit)" in _error(shards=9)
    d = copy.deepcopy(IDS_SPEC)
    d["suites"]["tasks"] = [{"name": "mmlu", "limit": 1, "shards": 57}]       # the limit is per subject
    assert parse_spec(d).suites.tasks[0].shards == 57
    d["suites"]["tasks"][0]["shards"] = 58
    with pytest.raises(SpecError, match="58 shards for 57 item"):
        parse_spec(d)


# ---------------------------------------------------------------------------------------------- the actor
def _actor(url: str):
    """The actor's own class, in this process, on the store at ``url`` (what Ray's actor would hold)."""
    from db.provenance import stamp
    from db.store import Store
    from workers.actors import _UnitActor
    from workers.units import Units

    a = _UnitActor(url, "cpu", 1, None)
    st = stamp()
    a._units, a._store = Units("cpu", st["package_versions"], st["git_rev"]), Store(url)
    return a


def _task(u, shards=None) -> dict:
    t = {"id": u.id, "kind": u.kind, "config": u.config.canonical()}
    if shards is not None:
        t["shards"] = list(shards)
    return t


def _rows(engine, unit_id: str) -> list[tuple]:
    with session_scope(engine) as s:
        return sorted((r.suite, r.task, r.metric, r.value, r.stderr, r.n)
                      for r in queries.accuracy_table(s) if r.unit_id == unit_id)


def _count(engine, entity) -> int:
    with session_scope(engine) as s:
        return s.scalar(select(func.count()).select_from(entity))


def test_sharded_task_rows_appear_complete_equal_the_unsharded_and_once(tiny_folder, tmp_path, monkeypatch):
    from orchestrator.driver import register

    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path / "home"))
    spec = parse_spec({"name": "shards", "models": [tiny_folder], "methods": [{"name": "oracle", "sparsity": [0.5]}],
                       "data": {"calib_tokens": 256, "metric_tokens": 256, "seq_len": 256}, "latency": None,
                       "suites": {"perplexity": None, "tasks": [{"name": "copa", "limit": 6, "shards": 2}]},
                       "resources": {"torch_threads": 1}})
    urls = {k: f"sqlite:///{tmp_path / k}.db" for k in ("sharded", "plain")}
    engines = {k: get_engine(u) for k, u in urls.items()}
    for e in engines.values():
        upgrade(e)
    a = _actor(urls["sharded"])
    described = {tiny_folder: a._units.describe(tiny_folder, spec.data.model_dump(), None)}
    units = [u for u in plan_units(spec, described) if u.method in (None, "dense")]
    collect, fit, s0, s1, task = units
    assert (collect.kind, fit.kind, task.shards) == ("collect", "fit", (s0.id, s1.id))
    register(a._store, spec, described, units, None)
    for u in (collect, fit, s0):
        assert a.run(_task(u))["status"] == "done"
    res = a.run(_task(task, task.shards))          # one shard missing: no row, the unit failed with the reason
    assert res["status"] == "failed" and "1 of the task's 2 shards are not done" in res["error"]
    assert _rows(engines["sharded"], task.id) == [] and _count(engines["sharded"], AccuracyResult) == 0
    assert a.run(_task(s1))["status"] == "done"
    n_scores = _count(engines["sharded"], RequestScore)
    assert n_scores == 12                          # copa: 6 items x 2 choices, each scored by one shard
    res = a.run(_task(task, [s0.id, s1.id, s0.id]))    # a shard named twice is read once
    assert res["status"] == "done" and res["summary"]["shards"] == 2
    sharded = _rows(engines["sharded"], task.id)

    b = _actor(urls["plain"])                     # known answer: the same unit, unsharded, in a store of its own
    register(b._store, spec, described, [collect, fit, task], None)
    for u in (collect, fit, task):
        assert b.run(_task(u))["status"] == "done"
    plain = _rows(engines["plain"], task.id)
    assert sharded == plain and [r[2] for r in plain] == ["acc"] and plain[0][5] == 6 and plain[0][4] > 0

    for u in (s0, s1):                            # a resumed sweep: the shards and the task are done, nothing added
        assert a.run(_task(u)) == {"id": u.id, "status": "done", "skipped": True, "worker": a.name}
    assert a.run(_task(task, task.shards))["skipped"] is True
    assert _count(engines["sharded"], RequestScore) == n_scores and _rows(engines["sharded"], task.id) == sharded
    with session_scope(engines["sharded"]) as s:
        assert queries.sweep_progress(s, 1) == (5, 0, 5)
