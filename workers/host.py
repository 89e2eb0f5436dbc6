"""What this host gives a process (stdlib only: the orchestrator and the CLI import it without torch)."""
from __future__ import annotations

import os


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one (a container's or a Ray
    worker's CPU set), else every core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:           # no affinity call (macOS)
        return max(1, os.cpu_count() or 1)
