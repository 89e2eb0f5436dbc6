"""Decode runtime (workers.decode.runtime) and latency rows (workers.decode.latency) on tiny random models of each family."""
from __future__ import annotations

import pytest
import torch

from tests.workers.tiny_model_support import runtime_logits, tiny_model
from workers.decode.latency import bench_decode, random_plan
from workers.decode.runtime import DecodeRuntime

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "opt"]


def _greedy_reference(model, ids, n):
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, ids.shape[1]:]


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_logits_match_hf(family):
    m = tiny_model(family)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).logits          # gemma3 tiny: sliding window 16 < 24 (layer 0), exercised
    rt = DecodeRuntime.from_hf(m)
    rt.setup(2, 32)
    lg = rt.prefill(ids[:, :10])
    torch.testing.assert_close(lg, ref[:, 9], atol=1e-5, rtol=1e-4)
    for t in range(10, 24):
        rt.tok.copy_(ids[:, t])
        torch.testing.assert_close(rt.step(keep_logits=True), ref[:, t], atol=1e-5, rtol=1e-4)
    # the whole prompt at once: gemma3's sliding layer drops keys in the prefill's mask too (24 > 16 positions)
    torch.testing.assert_close(rt.prefill(ids), ref[:, 23], atol=1e-5, rtol=1e-4)
    assert torch.equal(rt.generate(ids[:, :10], 6), _greedy_reference(m, ids[:, :10], 6))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["lookahead", "residual"])
def test_sparse_at_s0_greedy_equals_dense(family, kind):
    m = tiny_model(family)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    rt = DecodeRuntime.from_hf(m)
    dense = rt.generate(ids, 10)
    rt.set_plan(random_plan(m, 0.0, 0.0, rank=8, input_kind=kind))
    assert rt.sparse_plan.dense and not rt.sparse          # k = N everywhere: the dense step runs
    assert torch.equal(rt.generate(ids, 10), dense)
    assert rt.realized_sparsity() == {"mlp": 0.0, "heads": 0.0}


