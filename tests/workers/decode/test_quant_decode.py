"""The decode runtime over the GGUF's quantized blocks (workers.decode.quant_weights, kernels.cpu_quant) on
SmolLM2-135M (Q4_1 layers, Q8_0 embedding / tied LM head): the weights are the model loader's bit for bit, the
greedy tokens are the fp32 runtime's, the logits agree to fp32 summation order; the 8-bit activation option
within its quantization's error bound. Each case runs on one instruction-set build of the native kernels
(tests/kernels/isa_support.py): every test on the native build; the 1-thread greedy decode and the 8-bit
activations on every build CTXSPARSE_TEST_ISAS chooses (the scalar build too on an AVX2 CPU; AVX2-only too on
an AVX-512 one). About 15 s per build (the GGUF's metadata parse, the fp32 structs, short decodes)."""
from __future__ import annotations

import pytest
import torch

import numpy as np

from kernels import cpu_quant
from kernels.quant import SPLIT, QuantWeight, quantize_q8
from workers.decode import quant_weights
from workers.decode.runtime import DecodeRuntime

pytestmark = pytest.mark.usefixtures("cpu_isa")


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


@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.every_isa), 2])
def test_greedy_tokens_equal_fp32(runtimes, smollm2, threads):
    """Same greedy tokens; one more step's logits within 2e-3 of their range. The weights' values are the same,
    so the logits differ by fp32 summation order alone: each product within γ_n ≈ 1e-4 of its terms' mass
    (n <= 1536), and seen at 1-2e-6 of the range after the 30 layers in the native and scalar builds; a wrong
    product moves them by O(1) of the range."""
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


Q8_HALF_STEP = 0.5 + 2 * 127 * 2.0**-24     # |x - x̂| per element in units of its block's scale (round to nearest)


def _gamma(n: int) -> float:
    """γ_n = n·u / (1 - n·u), u = 2^-24: the relative error bound of an fp32 sum of n terms in any order."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def _q8_error_bound(x: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂ fp64, the most |W x - W x̂| can be): x quantized as the kernels do (kernels.quant.quantize_q8: d_b =
    max|x| / 127 per block of 32, |x_j - x̂_j| <= d_b / 2), so |W_i (x - x̂)| <= Σ_b (d_b / 2) Σ_{j in b} |W_ij|."""
    q, d = quantize_q8(x)
    xh = (q.double().reshape(*d.shape, 32) * d.double()[..., None]).reshape(x.shape)
    return xh, (d.double() * Q8_HALF_STEP) @ W.abs().reshape(W.shape[0], -1, 32).sum(-1).t()


def _term_magnitudes(w: QuantWeight, rows: torch.Tensor | None) -> torch.Tensor:
    """fp64 [k, cols]: |scale · code| + |offset| of each weight (times its part's scale), the magnitude of the terms
    the kernels sum for it (the scale and the offset terms apart, whatever the build groups them into)."""
    one = rows is not None and len(w.parts) == 1
    out = []
    for p in w.parts:
        data = p.data[rows].numpy() if one else p.data.numpy()
        fmt = p.fmt
        if fmt.code_bits == 0:                                   # F16 / F32: the values themselves
            vals = data.view(np.float16 if fmt.name == "F16" else np.float32).astype(np.float64)
            out.append(torch.from_numpy(np.abs(vals).reshape(data.shape[0], -1)) * abs(p.scale))
            continue
        sc = SPLIT[fmt.name](data.reshape(-1, fmt.nbytes))
        g = fmt.block // sc.scale.shape[1]
        mag = np.abs(np.repeat(sc.scale.astype(np.float64), g, 1)) * np.abs(sc.code.astype(np.float64))
        if sc.offset is not None:
            mag = mag + np.abs(np.repeat(sc.offset.astype(np.float64), g, 1))
        out.append(torch.from_numpy(mag.reshape(data.shape[0], -1)) * abs(p.scale))
    full = torch.cat(out)
    return full if rows is None or one else full[rows]


