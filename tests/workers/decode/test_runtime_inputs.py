"""Input sparsity (TEAL / WINA) and gate-threshold plans on the decode runtime, against workers.sparsity.sparse_exec
on tiny random models."""
from __future__ import annotations

import pytest
import torch

from tests.workers.tiny_model_support import tiny_model
from workers.decode.latency import bench_decode, random_plan
from workers.decode.runtime import DecodeRuntime


def _projection_inputs(m, ids):
    """{(layer, projection): inputs [T, in]} of every projection of the HF model on ``ids``."""
    from workers.loading.adapters import adapter_for
    from workers.sparsity.input_sparse import projection_modules

    ad = adapter_for(m)
    seen, hooks = {}, []
    for l, layer in ad.iter_layers(m):
        for p, mod in projection_modules(ad, layer).items():
            hooks.append(mod.register_forward_hook(
                lambda mod, a, out, key=(l, p): seen.__setitem__(key, a[0].reshape(-1, a[0].shape[-1]).detach())))
    try:
        with torch.no_grad():
            m(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _input_plan(m, ids, s, score="abs", projections=("q", "k", "v", "o", "gate", "up", "down"), plan=None):
    """A TEAL (|x|) or WINA (|x|·‖W[:, i]‖) plan: every listed projection's threshold at the s-quantile of its
    score on ``ids`` (as the fitted methods take it from the calibration histograms)."""
    from workers.loading.adapters import adapter_for
    from workers.sparsity.input_sparse import column_norms, projection_modules
    from workers.sparsity.predictors.base import SparsityPlan

    ad = adapter_for(m)
    mods = {l: projection_modules(ad, layer) for l, layer in ad.iter_layers(m)}
    plan = plan if plan is not None else SparsityPlan()
    plan.input_score = score
    for (l, p), x in _projection_inputs(m, ids).items():
        if p not in projections:
            continue
        sc = x.abs() if score == "abs" else x.abs() * column_norms(mods[l][p])
        plan.inputs.setdefault(l, {})[p] = float(torch.quantile(sc.float().reshape(-1), s))
    return plan


def _hf_sparse_decode(m, plan, ids, n_prompt):
    """(logits of every position from n_prompt - 1 on, SparseStats of the decode tokens): HF dense prefill, then
    sparse_exec (masked mode) for every later token."""
    from workers.sparsity.sparse_exec import apply_sparsity

    with torch.no_grad():
        out = m(ids[:, :n_prompt], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        with apply_sparsity(m, plan, input_mode="masked", mode="masked") as applied:
            for t in range(n_prompt, ids.shape[1]):
                o = m(ids[:, t: t + 1], past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                logits.append(o.logits[:, -1])
    return logits, applied.stats


def _hf_sparse_greedy(m, plan, prompt, n):
    """HF greedy tokens: the first from the dense prompt pass, the next n - 1 with the plan applied."""
    from workers.sparsity.sparse_exec import apply_sparsity

    with torch.no_grad():
        out = m(prompt, use_cache=True)
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]
        cache = out.past_key_values
        with apply_sparsity(m, plan, input_mode="masked", mode="masked"):
            for _ in range(n - 1):
                out = m(toks[-1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(toks, 1)


def _runtime_decode(rt, ids, n_prompt):
    rt.setup(1, ids.shape[1])
    logits = [rt.prefill(ids[:, :n_prompt])]
    for t in range(n_prompt, ids.shape[1]):
        rt.tok.copy_(ids[:, t])
        logits.append(rt.step(keep_logits=True))
    return logits


def _assert_logits(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3", "opt"])
@pytest.mark.parametrize("score", ["abs", "wina"])
def test_input_sparse_plan_matches_sparse_exec(family, score):
    """TEAL / WINA on every projection: the runtime's logits and greedy tokens are those of the HF model with the
    plan applied by sparse_exec, and its realized input sparsity (weights skipped) is sparse_exec's count."""
    m = tiny_model(family)
    g = torch.Generator().manual_seed(11)
    plan = _input_plan(m, torch.randint(0, 128, (2, 24), generator=g), 0.4, score)
    ids = torch.randint(0, 128, (1, 18), generator=g)
    want, stats = _hf_sparse_decode(m, plan, ids, 10)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    _assert_logits(_runtime_decode(rt, ids, 10), want)
    sp = rt.realized_sparsity()
    assert sp["inputs"] == pytest.approx(stats.weight_skipped(), rel=1e-9) and sp["weights"] == sp["inputs"]
    assert 0.25 < sp["inputs"] < 0.55            # ~0.4 of every projection's inputs dropped
    assert set(sp) == {"inputs", "weights"}
    assert torch.equal(rt.generate(ids[:, :10], 8), _hf_sparse_greedy(m, plan, ids[:, :10], 8))


def test_attention_input_sparsity_with_a_ffn_predictor():
    """TEAL on q, k, v, o beside a neuron predictor on the FFN (a user combination): sparse_exec's logits; the
    QKV projection reads one Wᵀ copy (three thresholds over one input), the FFN keeps its own kernels."""
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(12)
    plan = random_plan(m, 0.5, None, rank=8, input_kind="residual", seed=13)
    plan = _input_plan(m, torch.randint(0, 128, (2, 24), generator=g), 0.35, projections=("q", "k", "v", "o"),
                       plan=plan)
    ids = torch.randint(0, 128, (1, 16), generator=g)
    want, stats = _hf_sparse_decode(m, plan, ids, 10)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    _assert_logits(_runtime_decode(rt, ids, 10), want)
    assert all(L.w_qkv_t is not None and L.w_gu_t is None for L in rt.layers)
    sp = rt.realized_sparsity()
    assert sp["mlp"] == pytest.approx(0.5)
    assert sp["inputs"] == pytest.approx(stats.inputs.skipped_numel() / stats.inputs.total_numel(), rel=1e-9)
    assert sp["weights"] == pytest.approx(stats.weight_skipped(), rel=1e-9)
    # skipped weights: attention inputs plus half of the gate/up/down rows (top-k predictor: all three sparse)
    numel = rt.weights.proj_numel()
    nl = len(rt.layers)
    total = nl * sum(n for n, _ in numel.values())
    ffn = nl * 0.5 * (numel["gate"][0] + numel["up"][0] + numel["down"][0])
    pred = sum(t.numel() for p in plan.mlp.values() for t in p.to_tensors().values())   # read by every token
    assert sp["weights"] == pytest.approx(sp["inputs"] + (ffn - pred) / total, rel=1e-9)
    assert 0 < sp["inputs"] < ffn / total


def test_input_sparsity_layouts_and_errors():
    """Wᵀ copies exist only for the projections a plan needs and go with the plan; weight_bytes ignores them;
    WINA off the CPU and input sparsity beside a head predictor on the same projections are clear errors."""
    from workers.sparsity.predictors.base import SparsityPlan

    m = tiny_model("llama")
    rt = DecodeRuntime.from_hf(m)
    nbytes = rt.weight_bytes()
    rt.set_plan(SparsityPlan(inputs={0: {"gate": 0.1, "down": 0.1}}))
    L0, L1 = rt.layers
    assert L0.w_gu_t is not None and L0.w_qkv_t is None and L1.w_gu_t is None
    assert torch.equal(L0.w_gu_t, torch.cat([L0.w_gate, L0.w_up]).t())
    assert rt.weight_bytes() == nbytes
    rt.set_plan(None)
    assert L0.w_gu_t is None and L0.w_qkv_t is None
    with pytest.raises(ValueError, match="projections"):
        rt.set_plan(SparsityPlan(inputs={0: {"qkv": 0.1}}))
    with pytest.raises(ValueError, match="head predictor"):
        plan = random_plan(m, None, 0.5, rank=8)
        plan.inputs = {1: {"q": 0.1}}
        rt.set_plan(plan)
    rt = DecodeRuntime.from_hf(m, device="meta")       # not the CPU: WINA's per-channel thresholds go there too
    rt.set_plan(SparsityPlan(inputs={0: {"q": 0.1, "down": 0.2}}, input_score="wina"))
    thr_qkv, thr_down = rt.sparse_plan.in_attn[0]["qkv"][0], rt.sparse_plan.in_ffn[0]["down"][0]
    d, D = m.config.hidden_size, m.config.intermediate_size
    assert thr_qkv.shape == (3, d) and thr_down.shape == (1, D) and thr_qkv.device.type == "meta"


def _threshold_plan(m, ids, s):
    """Method ``threshold``'s plan: per layer a GateThreshold on |act(W1 h)| at its s-quantile on ``ids``."""
    from workers.loading.adapters import adapter_for
    from workers.sparsity.predictors.base import SparsityPlan
    from workers.methods.threshold.predictor import GateThreshold
    from kernels.common import apply_act

    ad = adapter_for(m)
    act = ad.act_name(m.config)
    first = "gate" if ad.ffn.gated else "up"
    plan = SparsityPlan(dense_gate=True)
    for (l, p), x in _projection_inputs(m, ids).items():
        if p != first:
            continue
        w = ad.ffn_weights(ad.decoder_layers(m)[l])[first].float()
        a = apply_act(x.float() @ w.t(), act).abs()
        plan.mlp[l] = GateThreshold(w, act, float(torch.quantile(a.reshape(-1), s)))
    return plan


@pytest.mark.parametrize("family", ["llama", "gemma3", "opt"])
@pytest.mark.parametrize("native", [True, False])
def test_threshold_plan_matches_sparse_exec(family, native, monkeypatch):
    """Gate-threshold plans: the first projection dense once, up/down rows of the kept neurons only (the C kernel,
    or the torch decomposition where it does not run), never sparse_ffn's second pass over the gate rows; same
    logits, greedy tokens and realized FFN sparsity as sparse_exec."""
    from kernels import ops

    from kernels import cpu

    if not native:
        monkeypatch.setenv("CTXSPARSE_CPU_NATIVE", "0")
    assert cpu.native_available() == native
    m = tiny_model(family)
    g = torch.Generator().manual_seed(14)
    plan = _threshold_plan(m, torch.randint(0, 128, (2, 24), generator=g), 0.5)
    ids = torch.randint(0, 128, (1, 18), generator=g)
    want, stats = _hf_sparse_decode(m, plan, ids, 10)

    def no_second_pass(*a, **k):
        raise AssertionError("threshold plan went through sparse_ffn / sparse_mlp")

    monkeypatch.setattr(ops, "sparse_ffn", no_second_pass)
    monkeypatch.setattr(ops, "sparse_mlp", no_second_pass)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    assert sorted(rt.thr_ffn) == sorted(plan.mlp)
    _assert_logits(_runtime_decode(rt, ids, 10), want)
    sp = rt.realized_sparsity()
    assert sp["mlp"] == pytest.approx(stats.mlp_sparsity(), rel=1e-9) and 0.3 < sp["mlp"] < 0.7
    assert torch.equal(rt.generate(ids[:, :10], 8), _hf_sparse_greedy(m, plan, ids[:, :10], 8))


def test_threshold_plan_batch_uses_each_tokens_set():
    """Batch 3: the union's rows are read once, each token keeps its own neurons (sparse_exec's per-token sets)."""
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(15)
    plan = _threshold_plan(m, torch.randint(0, 128, (2, 24), generator=g), 0.6)
    ids = torch.randint(0, 128, (3, 12), generator=g)
    want, stats = _hf_sparse_decode(m, plan, ids, 8)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    rt.setup(3, 12)
    got = [rt.prefill(ids[:, :8])]
    for t in range(8, 12):
        rt.tok.copy_(ids[:, t])
        got.append(rt.step(keep_logits=True))
    _assert_logits(got, want)
    assert 0.0 < rt.realized_sparsity()["mlp"] < stats.mlp_sparsity()     # the union of 3 tokens' sets


def test_bench_decode_input_sparse_row():
    """A TEAL latency row times the input-sparse runtime and reports the decoder weight fraction skipped."""
    m = tiny_model("llama")
    plan = _input_plan(m, torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(16)), 0.5)
    rows = bench_decode(m, plan, batch=1, prompt_len=8, gen_len=5, repeats=1, paired=False)
    assert [r["runtime"] for r in rows] == ["ctxsparse-sparse"]
    assert 0.3 < rows[0]["realized_sparsity"] < 0.7
