"""The placement probe (``python -m tests.orchestrator.test_placement``: a Ray cluster of its own with fake GPUs and
NPUs, in a child process) started once per session, when collection ends, so that its cluster starts and its
actors spawn beside the other tests instead of in front of them; ``result`` waits for its answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
_PROC: subprocess.Popen | None = None


def start() -> subprocess.Popen:
    """The probe's process, started on the first call."""
    global _PROC
    if _PROC is None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        env.pop("RAY_ADDRESS", None)
        _PROC = subprocess.Popen([sys.executable, "-m", "tests.orchestrator.test_placement"], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _PROC


def result() -> dict:
    """The probe's answer (its last line of output, JSON); AssertionError with its stderr's end if it failed."""
    proc = start()
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def stop() -> None:
    """End a probe still running (a session cut short)."""
    if _PROC is not None and _PROC.poll() is None:
        _PROC.kill()
        _PROC.wait()
