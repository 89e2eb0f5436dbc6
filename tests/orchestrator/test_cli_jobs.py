"""``ctxsparse submit / status / logs / resume`` against a real Ray job server, and operational errors.

One Ray head with its job server serves the whole module (own ports, own temp dir, own process group, stopped at
the end). The sweeps submitted to it are latency-only sweeps of a random-weights shape (``shape:llama2-7b``)
timed on ``cuda``: the driver really runs (describe, plan, register, the two trivial fit units) in seconds, and
the cuda units stay pending on this GPU-less cluster, so no model is loaded. Ray 2.60 guards the job API with a
token: as in orchestrator/demo.sh, RAY_AUTH_MODE=token (the head writes ~/.ray/auth_token if missing and clients
read it); Ray reads that setting once per process, hence every Ray client here is a subprocess.

The job-server tests are slow (the head and each job's driver start in ~1-2 minutes on 2 cores); the default
suite keeps the submission logic against a stand-in job client (tests/orchestrator/test_battery.py).

Operational errors (an unreachable store, an unknown model, a missing or empty data file, budgets smaller than
one window) are one message and exit status 2, found before any Ray work starts.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from tests.net_support import free_port

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

JOBS_PY = """
import json, sys, time
from ray.job_submission import JobSubmissionClient
c = JobSubmissionClient(sys.argv[1])
op = json.loads(sys.argv[2])
for sid, entrypoint in op.get("submit", {}).items():
    c.submit_job(entrypoint=entrypoint, submission_id=sid)
for sid in op.get("stop", []):
    c.stop_job(sid)
if op.get("stop_live"):
    [c.stop_job(j.submission_id) for j in c.list_jobs() if str(j.status.value) in ("PENDING", "RUNNING")]
for sid, want in op.get("wait", {}).items():
    t0 = time.time()
    while str(c.get_job_status(sid).value) not in want:
        assert time.time() - t0 < 120, (sid, str(c.get_job_status(sid).value), want)
        time.sleep(0.3)
print(json.dumps({j.submission_id: str(j.status.value) for j in c.list_jobs() if j.submission_id}))
"""


@dataclass
class JobServer:
    address: str
    env: dict
    root: Path

    def jobs(self, **op) -> dict | None:
        """Submit / stop / wait for raw jobs; -> {submission id: status} of every job (None: server not up)."""
        r = subprocess.run([sys.executable, "-c", JOBS_PY, self.address, json.dumps(op)], env=self.env,
                           capture_output=True, text=True, timeout=180)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """The installed ``ctxsparse`` command, as a user runs it."""
        return subprocess.run([str(BIN / "ctxsparse"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def spec(self, name: str) -> Path:
        p = self.root / f"{name}.yaml"
        p.write_text(yaml.safe_dump({"name": name, **SHAPE_SPEC}))
        return p


@pytest.fixture(scope="module")
def job_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    gcs, dash, *agent = (free_port() for _ in range(7))
    temp = Path(f"/tmp/rj{os.getpid()}")
    home = root / "home"
    home.mkdir()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "CTXSPARSE_HOME": str(home)}
    for var in ("RAY_ADDRESS", "CTXSPARSE_DB_URL"):   # the job runs `python -m orchestrator.driver`: this venv's
        env.pop(var, None)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp}",
         "--disable-usage-stats",
         # every fixed default port of its own: another Ray on this machine (a demo, a user's) holds the defaults
         *(f"--{name}={port}" for name, port in zip(
             ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port", "ray-client-server-port"), agent))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = JobServer(f"http://127.0.0.1:{dash}", env, root)
    t0 = time.time()
    try:
        n = 0      # up when a job runs: the job API answers a little before the node's job agent takes jobs
        while server.jobs(submit={f"probe-{n}": "true"}, wait={f"probe-{n}": ["SUCCEEDED"]}) is None:
            assert head.poll() is None and time.time() - t0 < 180, "the Ray head did not come up"
            n += 1
            time.sleep(1)
        print(f"Ray job server up in {time.time() - t0:.1f}s", file=sys.stderr)
        yield server
    finally:
        server.jobs(stop_live=True)     # job drivers (their command lines do not name the temp dir) end first
        # nothing of this throwaway cluster is kept: end it at once, the whole group (gcs, raylet, ...), then the
        # workers and job drivers that started sessions of their own
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=30)
        _kill_leftovers(str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def _kill_leftovers(marker: str) -> None:
    """Ray worker processes start their own session, so the head's process group does not hold them: end the
    ones of this module's head (their command line names its temp dir) by pid."""
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


def _last_json(r: subprocess.CompletedProcess):
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sid(spec: Path) -> str:
    from orchestrator.spec import load_spec

    s = load_spec(spec)
    return f"ctxsparse-{s.name}-{s.spec_hash()[:12]}"


