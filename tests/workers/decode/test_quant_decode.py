"""The decode runtime over the GGUF's quantized blocks (workers.decode.quant_weights, kernels.cpu_quant) on
SmolLM2-135M (Q4_1 layers, Q8_0 embedding / tied LM head): the weights are the model loader's bit for bit, the
greedy tokens are the fp32 runtime's, the logits agree to fp32 summation order. About 15 s (the GGUF's metadata
parse, the fp32 structs, 2 x 2 short decodes)."""
from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantWeight
from workers.decode import quant_weights
from workers.decode.runtime import DecodeRuntime


@pytest.fixture(scope="module")
def runtimes(smollm2):
    rq = DecodeRuntime.from_gguf(smollm2.model, smollm2.source)      # verify=True: every matrix bit for bit
    rf = DecodeRuntime.from_hf(smollm2.model, torch.float32, "cpu", cpu_rows=True)
    return rq, rf


def test_weights_are_the_loaders_and_the_files_bytes(runtimes, smollm2):
    rq, rf = runtimes
    L = rq.weights.layers[0]
    assert rq.weights.quantized and not rf.weights.quantized
    assert L.w_qkv.formats == ("Q4_1", "Q4_1", "Q4_1") and L.w_qkv.parts[0].scale == rf.weights.q_fold
    assert isinstance(rq.weights.lm_head, QuantWeight) and rq.weights.lm_head.formats == ("Q8_0",)
    assert rq.weights.lm_head is rq.weights.embed                     # tied: one table
    # the decoder's matrices and the head: the GGUF's bytes (98 MB file), not fp32's 538 MB
    assert 90e6 < rq.weight_bytes() < 100e6 and rf.weight_bytes() > 5 * rq.weight_bytes()


def test_a_wrong_layout_is_refused(smollm2, monkeypatch):
    """Without the llama query/key row permutation the dequantized rows differ from the loader's: refused."""
    monkeypatch.setattr(quant_weights, "PERMUTED_QK", ())
    with pytest.raises(quant_weights.GGUFMismatch, match="w_qkv"):
        quant_weights.from_gguf(smollm2.model, smollm2.source)


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_equal_fp32(runtimes, smollm2, threads):
    rq, rf = runtimes
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tq, tf = rq.generate(ids, 16), rf.generate(ids, 16)
        assert tq.tolist() == tf.tolist()
        assert "Paris" in smollm2.tokenizer.decode(tq[0])
        # one more step with logits: same up to fp32 summation order (the vocabulary's logits span ~30)
        lq, lf = rq.step(keep_logits=True), rf.step(keep_logits=True)
        assert (lq - lf).abs().max().item() < 2e-3 * lf.abs().max().item()
    finally:
        torch.set_num_threads(prev)


def test_q8_activations_option(runtimes, smollm2):
    """llama.cpp's arithmetic as an option: 8-bit activations. Same blocks; fed the same tokens, the logits move
    by the activations' quantization (about 1 % of their range), far more than by fp32's summation order; the
    greedy text stays sensible (it soon departs from fp32's)."""
    rq, rf = runtimes
    r8 = DecodeRuntime(quant_weights.with_activations(rq.weights, "q8"))
    L8, L = r8.weights.layers[0], rq.weights.layers[0]
    assert L8.w_up.activations == "q8" and L8.w_up.parts[0].data is L.w_up.parts[0].data
    assert r8.weights.embed.activations == "fp32"         # a lookup, not a product
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    assert "Paris" in smollm2.tokenizer.decode(r8.generate(ids, 8)[0])
    # teacher-forced: both runtimes fed fp32's greedy tokens, logits compared step by step
    toks = rf.generate(ids, 6)[0].tolist()
    for rt in (r8, rf):
        rt.setup(1, ids.shape[1] + 8)
        rt.prefill(ids)
    for t in toks[:5]:
        r8.tok.fill_(t)
        rf.tok.fill_(t)
        l8, lf = r8.step(keep_logits=True), rf.step(keep_logits=True)
        span = lf.abs().max().item()
        assert 1e-4 * span < (l8 - lf).abs().max().item() < 5e-2 * span


@pytest.mark.slow      # Gemma-3's load (a minute cold) and its GGUF's metadata parse (15-20 s)
def test_gemma3_mixed_formats_decode_as_fp32():
    """Gemma-3-270M Q4_K_M: query/key Q5_0 and value Q8_0 rows in one fused QKV, O Q4_K, down Q6_K, gate/up
    Q5_0, Q8_0 embedding / tied head; every matrix verified bit for bit, the greedy tokens equal fp32's."""
    from workers.loading.models import load_model

    lm = load_model("gemma3-270m")
    rq = DecodeRuntime.from_gguf(lm.model, lm.source)
    rf = DecodeRuntime.from_hf(lm.model, torch.float32, "cpu", cpu_rows=True)
    L = rq.weights.layers[0]
    assert (L.w_qkv.formats, L.w_o_t.formats, L.w_down_t.formats, L.w_up.formats) == (
        ("Q5_0", "Q5_0", "Q8_0"), ("Q4_K",), ("Q6_K",), ("Q5_0",))
    ids = lm.tokenizer("The capital of Japan is", return_tensors="pt")["input_ids"]
    tq, tf = rq.generate(ids, 16), rf.generate(ids, 16)
    assert tq.tolist() == tf.tolist() and "Tokyo" in lm.tokenizer.decode(tq[0])
    lq, lf = rq.step(keep_logits=True), rf.step(keep_logits=True)
    assert (lq - lf).abs().max().item() < 1e-3 * lf.abs().max().item()
