"""Torch's thread count is part of every fit / eval / latency unit: rows measured under different counts never mix."""
from __future__ import annotations

import pytest
import torch

from db.units import FitConfig, unit_id
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
            assert a.id == b.id and "threads" not in a.config.canonical()
        else:
            assert a.config.threads == 1 and b.config.threads == 2 and a.id != b.id
    assert [u.id for u in _plan(torch_threads=1)] == [u.id for u in one]      # and stable


def test_the_worker_applies_the_configured_count():
    from workers.units import Units

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        cfg = FitConfig(model="shape:llama2-7b", model_fp="fp", method="dense", sparsity=0.0, threads=want)
        out = Units().run("fit", "0" * 40, cfg)
        assert torch.get_num_threads() == want and out.summary == {"random_predictors": False}
    finally:
        torch.set_num_threads(before)


def test_evaluation_on_an_accelerator_runs_on_it_with_larger_batches():
    cpu, gpu = _plan(), _plan(accelerator="cuda")
    ev = {u.config.suite: u for u in cpu if u.kind == "eval" and u.method == "oracle"}
    ev_gpu = {u.config.suite: u for u in gpu if u.kind == "eval" and u.method == "oracle"}
    assert set(ev) == set(ev_gpu) == {"perplexity", "piqa"}
    assert ev["piqa"].config.exec_mode == "masked" and ev["piqa"].config.batch_size is None
    assert ev["piqa"].config.batch_tokens is None
    assert not {"batch_size", "batch_tokens"} & set(ev["piqa"].config.canonical())     # the CPU units' ids held
    assert ev_gpu["piqa"].config.exec_mode == "masked" and ev_gpu["piqa"].config.batch_size == 64
    assert ev_gpu["piqa"].config.batch_tokens == 32768
    assert ev_gpu["piqa"].device_type == "cuda" and ev_gpu["piqa"].id != ev["piqa"].id
    # one window per forward on every device
    assert not {"batch_size", "batch_tokens"} & set(ev_gpu["perplexity"].config.canonical())


def test_every_config_field_is_part_of_the_unit_id():
    """A unit's id is the hash of its kind and its whole config: changing any one field (a fingerprint, the data,
    the method's options, a task's limit, the thread count, the latency point, ...) gives another id, so rows of
    different work never share one; the same config always gives the same id."""
    from orchestrator.plan import CODE_VERSION

    spec = parse_spec({**SPEC, "methods": [{"name": "svd", "sparsity": [0.5], "rank": [8],
                                            "options": {"target": "gate"}}],
                       "latency": {"devices": ["cpu"], "prompt_len": [16], "gen_len": 4, "repeats": 1}})
    fields = set()
    for u in plan_units(spec, DESCRIBED):
        cfg = u.config.canonical()
        assert not u.config.model_extra                             # every key the plan writes is a typed field
        assert u.id == u.config.unit_id(CODE_VERSION) == unit_id(u.kind, cfg, CODE_VERSION) != \
            unit_id("other", cfg, CODE_VERSION)
        for key, value in cfg.items():
            assert unit_id(u.kind, {**cfg, key: ["changed", value]}, CODE_VERSION) != u.id, (u.label, key)
            fields.add((u.kind, key))
    assert {("collect", "model_fp"), ("collect", "calib_fp"), ("collect", "data"), ("fit", "options"),
            ("fit", "rank"), ("fit", "sparsity"), ("fit", "threads"), ("eval", "limit"), ("eval", "fit_unit"),
            ("eval", "heldout_fp"), ("eval", "exec_mode"), ("latency", "prompt_len"), ("latency", "paired"),
            ("latency", "runtime")} <= fields


LATENCY = {"devices": ["cpu", "cuda"], "prompt_len": [16, 32], "gen_len": 4, "repeats": 1}


