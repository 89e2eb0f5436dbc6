"""``make test``'s two shards (tests/shards.py): together they run every test file once, and their closing lines
add up."""
from __future__ import annotations

import re
from pathlib import Path

from tests import shards
from tests.conftest import READERS

TESTS = Path(__file__).resolve().parent


def _files(paths) -> list[Path]:
    out = []
    for p in paths:
        p = TESTS.parent / p
        out += [p] if p.is_file() else sorted(p.rglob("test_*.py"))
    return out


def test_the_shards_run_every_test_file_once():
    plan = shards.shards()
    assert set(plan) == {"service", "compute"}
    every = sorted(TESTS.rglob("test_*.py"))
    ran = _files(plan["service"]) + _files(plan["compute"])
    assert sorted(ran) == every and len(set(ran)) == len(ran)
    # every Ray cluster and PostgreSQL server starts in the service shard
    service = re.compile(r"\b(ray_local|ray_job_address|pg_cluster|%s)\b" % "|".join(READERS))
    uses_service = {f for f in every if f != Path(__file__) and service.search(f.read_text())}
    assert uses_service and uses_service <= set(_files(plan["service"]))


def test_closing_lines_add_up():
    assert shards.counts("...\n=== 2 failed, 1604 passed, 3 skipped, 1057 deselected, 1 error in 886.54s ===\n") == \
        {"failed": 2, "passed": 1604, "skipped": 3, "deselected": 1057, "errors": 1}
    assert shards.counts("1 passed in 0.1s\n") == {"passed": 1}
    assert shards.counts("no tests ran in 0.01s\n") == {}


def test_the_shards_run_with_openmp_threads_that_sleep_unless_told_otherwise():
    assert shards.shard_env({"HOME": "/h"}) == {"HOME": "/h", "OMP_WAIT_POLICY": "PASSIVE"}
    assert shards.shard_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
