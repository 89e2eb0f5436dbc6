"""Input sparsity over GGUF blocks (TEAL / WINA plans on ``DecodeRuntime.from_gguf``): the transposed blocks read
only the active inputs' rows and give the masked fp32 products (kernels.cpu_quant.input_sparse_linear_parts,
the per-op step); the one-call native layers (cs_q_layers with kernels.cpu_quant.SparseLayers) give the per-op
step's values and counts; on real SmolLM2-135M weights (its Q4_1 GGUF) the sparse quantized decode's greedy
tokens are the masked fp32 model's. Each case runs on one instruction-set build (tests/kernels/isa_support.py):
every test on the native build; the products, the tiny families, the dense-or-active choice and SmolLM2's tokens
at 1 thread on every build CTXSPARSE_TEST_ISAS chooses. About 15 s, 10 s per other build."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_quant
from tests.workers.decode.test_native_layer import FORMATS_OF, _blocks, _decode_logits, _engaged, _quantized, _tiny
from workers.decode import native_layer
from workers.decode.latency import calibrated_input_plan
from workers.decode.runtime import DecodeRuntime

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _masked_reference(x, weights, scales, thresholds, bias=None):
    """Σ over the inputs with |x_i| > t of x_i W[:, i] (fp64), part by part, from the dequantized weights."""
    outs = []
    for w, sc, t in zip(weights, scales, thresholds):
        W = cpu_quant.dequantize(w).double() * sc
        outs.append((x.double() * (x.abs() > t)) @ W.t())
    y = torch.cat(outs, 1)
    return y if bias is None else y + bias.double()


@pytest.mark.every_isa
@pytest.mark.parametrize("fmts", [("Q4_1", "Q4_1", "Q4_1"), ("Q5_0", "Q8_0", "Q4_K"), ("Q6_K", "Q4_0", "Q5_1")])
def test_transposed_parts_give_the_masked_products_and_counts(fmts):
    """Three parts of three formats (the first scaled by 1/8, as the folded attention scale), a threshold each,
    two tokens and one: equal to the masked fp64 products within fp32 rounding; counts exact."""
    rng = np.random.default_rng(3)
    n_in = 256
    ws = [_blocks(f, rows, n_in, rng) for f, rows in zip(fmts, (64, 32, 96))]
    scales = (0.125, 1.0, 1.0)
    tp = cpu_quant.TransposedParts.of(ws[0].with_scale(0.125), ws[1], ws[2])
    assert tp.sizes == (64, 32, 96) and tp.scales == scales and tp.shape == (n_in, 192)
    thr = torch.tensor([0.3, 0.8, -1.0])            # -1: every input
    bias = torch.randn(192)
    for B in (1, 2):
        x = torch.randn(B, n_in, generator=torch.Generator().manual_seed(B))
        counts = torch.zeros(3, dtype=torch.float64)
        y = cpu_quant.input_sparse_linear_parts(x, tp, thr, bias, counts=counts)
        ref = _masked_reference(x, ws, scales, thr, bias)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))
        assert counts.tolist() == [float((x.abs() > t).sum()) for t in thr]
    with pytest.raises(ValueError, match="2 thresholds for 3 parts"):
        cpu_quant.input_sparse_linear_parts(x, tp, thr[:2])


def test_sparse_layers_refuse_bad_input():
    rng = np.random.default_rng(0)
    tp = cpu_quant.TransposedParts.of(_blocks("Q4_1", 64, 64, rng))
    with pytest.raises(ValueError, match="thresholds for 1 parts"):
        cpu_quant.SparseLayers(2, {0: {"o": (tp, [0.1, 0.2])}})
    with pytest.raises(ValueError, match="group 'ffn'"):
        cpu_quant.SparseLayers(2, {0: {"ffn": (tp, [0.1])}})
    with pytest.raises(IndexError, match="layer 2"):
        cpu_quant.SparseLayers(2, {2: {"o": (tp, [0.1])}})
    with pytest.raises(ValueError, match="float64"):
        cpu_quant.SparseLayers(2, {}, torch.zeros(2, 7))
    with pytest.raises(ValueError, match="share their input"):
        cpu_quant.TransposedParts.of(_blocks("Q4_1", 64, 64, rng), _blocks("Q4_1", 64, 96, rng))


@pytest.mark.every_isa
@pytest.mark.parametrize("family", list(FORMATS_OF))
def test_tiny_families_native_sparse_layers_equal_the_per_op_step(family):
    """Llama (Q4_1), Qwen2 (QKV bias, five formats), Gemma-3 (q/k and sandwich norms, GeLU-tanh) with a TEAL plan
    at 40 % on every projection: the native step's logits equal the per-op step's within the activation function's
    rounding, the same tokens and active-input counts. (Heads of 32: the kernels take parts of 32k outputs.)"""
    model = _tiny(family, head_dim=32)
    w = _quantized(model, family)
    plan = calibrated_input_plan(model, 0.4, n_tokens=32)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    native, per_op = DecodeRuntime(w).set_plan(plan), DecodeRuntime(w, fuse=False).set_plan(plan)
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            a, b = _decode_logits(native, ids, 5), _decode_logits(per_op, ids, 5)
            nat = _engaged(native)
            assert nat is not None and nat.sparse is not None and nat.dense is None and _engaged(per_op) is None
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), family
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            assert torch.equal(native.counters.inputs, per_op.counters.inputs)
            got = native.realized_sparsity()["inputs"]
            assert 0.2 < got < 0.7, got
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.every_isa)])
@pytest.mark.parametrize("sparsity", [0.2, 0.7])
def test_native_layers_choose_dense_rows_on_a_masked_input_or_the_active_rows(sparsity, threads):
    """Above 60 % active inputs a group runs the dense rows on its input with the inactive entries zeroed
    (cpu_quant_layers.c sp_begin; on two threads O's and down's shared inputs through sp_begin_shared), below it the
    active rows; either way the per-op step's values and counts."""
    model = _tiny("llama", head_dim=32)
    w = _quantized(model, "llama")
    plan = calibrated_input_plan(model, sparsity, n_tokens=32)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    native, per_op = DecodeRuntime(w).set_plan(plan), DecodeRuntime(w, fuse=False).set_plan(plan)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = _decode_logits(native, ids, 5), _decode_logits(per_op, ids, 5)
    finally:
        torch.set_num_threads(prev)
    assert _engaged(native).sparse is not None
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert torch.equal(native.counters.inputs, per_op.counters.inputs)
    dense = _decode_logits(DecodeRuntime(w), ids, 5)
    assert not torch.allclose(a, dense, rtol=1e-3, atol=1e-3)          # the plan does act
    got = native.realized_sparsity()["inputs"]
    assert got < 0.4 if sparsity < 0.5 else got > 0.4, got       # each case on its side of the 60 % active choice


