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