def _latency_plan(cpu_cores, described=DESCRIBED, **resources):
    spec = parse_spec({**SPEC, "latency": LATENCY, "resources": resources})
    return plan_units(spec, described, cpu_cores=cpu_cores)


def test_cpu_latency_defaults_to_every_core_and_torch_threads_overrides():
    """CPU latency units run at every core of a node unless the spec sets torch_threads; fit / eval units and GPU
    latency units keep the actor's count. The count is in the config, so CPU latency under another core count is
    another unit, while every other unit keeps its id (a sweep stored before resumes with only its CPU latency
    units to run)."""
    from orchestrator.plan import latency_threads

    four, two = _latency_plan(4), _latency_plan(2)
    assert [u.kind for u in four] == [u.kind for u in two]
    for a, b in zip(four, two):
        cpu_latency = a.kind == "latency" and a.device_type == "cpu"
        if cpu_latency:
            assert (a.config.threads, b.config.threads) == (4, 2) and a.id != b.id
        else:
            assert a.id == b.id and (a.kind == "collect" or a.config.threads == 1)      # one CPU per actor
    assert {u.device_type for u in four if u.kind == "latency"} == {"cpu", "cuda"}
    for u in _latency_plan(4, torch_threads=3):                              # the spec's count wins everywhere
        assert u.kind == "collect" or u.config.threads == 3
    spec = parse_spec(SPEC)
    assert latency_threads(spec, "cpu", 16) == 16 and latency_threads(spec, "cuda", 16) == 1
    assert latency_threads(parse_spec({**SPEC, "resources": {"torch_threads": 2}}), "cpu", 16) == 2


def test_cpu_latency_without_a_count_uses_this_process_cores():
    from workers.host import available_cores

    lat = [u for u in _latency_plan(None) if u.kind == "latency" and u.device_type == "cpu"]
    assert lat and {u.config.threads for u in lat} == {available_cores()}


GGUF = {"smollm2-135m": {**DESCRIBED["smollm2-135m"], "gguf": True}}


def _llama_units(units):
    return [u for u in units if u.kind == "latency" and u.config.runtime == "llama.cpp"]


def test_llama_cpp_row_is_planned_when_the_package_imports_else_the_plan_says_why(caplog):
    """With llama-cpp-python importable here (``make llama-cpp``) the dense setting of a GGUF model gets one
    llama.cpp unit per CPU prompt length, at the CPU latency's thread count; without it none, and one warning says
    why and how to get it. A model not loaded from a GGUF never gets one, and no warning."""
    from workers.decode.llama_cpp import llama_cpp_missing

    why = llama_cpp_missing()
    with caplog.at_level("WARNING", logger="ctxsparse.plan"):
        units = _latency_plan(2, GGUF)
    warned = [r.getMessage() for r in caplog.records if "llama.cpp" in r.getMessage()]
    llama = _llama_units(units)
    if why is None:
        dense_fit = next(u.id for u in units if u.kind == "fit" and u.method == "dense")
        assert warned == [] and len(llama) == len(LATENCY["prompt_len"])
        assert {(u.device_type, u.config.fit_unit, u.config.batch, u.config.threads) for u in llama} == \
            {("cpu", dense_fit, 1, 2)}
        assert sorted(u.config.prompt_len for u in llama) == LATENCY["prompt_len"]
        assert len({u.id for u in llama}) == len(llama)
    else:
        assert llama == [] and len(warned) == 1 and "make llama-cpp" in warned[0], warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="ctxsparse.plan"):
        assert _llama_units(_latency_plan(2)) == []               # no GGUF: nothing for llama.cpp to run
    assert not [r for r in caplog.records if "llama.cpp" in r.getMessage()]