def _hf_sparse_decode_logits(m, plan, ids, n_prompt):
    """HF model: dense prefill (its own cache), then sparse_exec's modules for every later token."""
    from workers.sparsity.sparse_exec import apply_sparsity

    with torch.no_grad():
        out = m(ids[:, :n_prompt], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        with apply_sparsity(m, plan):
            for t in range(n_prompt, ids.shape[1]):
                o = m(ids[:, t: t + 1], past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                logits.append(o.logits[:, -1])
    return logits


def _runtime_matches(m, plan, ids, ref, n_prompt):
    """The runtime under ``plan``: prefill of ids[:, :n_prompt], then one step per later token, each step's logits
    equal to ``ref`` (from _hf_sparse_decode_logits). Returns the runtime."""
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    rt.setup(1, ids.shape[1])
    torch.testing.assert_close(rt.prefill(ids[:, :n_prompt]), ref[0], atol=1e-5, rtol=1e-4)
    for i, t in enumerate(range(n_prompt, ids.shape[1])):
        rt.tok.copy_(ids[:, t])
        torch.testing.assert_close(rt.step(keep_logits=True), ref[i + 1], atol=1e-5, rtol=1e-4)
    return rt


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["lookahead", "residual", "ffn_in"])
def test_sparse_step_matches_sparse_exec(family, kind):
    """The runtime computes exactly the predicted sets: same logits as workers.sparsity.sparse_exec on the HF model
    (token-sparse FFN on each token's predicted neurons, head-sparse output projection, exact K/V)."""
    m = tiny_model(family)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    plan = random_plan(m, 0.5, 0.5, rank=8, input_kind="residual" if kind == "ffn_in" else kind, seed=3)
    if kind == "ffn_in":
        for p in plan.mlp.values():
            p.input_kind = "ffn_in"
    rt = _runtime_matches(m, plan, ids, _hf_sparse_decode_logits(m, plan, ids, 10), 10)
    assert rt.realized_sparsity() == pytest.approx({"mlp": 0.5, "heads": 0.5})


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("filter_on, f", [("gate", 0.05), ("damage", 0.002)])
def test_sequential_filters_match_sparse_exec(family, filter_on, f):
    """The sequential pipeline's two filters (|act(gate)|, and the damage |act(gate)·up|·‖g ⊙ W_down[:, i]‖ with
    Gemma-3's post-FFN gain) drop the same pairs in the runtime as in sparse_exec, and do drop some."""
    m = tiny_model(family)
    ids = torch.randint(0, 128, (1, 14), generator=torch.Generator().manual_seed(5))
    plan = random_plan(m, 0.3, None, rank=8, input_kind="residual", seed=4)
    unfiltered = _hf_sparse_decode_logits(m, plan, ids, 10)
    plan.mlp_mode, plan.seq_filter_on, plan.seq_filter = "sequential", filter_on, {l: f for l in plan.mlp}
    ref = _hf_sparse_decode_logits(m, plan, ids, 10)
    assert max(float((a - b).abs().max()) for a, b in zip(ref[1:], unfiltered[1:])) > 1e-4
    _runtime_matches(m, plan, ids, ref, 10)


def test_sparse_ffn_gets_the_predicted_indices(monkeypatch):
    """Spy on the kernel call: idx is the predictor's top-k of its input (batch 1), nothing else."""
    from kernels import ops

    m = tiny_model("llama")
    plan = random_plan(m, 0.5, None, rank=8, input_kind="residual", seed=4)
    seen = []
    real = ops.sparse_ffn

    def spy(x, w_gate, w_up, w_down_t, idx, count=None, *a, **kw):
        seen.append((idx.clone(), count))
        return real(x, w_gate, w_up, w_down_t, idx, count, *a, **kw)

    monkeypatch.setattr(ops, "sparse_ffn", spy)
    inputs = {}
    rt = DecodeRuntime.from_hf(m)
    rt.set_plan(plan)
    for l, p in rt.mlp_pred.items():   # the runtime's own copies: record what each predictor was given
        def rec(x, l=l, f=p.scores):
            inputs[l] = x.clone()
            return f(x)
        p.scores = rec
    rt.setup(1, 12)
    rt.prefill(torch.randint(0, 128, (1, 8)))
    rt.step()
    assert len(seen) == len(plan.mlp)
    for l, (idx, count) in enumerate(seen):
        want = set(plan.mlp[l].mask(inputs[l]).nonzero()[:, 1].tolist())
        assert count is None and set(idx.tolist()) == want and len(idx) == plan.mlp[l].k


def test_batch_union_and_kv_active():
    m = tiny_model("qwen2")
    rt = DecodeRuntime.from_hf(m).set_plan(random_plan(m, 0.5, 0.5, rank=8), kv_mode="active")
    out = rt.generate(torch.randint(0, 128, (3, 8)), 5)
    assert out.shape == (3, 5)
    sp = rt.realized_sparsity()
    assert 0.0 <= sp["mlp"] < 0.5 and 0.0 <= sp["heads"] < 0.5     # union of 3 tokens' sets


@pytest.fixture(scope="module")
def interpreted():
    """{part: "OK" or its traceback} of tests/workers/decode/interpreted_parts.py, run once in a fresh process with
    TRITON_INTERPRET=1, started when collection ended (tests/probe_support.py)."""
    import json

    from tests import probe_support

    lines = [ln for ln in probe_support.output("interpreted").splitlines() if ln.startswith("RESULTS ")]
    assert lines, "the interpreted parts printed no RESULTS line"
    return json.loads(lines[-1][len("RESULTS "):])


def test_triton_sparse_step_gives_the_reference_logits(interpreted):
    """The runtime's sparse step through the Triton kernels (the CUDA defaults; here in Triton's interpreter) gives
    the reference path's logits, qwen2 (QKV bias, GQA), batch 1, 2 steps: FFN and head predictors at 0.5 (every
    layer's FFN, head-sparse QKV / O and attention counted in Triton, realized sparsity exactly 0.5), the Triton
    radix select's top-k indices, and input sparsity on every projection through both Triton paths ("mask",
    "local": 8 launches a step) against the CPU default's, logits and inputs counted."""
    assert interpreted["sparse_step"] == "OK", interpreted["sparse_step"]


def test_triton_rotated_and_rank_sparse_steps_give_the_cpu_logits(interpreted):
    """A LaRoSA plan (batch 1: each token's k-th value by the Triton threshold kernel into the input-sparse kernel;
    batch 2: top-k by the Triton radix select, the kept rows of the rotated weights by the Triton down kernel:
    4 groups x 2 layers) and an R-Sparse plan (the input-sparse kernel on every group, the low-rank terms
    beside it) at 30 % of the bytes, qwen2, through the Triton kernels in the interpreter: the CPU default's
    logits and bytes skipped."""
    assert interpreted["rotated_step"] == "OK", interpreted["rotated_step"]


def test_triton_attention_gives_the_torch_attention_logits(interpreted):
    """glue="kernel" with the Triton backend (RoPE, q/k norms, cache write and attention in one launch; here in
    Triton's interpreter) gives the torch glue's logits, batch 2, prompt 12, 6 steps: llama (GQA: 2 KV heads for 4),
    gemma3 (q/k norms; its 16-position sliding window starts to drop positions at 16), opt (no RoPE); and 3 steps of
    llama's head-sparse step (compact active heads). And o_proj "kernel" (the dense O projection through the
    Triton down kernel) gives o_proj "torch"'s logits, llama and opt (O with a bias)."""
    assert interpreted["attention"] == "OK", interpreted["attention"]


def test_densify_slow_ffn_switches_the_layers_whose_union_is_too_wide():
    """Batch 3: after some steps, the layers whose mean union keeps more than 40 % of the neurons (the rule given)
    run the dense FFN: the next steps' logits equal a runtime whose plan has no FFN predictor there. The default
    rule switches nothing off CUDA (the crossover table was measured on GPUs)."""
    import copy

    from workers.decode.timing import densify_slow_ffn

    m = tiny_model("llama")
    ids = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(5))
    plan = random_plan(m, 0.7, None, rank=8, seed=2)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    rt.setup(3, 20)
    rt.prefill(ids)
    for _ in range(4):
        rt.step()
    assert densify_slow_ffn(rt) == []
    kept = (rt.counters.mlp / rt.counters.steps).tolist()
    D = rt.dims.D
    want = sorted(l for l in range(len(rt.layers)) if kept[l] > 0.4 * D)
    assert 0 < len(want), kept                  # 3 tokens' unions of 30 % sets: about 66 % of the neurons
    assert densify_slow_ffn(rt, lambda b, k, n: k > 0.4 * n) == want
    assert all(l not in rt.sparse_plan.mlp for l in want)
    ref_plan = copy.deepcopy(plan)
    for l in want:
        del ref_plan.mlp[l]
    ref = DecodeRuntime.from_hf(m).set_plan(ref_plan)
    ref.setup(3, 20)
    nxt = torch.randint(0, 128, (3, 1), generator=torch.Generator().manual_seed(6))
    for r in (rt, ref):
        r.prefill(ids)
    for t in range(3):
        for r in (rt, ref):
            r.tok.copy_(nxt[:, 0] + t)
        torch.testing.assert_close(rt.step(keep_logits=True), ref.step(keep_logits=True), atol=1e-6, rtol=1e-5)
    rt.set_plan(plan)
    assert sorted(rt.sparse_plan.mlp) == sorted(plan.mlp)


