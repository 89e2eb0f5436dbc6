"""Every benchmark tool that a BENCHMARKS.md figure comes from, and every experiment (``benchmarks/experiments/``),
run once in-process (``main(argv)``) on a tiny shape: the tiny random Qwen2 GGUF of ``conftest.tiny_gguf`` (real
LAMBADA / task data, a few tokens, one or two repeats), or a GPU script's CPU path (``--smoke``: the CPU kernels, or
its Triton kernels in the interpreter). Each test checks that the script's figures come out: the rows or columns
it prints or writes, with finite positive timings and, where the setting has one, a known answer (the oracle keeps
exactly half the neurons, its predicted set is the oracle set, ...). Written results carry the CPU they ran on
(``kernels.isa.cpu_info``), and the header line of the timed scripts names it.

Covered elsewhere in the default suite: ``benchmarks.accuracy_table`` (tests/benchmarks/test_accuracy_table.py),
``benchmarks.layer_costs --smoke`` (random weights; tests/benchmarks/test_harness.py; its ``--gguf`` path is here),
``benchmarks.topk_mask --device cpu`` (tests/kernels/test_topk_mask.py) and ``benchmarks.generation_grad_mode``
(tests/benchmarks/test_generation_grad_mode.py).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from benchmarks.harness import device_line
from kernels.isa import cpu_info


def _pos(x) -> bool:
    """A finite positive number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _doc(path) -> dict:
    """A result file the harness wrote: it must say which CPU ran it."""
    doc = json.loads(Path(path).read_text())
    assert {k: doc["meta"].get(k) for k in ("cpu_model", "cpu_flags", "isa")} == cpu_info()
    return doc


def _points(tmp_path, points) -> str:
    p = tmp_path / "points.json"
    p.write_text(json.dumps(points))
    return str(p)


# ---- quality scripts on the tiny model ------------------------------------------------------------------------
def test_quality_measures_each_point(tiny_model, tmp_path, capsys):
    """``benchmarks.quality``: a JSON line per point, with the dense and sparse perplexities; the oracle keeps
    exactly half of the 128 neurons with recall 1 (up to ties), TEAL drops about 40 % of the projections' inputs."""
    from benchmarks import quality

    out = tmp_path / "points.jsonl"
    pts = _points(tmp_path, [{"method": "oracle", "sparsity": 0.5}, {"method": "teal", "sparsity": 0.4}])
    assert quality.main(["--model", tiny_model, "--points", pts, "--calib-tokens", "512", "--heldout-tokens", "512",
                         "--threads", "1", "--jsonl", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["sparsity"]) for r in rows] == [("oracle", 0.5), ("teal", 0.4)]
    assert all(_pos(r["ppl"]) and _pos(r["dense_ppl"]) and _pos(r["eval_s"]) and r["n_tokens"] == 511
               for r in rows)
    oracle, teal = rows
    assert oracle["mlp_sparsity"] == 0.5 and oracle["mean_recall"] > 0.999 and len(oracle["layers"]) == 2
    assert abs(teal["input_sparsity"] - 0.4) < 0.05 and teal["mlp_sparsity"] == 0.0
    printed = capsys.readouterr().out
    assert re.search(r"^dense ppl [0-9.]+ on 511 held-out tokens$", printed, re.M)
    assert re.search(r"^oracle +0\.50 +None +[0-9.]+ +-?[0-9.]+ +0\.500 +1\.000", printed, re.M)


