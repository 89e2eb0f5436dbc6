"""The quantized CPU step's decoder layers in one native call each (workers.decode.native_layer): the logits and
caches equal the per-op step's (``fuse=False``) BIT FOR BIT -- the same row products and the same glue code on the
same values -- on real SmolLM2-135M weights (Q4_1, its GGUF) at 1 and 2 threads, with the greedy tokens of the
fp32 runtime, and on tiny random Llama, Qwen2 and Gemma-3 layers over mixed GGUF formats (also at 4 and 8
threads: the 1-thread logits bit for bit); where the layer cannot run natively the per-op step runs and says so
(and the failed build warns, once per library); the runtime's options choose the path. Each case runs on one
instruction-set build (tests/kernels/isa_support.py): every test on the native build, the bit-for-bit decodes
(SmolLM2 at 1 thread, the tiny families) on every build CTXSPARSE_TEST_ISAS chooses. About 15 s, 5 s per other
build."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.quant import FORMATS, QuantWeight
from workers.decode import native_layer
from workers.decode.glue import glue_fns
from workers.decode.plan import InputGroup, RuntimePlan
from workers.decode.runtime import DecodeRuntime
from workers.decode.weights import from_hf

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _decode_logits(rt: DecodeRuntime, ids: torch.Tensor, steps: int) -> torch.Tensor:
    rt.setup(ids.shape[0], ids.shape[1] + steps + 1)
    return torch.stack([rt.prefill(ids)] + [rt.step(keep_logits=True) for _ in range(steps)])


def _engaged(rt: DecodeRuntime):
    """What the next step would run natively (None: the per-op step)."""
    return native_layer.for_step(rt.blocks, rt.sparse_plan, rt.cache, glue_fns(False, "kernel"))


@pytest.fixture(scope="module")
def smollm2_quant(smollm2):
    return DecodeRuntime.from_gguf(smollm2.model, smollm2.source)


@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.every_isa), 2])
def test_smollm2_native_layers_equal_the_per_op_step_and_fp32_tokens(smollm2, smollm2_quant, threads):
    rq = smollm2_quant
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rq.configure(fuse=False)
        per_op = _decode_logits(rq, ids, 6)
        k_per_op = rq.cache.k[17].clone()
        assert _engaged(rq) is None
        rq.configure(fuse=True)
        native = _decode_logits(rq, ids, 6)
        assert _engaged(rq) is not None and _engaged(rq).covers(29)
        assert torch.equal(_bits(native), _bits(per_op))
        assert torch.equal(rq.cache.k[17], k_per_op)
        if threads > 1:
            return        # the tokens follow from the logits; 2 threads on a loaded 2-core machine are slow
        # greedy tokens: the fp32 runtime's (the existing quantized-decode pattern)
        rf = DecodeRuntime.from_hf(smollm2.model, torch.float32, "cpu", cpu_rows=True)
        tq, tf = rq.generate(ids, 16), rf.generate(ids, 16)
        assert tq.tolist() == tf.tolist() and "Paris" in smollm2.tokenizer.decode(tq[0])
    finally:
        torch.set_num_threads(prev)


# ---------------------------------------------------------------------------------------------------------
# tiny random models, every projection in random GGUF blocks of a family's formats
FORMATS_OF = {   # q, k, v, o, gate, up, down, LM head
    "llama": ("Q4_1", "Q4_1", "Q4_1", "Q4_1", "Q4_1", "Q4_1", "Q4_1", "Q8_0"),
    "qwen2": ("Q5_0", "Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_1", "Q8_0", "Q8_0"),
    "gemma3": ("Q5_0", "Q5_0", "Q8_0", "Q8_0", "Q5_0", "Q5_0", "Q8_0", "Q8_0"),
}


def _tiny(family: str, head_dim: int = 16):
    import transformers as tf

    from tests.workers.tiny_model_support import randomize_norms_and_biases

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=64, head_dim=head_dim)
    if family == "gemma3":
        cfg = tf.Gemma3TextConfig(num_key_value_heads=1, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"], **common)
    else:
        cfg = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family](num_key_value_heads=2, **common)
    torch.manual_seed(0)
    return randomize_norms_and_biases(tf.AutoModelForCausalLM.from_config(cfg).eval())


def _blocks(fmt: str, rows: int, cols: int, rng, scale: float = 1.0) -> QuantWeight:
    """Random codes and small fp16 scales (a block format), or small fp16 values (F16)."""
    f = FORMATS[fmt]
    if f.block == 1:
        data = torch.from_numpy((rng.standard_normal((rows, cols)) * 0.1).astype(np.float16).view(np.uint8))
        return QuantWeight.of(fmt, data, cols, scale)
    from tests.kernels.test_quant import random_blocks

    return QuantWeight.of(fmt, random_blocks(fmt, rows, cols, rng), cols, scale)


def _quantized(model, family: str, seed: int = 0, formats=None):
    """The runtime weights of ``model`` with every projection and the LM head replaced by random blocks (the
    query part scaled by the folded attention scale, as from_gguf does)."""
    w = from_hf(model, torch.float32, "cpu")
    fq, fk, fv, fo, fg, fu, fd, fh = formats or FORMATS_OF[family]
    dims, rng = w.dims, np.random.default_rng(seed)
    d, D, H, KV, hd = dims.d, dims.D, dims.n_heads, dims.n_kv_heads, dims.head_dim
    layers = [dataclasses.replace(
        L, w_qkv=QuantWeight.stack([_blocks(fq, H * hd, d, rng, w.q_fold), _blocks(fk, KV * hd, d, rng),
                                    _blocks(fv, KV * hd, d, rng)]),
        w_o_t=_blocks(fo, d, H * hd, rng), w_gate=_blocks(fg, D, d, rng), w_up=_blocks(fu, D, d, rng),
        w_down_t=_blocks(fd, d, D, rng)) for L in w.layers]
    head = _blocks(fh, w.vocab, d, rng)
    return dataclasses.replace(w, layers=tuple(layers), lm_head=head, embed=head)


@pytest.mark.every_isa
@pytest.mark.parametrize("family", list(FORMATS_OF))
def test_tiny_families_native_layers_equal_the_per_op_step(family):
    """Llama; Qwen2 (QKV biases, a fused QKV of two formats); Gemma-3 (q/k norms, sandwich norms, GeLU-tanh, a
    sliding window of 4 that the 10 positions pass): native and per-op logits bit for bit, 1 and 2 threads."""
    w = _quantized(_tiny(family), family)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    native, per_op = DecodeRuntime(w), DecodeRuntime(w, fuse=False)
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            a, b = _decode_logits(native, ids, 5), _decode_logits(per_op, ids, 5)
            assert _engaged(native) is not None and _engaged(per_op) is None
            assert torch.equal(_bits(a), _bits(b)), family
            assert bool(torch.isfinite(a).all()) and a[1:].std() > 0
    finally:
        torch.set_num_threads(prev)


@pytest.mark.every_isa
def test_the_thread_team_at_4_and_8_threads_gives_the_1_thread_logits():
    """Users decode on every core, the tests above at 1-2 threads: the one-call layers (cs_q_layers, every layer
    in one parallel region) at 4 and 8 threads (oversubscribed here: a correctness test) give the 1-thread logits
    BIT FOR BIT -- every output's reduction order is fixed whatever the split (a row chunk or a head a task) --
    on the three tiny families; and they are the native path (not the per-op step)."""
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    prev = torch.get_num_threads()
    try:
        for family in FORMATS_OF:
            rt = DecodeRuntime(_quantized(_tiny(family), family))
            torch.set_num_threads(1)
            one = _decode_logits(rt, ids, 4)
            for threads in (4, 8):
                torch.set_num_threads(threads)
                many = _decode_logits(rt, ids, 4)
                assert _engaged(rt) is not None and _engaged(rt).dense is None
                assert torch.equal(_bits(many), _bits(one)), (family, threads)
    finally:
        torch.set_num_threads(prev)


def test_a_layer_the_kernels_do_not_take_runs_per_op_and_says_so():
    """Heads of 12 (H * hd = 48, not a multiple of 32; the O projection in F16): the one-call layer refuses, a
    RuntimeWarning says the per-op step runs, and the logits are that step's."""
    formats = ("Q8_0", "Q8_0", "Q8_0", "F16", "Q8_0", "Q8_0", "F16", "Q8_0")
    w = _quantized(_tiny("llama", head_dim=12), "llama", formats=formats)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    rt = DecodeRuntime(w)
    with pytest.warns(RuntimeWarning, match="per-op step runs"):
        a = _decode_logits(rt, ids, 3)
    assert _engaged(rt) is None
    b = _decode_logits(DecodeRuntime(w, fuse=False), ids, 3)
    assert torch.equal(_bits(a), _bits(b))


