"""Suite tasks in a sweep spec: packaged names offline, ``lm_eval:NAME`` against lm-eval's (cached) index,
``yaml:PATH`` local task files, ``limit: all``; an unknown name fails at validation with one line that lists the
packaged tasks and says how to name the others."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.spec import SpecError, check_inputs, parse_spec
from workers.evals import tasks as registry

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"name": "ok", "models": ["smollm2-135m"], "methods": [{"name": "svd", "sparsity": [0.5], "rank": [64]}]}


def _tasks(*tasks) -> dict:
    return {**GOOD, "suites": {"tasks": list(tasks)}}


def _error(data) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return str(e.value)


def test_unknown_task_fails_with_the_packaged_list_and_the_naming_rule():
    msg = _error(_tasks({"name": "mmlu-pro"}))
    (line,) = [ln for ln in msg.splitlines() if "suites.tasks.0.name" in ln]          # one line for the field
    assert "unknown task 'mmlu-pro'" in line
    for name in ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa", "sciq",
                 "copa", "social_iqa", "mmlu", "lambada_openai", "gsm8k_cot"):
        assert name in line
    assert "'lm_eval:NAME'" in line and "'yaml:PATH.yaml'" in line


def test_packaged_names_validate_without_lm_eval():
    """Packaged names need no lm-eval index (and so no network): lm_eval is not even imported."""
    code = ("import sys; from orchestrator.spec import parse_spec; "
            f"s = parse_spec({_tasks({'name': 'mmlu', 'limit': None}, {'name': 'gsm8k_cot', 'limit': 4})!r}); "
            "print(s.suites.tasks[0].name, 'lm_eval' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["mmlu", "False"]


def test_limit_all_is_null():
    a = parse_spec(_tasks({"name": "piqa", "limit": "all"}))
    b = parse_spec(_tasks({"name": "piqa", "limit": None}))
    assert a.suites.tasks[0].limit is None and a.spec_hash() == b.spec_hash()
    assert parse_spec(_tasks({"name": "piqa"})).suites.tasks[0].limit == 100          # the default
    assert "suites.tasks.0.limit" in _error(_tasks({"name": "piqa", "limit": "everything"}))


@pytest.mark.slow       # indexing every YAML of lm-eval (the first check of a session: ~10-20 s on 2 cores)
def test_lm_eval_names_are_checked_against_its_cached_index():
    registry.lm_eval_task_names.cache_clear()
    t0 = time.time()
    spec = parse_spec(_tasks({"name": "lm_eval:hellaswag"}, {"name": "lm_eval:mmlu_anatomy", "limit": 5}))
    first = time.time() - t0
    assert [t.name for t in spec.suites.tasks] == ["lm_eval:hellaswag", "lm_eval:mmlu_anatomy"]
    assert registry._index_cache_file().is_file()
    registry.lm_eval_task_names.cache_clear()           # a new process: reads the cached index, indexes nothing
    t0 = time.time()
    msg = _error(_tasks({"name": "lm_eval:no_such_task_xyz"}))
    again = time.time() - t0
    assert "lm-eval has no task 'no_such_task_xyz'" in msg and "'lm_eval:NAME'" in msg
    assert again < 2.0, (first, again)
    assert "needs a task name" in _error(_tasks({"name": "lm_eval:"}))


def test_yaml_tasks_are_checked_before_a_job_exists(tmp_path):
    assert "ending in .yaml" in _error(_tasks({"name": "yaml:task.txt"}))
    missing = parse_spec(_tasks({"name": f"yaml:{tmp_path / 'nope.yaml'}"}))        # may exist on the cluster
    with pytest.raises(SpecError, match=r"suites.tasks.0.name: task file not found"):
        check_inputs(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\noutput_type: multiple_choice\n")
    with pytest.raises(SpecError, match=r"needs 'task: NAME'"):
        check_inputs(parse_spec(_tasks({"name": f"yaml:{bad}"})))
    good = tmp_path / "good.yaml"
    good.write_text("task: tiny\ndataset_path: json\noutput_type: multiple_choice\n")
    check_inputs(parse_spec(_tasks({"name": f"yaml:{good}"})))