def test_llama_cpp_row_is_absent_and_explained_where_the_package_does_not_import(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)           # `import llama_cpp` raises ImportError
    with caplog.at_level("WARNING", logger="ctxsparse.plan"):
        units = _latency_plan(2, GGUF)
    assert _llama_units(units) == []
    warned = [r.getMessage() for r in caplog.records if "llama.cpp" in r.getMessage()]
    assert warned == ["no llama.cpp baseline row on the CPU front: llama-cpp-python is not installed: "
                      "`make llama-cpp` builds it (llama-cpp-python, about 6 minutes)"]
    # the rest of the plan is the same as with the package
    import orchestrator.plan as plan_mod

    monkeypatch.setattr(plan_mod, "llama_cpp_plan", lambda spec, described: (True, None))
    with_package = _latency_plan(2, GGUF)
    assert _llama_units(with_package)
    assert [u.id for u in units] == [u.id for u in with_package if u not in _llama_units(with_package)]


def test_cpu_latency_of_a_gguf_model_decodes_its_quantized_blocks():
    """``latency.cpu_weights``: "auto" (default) times our CPU runtime (and llama.cpp's paired dense) on the GGUF's
    blocks for a model loaded from a GGUF (config ``weights: gguf``), never HF generate or a GPU unit, and nothing
    changes for a model without a GGUF; "float" keeps the float weights (the ids of before); "gguf" on a model
    without one is an error saying what to give; the default stays out of the spec's hash."""
    gguf = _latency_plan(2, GGUF)
    lat = [u for u in gguf if u.kind == "latency"]
    quant = [u for u in lat if u.config.weights == "gguf"]
    assert quant and all(u.config.device_type == "cpu" and u.config.runtime != "hf-generate" for u in quant)
    assert all(u.config.runtime == "hf-generate" or u.config.device_type != "cpu" for u in lat if u not in quant)
    assert all("weights" not in u.config.canonical() for u in _latency_plan(2))
    spec = parse_spec({**SPEC, "latency": {**LATENCY, "cpu_weights": "float"}})
    floats = plan_units(spec, GGUF, cpu_cores=2)
    assert all("weights" not in u.config.canonical() for u in floats)
    assert [u.id for u in floats if u not in _llama_units(floats)] == [u.id for u in _latency_plan(2)]
    with pytest.raises(ValueError, match="cpu_weights is 'gguf' but model smollm2-135m was not loaded from a GGUF"):
        plan_units(parse_spec({**SPEC, "latency": {**LATENCY, "cpu_weights": "gguf"}}), DESCRIBED, cpu_cores=2)
    assert parse_spec({**SPEC, "latency": {**LATENCY, "cpu_weights": "auto"}}).spec_hash() == \
        parse_spec({**SPEC, "latency": LATENCY}).spec_hash()
    with pytest.raises(ValueError, match="cpu_weights"):
        parse_spec({**SPEC, "latency": {**LATENCY, "cpu_weights": "q4"}})


def test_the_driver_plans_cpu_latency_on_the_largest_nodes_cores():
    from orchestrator.plan import node_cores

    assert node_cores([{"CPU": 4.0, "memory": 1e9}, {"CPU": 16.0, "GPU": 1.0}, {"GPU": 8.0}]) == 16
    assert node_cores([{"GPU": 1.0}]) is None and node_cores([]) is None


def test_covariances_are_collected_only_for_sweeps_with_a_method_that_fits_from_them():
    """larosa fits from the block inputs' covariances (an optional cache component): a sweep with it records them
    (every unit of the model carries ``capture``); one without keeps the units and ids it had."""
    from workers.sparsity.capture import COMPONENTS, sweep_components

    plain = plan_units(parse_spec(SPEC), DESCRIBED)
    assert all("capture" not in u.config.canonical() for u in plain)
    both = {**SPEC, "methods": SPEC["methods"] + [{"name": "larosa", "sparsity": [0.4]}]}
    rotated = plan_units(parse_spec(both), DESCRIBED)
    with_data = [u for u in rotated if u.kind != "latency" and u.config.data is not None]
    assert {u.kind for u in with_data} >= {"collect", "fit", "eval"}
    assert all(u.config.capture == ("cov",) and u.config.canonical()["capture"] == ["cov"] for u in with_data)
    assert "cov" in COMPONENTS and "cov" not in sweep_components() and "cov" in sweep_components(["cov"])
    assert set(COMPONENTS) - set(sweep_components()) == {"cov", "final"}
    # a predicted head fits from the final states: its sweep records them, and its head-alone fit waits for them
    headed = plan_units(parse_spec({**SPEC, "head": {"rank": [64], "candidates": [2048]}}), DESCRIBED)
    assert {u.config.capture for u in headed if u.kind != "latency" and u.config.data is not None} == {("final",)}
    alone = [u for u in headed if u.kind == "fit" and u.config.method == "dense" and u.config.head is not None]
    assert len(alone) == 1 and alone[0].deps and alone[0].label.endswith("dense + head r=64 K=2048 fit")


