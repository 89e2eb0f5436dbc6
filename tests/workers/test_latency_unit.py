"""The latency unit (``workers.units.Units.latency``): its rows record the thread count the unit ran at and, for a
sparse setting timed beside dense, the spread of the paired speedup; the ``llama.cpp`` unit times llama.cpp on
the model's own GGUF beside our dense decode (with llama-cpp-python installed; without it, one line saying so)."""
from __future__ import annotations

import uuid

import pytest
import torch

from db.schemas import LatencyRow
from tests.workers.tiny_model_support import tiny_model
from workers.decode.latency import random_plan
from workers.loading.adapters import adapter_for
from workers.loading.models import LoadedModel
from workers.names import RUNTIME_DENSE_PAIRED, RUNTIME_LLAMA_CPP, RUNTIME_SPARSE
from workers.sparsity.bundle import save_bundle
from workers.units import Units, bundle_dir

PROV = {"package_versions": {"x": "1"}, "git_rev": "r"}


@pytest.fixture
def threads_restored():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _units_with(lm) -> Units:
    units = Units()
    units._lms[lm.ref] = lm          # the loaded model, as a worker keeps it between units
    return units


def _tiny_setting(tmp_path):
    """A tiny random Llama and a saved bundle of a random Deja Vu plan on it (what a fit unit leaves)."""
    m = tiny_model("llama")
    ad = adapter_for(m)
    lm = LoadedModel(m, None, f"tiny-{uuid.uuid4().hex[:8]}", ad, ad.dims(m.config), "fp-tiny", "random", {})
    fit_unit = uuid.uuid4().hex
    save_bundle(random_plan(m, 0.5, rank=8), lm, bundle_dir(fit_unit), method="dejavu", sparsity=0.5, rank=8)
    return lm, fit_unit


def _cfg(lm, fit_unit, threads, repeats, runtime="ctxsparse"):
    return {"model": lm.ref, "model_fp": lm.fingerprint, "fit_unit": fit_unit, "device_type": "cpu", "batch": 1,
            "prompt_len": 4, "gen_len": 4, "repeats": repeats, "runtime": runtime, "threads": threads,
            "paired": runtime == "ctxsparse"}


@pytest.mark.parametrize("repeats, want", [(1, 1), (3, 2)])
def test_rows_record_the_units_thread_count_and_the_paired_speedups_spread(tmp_path, threads_restored, repeats,
                                                                           want):
    lm, fit_unit = _tiny_setting(tmp_path)
    torch.set_num_threads(3)                # neither: the unit sets its own
    out = _units_with(lm).run("latency", uuid.uuid4().hex, _cfg(lm, fit_unit, want, repeats))
    sparse, dense = out.latency
    assert (sparse["runtime"], dense["runtime"]) == (RUNTIME_SPARSE, RUNTIME_DENSE_PAIRED)
    assert sparse["threads"] == dense["threads"] == out.summary["threads"] == want == torch.get_num_threads()
    lo, hi = sparse["speedup_min"], sparse["speedup_max"]
    assert 0 < lo <= hi and "speedup_min" not in dense
    if repeats == 1:    # one repeat: its ratio of medians is the ratio of the rows' p50s, exactly
        assert lo == hi == dense["p50_ms_per_token"] / sparse["p50_ms_per_token"]
    for r in out.latency:      # what the store takes
        assert LatencyRow(**r, **PROV).threads == want


