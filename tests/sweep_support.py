"""Real, small sweeps on the session's Ray cluster (shared by the orchestrator and dashboard tests).

``TINY_SPEC`` is kept small enough for the 2-core CI: two sparsity methods plus dense, calibration on one window
of 256 tokens, perplexity on one 256-token held-out window and 4 COPA items, CPU latency of 4 decode tokens.
Most of a tiny sweep's time on a 2-core CPU is its actors starting (each imports torch and transformers and loads
the model: ~10 s), not its units; so the default test suite runs each sweep it needs once, in the background from
the start of the session (``Background`` below; the session fixtures ``tiny_sweep``, ``pg_sweep`` and
``troubled_sweep`` in tests/conftest.py), and every test reads the outcome and the store of one of them:

- ``shared``: the tiny sweep on SQLite (``SHARED_OVERRIDES``), with one evaluator killed in the middle of its
  first unit; then, on a copy of the store, what a user does at a terminal: ``ctxsparse resume`` of the stored
  sweep (a Ray job on the session's job server), ``ctxsparse submit`` of the same spec while that job lives,
  ``ctxsparse logs --follow`` to its end (``RESUME_STEPS``);
- ``pg``: the tiny sweep's dense setting and a fit that raises, on PostgreSQL, with two evaluators
  (``PG_OVERRIDES``);
- ``troubled``: a latency-only sweep of a random-weights shape whose fitter dies every time, or cannot record
  its unit (``TroubledFitter``, ``TROUBLED_SPEC``).
"""
from __future__ import annotations

import copy
import os
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SHARED_CACHES = ("activations", "allocation")

TINY_SPEC = {
    "name": "tiny-test",
    "models": ["smollm2-135m"],
    "data": {"calib_tokens": 256, "metric_tokens": 256, "seq_len": 256},
    "methods": [
        {"name": "oracle", "sparsity": [0.5]},
        {"name": "threshold", "sparsity": [0.5]},
    ],
    "suites": {"perplexity": {"tokens": 256, "seq_len": 256}, "tasks": [{"name": "copa", "limit": 4}]},
    "latency": {"devices": ["cpu"], "batch": [1], "prompt_len": [16], "gen_len": 4, "repeats": 1},
    "resources": {"fitters": 1, "evaluators": 1, "benchers": 1, "torch_threads": 1},
}

# the accuracy rows of one perplexity eval unit (workers.units.Units.evaluate)
PERPLEXITY_METRICS = ("ppl", "nll", "mlp_sparsity", "head_sparsity", "input_sparsity", "weight_skipped",
                      "all_weight_skipped")

# The session's shared sweep: TINY_SPEC's ``threshold`` (fitted on calibration data: a real fit; ``oracle`` too
# would add two eval units and a latency unit to the evaluator's serial path) plus a setting whose fit raises
# (``svd`` given a value only the fit can refuse: an unknown option name is refused at submit), latency asked
# for on ``cpu`` and on ``cuda`` (which the CPU test cluster lacks), and half a CPU per actor. One run gives:
# every unit done with its rows exactly once, the failing fit recorded with its error and its dependants failed
# with the reason, the cuda latency units left pending (no cuda rows invented), and a unit whose worker was
# killed retried on a new worker. Latency is not timed alone (``exclusive: false``): the bencher starts while the
# evaluator works, ~30 s less on 2 cores; no test here reads the timings' values.
FAILING_METHOD = {"name": "svd", "sparsity": [0.5], "options": {"target": "no_such_target"}}
FAILING_ERROR = "target must be one of"
SHARED_METHOD = {"name": "threshold", "sparsity": [0.5]}
assert SHARED_METHOD in TINY_SPEC["methods"]
SHARED_OVERRIDES = {
    "methods": [SHARED_METHOD, FAILING_METHOD],
    "latency": {**TINY_SPEC["latency"], "devices": ["cpu", "cuda"], "exclusive": False},
    "resources": {**TINY_SPEC["resources"], "cpus_per_actor": 0.5},
}
# The PostgreSQL sweep: the dense setting (its two eval units become ready together, one for each of the two
# evaluators, which then write at the same time) and the failing fit (its two eval units failed without running);
# no latency units (nothing they would add here).
PG_DATABASE = "battery_pg"
PG_OVERRIDES = {
    "name": "battery-pg",
    "methods": [FAILING_METHOD],
    "latency": None,
    "resources": {**TINY_SPEC["resources"], "evaluators": 2, "cpus_per_actor": 0.5},
}
# The troubled sweep: a random-weights shape (its fit units are trivial; its cuda latency units wait for a GPU),
# fitted by ``TroubledFitter``, two attempts per unit. The driver must finish within TROUBLED_HANG_S.
TROUBLED_SPEC = {
    "name": "battery-troubled", "models": ["shape:llama2-7b"],
    "methods": [{"name": m, "sparsity": [0.5]} for m in ("oracle", "threshold", "static")],
    "latency": {"devices": ["cuda"], "prompt_len": [16], "gen_len": 4, "repeats": 1},
    "resources": {"max_attempts": 2, "torch_threads": 1, "cpus_per_actor": 0.5},
}
TROUBLED_HANG_S = 300
READONLY = "attempt to write a readonly database"


