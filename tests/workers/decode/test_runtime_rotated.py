"""Rotated (LaRoSA) and rank-sparse (R-Sparse) plans on the decode runtime, against the masked-mode model
(workers.sparsity.sparse_exec) on tiny random models: rotations folded into the weights, adapters on the residual
stream, top-k rows and low-rank terms."""
from __future__ import annotations

import pytest
import torch

from tests.workers.decode.test_runtime_inputs import _assert_logits, _hf_sparse_decode, _hf_sparse_greedy, \
    _runtime_decode
from tests.workers.sparsity.test_larosa import _ctx, _zero_sparsity
from tests.workers.sparsity.test_rsparse import recipe_tokens  # noqa: F401  (a fixture)
from tests.workers.tiny_model_support import tiny_model
from workers.decode.runtime import DecodeRuntime
from workers.sparsity.predictors import fit_method
from workers.methods.larosa.rotations import keep_count


def _hf_rotated(m, plan, ids, n_prompt, greedy: int = 0):
    """The masked model's logits from n_prompt - 1 on (or ``greedy`` tokens): the prompt through the plan's
    rotations at s = 0 (exact, and it leaves v rotated in the cache as the runtime's prefill does), every later
    token with the plan."""
    import copy

    from workers.sparsity.sparse_exec import apply_sparsity

    exact = _zero_sparsity(copy.deepcopy(plan))
    with torch.no_grad():
        with apply_sparsity(m, exact, input_mode="masked", mode="masked"):
            out = m(ids[:, :n_prompt], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        toks = [logits[0].argmax(-1, keepdim=True)]
        with apply_sparsity(m, plan, input_mode="masked", mode="masked") as applied:
            for t in range(n_prompt, n_prompt + greedy - 1 if greedy else ids.shape[1]):
                o = m(toks[-1] if greedy else ids[:, t: t + 1], past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                logits.append(o.logits[:, -1])
                toks.append(o.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(toks, 1) if greedy else (logits, applied.stats)


def _ids(seed=11, n=18):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,rotation,basis", [
    ("llama", "layer", "normed"), ("llama", "block", "normed"), ("qwen2", "model", "normed"),
    ("llama", "layer", "scaled"), ("gemma3", "layer", "normed"), ("qwen2", "none", "normed"),
])
def test_rotated_runtime_is_exact_at_zero_sparsity(tmp_path, family, rotation, basis):
    """Every rotation, adapter and gain folded into the runtime's copy of the weights: at s = 0 its logits are the
    dense runtime's to float32 rounding, and the dense weights are untouched (set_plan(None) gives them back)."""
    m = tiny_model(family)
    plan = _zero_sparsity(fit_method("larosa", _ctx(m, tmp_path), 0.4, rotation=rotation, basis=basis))
    ids = _ids()
    rt = DecodeRuntime.from_hf(m)
    dense = _runtime_decode(rt, ids, 10)
    base = rt.weights
    rt.set_plan(plan)
    assert rt.weights is not base and rt.sparse_plan.attn_fn == rt.sparse_plan.ffn_fn == {}
    if (family, rotation, basis) == ("llama", "block", "normed"):
        assert rt.weights.layers[0].adapt_ffn is not None and rt.weights.layers[1].adapt_attn is not None
    if family == "gemma3" or basis == "scaled":
        assert rt.weights.layers[0].rot_attn is not None and rt.weights.layers[0].adapt_ffn is None
    if rotation == "none":      # only o's rotation (into v and o): the FFN's tensors are shared, not copied
        L, L0 = rt.weights.layers[0], base.layers[0]
        assert L.w_gate is L0.w_gate and L.w_down_t is L0.w_down_t and L.w_qkv is not L0.w_qkv
    rotated = _runtime_decode(rt, ids, 10)
    for a, b in zip(rotated, dense, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert any((a - b).abs().max() > 0 for a, b in zip(rotated, dense))      # it ran on the rotated weights
    rt.set_plan(None)
    assert rt.weights is base


@pytest.mark.parametrize("family,rotation,basis,score", [
    ("llama", "layer", "normed", "abs"), ("llama", "block", "normed", "wina"), ("gemma3", "layer", "normed", "abs"),
    ("qwen2", "layer", "scaled", "abs"),
])
def test_rotated_plan_matches_sparse_exec(tmp_path, family, rotation, basis, score):
    """The runtime's top-k over the rotated weights gives the masked model's logits and greedy tokens, each token
    keeps exactly k inputs of every sparse group, and the weights skipped charge the adapters / rotations as the
    masked model's count does."""
    m = tiny_model(family)
    s = 0.4
    plan = fit_method("larosa", _ctx(m, tmp_path), s, rotation=rotation, basis=basis, score=score)
    ids = _ids()
    want, stats = _hf_rotated(m, plan, ids, 10)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    _assert_logits(_runtime_decode(rt, ids, 10), want)
    steps = ids.shape[1] - 10
    d, D, n_o = 48, 80, m.config.num_attention_heads * (m.config.hidden_size // m.config.num_attention_heads)
    if family == "gemma3":
        n_o = m.config.num_attention_heads * m.config.head_dim
    for l in range(2):                      # exactly k per token on every projection of every layer
        for col, n in ((0, d), (1, d), (2, d), (3, n_o), (4, d), (5, d), (6, D)):
            assert int(rt.counters.inputs[l, col]) == steps * keep_count(s, n)
    sp = rt.realized_sparsity()
    assert sp["weights"] == pytest.approx(stats.weight_skipped(), rel=1e-9)
    assert (sp["weights"] < sp["inputs"]) == (stats.extra_numel > 0)
    assert torch.equal(rt.generate(ids[:, :10], 8), _hf_rotated(m, plan, ids, 10, greedy=8))


def test_rotated_plan_batch_keeps_each_tokens_own_topk(tmp_path):
    """Batch 2: the rows read are the union of the tokens' top-k sets, each token's product on its own k only."""
    m = tiny_model("llama")
    plan = fit_method("larosa", _ctx(m, tmp_path), 0.5)
    prompts = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    got = rt.generate(prompts, 6)
    for b in range(2):
        assert torch.equal(got[b: b + 1], _hf_rotated(m, plan, prompts[b: b + 1], 9, greedy=6))


@pytest.mark.parametrize("family,rho", [("llama", 0.8), ("qwen2", 0.7), ("gemma3", 0.9)])
def test_rank_sparse_plan_matches_sparse_exec(tmp_path, recipe_tokens, family, rho):
    """R-Sparse: the kept inputs through W's rows, the dropped ones through the rank-r factors; logits, greedy
    tokens and the weights skipped (factor bytes charged) are the masked model's."""
    m = tiny_model(family)
    plan = fit_method("rsparse", _ctx(m, tmp_path), 0.5, rho=rho)
    assert any(p.rank > 0 for per in plan.part("rsparse").parts.values() for p in per.values())
    ids = _ids(3)
    want, stats = _hf_sparse_decode(m, plan, ids, 10)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    assert any(g.terms for fn in rt.sparse_plan.ffn_fn.values() for g in fn.keywords["groups"].values())
    _assert_logits(_runtime_decode(rt, ids, 10), want)
    sp = rt.realized_sparsity()
    assert sp["weights"] == pytest.approx(stats.weight_skipped(), rel=1e-9)
    assert sp["weights"] < sp["inputs"]
    assert torch.equal(rt.generate(ids[:, :10], 8), _hf_sparse_greedy(m, plan, ids[:, :10], 8))


def test_rank_sparse_at_full_rank_is_dense_in_the_runtime(tmp_path):
    """Every input dropped to the low-rank term at full rank: W exactly, so the dense runtime's logits."""
    from workers.methods.rsparse.part import LowRankPart, RankSparsePlan
    from workers.sparsity.predictors.base import SparsityPlan
    from workers.loading.adapters import adapter_for, get_path, linear_weight
    from workers.sparsity.input_sparse import projection_paths

    m = tiny_model("llama")
    ad = adapter_for(m)
    parts = {}
    for l, layer in ad.iter_layers(m):
        parts[l] = {}
        for p, path in projection_paths(ad).items():
            u, sig, vh = torch.linalg.svd(linear_weight(get_path(layer, path)).double(), full_matrices=False)
            parts[l][p] = LowRankPart(1e9, "abs", (sig[:, None] * vh).float(), u.float())   # nothing kept
    plan = SparsityPlan()
    plan.parts = [RankSparsePlan(parts)]
    ids = _ids(4)
    dense = _runtime_decode(DecodeRuntime.from_hf(m), ids, 10)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    got = _runtime_decode(rt, ids, 10)
    for a, b in zip(got, dense, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert int(rt.counters.inputs.sum()) == 0          # no input went through W's rows
    assert rt.realized_sparsity()["inputs"] == pytest.approx(1.0, abs=1e-12)


def test_rotated_plan_refused_over_gguf_blocks_and_on_other_models(tmp_path):
    from workers.methods.larosa.runtime import check, rotated_weights
    from workers.decode.weights import from_hf

    m = tiny_model("opt")
    with pytest.raises(ValueError, match="RMS norms and a gated FFN"):
        check(from_hf(m))
    llama = tiny_model("llama")
    plan = fit_method("larosa", _ctx(llama, tmp_path), 0.4)
    w = from_hf(llama)
    w2 = rotated_weights(w, plan.part("larosa"))
    assert w2.layers[0].w_qkv is not w.layers[0].w_qkv and torch.equal(w.layers[0].n1, from_hf(llama).layers[0].n1)
