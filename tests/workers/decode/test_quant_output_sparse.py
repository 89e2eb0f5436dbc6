"""Output sparsity over GGUF blocks (FFN-neuron and attention-head predictors, Deja Vu / SVD / gate thresholds, on
``DecodeRuntime.from_gguf``): the ops read the active whole quantized rows of gate / up / QKV and the active rows of
the exact transposed blocks of down / O and give the fp64 reference's values over the dequantized weights
(kernels.cpu_quant's sparse_ffn, sparse_mlp, damage_filter_ffn, threshold_ffn, head_sparse_qkv,
head_sparse_out); a runtime over random blocks decodes every predictor plan as the runtime over the same values
in fp32 (logits to rounding, the same tokens and realized sparsity), the layers without a predictor still in the
one-call native layer; the plan makes the transposed blocks for the layers that need them and drops them after;
on real SmolLM2-135M weights (its Q4_1 GGUF) a Deja Vu plan's greedy tokens over the blocks are the fp32
runtime's. The rows_dot / rows_axpy_t primitives with an index are tested in tests/kernels/test_quant.py. Each case
runs on one instruction-set build (tests/kernels/isa_support.py): every test on the native build; the ops and
three of the runtime plans (Deja Vu on Llama and Gemma-3, gate thresholds on a Qwen2 batch) on every build
CTXSPARSE_TEST_ISAS chooses. About 15 s, 5 s per other build."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels import cpu_quant
from kernels import reference as ref
from kernels.common import apply_act, group_rows
from kernels.quant import QuantWeight
from tests.workers.decode.test_native_layer import _blocks, _decode_logits, _engaged, _quantized, _tiny
from workers.decode.latency import calibrated_input_plan, random_plan
from workers.decode.runtime import DecodeRuntime, runs_on_blocks
from workers.methods.larosa.part import RotatedPlan
from workers.sparsity.predictors.base import SparsityPlan
from workers.methods.threshold.predictor import GateThreshold

# (gate, up, down) formats: Q4_0 / Q4_1 / Q8_0 and a K-quant in each role
FFN_FORMATS = [("Q4_0", "Q4_1", "Q8_0"), ("Q8_0", "Q4_K", "Q4_0"), ("Q4_K", "Q8_0", "Q4_1")]
pytestmark = pytest.mark.usefixtures("cpu_isa")
EVERY = pytest.mark.every_isa


def _d64(w: QuantWeight) -> torch.Tensor:
    return cpu_quant.dequantize(w).double()


def _close(y, want, mass, rel=1e-5):
    """|y - want| <= rel · mass everywhere (mass: the sum of the terms' magnitudes, fp32 rounding's scale)."""
    err = (y.double() - want).abs()
    assert bool((err <= rel * mass + 1e-12).all()), float((err / mass.clamp_min(1e-30)).max())


def _between(v: torch.Tensor) -> float:
    """A threshold in the middle third of ``v``'s values, halfway across their widest gap there: far from every
    value next to fp32 rounding (which cannot flip a row to the other side)."""
    s = v.sort().values
    n = s.numel()
    m = n // 3 + int((s[n // 3 + 1: 2 * n // 3] - s[n // 3: 2 * n // 3 - 1]).argmax()) + 1
    assert float(s[m] - s[m - 1]) > 1e-5 * float(s[-1])
    return float(s[m - 1] + s[m]) / 2


def _index(rng, n: int, k: int, padded: bool):
    """An active set in kernels.common's convention: k unsorted indices (count None), or a buffer of n entries
    whose first k are valid (count k) and the rest garbage."""
    act = torch.tensor(rng.choice(n, k, replace=False), dtype=torch.int32)
    if not padded:
        return act, None
    return torch.cat([act, torch.tensor(rng.integers(0, n, n - k), dtype=torch.int32)]), torch.tensor([k])


@EVERY
@pytest.mark.parametrize("fmts", FFN_FORMATS)
@pytest.mark.parametrize("B", [1, 3])
def test_sparse_ffn_ops_equal_the_dequantized_reference(fmts, B):
    """Gated FFN over a top-k set and over a padded (idx, count) buffer; with the sequential gate filter; the damage
    filter; a non-gated MLP with biases: the fp64 reference over the dequantized weights, within fp32 rounding."""
    rng = np.random.default_rng(11)
    d, D = 256, 512
    wg, wu, wd = _blocks(fmts[0], D, d, rng), _blocks(fmts[1], D, d, rng), _blocks(fmts[2], d, D, rng)
    dt = cpu_quant.TransposedParts.of(wd).one
    Wg, Wu, WdT = _d64(wg), _d64(wu), _d64(wd).t()
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(B))
    x64 = x.double()
    mass_h = (apply_act(x64 @ Wg.t(), "silu").abs() * (x64.abs() @ Wu.abs().t())
              + 1.1 * (x64.abs() @ Wg.abs().t()) * (x64 @ Wu.t()).abs())            # h's rounding scale
    for padded in (False, True):
        idx, count = _index(rng, D, 200, padded)
        y = cpu_quant.sparse_ffn(x, wg, wu, dt, idx, count, "silu")
        want = ref.sparse_ffn(x64, Wg, Wu, WdT, idx, count, "silu")
        rows = idx[:200].long()
        assert y.shape == (B, d) and y.dtype == torch.float32
        _close(y, want, mass_h[:, rows] @ WdT[rows].abs())
    # sequential: gate on the set, rows with |act(gate)| <= f for every token dropped (f: the set's middle)
    idx, count = _index(rng, D, 200, True)
    a = apply_act(x64 @ Wg[idx[:200].long()].t(), "silu").abs().amax(0)
    f = _between(a)
    y = cpu_quant.sparse_ffn(x, wg, wu, dt, idx, count, "silu", f)
    want = ref.sparse_ffn(x64, Wg, Wu, WdT, idx, count, "silu", f)
    _close(y, want, mass_h @ WdT.abs())
    assert (want - ref.sparse_ffn(x64, Wg, Wu, WdT, idx, count, "silu")).abs().max() > 1e-3 * want.abs().max()
    # damage filter: rows whose |act(gate)·up|·c_i <= f for every token dropped
    c = torch.rand(D, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    h = ref.gated_gather_gemv(x64, Wg, Wu, idx, count, "silu")[:, :200]
    dmg = (h.abs() * c[idx[:200].long()]).amax(0)
    f = _between(dmg)
    y = cpu_quant.damage_filter_ffn(x, wg, wu, dt, idx, count, "silu", f, c.float())
    keep = idx[:200].long()[dmg > f]
    want = (apply_act(x64 @ Wg[keep].t(), "silu") * (x64 @ Wu[keep].t())) @ WdT[keep]
    _close(y, want, mass_h @ WdT.abs())
    # non-gated MLP, biases on both projections
    b1, b2 = torch.randn(D) * 0.1, torch.randn(d) * 0.1
    idx, count = _index(rng, D, 300, True)
    y = cpu_quant.sparse_mlp(x, wu, b1, dt, b2, idx, count, "relu")
    want = ref.sparse_mlp(x64, Wu, b1.double(), WdT, b2.double(), idx, count, "relu")
    _close(y, want, (x64.abs() @ Wu.abs().t() + b1.double().abs()) @ WdT.abs() + b2.double().abs())


@EVERY
@pytest.mark.parametrize("B", [1, 2])
def test_threshold_ffn_keeps_each_tokens_own_neurons(B):
    """The gate-threshold FFN after a dense gate: token b adds only the neurons it keeps; the union's rows read
    once; ``stat`` counts the union."""
    rng = np.random.default_rng(12)
    d, D = 256, 512
    wu, wd = _blocks("Q4_1", D, d, rng), _blocks("Q4_K", d, D, rng)
    Wg = torch.randn(D, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.05
    Wu, WdT = _d64(wu), _d64(wd).t()
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(B)).double()
    z = x @ Wg.t()
    a = apply_act(z, "silu")
    t = float(a.abs().quantile(0.6))
    keep = a.abs() > t
    stat = torch.zeros(1, dtype=torch.float64)
    y = cpu_quant.threshold_ffn(x.float(), z.float(), wu, cpu_quant.TransposedParts.of(wd).one, t, "silu",
                                stat=stat)
    want = (torch.where(keep, a, 0) * (x @ Wu.t())) @ WdT
    _close(y, want, (a.abs() * (x.abs() @ Wu.abs().t())) @ WdT.abs())
    assert int(stat) == int(keep.any(0).sum()) < D


@EVERY
@pytest.mark.parametrize("fmts", [("Q4_0", "Q8_0", "Q4_1"), ("Q4_K", "Q4_0", "Q8_0")])
def test_head_sparse_ops_equal_the_dequantized_reference(fmts):
    """QKV rows of the active query heads (the query part scaled, as the folded attention scale) and of every or
    of compact KV heads, biases; O over the active heads' rows of W_oᵀ: the fp64 reference's values."""
    rng = np.random.default_rng(13)
    d, H, KV, hd = 256, 8, 2, 32
    w_qkv = QuantWeight.stack([_blocks(fmts[0], H * hd, d, rng, 0.125), _blocks(fmts[1], KV * hd, d, rng),
                               _blocks(fmts[1], KV * hd, d, rng)])
    w_o = _blocks(fmts[2], d, H * hd, rng)
    W, WoT = _d64(w_qkv), _d64(w_o).t()
    bias, b_o = torch.randn(W.shape[0]) * 0.1, torch.randn(d) * 0.1
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(0))
    mass = x.double().abs() @ W.abs().t() + bias.double().abs()
    for (q_idx, q_count), (kv_idx, kv_count) in (
            ((torch.tensor([6, 1, 3], dtype=torch.int32), None), (torch.arange(KV, dtype=torch.int32), None)),
            ((torch.tensor([5, 2, 0, 0, 7], dtype=torch.int32), torch.tensor([3])),
             (torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1])))):
        got = cpu_quant.head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, H, KV, hd, bias)
        want = ref.head_sparse_qkv(x.double(), W, q_idx, q_count, kv_idx, kv_count, H, KV, hd, bias.double())
        for g, w_, (part_idx, off) in zip(got, want, ((q_idx, 0), (kv_idx, H), (kv_idx, H + KV))):
            assert g.shape == w_.shape
            rows = group_rows(part_idx.long() + off, torch.ones(part_idx.shape[0], dtype=torch.bool), hd)
            _close(g.reshape(2, -1), w_.reshape(2, -1), mass[:, rows])
        a = torch.randn(2, q_idx.shape[0], hd, generator=torch.Generator().manual_seed(1))
        y = cpu_quant.head_sparse_out(a, cpu_quant.TransposedParts.of(w_o).one, q_idx, q_count, hd, b_o)
        want = ref.head_sparse_out(a.double(), WoT, q_idx, q_count, hd, b_o.double())
        _close(y, want, a.double().abs().reshape(2, -1) @ WoT.abs()[group_rows(
            q_idx.long(), torch.ones(q_idx.shape[0], dtype=torch.bool), hd)] + b_o.double().abs())


# ---------------------------------------------------------------------------------------------------------
# the runtime over random blocks against the runtime over their values in fp32
def _dequantized(w):
    """The fp32 runtime weights holding exactly the values of the quantized ``w`` (the fp32 slot layouts)."""
    f = cpu_quant.dequantize
    layers = tuple(dataclasses.replace(
        L, w_qkv=f(L.w_qkv), w_o_t=f(L.w_o_t).t().contiguous(), w_gate=f(L.w_gate) if L.w_gate is not None else None,
        w_up=f(L.w_up), w_down_t=f(L.w_down_t).t().contiguous(), layouts={}) for L in w.layers)
    return dataclasses.replace(w, layers=layers, lm_head=f(w.lm_head), embed=f(w.embed))


def _plan(model, kind: str, wf) -> SparsityPlan:
    """Deja Vu predictors on layer 0 (FFN top-k and heads; layer 1 dense, the native layer's), an SVD-style
    ``positive`` rule on both layers, the sequential gate / damage filters, gate thresholds (the fast path)."""
    if kind == "dejavu":
        return random_plan(model, 0.5, 0.5, rank=16, layers=[0])
    if kind == "svd":
        return random_plan(model, 0.5, rank=16, mlp_rule="positive")
    if kind in ("sequential", "damage"):
        plan = random_plan(model, 0.25, rank=16)
        plan.mlp_mode, plan.seq_filter_on = "sequential", "gate" if kind == "sequential" else "damage"
        plan.seq_filter = {0: 0.1, 1: 0.1} if kind == "sequential" else {0: 0.01, 1: 0.01}
        return plan
    if kind == "threshold":
        plan = SparsityPlan(dense_gate=True)
        for l, L in enumerate(wf.layers):
            plan.mlp[l] = GateThreshold(L.w_gate, wf.act, 0.4)
        return plan
    raise ValueError(kind)


@pytest.mark.parametrize("family,kind,kv_mode,B", [
    pytest.param("llama", "dejavu", "exact", 1, marks=EVERY), ("qwen2", "dejavu", "exact", 1),
    pytest.param("gemma3", "dejavu", "exact", 1, marks=EVERY), ("llama", "dejavu", "active", 1),
    ("llama", "dejavu", "exact", 2), ("llama", "svd", "exact", 1), ("llama", "sequential", "exact", 1),
    ("llama", "damage", "exact", 1), pytest.param("qwen2", "threshold", "exact", 2, marks=EVERY)])
def test_predictor_plans_over_blocks_equal_the_fp32_runtime_over_their_values(family, kind, kv_mode, B):
    """Llama (Q4_1), Qwen2 (QKV biases, five formats), Gemma-3 (q/k and sandwich norms, GeLU-tanh): the plan's
    logits over the blocks equal those over the same values in fp32 within fp32 rounding, the same greedy tokens,
    the same realized sparsity; the plan acts (not the dense logits); the layers without a predictor run in the
    one-call native layer (batch 1, kv_mode exact)."""
    model = _tiny(family, head_dim=32)
    wq = _quantized(model, family)
    wf = _dequantized(wq)
    plan = _plan(model, kind, wf)
    assert runs_on_blocks(plan)
    ids = torch.randint(0, 128, (B, 5), generator=torch.Generator().manual_seed(1))
    rq = DecodeRuntime(wq).set_plan(plan, kv_mode=kv_mode)
    rf = DecodeRuntime(wf).set_plan(plan, kv_mode=kv_mode)
    a, b = _decode_logits(rq, ids, 5), _decode_logits(rf, ids, 5)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    sq, sf = rq.realized_sparsity(), rf.realized_sparsity()
    assert sq.keys() == sf.keys() and all(abs(sq[k] - sf[k]) < 1e-9 for k in sq) and sq["mlp"] > 0.05, (sq, sf)
    dense = _decode_logits(DecodeRuntime(wq), ids, 5)
    assert not torch.allclose(a, dense, rtol=1e-3, atol=1e-3)              # the plan does act
    if kind == "dejavu":
        assert set(rq.sparse_plan.heads) == {0} and sq["heads"] > 0
    if kind in ("sequential", "damage"):            # the filter acts too
        parallel = dataclasses.replace(plan, mlp_mode="parallel", seq_filter={})
        assert not torch.allclose(a, _decode_logits(DecodeRuntime(wq).set_plan(parallel), ids, 5), rtol=1e-3,
                                  atol=1e-3)
    if kind == "threshold":
        assert set(rq.sparse_plan.thr_ffn) == {0, 1}        # the fast path: gate dense, then up / down rows
    nat = _engaged(rq)
    if B == 1 and kv_mode == "exact" and kind == "dejavu":
        assert nat is not None and nat.covers(1) and not nat.covers(0)
    elif B == 1 and kv_mode == "exact":
        assert nat is None                        # every layer has a predictor: the per-op step


def test_the_plan_makes_the_transposed_blocks_it_needs_and_drops_them():
    """FFN predictor on layer 0: W_downᵀ blocks there only; head predictor on layer 1: W_oᵀ there only; a dense
    plan drops both; a TEAL plan keeps its own."""
    model = _tiny("llama", head_dim=32)
    wq = _quantized(model, "llama")
    plan = random_plan(model, 0.5, rank=16, layers=[0])
    plan.attn.update(random_plan(model, None, 0.5, rank=16, layers=[1]).attn)
    rt = DecodeRuntime(wq).set_plan(plan)
    L0, L1 = wq.layers
    assert set(L0.layouts) == {"down_t"} and set(L1.layouts) == {"o_t"}
    assert torch.equal(L0.layouts["down_t"].one.dequantize_reference(), cpu_quant.dequantize(L0.w_down_t).t())
    rt.set_plan(None)
    assert not L0.layouts and not L1.layouts
    rt.set_plan(calibrated_input_plan(model, 0.4, n_tokens=16))
    assert set(L0.layouts) == {"qkv_t", "o_t", "gu_t", "down_t"}
    # without its layout (another runtime over these weights set another plan) the sparse FFN says why
    rt.set_plan(plan)
    other = DecodeRuntime(wq).set_plan(None)
    assert other.sparse_plan.dense and "down_t" not in L0.layouts
    with pytest.raises(RuntimeError, match="no 'down_t' layout"):
        rt.generate(torch.tensor([[1, 2, 3]]), 2)


def test_runs_on_blocks_takes_predictor_plans_not_rotated_ones():
    model = _tiny("llama", head_dim=32)
    wq = _quantized(model, "llama")
    for plan in (None, random_plan(model, 0.5, 0.5, rank=16), calibrated_input_plan(model, 0.4, n_tokens=16)):
        assert runs_on_blocks(plan)
        DecodeRuntime(wq).set_plan(plan)
    rotated = SparsityPlan(parts=[RotatedPlan()])
    assert not runs_on_blocks(rotated)
    with pytest.raises(NotImplementedError, match="a rotated plan folds its rotations into float"):
        DecodeRuntime(wq).set_plan(rotated)


# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dejavu(smollm2):
    """Deja Vu style predictors with random weights (the latency benchmark's shape plans; real GEMVs and top-k):
    FFN 50 % on layers 0-27, heads 3 of 9 skipped on layers 5-27 (Deja Vu keeps the first layers' heads and the
    last layers dense)."""
    m = smollm2.model
    plan = random_plan(m, 0.5, rank=64, layers=range(28))
    plan.attn.update(random_plan(m, None, 0.34, rank=64, layers=range(5, 28), seed=1).attn)
    return plan, DecodeRuntime.from_gguf(m, smollm2.source).set_plan(plan)


@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.slow), 2])     # 2: the threads' shares
def test_smollm2_dejavu_over_blocks_decodes_the_fp32_runtimes_tokens(smollm2, smollm2_dejavu, threads):
    """Real weights: the plan over the Q4_1 blocks (layers 28-29 in the native layer) and over the fp32 weights
    decode the same greedy tokens and report the same realized sparsity; the plan acts."""
    plan, rq = smollm2_dejavu
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tq = rq.generate(ids, 8)
        nat = _engaged(rq)
        assert nat is not None and nat.covers(29) and not nat.covers(0)
        rf = DecodeRuntime.from_hf(smollm2.model, torch.float32, "cpu").set_plan(plan)
        tf = rf.generate(ids, 8)
        assert tq.tolist() == tf.tolist()
        sq, sf = rq.realized_sparsity(), rf.realized_sparsity()
        assert sq == sf and abs(sq["mlp"] - 0.5 * 28 / 30) < 0.01 and sq["heads"] > 0.2, sq
        dense = DecodeRuntime.from_gguf(smollm2.model, smollm2.source).generate(ids, 8)
        assert tq.tolist() != dense.tolist()
    finally:
        torch.set_num_threads(prev)
