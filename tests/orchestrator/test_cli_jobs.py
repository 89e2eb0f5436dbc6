"""``ctxsparse submit / status / logs / resume`` against a real Ray job server, and operational errors.

The job server is the session's Ray cluster's (``ray_job_address``, tests/conftest.py: its dashboard's job API on
loopback, Ray 2.60's token authentication on; this process and its children hold the token, as a user's shell
does with ``RAY_AUTH_MODE=token``). The default test reads the session's shared SmolLM2 sweep, whose store copy its
background driver resumed through that server (``ctxsparse resume``, ``submit`` while the job lives, ``logs
--follow``: tests/sweep_support.py), then asks ``status`` and ``logs`` itself; the commands run in-process
(``orchestrator.cli.main``). The slow one submits its own jobs (an attempt that failed, one still running).

Operational errors (an unreachable store, an unknown model, a missing or empty data file, budgets smaller than
one window) are one message and exit status 2, found before any Ray work starts.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from db import queries
from db.engine import get_engine, session_scope
from tests.sweep_support import FAILING_ERROR

BIN = Path(sys.executable).parent
SHAPE_SPEC = {
    "models": ["shape:llama2-7b"],
    "methods": [{"name": "oracle", "sparsity": [0.5]}],
    "latency": {"devices": ["cuda"], "prompt_len": [16], "gen_len": 4, "repeats": 1},
    "resources": {"torch_threads": 1, "cpus_per_actor": 0.5},
}
# a store that cannot be reached: nothing listens on port 1
UNREACHABLE_DB = "postgresql+psycopg://nobody@127.0.0.1:1/nothing"
NOWHERE = "http://127.0.0.1:1"       # no Ray there either


class Jobs:
    """Raw jobs on the job server (what a test submits itself, besides the CLI's)."""

    def __init__(self, address: str):
        from ray.job_submission import JobSubmissionClient

        self.client = JobSubmissionClient(address)

    def status(self, sid: str) -> str:
        return str(self.client.get_job_status(sid).value)

    def wait(self, sid: str, *states: str, timeout: float = 120) -> str:
        t0 = time.time()
        while (st := self.status(sid)) not in states:
            assert time.time() - t0 < timeout, (sid, st, states)
            time.sleep(0.3)
        return st

    def listed(self, prefix: str) -> list[str]:
        return sorted(j.submission_id for j in self.client.list_jobs() if (j.submission_id or "").startswith(prefix))


@pytest.fixture
def jobs(ray_job_address):
    """Raw jobs; every job still live at the end of the test is stopped."""
    j = Jobs(ray_job_address)
    before = {x.submission_id for x in j.client.list_jobs()}
    yield j
    for x in j.client.list_jobs():
        if x.submission_id not in before and str(x.status.value) in ("PENDING", "RUNNING"):
            j.client.stop_job(x.submission_id)


def _spec(root: Path, name: str) -> Path:
    p = root / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"name": name, **SHAPE_SPEC}))
    return p