@pytest.mark.slow       # inductor compiles four graphs (about 30 s on 2 cores with an empty cache)
def test_compiled_torch_attention_takes_every_variant_whole():
    """The glue CUDA compiles (torch.compile, full graph) accepts every variant the step passes: all heads, compact
    heads with and without a count, a sliding window with q/k norms, the "active" kv mode's mask; and gives the
    eager function's result (compiled here for the CPU: a graph break fails the same way on any device)."""
    from kernels import reference as R
    from tests.kernels.test_decode_attn import _case
    from workers.decode.glue import glue_fns

    attn = glue_fns(True, "torch")["attn"]
    for family, compact, masked in (("llama", None, False), ("gemma", "padded", False), ("llama", "fixed", False),
                                    ("llama", "padded", True)):
        (q, k, v, kc, vc, p), extra = _case(torch.Generator().manual_seed(1), torch.float32, "cpu", 1, 4, 2, 20,
                                            family, compact)
        if masked:
            extra["valid"] = torch.rand(1, 2, kc.shape[2], generator=torch.Generator().manual_seed(2)) > 0.3
            extra["valid"][..., 20] = True
        want = R.decode_attention(q, k, v, kc.clone(), vc.clone(), p, **extra)
        torch.testing.assert_close(attn(q, k, v, kc.clone(), vc.clone(), p, **extra), want, atol=1e-6, rtol=1e-5)


