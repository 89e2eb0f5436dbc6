"""Reliability battery: the cases that no other test module covers.

Covered elsewhere, not repeated here: malformed specs (tests/orchestrator/test_spec.py), tampered / damaged /
wrong-model / escaping bundles (tests/workers/test_bundle.py), a killed worker, a re-submitted sweep and missing
device types (tests/orchestrator/test_sweep.py), a corrupted activation cache (tests/workers/test_capture.py),
concurrent writers on SQLite and PostgreSQL at the query layer (tests/db/test_db_concurrency.py), the real Ray
job server (tests/orchestrator/test_cli_jobs.py).

Here, on sweeps the session runs in the background (tests/sweep_support.py):
- the real tiny SmolLM2 sweep through the Ray driver into **PostgreSQL** with **2 evaluators** writing at once
  (``pg_sweep``), one of its settings a method that raises: every other unit done with its rows exactly once, the
  failing fit recorded with its traceback, its dependants failed with the reason, none of them with a row, no
  lock error anywhere (unit errors, PostgreSQL's log of that database);
- a bundle file deleted from ``CTXSPARSE_HOME`` after the shared sweep: ``ctxsparse bundle export`` exits 2 with
  one clear message and writes nothing;
- a unit whose worker dies every time ends failed after ``resources.max_attempts`` with the reason, and a worker
  that cannot record its unit (its store refuses the write) has the unit failed with the reason, no hang
  (``troubled_sweep``);
and ``ctxsparse submit`` of the same spec twice against a stand-in job client (every job state).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from db import queries
from db.engine import get_engine, session_scope
from db.units import unit_config
from tests.sweep_support import FAILING_ERROR, FAILING_METHOD, PERPLEXITY_METRICS, PG_DATABASE, READONLY, TINY_SPEC

LOCK_TROUBLE = re.compile(r"deadlock|could not obtain lock|could not serialize|lock timeout|database is locked",
                          re.I)



def _units(url: str, sweep_id: int) -> dict:
    """Every unit in the store (a fresh PostgreSQL schema: only this sweep's)."""
    with session_scope(get_engine(url)) as s:
        return {u.id: u for m in queries.list_models(s) for u in queries.units_for_model(s, m.id)}


def _expected_rows(u) -> int:
    from workers.evals.tasks import SUITES

    cfg = unit_config(u.kind, u.config)
    if u.kind == "eval":
        return len(PERPLEXITY_METRICS) if cfg.suite == "perplexity" else len(SUITES[cfg.suite].metrics)
    if u.kind == "latency":      # a paired timing adds the dense it ran beside
        return 2 if cfg.paired else 1
    return 0


def test_pg_sweep_with_two_evaluators_loses_and_duplicates_nothing(pg_sweep):
    url, out = pg_sweep.url, pg_sweep.outcome
    units = _units(url, out.sweep_id)
    assert len(units) == out.total == 7              # collect; per setting a fit and 2 evals; no latency
    bad_fit = [u for u in units.values()
               if u.kind == "fit" and unit_config("fit", u.config).options == FAILING_METHOD["options"]]
    assert len(bad_fit) == 1
    chain = {bad_fit[0].id} | {u.id for u in units.values() if bad_fit[0].id in json.dumps(u.config)}
    assert len(chain) == 3                                   # the fit and its 2 evals
    assert sorted(out.failed) == sorted(chain) and out.worker_deaths == 0 and out.unplaceable == []
    assert out.done == out.ran == out.total - 3
    assert {u.status for uid, u in units.items() if uid not in chain} == {"done"}
    with session_scope(get_engine(url)) as s:
        acc = queries.accuracy_table(s)
        assert queries.latency_table(s) == []
        assert [sw.status for sw in queries.list_sweeps(s)] == ["failed"]
    keys_acc = [(r.unit_id, r.suite, r.task, r.metric) for r in acc]
    assert len(keys_acc) == len(set(keys_acc))                                       # no duplicates
    got = {}
    for uid, *_ in keys_acc:
        got[uid] = got.get(uid, 0) + 1
    want = {uid: _expected_rows(u) for uid, u in units.items() if uid not in chain and _expected_rows(u)}
    assert len(want) == 2 and got == want                    # nothing lost, nothing for the failed chain
    # two evaluators really ran side by side: the two eval units, on different workers, overlap in time
    a, b = [u for u in units.values() if u.kind == "eval" and u.status == "done"]
    assert a.worker != b.worker, a.worker
    assert a.started_at < b.finished_at and b.started_at < a.finished_at, [(u.started_at, u.finished_at)
                                                                           for u in (a, b)]
    # no lock trouble: no unit error mentions it, nor does PostgreSQL's server log for this database
    assert not [u.error for u in units.values() if u.error and LOCK_TROUBLE.search(u.error)]
    log = pg_sweep.cluster.log_lines(PG_DATABASE)
    assert any("connection authorized" in ln for ln in log), log[:5]     # the log does name the sweep's database
    assert not [ln for ln in log if LOCK_TROUBLE.search(ln)][:5]


def test_a_method_that_raises_fails_its_chain_with_the_traceback_and_no_rows(pg_sweep):
    url, out = pg_sweep.url, pg_sweep.outcome
    units = _units(url, out.sweep_id)
    (fit,) = [units[i] for i in out.failed if units[i].kind == "fit"]
    assert fit.status == "failed" and fit.method == FAILING_METHOD["name"]
    assert "Traceback (most recent call last)" in fit.error and FAILING_ERROR in fit.error
    dependants = [units[i] for i in out.failed if i != fit.id]
    assert sorted(u.kind for u in dependants) == ["eval", "eval"]
    for u in dependants:
        assert u.status == "failed"
        assert u.error.startswith("not run: a unit it depends on failed") and fit.id in u.error
    with session_scope(get_engine(url)) as s:
        for uid in out.failed:
            assert queries.artifacts_for(s, uid) == [] and queries.layer_metrics_for(s, uid) == []
        ids = {r.unit_id for r in queries.accuracy_table(s)}
        assert not ids & set(out.failed)
    # the dense setting still went all the way
    done = sorted((u.kind, u.method) for u in units.values() if u.status == "done")
    assert done == [("collect", None), ("eval", "dense"), ("eval", "dense"), ("fit", "dense")], done


def _export_of_a_deleted_bundle_file_exits_2(url, sweep_id, home, tmp_path, capsys, out_name, method):
    from orchestrator.cli import main as cli

    units = _units(url, sweep_id)
    (fit,) = [u for u in units.values() if u.kind == "fit" and u.method == method and u.status == "done"]
    with session_scope(get_engine(url)) as s:
        files = [Path(a.uri) for a in queries.artifacts_for(s, fit.id, "bundle_file")]
    assert files and all(p.is_relative_to(home) for p in files), files     # the sweep's own CTXSPARSE_HOME
    victim = next(p for p in files if p.suffix == ".safetensors")
    saved = tmp_path / "saved"
    shutil.copy2(victim, saved)
    victim.unlink()
    try:
        dst = tmp_path / out_name
        assert cli(["bundle", "export", fit.id[:12], "--out", str(dst), "--db", url]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "recorded in the store but missing on disk" in err and victim.name in err
        assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    finally:
        shutil.copy2(saved, victim)
    assert cli(["bundle", "export", fit.id[:12], "--out", str(tmp_path / out_name), "--db", url]) == 0  # restored


@pytest.mark.parametrize("out_name", ["bundle", "bundle.tar.gz"])
def test_bundle_file_deleted_after_the_shared_sweep_export_exits_2_and_writes_nothing(tiny_sweep, tmp_path,
                                                                                     capsys, out_name):
    """On the session's shared sweep (SQLite; tests/sweep_support.py)."""
    _export_of_a_deleted_bundle_file_exits_2(tiny_sweep.url, tiny_sweep.outcome.sweep_id, tiny_sweep.home,
                                             tmp_path, capsys, out_name, "threshold")


# ------------------------------------------------------------------ submitting the same spec twice

class _FakeJobs:
    """A stand-in for ray.job_submission.JobSubmissionClient (the calls orchestrator.cli makes)."""
    jobs: dict[str, str] = {}
    submitted: list[str] = []

    def __init__(self, address):
        self.address = address

    def list_jobs(self):
        from ray.job_submission import JobDetails, JobStatus

        return [JobDetails(type="SUBMISSION", submission_id=sid, status=JobStatus(st), entrypoint="python")
                for sid, st in self.jobs.items()]

    def get_job_status(self, sid):
        if sid not in self.jobs:
            raise RuntimeError(f"Job {sid} does not exist")
        from ray.job_submission import JobStatus

        return JobStatus(self.jobs[sid])

    def submit_job(self, entrypoint, submission_id, runtime_env=None, metadata=None):
        assert submission_id not in self.jobs, "submitted the same id twice"
        self.jobs[submission_id] = "PENDING"
        self.submitted.append(submission_id)
        return submission_id


def _submit(cli, capsys, *args) -> dict:
    assert cli(["submit", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _spec_file(tmp_path, name="battery-submit") -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump({**TINY_SPEC, "name": name}))
    return p


def test_submitting_the_same_spec_twice_gives_one_submission_id(tmp_path, capsys, monkeypatch):
    import ray.job_submission

    from orchestrator.cli import main as cli

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _FakeJobs)
    monkeypatch.setattr(_FakeJobs, "jobs", {})
    monkeypatch.setattr(_FakeJobs, "submitted", [])
    spec = _spec_file(tmp_path)
    first = _submit(cli, capsys, str(spec), "--address", "http://fake:8265")
    assert first["submitted"] is True and first["submission_id"].startswith("ctxsparse-battery-submit-")
    for status in ("PENDING", "RUNNING", "SUCCEEDED"):     # while it waits, runs, and after it succeeded
        _FakeJobs.jobs[first["submission_id"]] = status
        again = _submit(cli, capsys, str(spec), "--address", "http://fake:8265")
        assert again == {"submission_id": first["submission_id"], "status": status, "submitted": False,
                         "note": "this sweep was already submitted; not submitting it twice"}
    # key order and defaults do not make it another sweep
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text(yaml.safe_dump(dict(reversed(list(yaml.safe_load(spec.read_text()).items()))),
                                        sort_keys=False))
    assert _submit(cli, capsys, str(reordered), "--address", "http://fake:8265")["submitted"] is False
    assert _FakeJobs.submitted == [first["submission_id"]]
    # a failed attempt may be submitted again (a resume: finished units are skipped), under a new id
    _FakeJobs.jobs[first["submission_id"]] = "FAILED"
    retry = _submit(cli, capsys, str(spec), "--address", "http://fake:8265")
    assert retry["submitted"] is True and retry["submission_id"] == first["submission_id"] + "-r2"
    # while that retry waits or runs, nothing more goes in: the live attempt is named instead
    for status in ("PENDING", "RUNNING"):
        _FakeJobs.jobs[retry["submission_id"]] = status
        again = _submit(cli, capsys, str(spec), "--address", "http://fake:8265")
        assert again["submitted"] is False and again["submission_id"] == retry["submission_id"]
    assert _FakeJobs.submitted == [first["submission_id"], retry["submission_id"]]


# ------------------------------------------------------------------ workers that die or cannot record
def _fits(url: str) -> tuple[dict, list]:
    with session_scope(get_engine(url)) as s:
        fits = {u.method: u for m in queries.list_models(s) for u in queries.units_for_model(s, m.id)
                if u.kind == "fit"}
        return fits, queries.list_sweeps(s)


def test_a_worker_that_dies_every_time_fails_its_unit_after_max_attempts(troubled_sweep):
    out = troubled_sweep.outcome
    fits, sweeps = _fits(troubled_sweep.url)
    u = fits["oracle"]
    assert out.worker_deaths == 2 and u.id in out.failed
    assert u.status == "failed" and u.attempts == 2
    assert u.error.startswith("worker died while running the unit (attempt 2)"), u.error
    assert fits["dense"].status == "done"
    assert [sw.status for sw in sweeps] == ["failed"]


def test_a_worker_that_cannot_record_its_unit_gets_it_failed_with_the_reason(troubled_sweep):
    out = troubled_sweep.outcome
    fits, _ = _fits(troubled_sweep.url)
    rows_refused, nothing_written = fits["threshold"], fits["static"]
    assert {rows_refused.id, nothing_written.id} <= set(out.failed)
    # the worker could still record the failure: its traceback names the refused write
    assert rows_refused.status == "failed" and "Traceback" in rows_refused.error and READONLY in rows_refused.error
    # it could not write at all: the driver records the failure, with the cause in one line
    assert nothing_written.status == "failed"
    assert nothing_written.error.startswith("the worker could not run or record the unit: OperationalError")
    assert READONLY in nothing_written.error and "\n" not in nothing_written.error, nothing_written.error
    assert out.done == 1 and sorted(out.failed) == sorted(u.id for m, u in fits.items() if m != "dense")


def test_driver_reports_a_model_its_workers_cannot_load_in_one_line(ray_local, tmp_path, capsys):
    """What only a worker can find (here a model folder whose config names no known architecture) ends the
    driver with the worker's own error in one line, exit 2, not Ray's wrapped remote traceback."""
    from orchestrator.driver import main as driver

    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "battery-bad-model", "models": [str(folder)],
                                    "methods": [{"name": "oracle", "sparsity": [0.5]}]}))
    assert driver([str(spec), "--db", f"sqlite:///{tmp_path / 's.db'}", "--no-pareto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err and "ray::" not in err, err
    assert "no-such-architecture" in err or "not-a-model" in err, err
