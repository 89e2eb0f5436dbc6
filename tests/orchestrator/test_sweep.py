"""The sweep service end to end on a local Ray cluster and real SmolLM2: rows, failures, resume, a killed worker,
placement.

The default tests read the session's one shared tiny sweep (``tiny_sweep``, tests/sweep_support.py): a setting
whose fit raises, latency asked for on a device type the cluster lacks and an evaluator killed in the middle of a
unit are part of it, and so is a copy of its store resumed as a Ray job. The slow one runs a sweep of its own (a run
whose only units left need a missing device, on a copy of that store)."""
from __future__ import annotations

import re

import pytest

from db import queries
from db.engine import get_engine, session_scope
from db.front.pareto import pareto
from db.front.settings import settings_for_model
from db.units import unit_config
from tests.sweep_support import (FAILING_ERROR, FAILING_METHOD, PERPLEXITY_METRICS, SHARED_METHOD, SHARED_OVERRIDES,
                                 copy_store, home_set_to, run_tiny_sweep, tiny_spec)
from workers.decode.llama_cpp import llama_cpp_missing


def _counts(url: str) -> dict:
    with session_scope(get_engine(url)) as s:
        acc = queries.accuracy_table(s)
        lat = queries.latency_table(s)
        keys_acc = [(r.unit_id, r.suite, r.task, r.metric) for r in acc]
        keys_lat = [(r.unit_id, r.device_type, r.batch, r.prompt_len, r.runtime) for r in lat]
        sweeps = queries.list_sweeps(s)
        units = {u.id: u for sw in sweeps for u in queries.pending_units(s, sw.id, include_failed=True)}
        return {"acc": keys_acc, "lat": keys_lat, "left": units, "sweeps": sweeps}


def _all_units(url: str) -> dict:
    with session_scope(get_engine(url)) as s:
        return {u.id: u for m in queries.list_models(s) for u in queries.units_for_model(s, m.id)}