def test_decode_is_bit_reproducible_at_one_thread_count():
    """Same weights, plan, prompt and thread count: the same logits bit for bit (what a resumed sweep's rows and an
    exported bundle's perplexity rely on). Fresh runtimes at 2 threads through the CPU defaults (native kernels
    that split rows across threads): batch 2, dense, FFN and head predictors, and input sparsity on every
    projection; prefill and 6 steps each. (The Triton kernels' fixed-order reductions are checked on a GPU: in the
    interpreter a launch's programs run one after another.)"""
    from workers.decode.latency import calibrated_input_plan

    torch.set_num_threads(2)                       # the module's fixture restores the count
    m = tiny_model("qwen2")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(9))
    for plan in (None, random_plan(m, 0.5, 0.5, rank=8, seed=3), calibrated_input_plan(m, 0.5, n_tokens=32)):
        runs = []
        for _ in range(2):
            rt = DecodeRuntime.from_hf(m).set_plan(plan)
            rt.setup(2, 18)
            runs.append(torch.stack([rt.prefill(ids)] + [rt.step(keep_logits=True) for _ in range(6)]))
        assert torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32))


def test_glue_option_is_checked():
    with pytest.raises(ValueError, match="glue must be one of"):
        DecodeRuntime.from_hf(tiny_model("llama"), glue="flash")
    rt = DecodeRuntime.from_hf(tiny_model("llama"))
    assert rt.glue == "auto"
    with pytest.raises(ValueError, match="glue must be one of"):
        rt.configure(glue="flash")
    assert rt.configure(glue="kernel").glue == "kernel"
    from workers.decode.glue import resolve_glue

    # "auto": the kernels where they were measured faster (CPU, CUDA), the compiled torch functions elsewhere
    assert [resolve_glue("auto", d) for d in ("cpu", "cuda", "npu")] == ["kernel", "kernel", "torch"]
    assert resolve_glue("torch", "cuda") == "torch"


