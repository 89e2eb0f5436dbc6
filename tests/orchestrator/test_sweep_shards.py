"""A sharded sweep on the session's real Ray cluster (slow: its actors start three times): a task split into
shards and a GSM8K task run only on the front, after the latency units, end to end through the driver; then the store as a sweep killed
mid-shard leaves it (a shard running with nothing recorded, the task's unit pending), resumed: the shard runs
again, the task's rows are assembled once and equal the first run's, no score is written twice.

The model is a one-layer random Llama with SmolLM2's tokenizer in a local folder (tests/orchestrator/conftest.py):
what costs here is Ray and the actors, not the model.
"""
from __future__ import annotations

import pytest
from sqlalchemy import delete, func, select, update

from db import queries
from db.engine import get_engine, session_scope
from db.models import AccuracyResult, RequestScore, WorkUnit
from db.units import TaskEvalConfig, unit_config
from tests.sweep_support import copy_store, home_set_to, private_home

pytestmark = pytest.mark.slow


def _rows(url):
    with session_scope(get_engine(url)) as s:
        return sorted((r.method, r.sparsity, r.suite, r.task, r.metric, r.value, r.stderr, r.n)
                      for r in queries.accuracy_table(s))


def _count(url, entity) -> int:
    with session_scope(get_engine(url)) as s:
        return s.scalar(select(func.count()).select_from(entity))


def test_sharded_sweep_runs_resumes_and_counts_every_shard_once(ray_local, tiny_folder, tmp_path):
    from orchestrator.driver import run_sweep
    from orchestrator.spec import parse_spec

    spec = parse_spec({
        "name": "sharded", "models": [tiny_folder], "methods": [{"name": "threshold", "sparsity": [0.5]}],
        "data": {"calib_tokens": 256, "metric_tokens": 256, "seq_len": 256},
        "suites": {"perplexity": {"tokens": 256, "seq_len": 256},
                   "tasks": [{"name": "copa", "limit": 6, "shards": 2},
                             {"name": "gsm8k_cot", "limit": 1, "only": "front"}]},
        "latency": {"devices": ["cpu"], "batch": [1], "prompt_len": [8], "gen_len": 2, "repeats": 1},
        "resources": {"fitters": 1, "evaluators": 1, "torch_threads": 1, "cpus_per_actor": 0.5}})
    url = f"sqlite:///{tmp_path / 'sharded.db'}"
    with home_set_to(private_home(tmp_path)):
        out = run_sweep(spec, url, heartbeat_s=30.0)
        # collect; per setting fit, perplexity, copa's 2 shards and task, GSM8K, latency; HF generate's on dense
        assert out.ok and out.failed == [] and out.total == 1 + 2 * (1 + 1 + 3 + 1 + 1) + 1 and out.done == out.total
        with session_scope(get_engine(url)) as s:     # latency, timed alone, went before the front's GSM8K
            units = s.execute(select(WorkUnit.kind, WorkUnit.config, WorkUnit.started_at, WorkUnit.finished_at)).all()
        timed = max(f for k, _, _, f in units if k == "latency")
        gsm8k = [st for k, c, st, _ in units if k == "eval" and unit_config(k, c).suite == "gsm8k_cot"]
        assert len(gsm8k) == 2 and min(gsm8k) >= timed
        rows = _rows(url)
        copa = [r for r in rows if r[3] == "copa"]
        assert [(r[0], r[4], r[7]) for r in copa] == [("dense", "acc", 6), ("threshold", "acc", 6)]
        assert {(r[0], r[3]) for r in rows if r[2] == "gen"} == {("dense", "gsm8k_cot"), ("threshold", "gsm8k_cot")}
        assert _count(url, RequestScore) == 2 * 12

        # the store a sweep killed in the middle of dense's second shard leaves: that shard running, nothing of it
        # recorded, its task's unit pending
        killed = copy_store(url, tmp_path / "killed.db")
        engine = get_engine(killed)
        with session_scope(engine) as s:
            evals = s.execute(select(WorkUnit.id, WorkUnit.config).where(WorkUnit.method == "dense",
                                                                         WorkUnit.kind == "eval")).all()
            typed = [(k, unit_config("eval", c)) for k, c in evals]
            tasks = [(k, c) for k, c in typed if isinstance(c, TaskEvalConfig)]
            shard = next(k for k, c in tasks if c.shard == (1, 2))
            task = next(k for k, c in tasks if c.suite == "copa" and c.shard is None)
            s.execute(delete(RequestScore).where(RequestScore.unit_id == shard))
            s.execute(delete(AccuracyResult).where(AccuracyResult.unit_id == task))
            s.execute(update(WorkUnit).where(WorkUnit.id == shard).values(status="running"))
            s.execute(update(WorkUnit).where(WorkUnit.id == task).values(status="pending"))
        assert _count(killed, RequestScore) < 2 * 12
        again = run_sweep(spec, killed, heartbeat_s=30.0)
    # it ran the shard and the task; threshold's shards were not planned again (their task is done)
    assert again.ok and again.ran == 2 and again.done == again.total == out.total - 2
    with session_scope(get_engine(killed)) as s:
        assert queries.sweep_progress(s, again.sweep_id) == (out.total, 0, out.total)
    assert _rows(killed) == rows and _count(killed, RequestScore) == 2 * 12