def test_the_runtime_options_choose_the_path():
    """Native only for the quantized weights, ``fuse`` on, the kernel glue, batch 1, the exact cache, and the
    layers a plan leaves dense."""
    m = _tiny("llama")
    w = _quantized(m, "llama")
    rt = DecodeRuntime(w)
    rt.setup(1, 16)
    kernel_glue = glue_fns(False, "kernel")
    assert native_layer.for_step(rt.blocks, rt.sparse_plan, rt.cache, kernel_glue) is not None
    assert native_layer.for_step(rt.blocks, rt.sparse_plan, rt.cache, glue_fns(False, "torch")) is None
    rt.setup(2, 16)
    assert native_layer.for_step(rt.blocks, rt.sparse_plan, rt.cache, kernel_glue) is None
    rt.setup(1, 16)
    part = native_layer.for_step(rt.blocks, RuntimePlan(mlp={1: object()}), rt.cache, kernel_glue)
    assert part.covers(0) and not part.covers(1)
    wina = {"down": InputGroup(torch.zeros(1, 96), (64,), 6)}      # per-channel thresholds: per op
    assert native_layer.for_step(rt.blocks, RuntimePlan(in_ffn={0: wina, 1: wina}), rt.cache, kernel_glue) is None
    fp32 = DecodeRuntime.from_hf(m, torch.float32, "cpu")
    fp32.setup(1, 16)
    assert native_layer.for_step(fp32.blocks, fp32.sparse_plan, fp32.cache, kernel_glue) is None
    rt.configure(fuse=False)
    assert native_layer.for_step(rt.blocks, rt.sparse_plan, rt.cache, kernel_glue) is None