def tiny_spec(**overrides):
    from orchestrator.spec import parse_spec

    d = copy.deepcopy(TINY_SPEC)
    d.update(overrides)
    return parse_spec(d)


def run_tiny_sweep(db_url: str, **overrides):
    """Run the tiny sweep (on the already-initialized Ray) into ``db_url``; returns the SweepOutcome."""
    from orchestrator.driver import run_sweep

    return run_sweep(tiny_spec(**overrides), db_url, heartbeat_s=30.0)


def private_home(root: Path) -> Path:
    """A CTXSPARSE_HOME of its own under ``root`` (bundles, store), sharing the activation caches with the test
    session's home (tests/conftest.py; model weights are in CTXSPARSE_MODEL_CACHE): tests that damage bundle files
    touch only their own."""
    real = Path(os.environ["CTXSPARSE_HOME"])
    home = root / "home"
    home.mkdir()
    for name in SHARED_CACHES:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    return home


@contextmanager
def home_set_to(home: Path):
    """``CTXSPARSE_HOME`` is ``home`` inside (the sweep driver hands it to every actor), restored after."""
    old = os.environ.get("CTXSPARSE_HOME")
    os.environ["CTXSPARSE_HOME"] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("CTXSPARSE_HOME", None)
        else:
            os.environ["CTXSPARSE_HOME"] = old


def copy_sqlite(src: Path, dst: Path) -> None:
    a, b = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        a.backup(b)
    finally:
        b.close()
        a.close()


def copy_store(url: str, dst: Path) -> str:
    """A copy of the SQLite store at ``url`` in ``dst``: for tests that add sweeps, so the shared one stays as
    the other tests expect it."""
    copy_sqlite(Path(url.removeprefix("sqlite:///")), dst)
    return f"sqlite:///{dst}"


def resubmitted_url(url: str) -> str:
    return f"sqlite:///{Path(url.removeprefix('sqlite:///')).with_name('resubmitted.db')}"


# ---------------------------------------------------------------------------------------------- what tests read
@dataclass(frozen=True)
class KilledWorker:
    unit: str            # the eval unit that was running when its worker was killed
    worker: str          # that worker ("evaluator@host:pid")


RESUME_STEPS = ("resume", "submit_while_live", "follow")   # the commands that resume the shared sweep's copy


@dataclass(frozen=True)
class CliCall:
    argv: list           # ctxsparse ARGV
    rc: int
    out: str
    err: str


@dataclass(frozen=True)
class TinySweep:
    url: str             # SQLAlchemy URL of the store (SQLite) holding this one sweep
    outcome: object      # orchestrator.driver.SweepOutcome
    home: Path           # CTXSPARSE_HOME of the sweep (its bundles)
    killed: KilledWorker | None     # the worker killed in the middle of a unit (None: no eval unit seen running)


@dataclass(frozen=True)
class ResumedSweep:
    url: str             # a copy of the shared sweep's store made right after it ran, then resumed as a Ray job
    steps: dict          # RESUME_STEPS name -> CliCall: the commands that resumed it and what they printed


@dataclass(frozen=True)
class PgSweep:
    url: str             # the sweep's own PostgreSQL database (PG_DATABASE)
    outcome: object
    cluster: object      # tests.pg_support.PgCluster (its server log)


@dataclass(frozen=True)
class TroubledSweep:
    url: str
    outcome: object


# ---------------------------------------------------------------------------------------------- background runs
REPO = Path(__file__).resolve().parents[1]
RESULT = "BACKGROUND-SWEEP-RESULT "