def test_tiny_sweep_writes_every_row_once(tiny_sweep):
    url, outcome = tiny_sweep.url, tiny_sweep.outcome
    spec = tiny_spec(**SHARED_OVERRIDES)
    n_settings = 1 + sum(len(m.sparsity) for m in spec.methods)                # dense + 2 (one of them fails)
    n_devices = len(spec.latency.devices)                                       # cpu, and cuda (not here)
    llama = llama_cpp_missing() is None          # llama-cpp-python installed here: SmolLM2's GGUF gets a CPU row
    # collect; per setting a fit, 2 evals and a latency unit per device type; the HF baseline per device type;
    # llama.cpp on the CPU where it is installed
    assert outcome.total == 1 + n_settings * (1 + 2 + n_devices) + n_devices + llama
    units = _all_units(url)
    assert len(units) == outcome.total
    # the failing fit and what depends on it (its 2 evals, its cpu latency unit) failed, with the reason
    cfgs = {k: unit_config(u.kind, u.config) for k, u in units.items()}
    bad_fit = [u for u in units.values() if u.kind == "fit" and cfgs[u.id].options == FAILING_METHOD["options"]]
    assert len(bad_fit) == 1 and bad_fit[0].status == "failed"
    assert FAILING_ERROR in bad_fit[0].error
    chain = {u.id for u in units.values() if u.device_type == "cpu" and (
        u.id == bad_fit[0].id or u.kind in ("eval", "latency") and cfgs[u.id].fit_unit == bad_fit[0].id)}
    assert sorted(u.kind for u in units.values() if u.id in chain) == ["eval", "eval", "fit", "latency"]
    assert sorted(outcome.failed) == sorted(chain) and outcome.worker_deaths == 1     # the killed evaluator
    assert all(units[i].error.startswith("not run: a unit it depends on failed") for i in chain - {bad_fit[0].id})
    # cuda units stay pending on a cluster without a GPU: one per setting and the HF baseline, no rows invented
    cuda = {u.id for u in units.values() if u.device_type == "cuda"}
    assert sorted(outcome.unplaceable) == sorted(cuda) and len(cuda) == n_settings + 1
    assert {units[i].status for i in cuda} == {"pending"}
    # everything else done, once
    assert outcome.done == outcome.total - len(chain) - len(cuda)
    assert {u.status for i, u in units.items() if i not in chain | cuda} == {"done"}
    c = _counts(url)
    assert set(c["left"]) == chain | cuda
    assert len(c["acc"]) == len(set(c["acc"]))                  # no duplicate rows
    assert not {k[0] for k in c["acc"] + c["lat"]} & (chain | cuda)
    n_ok = n_settings - 1
    # each sparse setting's CPU latency unit also stores the dense timed beside it, and so does llama.cpp's
    assert len(c["lat"]) == len(set(c["lat"])) == n_ok + 1 + (n_ok - 1) + 2 * llama
    with session_scope(get_engine(url)) as s:
        assert [sw.status for sw in queries.list_sweeps(s)] == ["failed"]
        assert queries.latency_table(s, device_type="cuda") == []
        nll = [r for r in queries.accuracy_table(s) if r.suite == "perplexity" and r.metric == "nll"]
        assert len(nll) == n_ok and all(r.stderr is None for r in nll)       # one window: no stderr
        # each metric's direction as stored with its rows: perplexity and NLL fall as a setting improves, COPA's
        # accuracy (lm-eval's declaration) and the realized sparsities rise
        directions = {(r.suite, r.metric): r.higher_is_better for r in queries.accuracy_table(s)}
        assert directions == {**{("perplexity", m): m not in ("ppl", "nll") for m in PERPLEXITY_METRICS},
                              ("mc", "acc"): True}, directions
        model = queries.list_models(s)[0]
        settings = settings_for_model(s, model.id)
        assert sorted(st.method for st in settings) == ["dense", FAILING_METHOD["name"], SHARED_METHOD["name"]]
        (failed,) = [st for st in settings if st.status == "failed"]
        assert failed.accuracy == {} and failed.latency == []
        ok = [st for st in settings if st is not failed]
        for st in ok:
            assert st.accuracy["perplexity/lambada-heldout/ppl"] > 1
            assert 0 <= st.accuracy["mc/copa/acc"] <= 1
            assert sorted(r.runtime for r in st.latency if r.runtime != "hf-generate") == (
                (["ctxsparse-dense"] + ["ctxsparse-dense-paired", "llama.cpp"] * llama) if st.is_dense
                else ["ctxsparse-dense-paired", "ctxsparse-sparse"])
            # every row at the spec's torch_threads (it overrides CPU latency's default of every core), and every
            # row timed beside our dense carries the spread of its speedup over it
            assert {r.threads for r in st.latency} == {spec.resources.torch_threads}
            for r in st.latency:
                paired = r.runtime in ("ctxsparse-sparse", "llama.cpp")
                assert (r.speedup_min is not None and 0 < r.speedup_min <= r.speedup_max) == paired, r
        dense = next(st for st in ok if st.is_dense)
        assert dense.realized_sparsity == 0.0
        for st in ok:
            if not st.is_dense:   # sparsity really applied: fewer neurons and a worse perplexity than dense
                assert st.accuracy["perplexity/lambada-heldout/mlp_sparsity"] == pytest.approx(0.5, abs=0.05)
                # gate, up and down are each a third of the FFN; the FFN is 3/4 of SmolLM2's projection weights
                ffn_share = 3 * 576 * 1536 / (3 * 576 * 1536 + 576 * (576 + 192 + 192 + 576))
                gate = 1 if st.method in ("oracle", "threshold") else 0       # both compute the gate in full
                assert st.realized_sparsity == pytest.approx(
                    ffn_share * (3 - gate) / 3 * st.accuracy["perplexity/lambada-heldout/mlp_sparsity"], rel=1e-6)
                assert st.accuracy["perplexity/lambada-heldout/ppl"] > dense.accuracy["perplexity/lambada-heldout/ppl"]
        fit = next(st for st in ok if st.method == "threshold")
        layers = queries.layer_metrics_for(s, fit.fit_unit)
        assert len(layers) == 30 and all(0 <= r.recall <= 1 for r in layers)
        front = pareto(settings, "perplexity/lambada-heldout/ppl", "cpu")
        assert front.message is None and front.front and front.threads == spec.resources.torch_threads
        assert failed.fit_unit not in {r.setting.fit_unit for r in front.front}
        best_ppl = min(st.accuracy["perplexity/lambada-heldout/ppl"] for st in ok)
        assert any(r.accuracy == best_ppl for r in front.front)    # the most accurate setting is never dominated
        assert pareto(settings, "perplexity/lambada-heldout/ppl", "cuda").message.startswith("no latency rows")