def _check_q8_product(what: str, x: torch.Tensor, w: QuantWeight, rows: torch.Tensor | None = None) -> None:
    """y = the kernels' q8 product of x [B, in] with W (its rows ``rows``). With x̂ = quantize_q8(x) and M = Σ_j
    |terms| (|x̂_j| times _term_magnitudes): |y - W x̂| <= γ_{in+4} M (any fp32 summation order of the in products,
    the scales' products and the offsets' -- the scalar build sums element by element), and |y - W x| <= that plus
    the quantization's bound; and some |y - W x| exceeds what fp32 rounding alone could give (γ_{in+4} of
    Σ|W_ij x_j|): the activations are quantized."""
    W = cpu_quant.dequantize(w, rows).double()
    y = cpu_quant.rows_dot(x, w.with_activations("q8"), rows, W.shape[0]).double()
    xh, bound = _q8_error_bound(x, W)
    g = _gamma(x.shape[1] + 4)
    A = _term_magnitudes(w, rows)
    M = xh.abs() @ A.t()
    err_hat = (y - xh @ W.t()).abs()
    assert bool((err_hat <= g * M).all()), (what, float((err_hat / M).max()))
    err = (y - x.double() @ W.t()).abs()
    assert bool((err <= bound + g * M).all()), (what, float((err / bound).max()))
    assert bool((err > g * (x.double().abs() @ A.t())).any()), what


@pytest.mark.every_isa
def test_q8_activations_option(runtimes, smollm2):
    """llama.cpp's arithmetic as an option: 8-bit activations, the same blocks. Per product, on the real weights
    and inputs of layers 0 and 29 (QKV, gate, up: the normed stream; down: the FFN's hidden h; the LM head: the
    final normed stream): the kernels' y equals W x̂ (x̂ = quantize_q8(x), fp64) to fp32 summation order, and
    differs from W x by at most the quantization's bound Σ_b (d_b / 2) Σ_{j in b} |W_ij| plus that -- and by more
    than fp32 rounding: the activations are quantized (_check_q8_product: the bounds; γ_n's worst case for the
    rounding, as real activations' sums are not random-signed: the scalar build reaches 7e-7 of Σ|W x̂|, near
    tests/kernels/test_quant.py's 1e-6 rule for random data; the quantization's errors are 1e-3 to 1e-2 of it,
    0.1-0.25 of their bound). Through 30 layers
    (norms, attention, SiLU) those errors have no useful a-priori bound on the logits: fed fp32's greedy tokens
    (teacher-forced), the logits move by far more than fp32's summation order (1e-4 of their range: seen at 1-2e-6
    without q8) yet the greedy choice agrees with fp32's at 12 or more of 16 steps (15-16 seen: it differs only
    where fp32's top two logits are close), and the free-running text stays sensible."""
    rq, rf = runtimes
    r8 = DecodeRuntime(quant_weights.with_activations(rq.weights, "q8"))
    L8, L = r8.weights.layers[0], rq.weights.layers[0]
    assert L8.w_up.activations == "q8" and L8.w_up.parts[0].data is L.w_up.parts[0].data
    assert r8.weights.embed.activations == "fp32"         # a lookup, not a product
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    # per product: the model's own activations (the HF model, fp32) into the quantized projections
    m = smollm2.model
    with torch.no_grad():
        hs = m(ids, output_hidden_states=True).hidden_states
        for li in (0, len(m.model.layers) - 1):
            layer, Lq = m.model.layers[li], r8.weights.layers[li]
            xn = layer.input_layernorm(hs[li][0]).float().contiguous()
            xf = layer.post_attention_layernorm(hs[li + 1][0]).float().contiguous()
            h = (layer.mlp.act_fn(layer.mlp.gate_proj(xf)) * layer.mlp.up_proj(xf)).contiguous()
            for name, x, w in (("qkv", xn, Lq.w_qkv), ("gate", xf, Lq.w_gate), ("up", xf, Lq.w_up),
                               ("down", h, Lq.w_down_t)):
                _check_q8_product(f"layer {li} {name}", x, w)
        head = r8.weights.lm_head
        rows = torch.arange(0, head.rows, 16)                       # every 16th token of the vocabulary
        _check_q8_product("lm head", hs[-1][0].float().contiguous(), head, rows)
    assert "Paris" in smollm2.tokenizer.decode(r8.generate(ids, 8)[0])
    # teacher-forced: both runtimes fed fp32's greedy tokens (its own continuation), logits compared step by step
    n = 16
    for rt in (r8, rf):
        rt.setup(1, ids.shape[1] + n + 2)
    l8, lf = r8.prefill(ids), rf.prefill(ids)
    agree = 0
    for i in range(n):
        if i:
            t = int(lf.argmax())
            r8.tok.fill_(t)
            rf.tok.fill_(t)
            l8, lf = r8.step(keep_logits=True), rf.step(keep_logits=True)
        assert (l8 - lf).abs().max().item() > 1e-4 * lf.abs().max().item()
        agree += int(l8.argmax() == lf.argmax())
    assert agree >= 12, agree


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