def test_rotated_and_rank_sparse_methods_get_latency_units():
    """larosa and rsparse decode on the runtime (rotations folded into the weights, low-rank terms as GEMVs):
    their settings get latency units like every other method's."""
    spec = parse_spec({**SPEC, "methods": SPEC["methods"] + [{"name": "rsparse", "sparsity": [0.4]},
                                                             {"name": "larosa", "sparsity": [0.4]}],
                       "latency": LATENCY})
    units = plan_units(spec, DESCRIBED, cpu_cores=2)
    for method in ("rsparse", "larosa"):
        assert {u.kind for u in units if u.method == method} == {"fit", "eval", "latency"}, method


def test_tf32_scoring_is_a_choice_of_the_spec_that_changes_only_the_eval_units():
    """``suites.matmul: tf32`` (CUDA only) puts ``matmul`` into every eval unit's config, so its rows never share
    an id with fp32 rows, and leaves collect, fit and latency units as they were; fp32 stays out of the hash."""
    gpu = {**SPEC, "resources": {"accelerator": "cuda"}}
    fp32 = plan_units(parse_spec(gpu), DESCRIBED)
    tf32 = plan_units(parse_spec({**gpu, "suites": {**SPEC["suites"], "matmul": "tf32"}}), DESCRIBED)
    assert [u.kind for u in fp32] == [u.kind for u in tf32]
    for a, b in zip(fp32, tf32):
        if a.kind == "eval":
            assert b.config.matmul == "tf32" and "matmul" not in a.config.canonical() and a.id != b.id
        else:
            assert a.id == b.id and "matmul" not in b.config.canonical()
    assert parse_spec({**gpu, "suites": {**SPEC["suites"], "matmul": "fp32"}}).spec_hash() == \
        parse_spec(gpu).spec_hash()
    with pytest.raises(ValueError, match="tf32 is a CUDA GPU's precision; resources.accelerator is 'cpu'"):
        parse_spec({**SPEC, "suites": {**SPEC["suites"], "matmul": "tf32"}})
    with pytest.raises(ValueError, match="matmul"):
        parse_spec({**gpu, "suites": {**SPEC["suites"], "matmul": "fp16"}})
    with pytest.raises(ValueError, match="bf16 is an accelerator's precision"):
        parse_spec({**SPEC, "suites": {**SPEC["suites"], "matmul": "bf16"}})
    bf16 = plan_units(parse_spec({**gpu, "suites": {**SPEC["suites"], "matmul": "bf16"}}), DESCRIBED)
    assert {u.config.matmul for u in bf16 if u.kind == "eval"} == {"bf16"}
    assert {u.id for u in bf16 if u.kind == "eval"}.isdisjoint(u.id for u in tf32)


