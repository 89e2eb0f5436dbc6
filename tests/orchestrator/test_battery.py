"""Reliability battery: the cases that no other test module covers (issue 6).

Covered elsewhere, not repeated here: malformed specs (tests/orchestrator/test_spec.py), tampered / damaged /
wrong-model / escaping bundles (tests/workers/test_bundle.py), a killed worker, a re-submitted sweep and missing
device types (tests/orchestrator/test_sweep.py), a corrupted activation cache (tests/workers/test_capture.py),
concurrent writers on SQLite and PostgreSQL at the query layer (tests/db/test_db_concurrency.py).

Here:
- the real tiny SmolLM2 sweep through the Ray driver into **PostgreSQL** with **2 evaluators** writing at once,
  one of its settings a method that raises (``threshold`` given an option it does not take): every other unit
  done with its rows exactly once, the failing fit recorded with its traceback, its dependants failed with the
  reason, none of them with a row, no lock error anywhere (unit errors, PostgreSQL's log);
- a bundle file deleted from ``CTXSPARSE_HOME`` after that sweep: ``ctxsparse bundle export`` exits 2 with one
  clear message and writes nothing;
- ``ctxsparse submit`` of the same spec twice: one submission id, one job (a stand-in job client here; the
  real Ray job server in the ``slow`` test).
The sweep uses its own ``CTXSPARSE_HOME`` (model and activation caches linked to the usual ones) so that
deleting a bundle file touches nothing another test or sweep uses.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from db import queries
from db.engine import get_engine, session_scope
from tests.db.conftest import pg_cluster  # noqa: F401  (the throwaway PostgreSQL, a session fixture)
from tests.sweep_support import TINY_SPEC, private_home, run_tiny_sweep

BAD_OPTION = {"name": "threshold", "sparsity": [0.3], "options": {"bogus": 1}}
LOCK_TROUBLE = re.compile(r"deadlock|could not obtain lock|could not serialize|lock timeout|database is locked",
                          re.I)




@pytest.fixture(scope="module")
def pg_sweep(ray_local, pg_cluster, tmp_path_factory):  # noqa: F811
    """The tiny sweep on PostgreSQL: 2 evaluators, and a third method whose fit raises."""
    root = tmp_path_factory.mktemp("battery")
    home = private_home(root)
    url = pg_cluster.empty_schema_url("ctxsparse_test")
    old = os.environ.get("CTXSPARSE_HOME")
    os.environ["CTXSPARSE_HOME"] = str(home)
    t0 = time.time()
    try:
        outcome = run_tiny_sweep(url, name="battery-pg", methods=TINY_SPEC["methods"] + [BAD_OPTION],
                                 resources={"fitters": 1, "evaluators": 2, "benchers": 1, "torch_threads": 1,
                                            "cpus_per_actor": 0.5})
    finally:
        if old is None:
            os.environ.pop("CTXSPARSE_HOME", None)
        else:
            os.environ["CTXSPARSE_HOME"] = old
    print(f"battery sweep on PostgreSQL: {time.time() - t0:.0f}s", file=sys.stderr)
    return url, outcome, home, pg_cluster


def _units(url: str, sweep_id: int) -> dict:
    """Every unit in the store (a fresh PostgreSQL schema: only this sweep's)."""
    with session_scope(get_engine(url)) as s:
        return {u.id: u for m in queries.list_models(s) for u in queries.units_for_model(s, m.id)}


def _expected_rows(u) -> int:
    from workers.evals.suites import SUITES

    if u.kind == "eval":
        suite = u.config["suite"]
        return 4 if suite == "perplexity" else len(SUITES[suite].metrics)    # ppl: ppl, nll, 2 sparsities
    return 1 if u.kind == "latency" else 0


def test_pg_sweep_with_two_evaluators_loses_and_duplicates_nothing(pg_sweep):
    url, out, _, cluster = pg_sweep
    units = _units(url, out.sweep_id)
    assert len(units) == out.total
    bad_fit = [u for u in units.values() if u.kind == "fit" and u.config.get("options") == {"bogus": 1}]
    assert len(bad_fit) == 1
    chain = {bad_fit[0].id} | {u.id for u in units.values() if bad_fit[0].id in json.dumps(u.config)}
    assert len(chain) == 4                                   # the fit, its 2 evals, its latency unit
    assert sorted(out.failed) == sorted(chain) and out.worker_deaths == 0 and out.unplaceable == []
    assert out.done == out.total - 4
    assert {u.status for uid, u in units.items() if uid not in chain} == {"done"}
    with session_scope(get_engine(url)) as s:
        acc = queries.accuracy_table(s)
        lat = queries.latency_table(s)
        assert [sw.status for sw in queries.list_sweeps(s)] == ["failed"]
    keys_acc = [(r.unit_id, r.suite, r.task, r.metric) for r in acc]
    keys_lat = [(r.unit_id, r.device_type, r.batch, r.prompt_len, r.runtime) for r in lat]
    assert len(keys_acc) == len(set(keys_acc)) and len(keys_lat) == len(set(keys_lat))      # no duplicates
    got = {}
    for uid, *_ in keys_acc + keys_lat:
        got[uid] = got.get(uid, 0) + 1
    want = {uid: _expected_rows(u) for uid, u in units.items() if uid not in chain and _expected_rows(u)}
    assert got == want                                       # nothing lost, nothing for the failed chain
    # two evaluators really ran side by side: eval units of different workers overlap in time
    evals = [u for u in units.values() if u.kind == "eval" and u.status == "done"]
    assert len({u.worker for u in evals}) >= 2, {u.worker for u in evals}
    assert any(a.worker != b.worker and a.started_at < b.finished_at and b.started_at < a.finished_at
               for a in evals for b in evals), [(u.worker, u.started_at, u.finished_at) for u in evals]
    # no lock trouble: no unit error mentions it, nor does PostgreSQL's server log
    assert not [u.error for u in units.values() if u.error and LOCK_TROUBLE.search(u.error)]
    log = (cluster.root / "log").read_text(errors="replace")
    assert not LOCK_TROUBLE.findall(log), [ln for ln in log.splitlines() if LOCK_TROUBLE.search(ln)][:5]


def test_a_method_that_raises_fails_its_chain_with_the_traceback_and_no_rows(pg_sweep):
    url, out, _, _ = pg_sweep
    units = _units(url, out.sweep_id)
    (fit,) = [units[i] for i in out.failed if units[i].kind == "fit"]
    assert fit.status == "failed" and fit.method == "threshold"
    assert "Traceback (most recent call last)" in fit.error and "bogus" in fit.error
    dependants = [units[i] for i in out.failed if i != fit.id]
    assert sorted(u.kind for u in dependants) == ["eval", "eval", "latency"]
    for u in dependants:
        assert u.status == "failed"
        assert u.error.startswith("not run: a unit it depends on failed") and fit.id in u.error
    with session_scope(get_engine(url)) as s:
        for uid in out.failed:
            assert queries.artifacts_for(s, uid) == [] and queries.layer_metrics_for(s, uid) == []
        ids = {r.unit_id for r in queries.accuracy_table(s)} | {r.unit_id for r in queries.latency_table(s)}
        assert not ids & set(out.failed)
    # the good threshold and oracle settings still went all the way
    done_fits = {u.method for u in units.values() if u.kind == "fit" and u.status == "done"}
    assert done_fits == {"dense", "oracle", "threshold"}


@pytest.mark.parametrize("out_name", ["bundle", "bundle.tar.gz"])
def test_bundle_file_deleted_after_the_sweep_export_exits_2_and_writes_nothing(pg_sweep, tmp_path, capsys,
                                                                              out_name):
    from orchestrator.cli import main as cli

    url, out, home, _ = pg_sweep
    units = _units(url, out.sweep_id)
    (fit,) = [u for u in units.values() if u.kind == "fit" and u.method == "oracle"]
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


# ------------------------------------------------------------------ submitting the same spec twice

class _FakeJobs:
    """A stand-in for ray.job_submission.JobSubmissionClient (the calls orchestrator.cli makes)."""
    jobs: dict[str, str] = {}
    submitted: list[str] = []

    def __init__(self, address):
        self.address = address

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_submitting_twice_to_a_real_ray_job_server(tmp_path):
    """``ctxsparse submit`` (the installed command, as a user runs it) twice against a real Ray head with its job
    server: own ports, own temp dir, own process group, stopped at the end. Ray 2.60 guards the job API with a
    token: as in orchestrator/demo.sh, RAY_AUTH_MODE=token (the head writes ~/.ray/auth_token if missing and
    clients read it); Ray reads that setting once per process, hence subprocesses here."""
    bindir = Path(sys.executable).parent
    gcs, dash = _free_port(), _free_port()
    temp = Path(f"/tmp/rb{os.getpid()}")
    address = f"http://127.0.0.1:{dash}"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)        # the job runs `python -m orchestrator.driver`: this venv's python
    jobs_py = ("import json, sys; from ray.job_submission import JobSubmissionClient as C; c = C(sys.argv[1]); "
               "[c.stop_job(s) for s in sys.argv[2:]]; "
               "print(json.dumps(sorted(j.submission_id for j in c.list_jobs() if j.submission_id)))")

    def jobs(*stop: str):
        r = subprocess.run([sys.executable, "-c", jobs_py, address, *stop], env=env, capture_output=True, text=True,
                           timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def submit(spec: Path) -> dict:
        r = subprocess.run([str(bindir / "ctxsparse"), "submit", str(spec), "--address", address,
                            "--db", f"sqlite:///{tmp_path / 's.db'}"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    head = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=1",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while jobs() is None:
            assert head.poll() is None and time.time() < deadline, "the Ray head did not come up"
            time.sleep(2)
        spec = _spec_file(tmp_path, "battery-real-submit")
        first, second = submit(spec), submit(spec)
        assert first["submitted"] is True and second["submitted"] is False, (first, second)
        assert second["submission_id"] == first["submission_id"]
        assert jobs(first["submission_id"]) == [first["submission_id"]]     # one job; stopped now
    finally:
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):   # the whole group: gcs, raylet, ...
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_leftovers(str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def _kill_leftovers(marker: str) -> None:
    """Ray worker processes start their own session, so the head's process group does not hold them: end the
    ones of this test's head (their command line names its temp dir) by pid."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