def test_svd_times_the_greedy_and_the_fit(tiny_model, tmp_path, capsys):
    """``benchmarks.experiments.svd``: the three greedy implementations (the same allocation) and the all-layer fit,
    timed."""
    from benchmarks.experiments import svd

    out = tmp_path / "svd.json"
    rows = svd.main(["--model", tiny_model, "--tokens", "1024", "--layer", "1", "--rank", "8", "--repeats", "1",
                     "--json", str(out)])
    doc = _doc(out)
    assert [(r["bench"], r["op"]) for r in doc["rows"]] == [
        ("svd-greedy", "argmin loop (reference)"), ("svd-greedy", "heap"), ("svd-greedy", "sort (default)"),
        ("svd-fit", "all layers, target=gate"), ("svd-fit", "all layers, target=product")]
    assert len(rows) == 5 and all(_pos(r["median"]) for r in doc["rows"])
    assert all(r["extra"]["identical"] and r["extra"]["steps"] > 0 for r in doc["rows"][:3])
    assert all(r["extra"]["layers"] == 2 and r["extra"]["tokens"] == 1024 for r in doc["rows"][3:])
    printed = capsys.readouterr().out
    assert device_line("cpu") in printed and "identical allocations: True" in printed


def test_dejavu_reports_recall_by_input_kind_and_for_the_heads(tiny_model, capsys):
    """``benchmarks.experiments.dejavu``: a recall row per (sparsity, input kind) over both layers and a head row
    (layer 0 keeps every head: one predicted layer, k = 2 of 4 heads)."""
    from benchmarks.experiments import dejavu

    dejavu.main(["--model", tiny_model, "--tokens", "1024", "--sparsities", "0.5", "--kinds", "ffn_in",
                 "--attn", "0.5", "--epochs", "1", "--threads", "1"])
    printed = capsys.readouterr().out
    mlp = re.search(r"^ 0\.50 +ffn_in +0\.500 +([0-9.]+) +([0-9.]+) +([0-9.]+) +\d of 2 ", printed, re.M)
    assert mlp, printed
    init, recall, low = map(float, mlp.groups())
    assert 0 < low <= recall <= 1 and 0 < init <= 1
    heads = re.search(r"^ +0\.50 +2 +0\.500 +([0-9.]+) +([0-9.]+) +([0-9.]+) +1 ", printed, re.M)
    assert heads and all(0 < float(v) <= 1 for v in heads.groups()), printed