def test_fused_scoring_is_a_cuda_choice_of_the_spec_that_changes_only_the_eval_units():
    """``suites.fused: true`` puts ``fused`` into every eval unit's config (rows of their own), leaves the other
    units as they were, stays out of the hash at its default, and is refused off CUDA."""
    gpu = {**SPEC, "resources": {"accelerator": "cuda"}}
    plain = plan_units(parse_spec(gpu), DESCRIBED)
    fused = plan_units(parse_spec({**gpu, "suites": {**SPEC["suites"], "fused": True}}), DESCRIBED)
    assert [u.kind for u in plain] == [u.kind for u in fused]
    for a, b in zip(plain, fused):
        if a.kind == "eval":
            assert b.config.fused is True and "fused" not in a.config.canonical() and a.id != b.id
        else:
            assert a.id == b.id and "fused" not in b.config.canonical()
    assert parse_spec({**gpu, "suites": {**SPEC["suites"], "fused": False}}).spec_hash() == \
        parse_spec(gpu).spec_hash()
    for accelerator in ("cpu", "npu"):
        with pytest.raises(ValueError, match=f"Triton kernels for CUDA GPUs; resources.accelerator is '{accelerator}'"):
            parse_spec({**SPEC, "resources": {"accelerator": accelerator}, "suites": {**SPEC["suites"], "fused": True}})


def test_generation_batch_sizes_the_accelerator_task_units_only():
    """``suites.generation_batch: 128`` gives the task units of an accelerator sweep 128 sequences per generation
    batch (64 without it), leaves perplexity, fit and latency units as they were, stays out of the hash when left
    out, and is refused on a CPU sweep (whose tasks run 8 sequences per forward)."""
    gpu = {**SPEC, "resources": {"accelerator": "cuda"}}
    plain = plan_units(parse_spec(gpu), DESCRIBED)
    big = plan_units(parse_spec({**gpu, "suites": {**SPEC["suites"], "generation_batch": 128}}), DESCRIBED)
    assert [u.kind for u in plain] == [u.kind for u in big]
    tasks = 0
    for a, b in zip(plain, big):
        if a.kind == "eval" and a.config.suite != "perplexity":
            tasks += 1
            assert a.config.batch_size == 64 and b.config.batch_size == 128 and a.id != b.id
        else:
            assert a.id == b.id
    assert tasks > 0
    assert parse_spec({**gpu, "suites": {**SPEC["suites"], "generation_batch": None}}).spec_hash() == \
        parse_spec(gpu).spec_hash()
    with pytest.raises(ValueError, match="suites.generation_batch sizes an accelerator's generation batches"):
        parse_spec({**SPEC, "suites": {**SPEC["suites"], "generation_batch": 128}})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        parse_spec({**gpu, "suites": {**SPEC["suites"], "generation_batch": 0}})


def test_fits_start_cheapest_first_then_longest():
    """Known order: the statistics fits (dense, oracle, threshold, TEAL) first, then Deja Vu's training, then the
    SVD predictor's and R-Sparse's decompositions; ready units of one priority keep their order."""
    from collections import deque

    from orchestrator.scheduler import enqueue
    from orchestrator.plan import fit_priority

    assert [fit_priority(m) for m in ("dense", "oracle", "threshold", "teal", "wina", "static")] == [0] * 6
    assert fit_priority("dejavu") == 1 and fit_priority("svd") == fit_priority("rsparse") == \
        fit_priority("larosa") == 2
    spec = parse_spec({**SPEC, "methods": [{"name": "svd", "sparsity": [0.5], "rank": [8]},
                                            {"name": "dejavu", "sparsity": [0.5], "rank": [8]},
                                            {"name": "teal", "sparsity": [0.3, 0.5]}]})
    fits = [u for u in plan_units(spec, DESCRIBED) if u.kind == "fit"]
    assert [u.method for u in fits] == ["dense", "svd", "dejavu", "teal", "teal"]     # the plan's own order
    q = deque()
    for u in fits:                  # as they become ready, in plan order
        enqueue(q, u)
    assert [(u.method, u.sparsity) for u in q] == [("dense", 0.0), ("teal", 0.3), ("teal", 0.5),
                                                    ("dejavu", 0.5), ("svd", 0.5)]
