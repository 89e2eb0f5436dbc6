"""Torch's thread count is part of every fit / eval / latency unit: rows measured under different counts never mix."""
from __future__ import annotations

import torch

from orchestrator.plan import plan_units, torch_threads
from orchestrator.spec import parse_spec

SPEC = {"name": "t", "models": ["smollm2-135m"], "methods": [{"name": "oracle", "sparsity": [0.5]}],
        "suites": {"tasks": [{"name": "piqa", "limit": 10}]}}
DESCRIBED = {"smollm2-135m": {"fingerprint": "fp", "calib_fp": "c", "heldout_fp": "h"}}


def _plan(**resources):
    return plan_units(parse_spec({**SPEC, "resources": resources}), DESCRIBED)


def test_thread_count_comes_from_the_spec():
    assert torch_threads(parse_spec(SPEC)) == 1                                   # one CPU per actor
    assert torch_threads(parse_spec({**SPEC, "resources": {"cpus_per_actor": 3.5}})) == 3
    assert torch_threads(parse_spec({**SPEC, "resources": {"cpus_per_actor": 0.5}})) == 1
    assert torch_threads(parse_spec({**SPEC, "resources": {"torch_threads": 4}})) == 4


def test_different_thread_counts_give_different_units():
    one, two = _plan(torch_threads=1), _plan(torch_threads=2)
    assert [u.kind for u in one] == [u.kind for u in two]
    assert {u.kind for u in one} == {"collect", "fit", "eval", "latency"}
    for a, b in zip(one, two):
        if a.kind == "collect":            # activations do not depend on the workers' thread count
            assert a.id == b.id and "threads" not in a.config
        else:
            assert a.config["threads"] == 1 and b.config["threads"] == 2 and a.id != b.id
    assert [u.id for u in _plan(torch_threads=1)] == [u.id for u in one]      # and stable


def test_the_worker_applies_the_configured_count():
    from workers.units import Units

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        out = Units().run("fit", "0" * 40, {"model": "shape:llama2-7b", "method": "dense", "threads": want})
        assert torch.get_num_threads() == want and out.summary == {"random_predictors": False}
    finally:
        torch.set_num_threads(before)


def test_evaluation_on_an_accelerator_runs_on_it_with_larger_batches():
    cpu, gpu = _plan(), _plan(accelerator="cuda")
    ev = {u.config["suite"]: u for u in cpu if u.kind == "eval" and u.method == "oracle"}
    ev_gpu = {u.config["suite"]: u for u in gpu if u.kind == "eval" and u.method == "oracle"}
    assert set(ev) == set(ev_gpu) == {"perplexity", "piqa"}
    assert ev["piqa"].config["exec_mode"] == "masked" and "batch_size" not in ev["piqa"].config
    assert ev_gpu["piqa"].config["exec_mode"] == "masked" and ev_gpu["piqa"].config["batch_size"] == 32
    assert ev_gpu["piqa"].device_type == "cuda" and ev_gpu["piqa"].id != ev["piqa"].id
    assert "batch_size" not in ev_gpu["perplexity"].config      # one window per forward on every device


def test_every_config_field_is_part_of_the_unit_id():
    """A unit's id is the hash of its kind and its whole config: changing any one field (a fingerprint, the data,
    the method's options, a task's limit, the thread count, the latency point, ...) gives another id, so rows of
    different work never share one; the same config always gives the same id."""
    from orchestrator.plan import unit_id

    spec = parse_spec({**SPEC, "methods": [{"name": "svd", "sparsity": [0.5], "rank": [8],
                                            "options": {"target": "gate"}}],
                       "latency": {"devices": ["cpu"], "prompt_len": [16], "gen_len": 4, "repeats": 1}})
    fields = set()
    for u in plan_units(spec, DESCRIBED):
        assert u.id == unit_id(u.kind, dict(u.config)) != unit_id("other", u.config)
        for key, value in u.config.items():
            assert unit_id(u.kind, {**u.config, key: ["changed", value]}) != u.id, (u.label, key)
            fields.add((u.kind, key))
    assert {("collect", "model_fp"), ("collect", "calib_fp"), ("collect", "data"), ("fit", "options"),
            ("fit", "rank"), ("fit", "sparsity"), ("fit", "threads"), ("eval", "limit"), ("eval", "fit_unit"),
            ("eval", "heldout_fp"), ("eval", "exec_mode"), ("latency", "prompt_len"), ("latency", "paired"),
            ("latency", "runtime")} <= fields
