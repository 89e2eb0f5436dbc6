"""Child processes that tests wait on, each started once per session when collection ends (where a collected test
uses its fixture), so that they run beside the other tests instead of in front of them:

* ``probe`` -- the placement probe (``python -m tests.orchestrator.test_placement``: a Ray cluster of its own with
  fake GPUs and NPUs);
* ``sm90_compiled`` -- every Triton kernel of ``kernels/`` compiled for sm_90 (``python -m
  tests.kernels.sm90_compile``), without TRITON_INTERPRET and with an empty Triton cache of its own.

``output(name)`` waits for one's standard output; AssertionError with its stderr's end if it failed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# fixture name -> (module run with -m, environment variables to drop, a fresh Triton cache, timeout in seconds)
CHILDREN = {
    "probe": ("tests.orchestrator.test_placement", ("RAY_ADDRESS",), False, 240),
    "sm90_compiled": ("tests.kernels.sm90_compile", ("TRITON_INTERPRET",), True, 600),
}
_PROCS: dict[str, tuple[subprocess.Popen, str | None]] = {}


def start(name: str) -> subprocess.Popen:
    """``name``'s process, started on the first call."""
    if name not in _PROCS:
        module, drop, fresh_cache, _ = CHILDREN[name]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        for key in drop:
            env.pop(key, None)
        cache = tempfile.mkdtemp(prefix="ctxsparse-triton-cache-") if fresh_cache else None
        if cache:
            env["TRITON_CACHE_DIR"] = cache
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _PROCS[name] = (proc, cache)
    return _PROCS[name][0]


def output(name: str) -> str:
    proc = start(name)
    try:
        out, err = proc.communicate(timeout=CHILDREN[name][3])
    finally:
        _clean(name)
    assert proc.returncode == 0, err[-3000:]
    return out


def _clean(name: str) -> None:
    cache = _PROCS[name][1]
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def stop() -> None:
    """End the children still running (a session cut short)."""
    for name, (proc, _) in _PROCS.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _clean(name)