def _sid(spec: Path) -> str:
    from orchestrator.spec import load_spec

    s = load_spec(spec)
    return f"ctxsparse-{s.name}-{s.spec_hash()[:12]}"


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from orchestrator.cli import main as cli

    capsys.readouterr()
    rc = cli([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _last_json(capsys, *args: str):
    rc, out, err = _cli(capsys, *args)
    assert rc == 0, (rc, err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- real job server
def test_resume_submit_twice_logs_and_status_of_a_real_sweep(tiny_sweep, tiny_sweep_resumed, ray_job_address,
                                                             capsys, monkeypatch):
    """The session's shared SmolLM2 sweep (tests/sweep_support.py), its store copied right after it ran, resumed
    by its background driver as a user would: ``ctxsparse resume`` (a Ray job), ``ctxsparse submit`` of the same
    spec while that job lives, ``ctxsparse logs --follow`` to the job's end; then here ``status`` and ``logs``."""
    from orchestrator.spec import parse_spec

    steps, first = tiny_sweep_resumed.steps, tiny_sweep.outcome
    assert set(steps) == {"resume", "submit_while_live", "follow"}, {k: v.err[-2000:] for k, v in steps.items()}
    db, at = tiny_sweep_resumed.url, ("--address", ray_job_address)
    with session_scope(get_engine(db)) as s:
        (sweep,) = queries.list_sweeps(s)
    sid = f"ctxsparse-{sweep.name}-{parse_spec(sweep.spec).spec_hash()[:12]}"
    # resume: the stored spec submitted as a job (the first run had none), named after the sweep's hash
    r = steps["resume"]
    assert r.rc == 0 and json.loads(r.out.splitlines()[-1]) == {
        "submission_id": sid, "status": "PENDING", "submitted": True, "address": ray_job_address, "previous": None}
    # the same spec submitted while that job waits or runs: nothing submitted, the live attempt named
    r = steps["submit_while_live"]
    live = json.loads(r.out.splitlines()[-1])
    assert r.rc == 0 and live["submitted"] is False and live["submission_id"] == sid, (r.out, r.err)
    assert live["status"] in ("PENDING", "RUNNING") and f"attempt {sid} of this sweep is {live['status']}" in r.err
    # logs --follow streamed the driver's log until the job ended, and said how: a unit failed (again), exit 1
    r = steps["follow"]
    assert "units registered" in r.out and r.out.rstrip().endswith(f"job {sid}: FAILED") and r.rc == 1, r.out[-3000:]
    assert re.search(r"\[\d+/\d+\] smollm2-135m svd s=0.5 target=no_such_target fit FAILED on fitter@", r.out), r.out
    # status: the store's view (the sweep now knows its job) plus the Ray job's state, failures with their error
    rc, out, err = _cli(capsys, "status", "tiny-test", *at, "--db", db)
    assert rc == 0, err
    (st,) = json.loads(out)
    assert (st["sweep"], st["submission_id"], st["ray_job"], st["status"]) == ("tiny-test", sid, "FAILED", "failed")
    assert (st["done"], st["failed"], st["total"]) == (first.done, len(first.failed), first.total)
    assert any(FAILING_ERROR in f["error"] for f in st["failures"]), st["failures"]
    assert f"Ray job state: from {ray_job_address} (--address)" in err
    # no --address, no RAY_ADDRESS: the session's head, found as Ray finds a local head (its address file, which
    # tests/conftest.py writes as `ray start` does), answers for its jobs
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, out, err = _cli(capsys, "status", "tiny-test", "--db", db)
    assert rc == 0 and json.loads(out)[0]["ray_job"] == "FAILED", err
    assert f"Ray job state: from {ray_job_address} (the local head at " in err, err
    # logs by sweep name (through the store), without following: the same log
    rc, out, err = _cli(capsys, "logs", "tiny-test", *at, "--db", db)
    assert rc == 0 and "units registered" in out and "already done" in out, err[-3000:]
    # an unknown job: one message, exit 2
    rc, _, err = _cli(capsys, "logs", "ctxsparse-nothing-0", *at)
    assert rc == 2 and err.strip().count("\n") == 0 and "no Ray job" in err


@pytest.mark.slow
def test_submit_never_starts_a_second_live_attempt(ray_job_address, jobs, tmp_path, capsys):
    """A failed first attempt, its ``-r2`` retry still running: submitting again submits nothing, names the live
    attempt; once that attempt has ended, a new one (``-r3``) is submitted."""
    spec = _spec(tmp_path, "jobs-attempts")
    sid = _sid(spec)
    db = ("--db", f"sqlite:///{tmp_path / 'attempts.db'}")
    jobs.client.submit_job(entrypoint="python -c 'import sys; sys.exit(3)'", submission_id=sid)
    jobs.client.submit_job(entrypoint="sleep 300", submission_id=f"{sid}-r2")
    jobs.wait(sid, "FAILED")
    jobs.wait(f"{sid}-r2", "RUNNING")
    rc, out, err = _cli(capsys, "submit", spec, "--address", ray_job_address, *db)
    # the live attempt ends (listing the jobs after that: whatever the submit did is still listed)
    jobs.client.stop_job(f"{sid}-r2")
    jobs.wait(f"{sid}-r2", "STOPPED")
    assert f"{sid}-r3" not in jobs.listed(sid), "a second live attempt was submitted"
    assert rc == 0, err[-3000:]
    out = json.loads(out.strip().splitlines()[-1])
    assert out["submitted"] is False and out["submission_id"] == f"{sid}-r2" and out["status"] == "RUNNING"
    assert f"{sid}-r2" in err and "RUNNING" in err and "Traceback" not in err
    # now a retry goes in, as -r3, naming what it follows
    retry = _last_json(capsys, "submit", spec, "--address", ray_job_address, *db)
    assert retry["submitted"] is True and retry["submission_id"] == f"{sid}-r3"
    assert retry["previous"] == {"submission_id": f"{sid}-r2", "status": "STOPPED"}
    jobs.client.stop_job(f"{sid}-r3")
    jobs.wait(f"{sid}-r3", "STOPPED", "SUCCEEDED", "FAILED")
    assert jobs.listed(sid) == [sid, f"{sid}-r2", f"{sid}-r3"]


# ------------------------------------------------------------------------------------- the command line itself
def _leaves(parser, path=()):
    """(argv prefix, parser) of every command the CLI has (``bundle export``, not ``bundle``)."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sp in subs[0].choices.items():
        yield from _leaves(sp, (*path, name))


def test_every_command_takes_db():
    """README: `--db URL` as every command takes it. Each command parses it (with its required arguments filled
    in), the ones that never use the store included."""
    from orchestrator.cli import build_parser

    parser = build_parser()
    seen = []
    for path, sp in _leaves(parser):
        argv = list(path)
        for a in sp._actions:
            if a.required or (not a.option_strings and a.nargs is None):
                argv += [a.option_strings[0], "X"] if a.option_strings else ["X"]
        args = parser.parse_args([*argv, "--db", "sqlite:///elsewhere.db"])
        assert args.db == "sqlite:///elsewhere.db", path
        seen.append(" ".join(path))
    assert {"ppl", "capture", "generate", "bundle download", "bundle export", "status", "kernels"} <= set(seen)


def _store_with_a_submitted_sweep(tmp_path) -> str:
    from db.engine import upgrade

    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = get_engine(url)
    upgrade(engine)
    with session_scope(engine) as s:
        queries.get_or_create_sweep(s, name="submitted", spec_hash="0" * 64, spec={"name": "submitted"},
                                    submission_id="ctxsparse-submitted-000000000000")
    return url


@pytest.mark.parametrize("address_file", [None, "127.0.0.1:1"], ids=["no head", "stopped head"])
def test_status_says_when_no_ray_cluster_is_reachable(tmp_path, capsys, monkeypatch, address_file):
    """No --address, no RAY_ADDRESS, no head recorded in Ray's address file (or one that has stopped): the store's
    view, and on stderr that no Ray job state could be asked, at once."""
    db = _store_with_a_submitted_sweep(tmp_path)
    ray_tmp = tmp_path / "ray-tmp"                   # Ray's temp folder, where `ray start` records its head
    (ray_tmp / "ray").mkdir(parents=True)
    if address_file:
        (ray_tmp / "ray" / "ray_current_cluster").write_text(address_file)
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    t0 = time.monotonic()
    rc, out, err = _cli(capsys, "status", "--db", db)
    assert rc == 0, err
    assert time.monotonic() - t0 < 15
    (st,) = json.loads(out)
    assert st["sweep"] == "submitted" and st["submission_id"] == "ctxsparse-submitted-000000000000"
    assert "ray_job" not in st
    assert "Ray job state: no Ray cluster reachable (set --address or RAY_ADDRESS)" in err.splitlines(), err


def test_kernels_names_the_build_or_the_fallback(capsys, monkeypatch):
    """`ctxsparse kernels --json` is kernels.native.native_status(): each library built for this CPU's instruction set
    (kernels.isa); the plain form starts with describe()'s line. With the fallback chosen it still exits 0 and says
    so."""
    from kernels import cpu, isa, native

    monkeypatch.delenv(cpu.NATIVE_ENV, raising=False)
    rc, out, _ = _cli(capsys, "kernels", "--json")
    assert rc == 0
    st = json.loads(out)
    want = isa.resolved()
    assert st["cpu_native"]["built"] and st["cpu_native"]["isa"] == want, st
    assert st["cpu_quant"]["built"] and st["cpu_quant"]["isa"] == want, st
    assert st["cpu_flags"] == isa.cpu_info()["cpu_flags"]
    rc, out, _ = _cli(capsys, "kernels")
    assert rc == 0 and out.splitlines()[0] == native.describe(st) and f"native kernels: {want} build" in out
    monkeypatch.setenv(cpu.NATIVE_ENV, "0")
    rc, out, _ = _cli(capsys, "kernels")
    assert rc == 0 and out.startswith("native kernels: off (CTXSPARSE_CPU_NATIVE=0); torch fallback"), out


# ------------------------------------------------------------------------------------- operational errors
def _one_line_error(capsys, *must: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    for m in must:
        assert m in err, err
    return err


def _spec_file(tmp_path, **changes) -> Path:
    d = {"name": "ops", "models": ["smollm2-135m"], "methods": [{"name": "oracle", "sparsity": [0.5]}], **changes}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_unreachable_store_is_one_message_exit_2_from_the_command(tmp_path):
    r = subprocess.run([str(BIN / "ctxsparse"), "status", "--db", UNREACHABLE_DB], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith("ctxsparse status: error: cannot open the store") and "127.0.0.1:1" in err, err


@pytest.mark.parametrize("argv", [
    ["submit", "SPEC", "--address", NOWHERE],
    ["status"],
    ["status", "some-sweep", "--address", NOWHERE],
    ["pareto", "smollm2-135m"],
    ["bundle", "export", "abcdef", "--out", "OUT"],
    ["resume", "some-sweep", "--address", NOWHERE],
], ids=lambda a: " ".join(a[:2]))
def test_unreachable_store_is_one_message_exit_2(argv, tmp_path, capsys):
    from orchestrator.cli import main as cli

    argv = [str(_spec_file(tmp_path)) if a == "SPEC" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert cli([*argv, "--db", UNREACHABLE_DB]) == 2
    _one_line_error(capsys, "cannot open the store", "127.0.0.1:1")
    assert not (tmp_path / "out").exists()


def test_driver_with_an_unreachable_store_exits_2_before_starting_ray(tmp_path, capsys):
    import ray

    from orchestrator.driver import main as driver

    was = ray.is_initialized()
    assert driver([str(_spec_file(tmp_path)), "--db", UNREACHABLE_DB, "--no-pareto"]) == 2
    _one_line_error(capsys, "cannot open the store", "127.0.0.1:1")
    assert ray.is_initialized() == was


@pytest.mark.parametrize("changes, must", [
    ({"models": ["smollm3-135m"]}, ["models.0", "unknown model 'smollm3-135m'", "smollm2-135m", "gemma3-270m"]),
    ({"models": ["weights/none.gguf"]}, ["models.0", "not found", "none.gguf"]),
    ({"data": {"source": "lambda"}}, ["data.source", "unknown data source 'lambda'"]),
    ({"data": {"source": "MISSING.txt"}}, ["data.source", "not found", "MISSING.txt"]),
    ({"data": {"source": "EMPTY.txt"}}, ["data.source", "no text", "EMPTY.txt"]),
    ({"data": {"source": "EMPTY.jsonl"}}, ["data.source", "no text", "EMPTY.jsonl"]),
], ids=["unknown model", "missing gguf", "unknown source", "missing data file", "empty txt", "empty jsonl"])
def test_submit_checks_models_and_data_before_contacting_ray(changes, must, tmp_path, capsys):
    from orchestrator.cli import main as cli

    (tmp_path / "EMPTY.txt").write_text("\n\n   \n")
    (tmp_path / "EMPTY.jsonl").write_text("\n")
    if "data" in changes:
        src = changes["data"]["source"]
        changes = {"data": {"source": str(tmp_path / src) if src.isupper() or "." in src else src}}
    spec = _spec_file(tmp_path, **changes)
    assert cli(["submit", str(spec), "--address", NOWHERE, "--db", f"sqlite:///{tmp_path / 's.db'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Ray" not in err, err
    for m in must:
        assert m in err, err


def test_submit_rejects_budgets_smaller_than_one_window(tmp_path, capsys):
    from orchestrator.cli import main as cli

    spec = _spec_file(tmp_path, data={"calib_tokens": 512, "seq_len": 1024},
                      suites={"perplexity": {"tokens": 256, "seq_len": 512}})
    assert cli(["submit", str(spec), "--address", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Ray" not in err, err
    assert "suites.perplexity" in err and "tokens (256) is smaller than seq_len (512)" in err, err
    assert "data" in err and "calib_tokens (512) is smaller than seq_len (1024)" in err, err


def test_submit_asks_again_while_rays_job_agent_is_starting(capsys):
    """Seconds after ``ray start`` the head answers a job submission with 'No available agent to submit job,
    please try again later' (HTTP 500, Ray's SDK raises RuntimeError): ``submit_job`` asks again until the agent
    answers; any other error, and that one once the wait is over, is raised. (Against the real cluster, the
    suite's resumed sweep submits right after its first run.)"""
    from orchestrator.cli import submit_job

    agent_down = RuntimeError("Request failed with status code 500: No available agent to submit job, please try "
                              "again later..")

    class Head:      # the answers of Ray's job API while the head's agent starts
        def __init__(self, failures, error=agent_down):
            self.failures, self.error, self.calls = failures, error, 0

        def submit_job(self, **job):
            self.calls += 1
            if self.calls <= self.failures:
                raise self.error
            return job["submission_id"]

    head = Head(2)
    assert submit_job(head, pause_s=0.01, submission_id="sweep-1") == "sweep-1" and head.calls == 3
    assert capsys.readouterr().err.count("job agent is not up yet") == 2
    with pytest.raises(RuntimeError, match="No available agent"):
        submit_job(Head(5), wait_s=0.03, pause_s=0.02, submission_id="sweep-1")
    bad = Head(1, RuntimeError("Request failed with status code 400: runtime_env is invalid."))
    with pytest.raises(RuntimeError, match="runtime_env is invalid"):
        submit_job(bad, pause_s=0.01, submission_id="sweep-1")
    assert bad.calls == 1