def test_resumed_sweep_recomputes_nothing(tiny_sweep, tiny_sweep_resumed):
    """A copy of the store made right after the sweep, resumed as a Ray job (``ctxsparse resume``, by the shared
    sweep's driver; tests/orchestrator/test_cli_jobs.py reads what the commands printed): nothing done is computed
    again; the failed fit is retried and fails again, its dependants with it; the same sweep, the same rows."""
    first = tiny_sweep.outcome
    before, after = _counts(tiny_sweep.url), _counts(tiny_sweep_resumed.url)
    assert sorted(after["acc"]) == sorted(before["acc"]) and sorted(after["lat"]) == sorted(before["lat"])
    assert [sw.id for sw in after["sweeps"]] == [first.sweep_id]        # the stored spec finds its sweep
    assert sorted(after["left"]) == sorted(before["left"])
    units, first_units = _all_units(tiny_sweep_resumed.url), _all_units(tiny_sweep.url)
    assert {i: u.attempts for i, u in units.items() if i not in first.failed} == \
           {i: u.attempts for i, u in first_units.items() if i not in first.failed}   # nothing done ran again
    assert {i: u.status for i, u in units.items()} == {i: u.status for i, u in first_units.items()}
    (fit,) = [units[i] for i in first.failed if units[i].kind == "fit"]
    assert fit.attempts == first_units[fit.id].attempts + 1 and FAILING_ERROR in fit.error        # retried
    # the driver's own summary of the resumed run
    log = tiny_sweep_resumed.steps["follow"].out
    assert f"{first.done} of {first.total} units already done; {first.total - first.done - len(first.unplaceable)} " \
           "to run" in log, log[-3000:]
    assert re.search(rf"sweep tiny-test: {first.done}/{first.total} units done, {len(first.failed)} failed, "
                     rf"{len(first.unplaceable)} waiting for devices this cluster lacks; 0 computed now in \S+; "
                     r"0 worker deaths", log), log[-3000:]


@pytest.mark.slow
def test_device_types_the_cluster_lacks_stay_pending(tiny_sweep, tmp_path):
    """A spec whose only units left are for a device type the cluster lacks: nothing runs, the sweep stays
    ``running`` (resumable on a cluster that has the device), no cuda rows."""
    url = copy_store(tiny_sweep.url, tmp_path / "store.db")
    latency = {"devices": ["cpu", "cuda"], "prompt_len": [16], "gen_len": 4, "repeats": 1}
    with home_set_to(tiny_sweep.home):
        out = run_tiny_sweep(url, methods=[SHARED_METHOD], latency=latency)
    assert out.ok and out.ran == 0 and len(out.unplaceable) == 3     # 2 settings + the HF baseline on cuda
    with session_scope(get_engine(url)) as s:
        assert queries.latency_table(s, device_type="cuda") == []
        sw = next(x for x in queries.list_sweeps(s) if len(x.spec["methods"]) == 1)
        assert sw.status == "running" and queries.sweep_progress(s, sw.id).done == out.total - 3


def test_worker_killed_mid_unit_loses_nothing_and_duplicates_nothing(tiny_sweep):
    """The shared sweep's driver killed (SIGKILL) the evaluator running the first eval unit: that unit ran again on
    a new worker and wrote its rows once; nothing else was lost (test_tiny_sweep_writes_every_row_once)."""
    killed, out = tiny_sweep.killed, tiny_sweep.outcome
    assert killed is not None, "no eval unit was seen running"
    assert out.worker_deaths == 1 and killed.unit not in out.failed
    c = _counts(tiny_sweep.url)
    assert killed.unit not in c["left"]
    assert len(c["acc"]) == len(set(c["acc"])) and len(c["lat"]) == len(set(c["lat"]))
    with session_scope(get_engine(tiny_sweep.url)) as s:
        u = queries.get_unit(s, killed.unit)
        assert u.kind == "eval" and u.status == "done" and u.attempts == 2 and u.worker != killed.worker
        rows = [r for r in queries.accuracy_table(s) if r.unit_id == killed.unit]
    from workers.evals.tasks import SUITES

    suite = unit_config(u.kind, u.config).suite
    expected = PERPLEXITY_METRICS if suite == "perplexity" else SUITES[suite].metrics
    assert sorted(r.metric for r in rows) == sorted(expected)