class Background:
    """One background sweep (``kind``: shared, pg or troubled), run by a driver process of its own on the session's
    Ray cluster (``python -m tests.sweep_support KIND ADDRESS URL [--after URL] [--jobs URL]``) while other tests
    run: on 2 cores most of a tiny sweep is single-threaded (an actor starting, one unit at a time), so the rest of
    the suite fills the other core. Its CTXSPARSE_HOME is ``home`` (a test may damage one of its bundle files,
    then restores it), given in the driver's environment, never by changing this process's. The driver prints one
    ``RESULT`` line per result (``name json``); its log (the sweeps' progress, any traceback) is
    ``root / "driver.log"``. ``after``: a SQLite store whose collect unit this sweep waits for: by then the model's
    float cache exists (several processes converting a cold GGUF at once cost ~30 s of CPU each) and so do the
    activations of the same data (the session's activation caches are shared: ``private_home``). ``jobs``: the
    cluster's job API (shared)."""

    def __init__(self, kind: str, root: Path, address: str, url: str, home: Path, *, after: str | None = None,
                 jobs: str | None = None):
        import subprocess
        import sys
        import time

        self.kind, self.root, self.url, self.home = kind, root, url, home
        self.cut_short = False
        self.log = root / "driver.log"
        env = {**os.environ, "CTXSPARSE_HOME": str(home), "PYTHONPATH": str(REPO)}
        self.t0 = time.time()
        with self.log.open("w") as f:
            extra = [*(["--after", after] if after else []), *(["--jobs", jobs] if jobs else [])]
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.sweep_support", kind, address, url, *extra],
                                         cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def results(self, timeout: float, *names: str) -> dict:
        """Wait (at most ``timeout`` s) until the driver has printed the results ``names`` (all of them, when none
        is named: until it exits); its results so far by name, or RuntimeError with the log's tail."""
        import json
        import time

        t_end = time.time() + timeout
        while True:
            rc = self.proc.poll()
            text = self.log.read_text(errors="replace")
            lines = [ln[len(RESULT):].split(" ", 1) for ln in text[:text.rfind("\n") + 1].splitlines()
                     if ln.startswith(RESULT)]                # whole lines only: the driver may be writing one
            got = {name: json.loads(payload) for name, payload in lines}
            if rc not in (None, 0):
                raise RuntimeError(f"the {self.kind} sweep's driver exited with {rc}; log {self.log}:\n{self._tail()}")
            if (names and set(names) <= set(got)) or rc == 0:
                return got
            if time.time() > t_end:
                self.stop()
                raise RuntimeError(f"the {self.kind} sweep did not finish in {timeout:.0f} s; "
                                   f"log {self.log}:\n{self._tail()}")
            time.sleep(0.5)

    @property
    def seconds(self) -> float | None:
        """From the start to the driver's last line, once it has exited by itself."""
        return None if self.proc.poll() is None or self.cut_short else self.log.stat().st_mtime - self.t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.cut_short = True
            self.proc.kill()
            self.proc.wait(timeout=60)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def shared_sweep(bg: Background, timeout: float) -> TinySweep:
    from orchestrator.driver import SweepOutcome

    r = bg.results(timeout, "first", "killed")
    return TinySweep(bg.url, SweepOutcome(**r["first"]), bg.home, KilledWorker(**r["killed"]) if r["killed"] else None)


def resumed_sweep(bg: Background, timeout: float) -> ResumedSweep:
    r = bg.results(timeout)
    return ResumedSweep(resubmitted_url(bg.url), {name: CliCall(**r[name]) for name in RESUME_STEPS if name in r})


def pg_sweep(bg: Background, cluster, timeout: float) -> PgSweep:
    from orchestrator.driver import SweepOutcome

    return PgSweep(bg.url, SweepOutcome(**bg.results(timeout)["outcome"]), cluster)


def troubled_sweep(bg: Background, timeout: float) -> TroubledSweep:
    from orchestrator.driver import SweepOutcome

    return TroubledSweep(bg.url, SweepOutcome(**bg.results(timeout)["outcome"]))


# ---------------------------------------------------------------------------------------------- in the driver
def _emit(name: str, payload) -> None:
    import json
    from dataclasses import asdict, is_dataclass

    print(RESULT + name + " " + json.dumps(asdict(payload) if is_dataclass(payload) else payload), flush=True)


def _units(engine, status: str | None = None) -> list:
    """Every unit in the store (with ``status``); none while the sweep is still creating it."""
    from db import queries
    from db.engine import session_scope

    try:
        with session_scope(engine) as s:
            return [u for m in queries.list_models(s) for u in queries.units_for_model(s, m.id, status=status)]
    except Exception:   # the store is being created by the sweep
        return []


def _kill_an_evaluator_mid_unit(url: str, killed: dict, stop) -> None:
    """Watch the store; SIGKILL the worker of the first eval unit seen running (its first unit: it loads the model
    inside the unit, seconds), and record which."""
    import signal

    from db.engine import get_engine

    engine = get_engine(url, read_only=True)
    try:
        while not stop.wait(0.2):
            evals = [u for u in _units(engine, "running") if u.kind == "eval" and u.worker]
            if evals:
                killed.update(unit=evals[0].id, worker=evals[0].worker)
                os.kill(int(evals[0].worker.rsplit(":", 1)[1]), signal.SIGKILL)
                return
    finally:
        engine.dispose()


