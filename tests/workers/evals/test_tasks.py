"""The task registry's kinds: the ``suite`` label of each task's accuracy rows (what the mean task accuracy
``mc/mean/acc`` averages is the ``mc`` rows only). Registry loading and templates: tests/workers/evals/test_suites.py."""
from __future__ import annotations

import pytest

from workers.evals.tasks import SUITES, SuiteError, task_kind


def test_each_packaged_task_has_its_kind():
    assert {name: task_kind(name) for name in SUITES} == {
        "piqa": "mc", "arc_easy": "mc", "arc_challenge": "mc", "copa": "mc", "hellaswag": "mc", "winogrande": "mc",
        "boolq": "mc", "openbookqa": "mc", "sciq": "mc", "social_iqa": "mc",
        "mmlu": "mmlu", "lambada_openai": "lambada", "gsm8k_cot": "gen"}
    for spec in SUITES.values():        # "mc" is exactly the single multiple-choice tasks
        single_mc = spec.output_type == "multiple_choice" and spec.members_of is None
        assert (spec.kind == "mc") == single_mc, spec.name


def test_lm_eval_and_yaml_tasks_take_their_kind_from_the_output_type():
    assert task_kind("lm_eval:hellaswag", "multiple_choice") == "mc"
    assert task_kind("lm_eval:lambada_standard", "loglikelihood") == "loglik"
    assert task_kind("lm_eval:wikitext", "loglikelihood_rolling") == "ppl"
    assert task_kind("yaml:local.yaml", "generate_until") == "gen"
    assert task_kind("yaml:local.yaml", "multiple_choice") == "mc"
    # an lm-eval group's rows (its members' and its own) are not single tasks, whatever they score
    assert task_kind("lm_eval:mmlu_stem/mmlu_anatomy", "multiple_choice", group=True) == "group"
    assert task_kind("lm_eval:mmlu_stem", group=True) == "group"
    assert task_kind("mmlu", "multiple_choice", group=True) == "mmlu"       # a packaged task keeps its own
    with pytest.raises(SuiteError, match="output type"):
        task_kind("lm_eval:hellaswag")