@pytest.mark.every_isa
def test_the_dense_choice_and_the_active_rows_give_the_same_layers(smollm2_teal):
    """SmolLM2's layers in one call at s = 0.4 (its TEAL plan), on one and two threads:
    every group's dense rows on the masked input (dense_above 0) and its active rows (dense_above 1) give the same
    stream within fp32 summation order, and the same active counts."""
    _, rt = smollm2_teal
    n = len(rt.weights.layers)
    groups = {l: native_layer.native_groups(rt.weights, rt.sparse_plan, l) for l in range(n)}
    assert all(g is not None and set(g) == set(cpu_quant.SPARSE_GROUPS) for g in groups.values())
    rt.setup(1, 16)
    rt.prefill(torch.tensor([[504, 2365, 6354, 16438]]))
    stack = native_layer.build(rt.weights, rt.cache)
    x = rt.blocks.embed(rt.tok, rt.cache.pos).contiguous()
    pos = int(rt.cache.pos)
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, counts = {}, {}
            for share in (0.0, 1.0):
                counts[share] = torch.zeros(n, 7, dtype=torch.float64)
                out[share] = stack.run(0, n, x.clone(), pos, sparse=cpu_quant.SparseLayers(
                    n, groups, counts[share], dense_above=share)).clone()
            assert torch.equal(counts[0.0], counts[1.0]) and counts[0.0].sum() > 0
            assert torch.allclose(out[0.0], out[1.0], rtol=1e-4, atol=1e-4 * float(out[1.0].abs().max())), threads
    finally:
        torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def smollm2_teal(smollm2):
    plan = calibrated_input_plan(smollm2.model, 0.4, n_tokens=128)
    return plan, DecodeRuntime.from_gguf(smollm2.model, smollm2.source).set_plan(plan)


@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.every_isa), 2])
def test_smollm2_sparse_quantized_tokens_are_the_masked_fp32_models(smollm2, smollm2_teal, threads):
    """TEAL at 40 % on every projection: the quantized runtime (native layers) and the fp32 runtime with the same
    plan decode the same greedy tokens, skip the same share of inputs (within 1 %), and the sparse logits are not
    the dense ones (the plan does act)."""
    plan, rq = smollm2_teal
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tq = rq.generate(ids, 6)
        assert _engaged(rq).sparse is not None
        sq = rq.realized_sparsity()["inputs"]
        rf = DecodeRuntime.from_hf(smollm2.model, torch.float32, "cpu").set_plan(plan)
        tf = rf.generate(ids, 6)
        assert tq.tolist() == tf.tolist()
        assert abs(sq - rf.realized_sparsity()["inputs"]) < 0.01 and 0.3 < sq < 0.6
    finally:
        torch.set_num_threads(prev)


def test_a_group_the_kernels_do_not_take_runs_the_layer_per_op():
    """Gemma-3 with heads of 16 (K/V parts of 16 outputs): the layers with sparse QKV run per op, same values."""
    model = _tiny("gemma3")
    w = _quantized(model, "gemma3")
    plan = calibrated_input_plan(model, 0.4, n_tokens=32)
    rt = DecodeRuntime(w).set_plan(plan)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    a = _decode_logits(rt, ids, 3)
    assert _engaged(rt) is None
    b = _decode_logits(DecodeRuntime(w, fuse=False).set_plan(plan), ids, 3)
    assert torch.equal(a, b)
