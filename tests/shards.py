"""The default suite as two pytest runs side by side, one per core of the 2-core CI (``make test``).

One pytest process computes on one core; the service tests (Ray sweeps in the background, PostgreSQL, the
dashboard) keep a second core busy only while their sweeps run. Two shards, started together, keep both busy:

* ``service``: the tests of the Ray cluster, the store and the dashboard (``SERVICE``): every Ray cluster and
  PostgreSQL server of the suite starts in this shard. Most evaluation tests (tests/workers/evals) run here too:
  this shard's process mostly waits on its background sweeps; without them it ended 100 s before the other;
* ``compute``: everything else under tests/ (kernels, workers, benchmarks, docs, ...), found anew on each run so
  that a new folder is never left out.

Both shards run with ``OMP_WAIT_POLICY=PASSIVE`` (unless the caller sets it): torch's OpenMP threads otherwise
spin between parallel regions, a core each, while their process runs Python between two small ops; with two
sessions (and their Ray workers) on two cores, the spinning took the other shard's core. Measured on the 2-core
VM, two pytest runs side by side (tests/workers/decode beside tests/workers/evals and tests/workers/sparsity):
144 and 203 s by default, 97 and 149 s passive. No test times anything against a bound, so no figure moves.

Each shard is a whole pytest session (its own temporary ``CTXSPARSE_HOME``; the model cache is shared, its
conversions made once under a lock). Each shard's output is printed whole when it ends; the exit status is 0 only
when every shard passed (pytest's 5, no test collected, fails too), and the last line sums the counts.

    python -m tests.shards [PYTEST ARGS...]      # extra arguments go to both shards
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SERVICE = ("orchestrator", "dashboard", "db", "k8s", "test_session_home.py",
           *(f"workers/evals/test_{n}.py" for n in ("generation", "request_cache", "scoring", "shards")))
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")


def shards() -> dict[str, list[str]]:
    """{shard: the test paths it runs}, relative to the repository."""
    for name in SERVICE:
        if not (TESTS / name).exists():
            raise SystemExit(f"tests/shards.py names {name!r}, which is not under tests/")
    return {"service": [f"tests/{n}" for n in SERVICE], "compute": [f"tests/{n}" for n in _rest(TESTS, SERVICE)]}


def _rest(folder: Path, taken) -> list[str]:
    """The test folders and files under ``folder`` outside ``taken`` (paths relative to tests/), whole folders
    where nothing in them is taken."""
    out = []
    for p in sorted(folder.iterdir(), key=lambda p: p.name):
        rel = p.relative_to(TESTS).as_posix()
        if not ((p.is_dir() and any(p.rglob("test_*.py"))) or re.fullmatch(r"test_.*\.py", p.name)) or rel in taken:
            continue
        inside = [t for t in taken if t.startswith(rel + "/")]
        out += _rest(p, taken) if inside else [rel]
    return out


def counts(log: str) -> dict[str, int]:
    """The counts of pytest's closing line ({"passed": 1200, "failed": 0, ...}); {} where there is none."""
    lines = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|errors?|deselected)", l)
             and " in " in l]
    if not lines:
        return {}
    return {("errors" if k.startswith("error") else k): int(n) for n, k in COUNT.findall(lines[-1])}


def shard_env(environ) -> dict[str, str]:
    """The shards' environment: the caller's, OpenMP's threads sleeping between regions unless it says otherwise."""
    return {**environ, "OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def main(argv: list[str]) -> int:
    plan = shards()
    logs = Path(tempfile.mkdtemp(prefix="ctxsparse-shards-"))
    procs = {}
    env = shard_env(os.environ)
    t0 = time.time()
    for name, paths in plan.items():
        log = logs / f"{name}.log"
        print(f"shard {name}: {' '.join(paths)} (output: {log})", flush=True)
        procs[name] = (subprocess.Popen([sys.executable, "-m", "pytest", *argv, *paths], cwd=REPO,
                                        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), log)
    status, total = {}, {}
    while procs:
        for name, (p, log) in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[name]
            text = log.read_text(errors="replace")
            print(f"\n======== shard {name}: exit {p.returncode} after {time.time() - t0:.0f} s ========", flush=True)
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
            status[name] = p.returncode
            for k, v in counts(text).items():
                total[k] = total.get(k, 0) + v
        time.sleep(1)
    bad = {n: rc for n, rc in status.items() if rc != 0}
    for n, rc in bad.items():
        why = "no test collected" if rc == 5 else "tests failed" if rc == 1 else "pytest stopped"
        print(f"shard {n}: exit {rc} ({why})", flush=True)
    print(f"{time.time() - t0:.0f} s, shards {', '.join(f'{n} {rc}' for n, rc in status.items())}")
    print(f"suite: {total.get('passed', 0)} passed, {total.get('failed', 0) + total.get('errors', 0)} failed, "
          f"{total.get('skipped', 0)} skipped", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