def test_npu_actor_is_placed_on_the_npu_node_and_sees_its_device(ray_local):
    from workers.actors import Evaluator, actor_options

    ray = ray_local
    npu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("NPU")}
    assert npu_nodes, "the test cluster declares an NPU resource"
    a = Evaluator.options(**actor_options("npu")).remote(None, "npu")
    try:
        info = ray.get(a.info.remote(), timeout=120)
        assert info["node_id"] in npu_nodes
        assert info["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "0"
        # without the Ascend plugin the actor says so instead of silently running on the CPU
        with pytest.raises(Exception, match="torch_npu is not importable"):
            ray.get(a.describe.remote("smollm2-135m", tiny_spec().data.model_dump(), None), timeout=300)
    finally:
        ray.kill(a)


def test_exported_bundle_on_a_fresh_model_reproduces_the_sweep_perplexity(tiny_sweep, smollm2, tmp_path, capsys):
    import torch

    from orchestrator.cli import main as cli
    from workers.sparsity.bundle import apply_bundle
    from workers.loading.data import token_windows
    from workers.evals.perplexity import perplexity

    url = tiny_sweep.url
    spec = tiny_spec(**SHARED_OVERRIDES)
    with session_scope(get_engine(url)) as s:
        st = next(x for x in settings_for_model(s, queries.list_models(s)[0].id)
                  if x.method == "threshold" and x.status == "done")
    out = tmp_path / "bundle"
    assert cli(["bundle", "export", st.fit_unit[:12], "--out", str(out), "--db", url]) == 0
    printed = capsys.readouterr().out
    assert f'"unit": "{st.fit_unit[:12]}"' in printed and '"threads": 1' in printed
    # the copy records the thread count its CPU latency row was timed at: what ctxsparse generate then runs at
    from workers.sparsity.bundle import load_bundle, measured_threads
    assert measured_threads(load_bundle(out).manifest) == spec.resources.torch_threads == 1
    lm = smollm2                                          # the session's model object, not the workers'
    toks = token_windows(lm.tokenizer, spec.data.source, "heldout", spec.suites.perplexity.tokens,
                         spec.suites.perplexity.seq_len)
    # The same thread count as the sweep's workers: a hard threshold (|act(gate)| > t, t = the median) flips
    # neurons at the boundary when the GEMM's summation order changes, and the flips compound over 30 layers
    # (on 512 tokens: ppl 70.38 with 2 threads, 69.85 with 1). Same threads: the same numbers exactly.
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.resources.torch_threads)
    try:
        with apply_bundle(lm.model, out) as applied:
            ppl = perplexity(lm.model, toks).ppl
            assert applied.stats.mlp_sparsity() == st.accuracy["perplexity/lambada-heldout/mlp_sparsity"]
            assert applied.stats.weight_skipped() == st.realized_sparsity
        assert ppl == pytest.approx(st.accuracy["perplexity/lambada-heldout/ppl"], rel=1e-9)
        assert perplexity(lm.model, toks).ppl < ppl            # reverted: dense again
    finally:
        torch.set_num_threads(threads)


def test_cli_pareto_and_bundle_errors(tiny_sweep, tmp_path, capsys):
    from orchestrator.cli import main as cli

    url = tiny_sweep.url
    assert cli(["pareto", "smollm2-135m", "--db", url]) == 0
    text = capsys.readouterr().out
    assert "Pareto front: smollm2-135m" in text and "(* = on the front" in text
    assert cli(["pareto", "smollm2-135m", "--db", url, "--device", "cuda"]) == 0
    assert "no latency rows for device type 'cuda'" in capsys.readouterr().out
    assert cli(["pareto", "gpt-17", "--db", url]) == 2
    assert "no model 'gpt-17'" in capsys.readouterr().err
    assert cli(["pareto", "smollm2-135m", "--db", url, "--metric", "mc/nope/acc"]) == 2
    assert cli(["bundle", "export", "ffff", "--out", str(tmp_path / "x"), "--db", url]) == 2
    assert "no unit with id 'ffff'" in capsys.readouterr().err
    assert cli(["bundle", "export", "--best", "smollm2-135m", "--by", "sparsity", "--max-loss", "0.0001",
                "--out", str(tmp_path / "y"), "--db", url]) == 2
    assert "no sparse setting" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
