"""Child processes that tests wait on, each started once per session when collection ends (where a collected test
uses its fixture), so that they run beside the other tests instead of in front of them:

* ``probe`` -- the placement probe (``python -m tests.orchestrator.test_placement``: a Ray cluster of its own with
  fake GPUs and NPUs);
* ``sm90_compiled`` -- every Triton kernel of ``kernels/`` compiled for sm_90 (``python -m
  tests.kernels.sm90_compile``), without TRITON_INTERPRET and with an empty Triton cache of its own;
* ``interpreted`` -- the decode runtime's parts that run the Triton kernels in Triton's interpreter (``python -m
  tests.workers.decode.interpreted_parts``), on one thread.

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
# fixture name -> (arguments of python -m, environment changes (None: removed), a fresh Triton cache, timeout in s)
CHILDREN = {
    "probe": (["tests.orchestrator.test_placement"], {"RAY_ADDRESS": None}, False, 240),
    "sm90_compiled": (["tests.kernels.sm90_compile"], {"TRITON_INTERPRET": None}, True, 600),
    "interpreted": (["tests.workers.decode.interpreted_parts", "attention", "sparse_step", "rotated_step"],
                    {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CTXSPARSE_KERNELS": None}, False, 300),
}
_PROCS: dict[str, tuple[subprocess.Popen, str | None]] = {}


def start(name: str) -> subprocess.Popen:
    """``name``'s process, started on the first call."""
    if name not in _PROCS:
        args, changes, fresh_cache, _ = CHILDREN[name]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        for key, value in changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        cache = tempfile.mkdtemp(prefix="ctxsparse-triton-cache-") if fresh_cache else None
        if cache:
            env["TRITON_CACHE_DIR"] = cache
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
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