def test_o_proj_option_is_checked_and_resolved():
    rt = DecodeRuntime.from_hf(tiny_model("llama"))
    assert rt.blocks.o_proj == "auto" and not rt.blocks.o_kernel(1)   # "auto" on the CPU: the matmul / row kernels
    with pytest.raises(ValueError, match="o_proj must be one of"):
        DecodeRuntime.from_hf(tiny_model("llama"), o_proj="cublas")
    with pytest.raises(ValueError, match="o_proj must be one of"):
        rt.configure(o_proj="cublas")
    assert rt.configure(o_proj="kernel").blocks.o_kernel(1)
    assert rt.configure(ffn_dense="torch").blocks.o_proj == "kernel"    # rebuilding the blocks keeps it


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_o_proj_kernel_gives_the_dense_logits_on_the_cpu(family):
    """o_proj "kernel" on the CPU (the native gather-down over every head's rows of W_o^T) gives the matmul's
    logits, batch 2, prefill and 6 steps; opt's O has a bias (random, as every tiny model's)."""
    m = tiny_model(family)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    out = {o: runtime_logits(m, ids, 6, o_proj=o) for o in ("torch", "kernel")}
    torch.testing.assert_close(out["kernel"], out["torch"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_cpu_glue_gives_the_torch_glue_logits(family):
    """On the CPU, glue "kernel" (native norms and attention: "auto" there) gives the torch glue's logits, batch 2,
    dense and head-sparse (compact active heads), past gemma3's 16-position sliding window."""
    from kernels import cpu

    assert cpu.native_available(), "the native CPU kernels did not build (a C compiler with OpenMP is needed)"
    m = tiny_model(family)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    for plan in (None, random_plan(m, 0.0, 0.5, rank=8, seed=4)):
        out = {}
        for glue in ("torch", "kernel"):
            rt = DecodeRuntime.from_hf(m, glue=glue).set_plan(plan)
            rt.setup(2, 24)
            out[glue] = torch.stack([rt.prefill(ids)] + [rt.step(keep_logits=True) for _ in range(8)])
        torch.testing.assert_close(out["kernel"], out["torch"], atol=2e-5, rtol=1e-4)


def test_select_impl_torch_and_reference_backend():
    """select_impl "torch" (and "auto" on the reference backend) is torch.topk's set; "triton" is forced only
    by name (the interpreter path is tested above)."""
    from workers.decode.select import ActiveSetSelector

    s = torch.randn(3, 40, generator=torch.Generator().manual_seed(7))
    want = torch.topk(s, 9).indices.sort().values
    for impl in ("auto", "torch"):
        assert torch.equal(ActiveSetSelector(impl).topk(s, 9).sort().values, want)
    with pytest.raises(ValueError, match="select_impl"):
        ActiveSetSelector("fast")


def test_select_impl_triton_variants_pick_the_kernel(monkeypatch):
    """"triton" is the top-k op (kernels.ops.topk_select), the one- / multi-CTA choice left to the kernel's size
    rule; "triton-1cta" forces one CTA. Where the Triton kernels do not run, "triton" is the op's reference."""
    from kernels import ops
    from kernels.reference import topk_select
    from workers.decode.select import ActiveSetSelector

    s = torch.randn(1, 40, generator=torch.Generator().manual_seed(3))
    monkeypatch.delenv("CTXSPARSE_KERNELS", raising=False)
    assert torch.equal(ActiveSetSelector("triton").topk(s, 9), topk_select(s, 9))
    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")
    seen = []
    monkeypatch.setattr(ops.backend(s), "topk_select", lambda s, k, multi=None: seen.append(multi) or torch.zeros(1, k))
    for impl in ("auto", "triton", "triton-1cta"):
        ActiveSetSelector(impl).topk(s, 9)
    assert seen == [None, None, False]


def test_bench_decode_rows():
    m = tiny_model("llama")
    keys = {"device_type", "accelerator_name", "batch", "prompt_len", "gen_len", "p50_ms_per_token",
            "p90_ms_per_token", "tokens_per_s", "realized_sparsity", "runtime", "threads", "weights", "cpu_flags",
            "isa"}
    rows = (bench_decode(m, None, batch=1, prompt_len=8, gen_len=4, repeats=1)
            + bench_decode(m, random_plan(m, 0.7, rank=8), batch=2, prompt_len=8, gen_len=4, repeats=1,
                           paired=False)
            + bench_decode(m, None, batch=1, prompt_len=8, gen_len=4, repeats=1, runtime="hf-generate"))
    assert [r["runtime"] for r in rows] == ["ctxsparse-dense", "ctxsparse-sparse", "hf-generate"]
    assert [r["weights"] for r in rows] == ["fp32"] * 3          # what each decode read
    for r in rows:
        assert set(r) == keys and r["device_type"] == "cpu" and r["accelerator_name"]
        assert r["threads"] == torch.get_num_threads()          # the count the row was timed at
        assert 0 < r["p50_ms_per_token"] <= r["p90_ms_per_token"] and r["tokens_per_s"] > 0
    # batch 2: each layer reads the union of two top-k sets of k = 0.3·D, between k and 2k neurons
    assert rows[0]["realized_sparsity"] is None and 0.4 <= rows[1]["realized_sparsity"] <= 0.7


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cpu_row_kernels_dense_path(family):
    """cpu_rows: QKV, O, LM head and the dense FFN through kernels.cpu's row kernels give the matmul path's
    logits (dense and with a sparse plan)."""
    m = tiny_model(family)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(8))
    for plan in (None, random_plan(m, 0.5, None, rank=8, seed=9)):
        out = {}
        for rows in (False, True):
            rt = DecodeRuntime.from_hf(m).set_plan(plan)
            rt.cpu_rows = rows
            rt.setup(1, 14)
            rt.prefill(ids)
            out[rows] = torch.stack([rt.step(keep_logits=True) for _ in range(3)])
        torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-4)


