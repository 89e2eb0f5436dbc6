"""The eval unit's task rows (``workers.units.task_rows``): each labelled by its task's kind, MMLU's subjects as
rows of their own, written into a throwaway SQLite store and read back the way the dashboard reads settings
(``db.front.settings.settings_for_model``): the mean task accuracy averages single multiple-choice tasks only."""
from __future__ import annotations

import pytest

from db import queries as q
from db.engine import get_engine, session_scope, upgrade
from db.front.settings import MEAN_TASKS, settings_for_model
from tests.unit_configs import eval_config, fit_config
from workers.evals.suites import SuiteResult
from workers.evals.tasks import task_kind
from workers.units import task_rows

PROV = {"package_versions": {"x": "1"}, "git_rev": "r"}
FIT, EVAL = "f1" * 8, "e1" * 8                      # unit ids (hex)


def _result(task: str, metric: str, value: float, n: int = 100, *, hib: bool = True, subtasks: tuple = (),
            output_type: str | None = None, group: bool = False) -> SuiteResult:
    return SuiteResult(task=task, lm_eval_task=task, kind=task_kind(task, output_type, group), metric=metric,
                       higher_is_better=hib, value=value, stderr=0.01, n=n, n_total=n, split="test",
                       task_version="1.0", suite_version=1, lm_eval_version="0", data_fingerprint="d",
                       items_fingerprint="i", comparable_with_published=True, subtasks=subtasks)


# (lm-eval subtask, n, value, stderr) of two MMLU subjects; the mmlu row is their micro average
SUBJECTS = (("mmlu_anatomy", 135, 0.30, 0.04), ("mmlu_astronomy", 152, 0.20, 0.03))
MMLU_ACC = (135 * 0.30 + 152 * 0.20) / 287
RESULTS = [
    _result("piqa", "acc", 0.60), _result("piqa", "acc_norm", 0.64), _result("copa", "acc", 0.70),
    _result("lambada_openai", "acc", 0.30), _result("lambada_openai", "perplexity", 40.0, hib=False),
    _result("gsm8k_cot", "exact_match,strict-match", 0.10), _result("gsm8k_cot", "exact_match,flexible-extract", 0.15),
    _result("mmlu", "acc", MMLU_ACC, 287, subtasks=SUBJECTS),
    _result("lm_eval:hellaswag", "acc", 0.50, output_type="multiple_choice"),
    # an lm_eval:GROUP: its members' rows and its own (whose subtasks are those members: not expanded again)
    _result("lm_eval:grp/grp_a", "acc", 0.90, output_type="multiple_choice", group=True),
    _result("lm_eval:grp/grp_b", "acc", 0.80, output_type="multiple_choice", group=True),
    _result("lm_eval:grp", "acc", 0.85, 200, group=True,
            subtasks=(("grp_a", 100, 0.90, 0.01), ("grp_b", 100, 0.80, 0.01))),
]


def test_task_rows_are_labelled_by_kind_with_mmlu_subjects():
    rows = task_rows(RESULTS)
    keys = [(r["suite"], r["task"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(RESULTS) + 2
    assert {k[0] for k in keys} == {"mc", "lambada", "gen", "mmlu", "group"}
    assert [k for k in keys if k[0] == "mc"] == [("mc", "piqa", "acc"), ("mc", "piqa", "acc_norm"),
                                                ("mc", "copa", "acc"), ("mc", "lm_eval:hellaswag", "acc")]
    subjects = [r for r in rows if r["task"].startswith("mmlu/")]
    assert [(r["suite"], r["task"], r["metric"], r["n"], r["value"], r["stderr"]) for r in subjects] == [
        ("mmlu", "mmlu/mmlu_anatomy", "acc", 135, 0.30, 0.04), ("mmlu", "mmlu/mmlu_astronomy", "acc", 152, 0.20, 0.03)]
    assert all(r["higher_is_better"] for r in subjects)


def test_the_mean_task_accuracy_averages_multiple_choice_tasks_only(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = get_engine(url)
    upgrade(engine)
    with session_scope(engine) as s:
        mid = q.upsert_model(s, name="tiny", fingerprint="f" * 64, family="llama")
        sid, _ = q.get_or_create_sweep(s, name="t", spec_hash="a" * 64, spec={})
        common = dict(model_id=mid, method="dense", sparsity=0.0, code_version="t")
        q.register_units(s, sid, [dict(id=FIT, kind="fit", config=fit_config(), **common),
                                  dict(id=EVAL, kind="eval", config=eval_config(FIT, "x"), **common)])
        q.finish_unit(s, FIT)
        q.finish_unit(s, EVAL, accuracy_rows=[{**r, **PROV} for r in task_rows(RESULTS)])
    with session_scope(get_engine(url, read_only=True)) as s:
        (st,) = settings_for_model(s, mid)
    engine.dispose()
    # piqa, copa, lm_eval:hellaswag; not LAMBADA's acc, MMLU, its subjects, nor the rows of an lm-eval group
    assert st.accuracy[MEAN_TASKS] == pytest.approx((0.60 + 0.70 + 0.50) / 3)
    assert st.accuracy["mmlu/mmlu/acc"] == pytest.approx(MMLU_ACC)
    assert st.accuracy["mmlu/mmlu/mmlu_anatomy/acc"] == 0.30
    assert st.accuracy["lambada/lambada_openai/perplexity"] == 40.0
    assert st.higher_is_better["lambada/lambada_openai/perplexity"] is False
    assert len(st.accuracy) == len(RESULTS) + 2 + 1                  # every row, and the mean