def test_without_a_compiler_the_per_op_step_runs_and_says_so(tmp_path):
    """No C compiler (CC fails, an empty kernel cache): neither native library builds, each says so once (a
    NativeBuildWarning on stderr naming CTXSPARSE_CPU_NATIVE=0), the step runs per op on the torch fallbacks,
    and a RuntimeWarning says that the one-call layer cannot run and why. About 10 s."""
    code = """
import warnings, torch
from kernels import cpu, cpu_quant
from tests.workers.decode.test_native_layer import _decode_logits, _quantized, _tiny
from workers.decode.runtime import DecodeRuntime
assert cpu_quant.load_library() is None and not cpu.native_available()
w = _quantized(_tiny("llama"), "llama")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = _decode_logits(DecodeRuntime(w), torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2)), 2)
print([str(c.message) for c in caught if c.category is RuntimeWarning])
print("finite", bool(torch.isfinite(a).all()))
"""
    env = dict(os.environ, CC="false", CTXSPARSE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the one-call native layer cannot run (the native CPU kernels are not built here" in out.stdout
    assert "finite True" in out.stdout
    for name in ("cpu_native", "cpu_quant"):
        assert out.stderr.count(f"NativeBuildWarning: the native CPU library {name} ") == 1, out.stderr[-3000:]
    assert out.stderr.count("set CTXSPARSE_CPU_NATIVE=0 to choose the fallback") == 2