def test_diagnose_measures_the_oracle_layer_by_layer(tiny_model, tmp_path):
    """``benchmarks.diagnose`` on the oracle at s = 0.5: every token keeps exactly half the neurons, and on policy
    the predictor's set is the oracle set (recall 1, the same lost energy)."""
    from benchmarks import diagnose

    out = tmp_path / "diag.json"
    assert diagnose.main(["--model", tiny_model, "--points", '[{"method": "oracle", "sparsity": 0.5}]',
                          "--calib-tokens", "512", "--heldout-tokens", "512", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert len(res) == 1 and [r["layer"] for r in res[0]["layers"]] == [0, 1]
    assert all(r["kept_mean"] == r["kept_min"] == 0.5 and 0 < r["lost_mean"] < 1 for r in res[0]["layers"])
    nll = res[0]["nll"]
    assert _pos(nll["ppl_dense"]) and _pos(nll["ppl_sparse"]) and len(nll["dnll_pos0_3"]) == 4
    assert all(math.isfinite(v) for v in nll["dnll_pos0_3"])
    on = res[0]["onpolicy"]
    assert [r["layer"] for r in on] == [0, 1]
    assert all(r["recall"] == 1.0 and r["lost_mean"] == pytest.approx(r["lost_oracle_mean"]) for r in on)


def test_method_allocation_spends_the_mean_budget(tiny_model, tmp_path, capsys):
    """``benchmarks.experiments.method_allocation``: per-layer KL curves of SVDP, an allocation of mean 0.5 and its
    perplexity."""
    from benchmarks.experiments import method_allocation

    out = tmp_path / "alloc.json"
    assert method_allocation.main(["--model", tiny_model, "--calib-tokens", "512", "--heldout-tokens", "512",
                                   "--rank", "8", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["curves"]) == ["0", "1"]
    res = doc["0.5"]
    alloc = list(res["alloc"].values())
    assert len(alloc) == 2 and sum(alloc) / 2 == pytest.approx(0.5, abs=0.01)
    assert _pos(res["ppl"]) and _pos(res["dense"]) and 0 < res["mlp_sparsity"] < 1
    assert '"delta"' in capsys.readouterr().out


def test_kl_gives_each_points_distance_to_dense(tiny_model, tmp_path, capsys):
    """``benchmarks.experiments.kl``: KL(dense || sparse) and the NLL change per point; the dense point (s = 0) is
    at 0."""
    from benchmarks.experiments import kl

    out = tmp_path / "kl.json"
    assert kl.main(["--model", tiny_model, "--points", '[{"method": "teal", "sparsity": 0.5}, '
                    '{"method": "oracle", "sparsity": 0.0}]', "--tokens", "512", "--calib-tokens", "512",
                    "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    teal, dense = doc["rows"]
    assert _pos(teal["kl"]) and math.isfinite(teal["nll_change"]) and _pos(doc["dense_nll"])
    assert dense["kl"] == pytest.approx(0, abs=1e-6) and dense["nll_change"] == pytest.approx(0, abs=1e-5)
    assert "KL " in capsys.readouterr().out


def test_exec_modes_compares_the_selections_of_both_paths(tiny_model, tmp_path):
    """``benchmarks.experiments.exec_modes`` on the oracle: the selections of the masked path (from the FFN's own
    activations) and of the kernel path, layer by layer; layer 0 sees the same input in both, so they select the same
    pairs."""
    from benchmarks.experiments import exec_modes

    out = tmp_path / "modes.json"
    assert exec_modes.main(["--model", tiny_model, "--method", "oracle", "--calib-tokens", "512",
                            "--heldout-tokens", "512", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    flips = doc["pairs_selected_differently"]
    assert sorted(flips) == ["0", "1"] and flips["0"] == 0.0 and 0 <= flips["1"] < 0.05
    assert _pos(doc["ppl"]["masked"]) and _pos(doc["ppl"]["kernel"]) and doc["max_logit_diff"] < 1e-2


# ---- evaluation cost scripts (the sweep's units, lm-eval) ----------------------------------------------------
def test_eval_cost_times_dense_and_each_mode(tiny_model, tmp_path, capsys):
    """``benchmarks.eval_cost``: each task timed dense and for the setting in both modes; the summary's ratios to
    dense; the modes' values agree."""
    from benchmarks import eval_cost

    out = tmp_path / "cost.json"
    assert eval_cost.main(["--model", tiny_model, "--device", "cpu", "--settings", "teal:0.5",
                           "--tasks", "perplexity,piqa:2", "--calib-tokens", "512", "--heldout-tokens", "512",
                           "--batch-size", "2", "--batchings", "2", "--threads", "1", "--json", str(out)]) == 0
    doc = _doc(out)
    got = {(r["task"], r["setting"], r["mode"]) for r in doc["evals"]}
    assert got == {(t, s, m) for t in ("perplexity", "piqa") for s, m in
                   (("dense", "masked"), ("teal s=0.5", "masked"), ("teal s=0.5", "kernel"))}
    assert all(_pos(r["seconds"]) and math.isfinite(r["value"]) for r in doc["evals"])
    assert {(s["setting"], s["mode"]) for s in doc["summary"]} == {
        ("dense", "masked"), ("teal s=0.5", "masked"), ("teal s=0.5", "kernel")}
    assert all(_pos(s["x_dense"]) for s in doc["summary"])
    assert [s["x_dense"] for s in doc["summary"] if s["setting"] == "dense"] == [1.0]
    assert len(doc["agreement"]) == 2 and all(abs(g["diff"]) < 1e-3 for g in doc["agreement"])
    printed = capsys.readouterr().out
    assert device_line("cpu") in printed and "setting                mode     batching" in printed


def test_eval_counting_times_the_counting_and_keeps_the_logits(tiny_model, tmp_path, capsys):
    """``benchmarks.eval_counting``: a forward with and without counting, timed, the logits equal."""
    from benchmarks import eval_counting

    out = tmp_path / "counting.json"
    assert eval_counting.main(["--model", tiny_model, "--settings", "teal:0.5", "--batch", "2", "--seq-len", "16",
                               "--repeats", "1", "--threads", "1", "--calib-tokens", "512", "--json", str(out)]) == 0
    (row,) = _doc(out)["settings"]
    assert row["setting"] == "teal s=0.5" and row["logits_equal"] is True
    assert _pos(row["counting_ms"]) and _pos(row["not_counting_ms"]) and _pos(row["speedup"])
    assert device_line("cpu") in capsys.readouterr().out


def test_scoring_times_each_path_on_the_same_requests(tiny_model, tmp_path, capsys, monkeypatch):
    """``benchmarks.scoring``: lm-eval's pass, ours uncached and cached, on the same requests (2 PIQA items, 4
    requests): ms per request and host ms per request each, the same log-likelihoods and accuracy."""
    from benchmarks import scoring

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")      # (the script sets it; put back after the test)
    out = tmp_path / "scoring.json"
    assert scoring.main(["--model", tiny_model, "--device", "cpu", "--tasks", "piqa:2", "--batch-size", "2",
                         "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    (row,) = _doc(out)["tasks"]
    assert row["task"] == "piqa" and row["requests"] == 4 and _pos(row["cached_cold_s"])
    for p in ("lm_eval", "uncached", "cached"):
        assert _pos(row[f"{p}_ms_per_request"]) and math.isfinite(row[f"{p}_host_ms_per_request"])
        assert row[f"acc_{p}"] == row["acc_lm_eval"]
    assert all(d < 1e-3 for d in row["max_abs_ll_diff"].values())
    assert device_line("cpu") in capsys.readouterr().out


def test_generation_waste_counts_each_loops_steps(tiny_model, tmp_path, capsys):
    """``benchmarks.generation_waste`` (answers cut at 6 new tokens: a random model never stops): each loop's
    steps, sequence-steps and useful fraction; both loops give the same texts."""
    from benchmarks import generation_waste

    out = tmp_path / "waste.json"
    assert generation_waste.main(["--model", tiny_model, "--limit", "2", "--batch", "2", "--threads", "1",
                                  "--max-gen-toks", "6", "--json", str(out)]) == 0
    loops = _doc(out)["loops"]
    assert sorted(loops) == ["lm_eval", "rounds"]
    for r in loops.values():
        assert _pos(r["seconds"]) and r["steps"] == 6 and r["sequence_steps"] == 12
        assert len(r["needed_tokens"]) == 2 and all(0 < n <= 6 for n in r["needed_tokens"])
        assert 0 < r["useful_fraction"] <= 1
    assert loops["lm_eval"]["texts"] == loops["rounds"]["texts"]
    printed = capsys.readouterr().out
    assert device_line("cpu") in printed and "texts equal in both loops: 2 of 2" in printed


def test_lambada_copy_splits_dense_and_a_bundle(tiny_model, tmp_path):
    """``benchmarks.experiments.lambada_copy``: accuracy and mean log-likelihood, copy / no copy, dense and a fitted
    bundle."""
    from benchmarks.experiments import lambada_copy
    from workers.loading.data import token_windows
    from workers.loading.models import load_model
    from workers.sparsity.bundle import save_bundle
    from workers.sparsity.capture import capture_activations
    from workers.sparsity.predictors import FitContext, fit_method

    lm = load_model(tiny_model)
    cache = capture_activations(lm, token_windows(lm.tokenizer, "lambada", "calib", 512, 512), progress=False)
    plan = fit_method("teal", FitContext(lm, cache, [0, 1]), 0.5)
    bundle = save_bundle(plan, lm, tmp_path / "teal-0.5", method="teal", sparsity=0.5)
    out = tmp_path / "copy.json"
    assert lambada_copy.main(["--model", tiny_model, "--limit", "4", "--batch-size", "4", "--threads", "1",
                              "--bundle", str(bundle), "--json", str(out)]) == 0
    dense, sparse = _doc(out)["settings"]
    assert dense["setting"] == "dense" and sparse["setting"].startswith("teal s=[0.5]")
    for r in (dense, sparse):      # of LAMBADA's first 4 passages, 3 hold their last word earlier on
        assert r["n"] == 4 and (r["copy"]["n"], r["no copy"]["n"]) == (3, 1) and 0 <= r["acc"] <= 1
        assert all(v["mean_ll"] < 0 for v in (r["copy"], r["no copy"]) if v["n"])


def test_suites_scores_a_task(tiny_model, tmp_path, capsys):
    """``benchmarks.suites``: accuracy rows with their standard error and item count."""
    from benchmarks import suites

    out = tmp_path / "suites.json"
    assert suites.main(["--model", tiny_model, "--tasks", "copa", "--limit", "4", "--threads", "1",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["metric"] for r in rows} == {"acc"} and all(r["n"] == 4 and 0 <= r["value"] <= 1 for r in rows)
    assert "copa" in capsys.readouterr().out


# ---- CPU decode and kernels ------------------------------------------------------------------------------------
def test_cpu_ops_times_the_ffn_candidates_and_the_decode(tiny_model, tmp_path, capsys):
    """``benchmarks.cpu_ops``: the FFN ops on random weights of the tiny shape (every dense candidate and the
    sparse ones, against the fastest dense), and the decode table with a fitted plan on the tiny model's weights."""
    from benchmarks import cpu_ops

    out = tmp_path / "ops.json"
    assert cpu_ops.main(["--shape", "tiny", "--threads", "1", "--repeats", "1", "--out-sparsity", "0.5",
                         "--in-sparsity", "0.5", "--json", str(out)]) == 0
    doc = _doc(out)
    kinds = {r["op"]: r["extra"]["kind"] for r in doc["rows"]}
    assert {"dense F.linear x3", "out s=0.5 cpu kernels", "in s=0.5 cpu kernels"} <= set(kinds)
    assert {"dense", "out", "in"} <= set(kinds.values())
    assert all(_pos(r["median"]) and _pos(r["extra"]["vs_fastest_dense"]) for r in doc["rows"])
    assert all(r["shape"] == "tiny ffn x2" for r in doc["rows"])
    assert device_line("cpu") in capsys.readouterr().out
    dec = tmp_path / "decode.json"
    assert cpu_ops.main(["--decode", "--weights", "real", "--model", tiny_model, "--methods", "teal:0.5",
                         "--threads", "1", "--repeats", "1", "--gen", "3", "--prompt", "8", "--calib-tokens", "512",
                         "--json", str(dec)]) == 0
    rows = {r["op"]: r for r in _doc(dec)["rows"]}
    assert set(rows) == {"dense torch matmul", "dense cpu kernels", "dense cpu kernels torch glue", "teal s=0.5"}
    assert all(_pos(r["median"]) for r in rows.values())
    assert abs(rows["teal s=0.5"]["extra"]["realized_sparsity"] - 0.5) < 0.2


def test_cpu_peer_runs_ours_and_says_the_peer_is_missing(tiny_model, tmp_path, capsys, monkeypatch):
    """``benchmarks.cpu_peer`` on the tiny GGUF: without llama-cpp-python (its import blocked where it is installed)
    the run stops with an error naming it, nothing written (never a silent skip); with ``--no-llama`` our runners
    are timed and the result says the peer was not; where llama.cpp is installed, it decodes the same file."""
    from benchmarks import cpu_peer
    from workers.decode.llama_cpp import llama_cpp_missing

    out = tmp_path / "peer.json"
    args = ["--model", tiny_model, "--threads", "1", "--gen", "4", "--prompt", "8", "--repeats", "1",
            "--json", str(out)]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "llama_cpp", None)          # what `import llama_cpp` meets where it is missing
        with pytest.raises(SystemExit) as e:
            cpu_peer.main(args)
    assert "llama-cpp-python is not installed" in str(e.value.code) and "--no-llama" in str(e.value.code)
    assert not out.exists()
    # with a predicted head alone (a full-rank screen over K = all but one: the dense tokens)
    assert cpu_peer.main([*args, "--no-llama", "--sparse", "dense:0:head=64/4095", "--calib-tokens", "512"]) == 0
    doc = _doc(out)
    assert doc["meta"]["llama_cpp"] == "not timed (--no-llama)"
    rows = {r["op"]: r for r in doc["rows"]}
    head = "ours quant dense s=0.0 head=64/4095"
    assert set(rows) == {"ours fp32", "ours quant", "ours quant per-op", "ours quant q8", head}
    assert rows[head]["extra"]["same_tokens"] == 5 and _pos(rows[head]["extra"]["vs_ours_quant"][0])
    assert all(_pos(r["median"]) and r["extra"]["same_tokens"] >= 1 for r in rows.values())
    assert rows["ours quant"]["extra"]["same_tokens"] == 5          # the blocks dequantize to the fp32 weights
    printed = capsys.readouterr().out
    assert device_line("cpu") in printed and "llama.cpp: not timed (--no-llama)" in printed
    if llama_cpp_missing() is None:                          # llama.cpp is here: timed beside ours
        assert cpu_peer.main(args) == 0
        doc = _doc(out)
        rows = {r["op"]: r for r in doc["rows"]}
        assert doc["meta"]["llama_cpp"].startswith("llama-cpp-python ") and _pos(rows["llama.cpp"]["median"])
        assert _pos(rows["llama.cpp"]["extra"]["vs_ours_quant"][0])     # the rounds' paired ratio


def test_quant_sparse_layers_times_each_group(tiny_model, tmp_path, capsys):
    """``benchmarks.quant_sparse_layers`` on the tiny GGUF's Q8_0 blocks: dense and each group input-sparse, with
    the share of each group's inputs that were active (about 1 - s where sparse, 0 where not)."""
    from benchmarks import quant_sparse_layers

    out = tmp_path / "qsl.json"
    assert quant_sparse_layers.main(["--model", tiny_model, "--sparsity", "0.5", "--threads", "1", "--rounds", "1",
                                     "--json", str(out)]) == 0
    rows = {r["op"]: r for r in _doc(out)["rows"]}
    assert list(rows) == ["dense", "qkv", "o", "gu", "down", "qkv+o+gu+down"]
    assert all(_pos(r["extra"]["min_ms"]) and _pos(r["extra"]["vs_dense"]) for r in rows.values())
    assert rows["dense"]["extra"]["active"] == [0.0] * 7
    q, k, v, o, g, u, d = rows["qkv+o+gu+down"]["extra"]["active"]
    assert all(0.3 < x < 0.7 for x in (q, k, v, o, g, u, d))
    assert rows["o"]["extra"]["active"][:3] == [0.0] * 3 and rows["o"]["extra"]["active"][3] > 0
    assert device_line("cpu") in capsys.readouterr().out


def test_head_screens_compares_the_screens_and_times_the_head(tiny_model, tmp_path, capsys):
    """``benchmarks.head_screens`` on the tiny GGUF (vocabulary 4,096, d 64, a Q8_0 head): every screen, rank or
    cluster count, K and text gets a row; K = the whole vocabulary keeps every argmax and the whole mass and gives
    the dense perplexity (a known answer); the head step is timed dense and per (rank, K)."""
    from benchmarks import head_screens

    out = tmp_path / "hs.json"
    assert head_screens.main(["--model", tiny_model, "--calib-tokens", "512", "--positions", "64", "--ranks", "32",
                              "--candidates", "256,4096", "--clusters", "64", "--time", "--threads", "1",
                              "--rounds", "2", "--json", str(out)]) == 0
    rows = _doc(out)["rows"]
    quality = [r["extra"] for r in rows if not r["op"].startswith("time")]
    assert {(q["screen"], q["candidates"], q["text"]) for q in quality} == {
        (sc, k, t) for sc in ("hidden", "logits", "clusters") for k in (256, 4096)
        for t in ("prose", "code", "numbers")}
    for q in quality:
        assert 0 <= q["argmax_kept"] <= 1 and 0 < q["mass"] <= 1 + 1e-9 and _pos(q["ppl"]) and _pos(q["head_mb"])
        if q["candidates"] == 4096:
            assert q["argmax_kept"] == 1 and q["mass"] == pytest.approx(1) and q["ppl"] == pytest.approx(q["ppl_dense"])
    timed = {r["op"]: r for r in rows if r["op"].startswith("time")}
    assert set(timed) == {"time dense head", "time r=32 K=256", "time r=32 K=4096"}
    assert all(_pos(r["median"]) and _pos(r["bytes"]) for r in timed.values())
    assert timed["time r=32 K=256"]["bytes"] < timed["time dense head"]["bytes"]
    assert device_line("cpu") in capsys.readouterr().out


# ---- GPU scripts through their CPU paths -----------------------------------------------------------------------
def test_kernels_smoke_times_dense_and_the_sparse_variants(tmp_path, monkeypatch, capsys):
    """``benchmarks.kernels --smoke`` on one tiny gated shape, batch 1, s = 0.5 (the Triton kernels interpreted):
    dense, the index path and each Triton variant, and the head-sparse attention projections."""
    from benchmarks import kernels

    for name in ("DEV", "SMOKE", "FFN_SHAPES", "ATTN_SHAPES"):       # --smoke sets them for the process
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    out = tmp_path / "kernels.json"
    assert kernels.main(["--smoke", "--shapes", "tiny", "--batches", "1", "--sparsities", "0.5",
                         "--json", str(out)]) == 0
    rows = _doc(out)["rows"]
    ffn = {r["op"] for r in rows if r["shape"] == "tiny"}
    assert {"dense", "torch_index", "triton_seq50", "triton_damage50"} <= ffn and ffn & {"triton_fused",
                                                                                       "triton_split"}
    attn = [r for r in rows if r["shape"] == "tiny-attn"]
    assert [(r["op"], r["extra"]["sparsity"]) for r in attn] == [("attn_dense", 0.0)] + [
        ("attn_triton", s) for s in (0.0, 0.5, 0.7)]
    # (an interpreted kernel is thousands of times slower than dense: its speedup rounds to 0.0)
    assert all(_pos(r["median"]) and 0 <= r["extra"]["speedup_vs_dense"] < math.inf for r in rows)
    assert device_line("cpu") in capsys.readouterr().out


def test_input_sparse_smoke_times_each_path(tmp_path, monkeypatch, capsys):
    """``benchmarks.input_sparse --smoke`` on Llama-2's gate|up (shrunk), batch 1, s = 0.5: cuBLAS's stand-in and
    each kernel path, with its error against the masked product."""
    from benchmarks import input_sparse

    for name in ("SMOKE", "MIN_BYTES"):
        monkeypatch.setattr(input_sparse, name, getattr(input_sparse, name))
    monkeypatch.setattr(input_sparse, "MODELS", dict(input_sparse.MODELS))   # --smoke shrinks them in place
    out = tmp_path / "input_sparse.json"
    assert input_sparse.main(["--smoke", "--models", "llama2-7b", "--proj", "gate_up", "--dtypes", "fp16",
                              "--batches", "1", "--sparsities", "0.5", "--paths", "mask,local",
                              "--json", str(out)]) == 0
    rows = _doc(out)["rows"]
    sparse = {r["extra"]["path"]: r for r in rows if r["extra"].get("path") in ("mask", "local")}
    assert set(sparse) == {"mask", "local"}
    assert all(_pos(r["median"]) and r["extra"]["rel_err"] < 1e-2 and r["extra"]["s"] == 0.5
               for r in sparse.values())
    assert device_line("cpu") in capsys.readouterr().out


def test_fused_layer_smoke_times_both_chains_and_each_part(tmp_path, monkeypatch, capsys):
    """``benchmarks.fused_layer --smoke`` (one tiny layer, the Triton kernels interpreted): both chains agree, the
    fused one repeats bit for bit, and each part is timed."""
    from benchmarks import fused_layer

    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")        # the prologue / epilogue fusions are Triton's
    out = tmp_path / "fused.json"
    assert fused_layer.main(["--smoke", "--sparsities", "0.5", "--layers", "1", "--reps", "1",
                             "--json", str(out)]) == 0
    rows = {r["op"]: r for r in _doc(out)["rows"]}
    assert {"layer, unfused", "layer, fused", "qkv + norm prologue", "down + act*up prologue + residual"} <= set(rows)
    assert all(_pos(r["median"]) and r["shape"] == "tiny" for r in rows.values())
    fused = rows["layer, fused"]["extra"]
    assert fused["repeat_identical"] is True and fused["rel_err"] < 2e-2
    assert device_line("cpu") in capsys.readouterr().out


def test_decode_smoke_times_each_point_and_the_hf_baseline(tmp_path, capsys):
    """``benchmarks.decode --smoke`` (a tiny random Llama on the CPU): the runtime's checks against HF, then ms
    per token of the dense, FFN-sparse and input-sparse points and of HF's ``generate``, with the bytes model."""
    from benchmarks import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--points", "dense,mlp.5,in.5", "--prompts", "16", "--gen", "4",
                        "--repeats", "1", "--hf", "eager", "--json", str(out)]) == 0
    doc = _doc(out)
    checks = doc["meta"]["checks"]
    assert checks["max_rel_logit_err"] < 1e-3 and checks["greedy_s0_equal_dense"] is True
    rows = {r["op"]: r for r in doc["rows"]}
    assert set(rows) == {"dense", "mlp.5", "in.5", "hf-generate"}
    assert all("error" not in r["extra"] and _pos(r["median"]) and r["extra"]["prompt_len"] == 16
               for r in rows.values())
    assert rows["dense"]["extra"]["ideal_speedup"] == 1.0
    assert all(rows[p]["extra"]["ideal_speedup"] > 1 for p in ("mlp.5", "in.5"))
    printed = capsys.readouterr().out
    assert device_line("cpu") in printed and re.search(r"^ +16 mlp\.5 ", printed, re.M)


def test_decode_attn_smoke_times_the_kernel_beside_torch(tmp_path, capsys):
    """``benchmarks.decode_attn --smoke``: one decode position's attention, every head and half of them, the kernel
    (interpreted) and torch's function, with the kernel's error against torch's."""
    from benchmarks import decode_attn

    out = tmp_path / "attn.json"
    assert decode_attn.main(["--smoke", "--prompts", "16", "--layers", "1", "--rounds", "1",
                             "--json", str(out)]) == 0
    rows = _doc(out)["rows"]
    assert {(r["op"], r["extra"]["heads"]) for r in rows} == {
        (op, h) for op in ("torch compiled", "kernel", "kernel 1 split") for h in ("all", "half")}
    assert all(_pos(r["median"]) and r["extra"]["rel_err_kernel_vs_torch"] < 1e-2 for r in rows)
    assert device_line("cpu") in capsys.readouterr().out


def test_layer_costs_times_the_parts_of_a_gguf_runtime(tiny_model, tmp_path, capsys):
    """``benchmarks.layer_costs --device cpu --gguf`` on the tiny GGUF's Q8_0 blocks: the glue, the quantized
    projections and the layer in one native call, per layer, and the step per op and in one call beside them.
    (Its random-weight ``--smoke`` is tests/benchmarks/test_harness.py's.)"""
    from benchmarks import layer_costs

    out = tmp_path / "lc.json"
    assert layer_costs.main(["--device", "cpu", "--model", tiny_model, "--gguf", "--threads", "1", "--prompt", "8",
                             "--reps", "2", "--gen", "3", "--json", str(out)]) == 0
    doc = _doc(out)
    ops = {r["op"] for r in doc["rows"]}
    assert {"qkv", "o", "ffn dense", "layer, one native call", "every layer, one native call",
            "lm head + argmax (per step)"} <= ops
    assert all(_pos(r["median"]) for r in doc["rows"])
    assert doc["meta"]["gguf"] is True and doc["meta"]["layers"] == 2
    assert all(_pos(doc["meta"][f"step_us_{k}"]) for k in ("glue_torch_o_torch", "glue_kernel_o_torch",
                                                          "glue_kernel_o_torch_native_layer"))
    assert device_line("cpu") in capsys.readouterr().out