def _wait_for_a_collect(url: str, timeout: float = 600) -> None:
    import time

    from db.engine import get_engine

    engine = get_engine(url, read_only=True)
    t_end = time.time() + timeout
    try:
        while time.time() < t_end and not any(u.kind == "collect" for u in _units(engine, "done")):
            time.sleep(1)
    finally:
        engine.dispose()


def _cli(*args) -> dict:
    """``ctxsparse ARGS`` (in this process): rc and what it printed."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from orchestrator.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return {"argv": argv, "rc": rc, "out": out.getvalue(), "err": err.getvalue()}


def _drive_shared(url: str, jobs: str) -> None:
    """The tiny sweep with an evaluator killed mid-unit; then a copy of the store, resumed through the job server
    at ``jobs``."""
    import json
    import threading

    import yaml

    killed: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_an_evaluator_mid_unit, args=(url, killed, stop), daemon=True)
    killer.start()
    first = run_tiny_sweep(url, **SHARED_OVERRIDES)
    stop.set()
    killer.join()
    _emit("first", first)
    _emit("killed", killed)
    again_url = resubmitted_url(url)
    again = Path(again_url.removeprefix("sqlite:///"))
    copy_store(url, again)
    spec = again.with_name("spec.yaml")
    spec.write_text(yaml.safe_dump(tiny_spec(**SHARED_OVERRIDES).canonical()))
    at = ("--address", jobs, "--db", again_url)
    resume = _cli("resume", TINY_SPEC["name"], *at)
    _emit("resume", resume)
    _emit("submit_while_live", _cli("submit", spec, *at))
    if resume["rc"] == 0:
        sid = json.loads(resume["out"].splitlines()[-1])["submission_id"]
        _emit("follow", _cli("logs", sid, "--address", jobs, "--follow"))


def _drive_pg(url: str, after: str | None) -> None:
    if after:
        _wait_for_a_collect(after)
    _emit("outcome", run_tiny_sweep(url, **PG_OVERRIDES))


class TroubledFitter:
    """A real fitter (mixed into ``workers.actors._UnitActor``) whose process misbehaves by method: ``oracle``: the
    worker process dies in the middle of the unit, every time; ``threshold``: the store refuses the unit's rows
    (``finish_unit`` raises); ``static``: the store refuses every write of this worker, the failure record
    included."""
    role = "fitter"

    def run(self, task: dict) -> dict:
        from db import queries as q

        method = task["config"].get("method")
        if method == "oracle":         # dies inside the unit, after marking it running
            self._setup().run = lambda *a, **k: os._exit(1)
        saved = q.finish_unit, q.fail_unit
        if method in ("threshold", "static"):
            q.finish_unit = _unwritable
        if method == "static":
            q.fail_unit = _unwritable
        try:
            return super().run(task)
        finally:
            q.finish_unit, q.fail_unit = saved


def _unwritable(*args, **kwargs):
    from sqlalchemy.exc import OperationalError

    raise OperationalError("UPDATE work_units SET status=?", None, sqlite3.OperationalError(READONLY))


def _drive_troubled(url: str) -> None:
    """TROUBLED_SPEC with the troubled fitter, in a thread: a driver that hangs ends this process (exit 3)."""
    import threading

    import ray

    from orchestrator.driver import run_sweep
    from orchestrator.spec import parse_spec
    from workers import actors

    actors.ROLE_CLASSES["fit"] = ray.remote(num_cpus=1, max_restarts=4, max_task_retries=0)(
        type("TroubledFitter", (TroubledFitter, actors._UnitActor), {}))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=run_sweep(parse_spec(TROUBLED_SPEC), url, heartbeat_s=10)),
                         daemon=True)
    t.start()
    t.join(timeout=TROUBLED_HANG_S)
    if t.is_alive():
        print(f"the driver hung: not done after {TROUBLED_HANG_S} s", flush=True)
        os._exit(3)
    _emit("outcome", result["out"])


def _main(argv: list[str]) -> None:
    import argparse
    import logging

    import ray

    ap = argparse.ArgumentParser(prog="python -m tests.sweep_support")
    ap.add_argument("kind", choices=("shared", "pg", "troubled"))
    ap.add_argument("address", help="the Ray cluster (GCS address)")
    ap.add_argument("url", help="the store")
    ap.add_argument("--jobs", help="shared: the cluster's job API")
    ap.add_argument("--after", help="pg: a SQLite store whose collect unit to wait for")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    if args.kind == "shared":
        _drive_shared(args.url, args.jobs)
    elif args.kind == "pg":
        _drive_pg(args.url, args.after)
    else:
        _drive_troubled(args.url)


if __name__ == "__main__":
    import sys

    from tests.sweep_support import _main as main   # this module by its name: Ray pickles its classes by reference

    main(sys.argv[1:])
