"""A real, small sweep on SmolLM2 (shared by the orchestrator and dashboard tests).

``TINY_SPEC`` is kept small enough for the 2-core CI: two sparsity methods plus dense, calibration on one window
of 256 tokens, perplexity on one 256-token held-out window and 4 COPA items, CPU latency of 4 decode tokens.
Most of a tiny sweep's time on a 2-core CPU is its actors starting (each imports torch and transformers and loads
the model: ~10 s), not its units; so the default test suite runs one sweep (``SHARED_*`` below, the session
fixture ``tiny_sweep`` in tests/conftest.py) and every test that only reads a sweep's store reads that one.
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
PERPLEXITY_METRICS = ("ppl", "nll", "mlp_sparsity", "head_sparsity", "input_sparsity", "weight_skipped")

# The session's shared sweep (run in the background: SharedSweep below): TINY_SPEC's ``threshold`` (fitted on
# calibration data: a real fit; ``oracle`` too would add two eval units and a latency unit to the evaluator's
# serial path) plus a setting whose fit raises (``threshold`` given an option it does not take), latency asked
# for on ``cpu`` and on ``cuda`` (which the CPU test cluster lacks), and half a CPU per actor (the 2-CPU test
# cluster then holds collector, fitter, evaluator and bencher at once). One run gives: every unit done with its
# rows exactly once, the failing fit recorded with its error and its dependants failed with the reason, and the
# cuda latency units left pending (no cuda rows invented). Latency is not timed alone (``exclusive: false``): the
# bencher starts while the evaluator works, ~30 s less on 2 cores; no test here reads the timings' values.
# a value only the fit can refuse (an unknown option name is refused at submit)
FAILING_METHOD = {"name": "svd", "sparsity": [0.5], "options": {"target": "no_such_target"}}
FAILING_ERROR = "target must be one of"
SHARED_METHOD = {"name": "threshold", "sparsity": [0.5]}
assert SHARED_METHOD in TINY_SPEC["methods"]
SHARED_OVERRIDES = {
    "methods": [SHARED_METHOD, FAILING_METHOD],
    "latency": {**TINY_SPEC["latency"], "devices": ["cpu", "cuda"], "exclusive": False},
    "resources": {**TINY_SPEC["resources"], "cpus_per_actor": 0.5},
}


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


@dataclass(frozen=True)
class TinySweep:
    url: str             # SQLAlchemy URL of the store (SQLite) holding this one sweep
    outcome: object      # orchestrator.driver.SweepOutcome
    home: Path           # CTXSPARSE_HOME of the sweep (its bundles)
    seconds: float
    resubmitted_url: str     # a copy of the store made right after the sweep, the same spec then submitted again
    resubmitted: object      # that second run's SweepOutcome


class SharedSweep:
    """The session's one tiny sweep (``SHARED_OVERRIDES``), run by a driver process of its own on the session's
    Ray cluster (``python -m tests.sweep_support ADDRESS URL``) while other tests run: on 2 cores most of a tiny
    sweep is single-threaded (an actor starting, one unit at a time), so the rest of the suite fills the other
    core. Its store is fresh, under ``root``; its CTXSPARSE_HOME is its own (a test may damage one of its bundle
    files, then restores it), given in the driver's environment, never by changing this process's. Then, still in
    the background, the same spec is submitted again on a copy of the store (``resubmitted``: what a resume does).
    The driver's log (the sweeps' progress, any traceback) is ``root / "driver.log"``."""

    def __init__(self, root: Path, address: str):
        import subprocess
        import sys
        import time

        self.root, self.home = root, private_home(root)
        self.url = f"sqlite:///{root / 'store.db'}"
        self.log = root / "driver.log"
        env = {**os.environ, "CTXSPARSE_HOME": str(self.home), "PYTHONPATH": str(REPO)}
        self.t0 = time.time()
        with self.log.open("w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.sweep_support", address, self.url], cwd=REPO,
                                         env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._result: TinySweep | None = None

    def result(self, timeout: float) -> TinySweep:
        """Wait for the sweep (at most ``timeout`` s); its outcome, or RuntimeError with the driver's log tail."""
        import json
        import subprocess
        import time

        from orchestrator.driver import SweepOutcome

        if self._result is None:
            try:
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise RuntimeError(f"the shared tiny sweep did not finish in {timeout:.0f} s; "
                                   f"log {self.log}:\n{self._tail()}") from None
            seconds = time.time() - self.t0
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith(OUTCOME)]
            if rc != 0 or len(lines) != 2:
                raise RuntimeError(f"the shared tiny sweep's driver exited with {rc}; log {self.log}:\n{self._tail()}")
            first, again = (SweepOutcome(**json.loads(ln[len(OUTCOME):])) for ln in lines)
            self._result = TinySweep(self.url, first, self.home, seconds, resubmitted_url(self.url), again)
        return self._result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


REPO = Path(__file__).resolve().parents[1]
OUTCOME = "SHARED-SWEEP-OUTCOME "


def resubmitted_url(url: str) -> str:
    return f"sqlite:///{Path(url.removeprefix('sqlite:///')).with_name('resubmitted.db')}"


def _drive(address: str, url: str) -> None:
    """The shared sweep's driver process: join the session's Ray cluster, run the sweep, print its outcome; copy
    the store, submit the same spec again on the copy, print that outcome."""
    import json
    import logging
    from dataclasses import asdict

    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    outcome = run_tiny_sweep(url, **SHARED_OVERRIDES)
    print(OUTCOME + json.dumps(asdict(outcome)), flush=True)
    again_url = resubmitted_url(url)
    copy_store(url, Path(again_url.removeprefix("sqlite:///")))
    again = run_tiny_sweep(again_url, **SHARED_OVERRIDES)
    print(OUTCOME + json.dumps(asdict(again)), flush=True)


if __name__ == "__main__":
    import sys

    _drive(*sys.argv[1:3])