def test_cpu_rows_written_by_the_unit_record_the_cpu_and_the_build_of_its_native_kernels(tmp_path, threads_restored):
    """Every row of a CPU latency unit carries ``kernels.isa.cpu_info()``'s flags of interest and instruction set
    (the native kernels built here), and keeps them through the store: what the worker writes is what
    ``latency_table`` reads back."""
    from db import queries as q
    from db.engine import get_engine, session_scope, upgrade
    from kernels.cpu import native_available
    from kernels.isa import cpu_info

    lm, fit_unit = _tiny_setting(tmp_path)
    unit_id = uuid.uuid4().hex
    cfg = _cfg(lm, fit_unit, 1, 1)
    out = _units_with(lm).run("latency", unit_id, cfg)
    info = cpu_info()
    assert native_available() and info["isa"] in ("avx512", "avx2", "neon", "scalar")
    assert [(r["cpu_flags"], r["isa"]) for r in out.latency] == [(info["cpu_flags"], info["isa"])] * 2
    assert out.summary["isa"] == info["isa"]
    engine = get_engine(f"sqlite:///{tmp_path / 'store.db'}")
    upgrade(engine)
    with session_scope(engine) as s:
        mid = q.upsert_model(s, name=lm.ref, fingerprint=lm.fingerprint)
        sid, _ = q.get_or_create_sweep(s, name="t", spec_hash="a" * 64, spec={})
        q.register_units(s, sid, [dict(id=unit_id, model_id=mid, kind="latency", device_type="cpu", config=cfg,
                                       code_version="t")])
        assert q.finish_unit(s, unit_id, latency_rows=[LatencyRow(**r, **PROV) for r in out.latency])
    with session_scope(engine) as s:
        stored = q.latency_table(s)
    engine.dispose()
    assert sorted((r.runtime, r.cpu_flags, r.isa) for r in stored) == sorted(
        (r["runtime"], info["cpu_flags"], info["isa"]) for r in out.latency)


def test_llama_cpp_unit_times_the_models_gguf_beside_our_dense_or_says_it_is_not_installed(smollm2,
                                                                                           threads_restored):
    """On SmolLM2 (loaded from its GGUF): with llama-cpp-python, a llama.cpp row and the dense row timed beside it,
    both at the unit's thread count, the llama.cpp row with its speedup spread over that dense; without it the
    unit fails with the one line saying how to install it (the plan never schedules it then)."""
    from workers.decode.llama_cpp import llama_cpp_missing

    assert smollm2.meta["kind"] == "gguf" and smollm2.source.endswith(".gguf")
    cfg = _cfg(smollm2, "0" * 40, 1, 1, RUNTIME_LLAMA_CPP)
    units = _units_with(smollm2)
    why = llama_cpp_missing()
    if why is not None:
        assert why.startswith("llama-cpp-python is not installed") and "make llama-cpp" in why
        with pytest.raises(RuntimeError, match="make llama-cpp"):
            units.run("latency", "1" * 40, cfg)
        return
    out = units.run("latency", "1" * 40, cfg)
    llama, dense = out.latency
    assert (llama["runtime"], dense["runtime"]) == (RUNTIME_LLAMA_CPP, RUNTIME_DENSE_PAIRED)
    assert llama["threads"] == dense["threads"] == 1 and llama["batch"] == 1 and llama["gen_len"] == 4
    assert llama["speedup_min"] == llama["speedup_max"] == dense["p50_ms_per_token"] / llama["p50_ms_per_token"]
    assert llama["realized_sparsity"] is None and all(r["p50_ms_per_token"] > 0 for r in out.latency)
    assert out.summary["speedup_vs_paired_dense"] == round(dense["p50_ms_per_token"] / llama["p50_ms_per_token"], 3)
    # llama.cpp really decoded every step of the row: its own counter, warm-up and 2 repeats of 3 steps
    from workers.decode.latency import bench_llama_cpp

    rows = bench_llama_cpp(smollm2.model, smollm2.source, prompt_len=4, gen_len=4, repeats=2, detail=True)
    assert rows[0]["llama_decode_evals"] == (1 + 2) * 3 and rows[0]["gguf"] == smollm2.source


def test_llama_cpp_unit_refuses_a_model_without_a_gguf(tmp_path, threads_restored):
    lm, fit_unit = _tiny_setting(tmp_path)
    with pytest.raises(ValueError, match="not loaded from a GGUF"):
        _units_with(lm).run("latency", uuid.uuid4().hex, _cfg(lm, fit_unit, 1, 1, RUNTIME_LLAMA_CPP))