# ------------------------------------------------------------------------------------- real job server
@pytest.mark.slow
def test_submit_never_starts_a_second_live_attempt(job_server):
    """A failed first attempt, its ``-r2`` retry still running: submitting again submits nothing, names the live
    attempt; once that attempt has ended, a new one (``-r3``) is submitted."""
    spec = job_server.spec("jobs-attempts")
    sid = _sid(spec)
    job_server.jobs(submit={sid: "python -c 'import sys; sys.exit(3)'", f"{sid}-r2": "sleep 300"},
                    wait={sid: ["FAILED"], f"{sid}-r2": ["RUNNING"]})
    r = job_server.cli("submit", str(spec), "--address", job_server.address,
                       "--db", f"sqlite:///{job_server.root / 'attempts.db'}")
    out = _last_json(r)
    # the live attempt ends (listing the jobs after that: whatever the submit did is still listed)
    jobs = job_server.jobs(stop=[f"{sid}-r2"], wait={f"{sid}-r2": ["STOPPED"]})
    assert f"{sid}-r3" not in jobs, f"a second live attempt was submitted: {jobs}"
    assert out["submitted"] is False and out["submission_id"] == f"{sid}-r2" and out["status"] == "RUNNING"
    assert f"{sid}-r2" in r.stderr and "RUNNING" in r.stderr and "Traceback" not in r.stderr
    # now a retry goes in, as -r3, naming what it follows
    retry = _last_json(job_server.cli("submit", str(spec), "--address", job_server.address,
                                      "--db", f"sqlite:///{job_server.root / 'attempts.db'}"))
    assert retry["submitted"] is True and retry["submission_id"] == f"{sid}-r3"
    assert retry["previous"] == {"submission_id": f"{sid}-r2", "status": "STOPPED"}
    jobs = job_server.jobs(stop=[f"{sid}-r3"], wait={f"{sid}-r3": ["STOPPED", "SUCCEEDED", "FAILED"]})
    assert sorted(j for j in jobs if j.startswith(sid)) == [sid, f"{sid}-r2", f"{sid}-r3"]


@pytest.mark.slow
def test_submit_twice_status_logs_and_resume_of_a_real_sweep(job_server):
    spec = job_server.spec("jobs-real")
    db = f"sqlite:///{job_server.root / 'real.db'}"
    at = ("--address", job_server.address)
    first = _last_json(job_server.cli("submit", str(spec), *at, "--db", db))
    sid = first["submission_id"]
    assert first["submitted"] is True and sid == _sid(spec)
    again = _last_json(job_server.cli("submit", str(spec), *at, "--db", db))    # while it waits or runs
    assert again["submitted"] is False and again["submission_id"] == sid
    # logs --follow streams the driver's log until the job ends, and says how it ended
    r = job_server.cli("logs", sid, *at, "--follow")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "units registered" in r.stdout and r.stdout.rstrip().endswith(f"job {sid}: SUCCEEDED")
    # status: the store's view plus the Ray job's state
    (st,) = _last_json_block(job_server.cli("status", "jobs-real", *at, "--db", db))
    assert st["sweep"] == "jobs-real" and st["submission_id"] == sid and st["ray_job"] == "SUCCEEDED"
    assert st["failed"] == 0 and st["done"] == 2 and st["total"] > st["done"]  # 2 fits; cuda units wait for a GPU
    assert st["status"] == "running"
    # logs by sweep name (through the store), without following
    r = job_server.cli("logs", "jobs-real", *at, "--db", db)
    assert r.returncode == 0 and "units registered" in r.stdout, r.stderr[-3000:]
    # resume: a new attempt of the stored spec; what was done is skipped
    res = _last_json(job_server.cli("resume", "jobs-real", *at, "--db", db))
    assert res["submitted"] is True and res["submission_id"] == f"{sid}-r2"
    assert res["previous"] == {"submission_id": sid, "status": "SUCCEEDED"}
    r = job_server.cli("logs", f"{sid}-r2", *at, "--follow")
    assert r.returncode == 0 and "2 of " in r.stdout and "already done; 0 to run" in r.stdout, r.stdout[-3000:]
    (st,) = _last_json_block(job_server.cli("status", "jobs-real", *at, "--db", db))
    assert st["submission_id"] == f"{sid}-r2" and st["ray_job"] == "SUCCEEDED" and st["done"] == 2
    # an unknown job or sweep: one message, exit 2
    r = job_server.cli("logs", "ctxsparse-nothing-0", *at)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no Ray job" in r.stderr


def _last_json_block(r: subprocess.CompletedProcess):
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return json.loads(r.stdout)


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