def test_options_are_keywords_and_keep_all_layers_run_dense():
    """Every setting a benchmark varies is a keyword (and configure() changes it); a layer whose predictors keep
    everything (k = N) is left out of the sparse plan and runs dense, while still counting in realized sparsity."""
    m = tiny_model("llama")
    rt = DecodeRuntime.from_hf(m, ffn_dense="torch", compile=False, use_graph=False, select_impl="torch",
                               cpu_rows=True)
    assert (rt.blocks.ffn_dense, rt.compile, rt.use_graph, rt.select_impl, rt.cpu_rows) == \
        ("torch", False, False, "torch", True)
    rt.configure(ffn_dense="auto", cpu_rows=False, select_impl="auto")
    assert (rt.blocks.ffn_dense, rt.cpu_rows, rt.select_impl) == ("auto", False, "auto")
    with pytest.raises(ValueError, match="ffn_dense"):
        DecodeRuntime.from_hf(m, ffn_dense="cublas")
    plan = random_plan(m, 0.5, 0.5, rank=8, layers=[0])
    keep_all = random_plan(m, 0.0, 0.0, rank=8, layers=[1])
    plan.mlp[1], plan.attn[1] = keep_all.mlp[1], keep_all.attn[1]
    rt.set_plan(plan)
    assert sorted(rt.mlp_pred) == sorted(rt.head_pred) == [0] and not rt.sparse_plan.dense
    rt.generate(torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(17)), 6)
    assert rt.realized_sparsity() == pytest.approx({"mlp": 0.25, "heads": 0.25})


def test_runtime_predictors_are_frozen_and_use_the_row_kernel(monkeypatch):
    """The runtime's predictor copies hold no autograd state, so their GEMVs take the CPU row kernel even where
    the caller has autograd on; the bundle's own predictors stay trainable."""
    from kernels import cpu as cpu_kernels

    m = tiny_model("llama")
    plan = random_plan(m, 0.5, None, rank=8, input_kind="residual", seed=4)
    rt = DecodeRuntime.from_hf(m)
    rt.set_plan(plan)
    preds = list(rt.sparse_plan.mlp.values())
    assert preds and all(not p.requires_grad for q in preds for p in q.parameters())
    assert all(p.requires_grad for q in plan.mlp.values() for p in q.parameters())
    calls = []
    real = cpu_kernels.rows_dot
    monkeypatch.setattr(cpu_kernels, "rows_dot", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x = torch.randn(1, preds[0].fc1.weight.shape[1])
    assert torch.is_grad_enabled()
    preds[0].scores(x)
    assert len(calls) == 2


def test_default_crossover_counts_the_predictor_at_batch_above_one():
    """The CUDA default of densify_slow_ffn: the kernels' crossover (dense from batch 2 at union sparsity 0,
    sparse from 0.3 up) and, from batch 2, dense below union sparsity SPARSE_FROM_UNION (0.45)."""
    from workers.decode.timing import faster_dense_with_predictor as f

    n = 1000
    assert not f(1, 700, n) and not f(1, 1000, n)          # batch 1: the fused kernel wins even at s = 0
    assert f(4, 1000, n) and f(2, 1000, n)                 # kernel crossover: s = 0 from batch 2
    assert f(4, 680, n) and f(4, 560, n)                   # union 0.32, 0.44: dense once the predictor counts
    assert not f(4, 540, n) and not f(8, 340, n)           # union 0.46, 0.66: sparse
    assert f(4, 1000, n, gated=False) and f(1, 1000, n, gated=False)
