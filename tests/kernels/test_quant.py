"""GGUF block formats (kernels.quant) and the quantized CPU kernels (kernels.cpu_quant).

Dequantization is checked BIT FOR BIT against gguf-py's ``dequantize`` (what transformers loads a GGUF through) on
real tensors of every type the packaged GGUFs contain and on random blocks of every supported format, for the
numpy reference, the native kernel (AVX-512 where the CPU has it), an AVX2-only build and the scalar fallback.
Products (fp32 activations, accumulation in fp32) are checked against the fp64 product over the same dequantized
weights at |y - y64| <= 1e-6 · Σ|w·x| (the observed error is about 1e-7 of that: fp32 summation order); with 8-bit
activations ("q8") against the fp64 product of the quantized activations x̂ at the same bound, and against the
exact product within the quantization's own bound Σ_blocks (d_b / 2) · Σ_{j in b} |w_j| (|x_j - x̂_j| <= d_b / 2,
d_b = max|x| / 127 over the block of 32). The builds are kernels.isa's (``ISA_FLAGS``, one definition); the
whole-layer tests run on each build ``CTXSPARSE_TEST_ISAS`` chooses (tests/kernels/isa_support.py), and the
thread team at 4 and 8 threads. About 12 s (three compiles on a cold cache).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize

from kernels import cpu_quant as CQ
from kernels import isa
from kernels.common import apply_act
from kernels.quant import BLOCK_FORMATS, FORMATS, QuantWeight, dequantize_blocks, format_of, quantize_q8
from workers.loading.models import packaged_gguf

# where each format keeps its fp16 fields (random bytes there would be NaN / inf scales)
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}
TYPES_IN = {"smollm2-135m": {"Q4_1", "Q8_0", "F32"}, "gemma3-270m": {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"}}


def _libs():
    """Every build of kernels.isa (its ISA_FLAGS): native (AVX-512 paths where the CPU has them), AVX2-only
    (-mno-avx512f) and the scalar fallback (no AVX / AVX2 / FMA / F16C), each compiled for what it asks."""
    libs = {name: CQ.load_library(isa=name) for name in isa.ISA_CHOICES}
    for name, lib in libs.items():
        assert lib is not None, f"the quantized kernels must build here ({name} build)"
        assert CQ.library_isa(lib) == isa.resolved(name), name
    assert libs["scalar"].cs_q_simd() == 0
    return libs


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                         b.view(np.uint32))


def random_blocks(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, row_bytes] of random codes and finite random fp16 scales."""
    f = FORMATS[fmt]
    b = rng.integers(0, 256, (rows * cols // f.block, f.nbytes), dtype=np.uint8)
    for o in F16_AT[fmt]:
        b[:, o:o + 2] = (rng.standard_normal((len(b), 1)) * 0.02).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def random_weight(fmt: str, rows: int, cols: int, rng, scale: float = 1.0) -> QuantWeight:
    return QuantWeight.of(fmt, random_blocks(fmt, rows, cols, rng), cols, scale)


@pytest.mark.parametrize("model", ["smollm2-135m",
                                   # gguf's reader parses Gemma-3's 262k-token vocabulary for 15-20 s; its
                                   # formats are covered by the random blocks below in the default suite
                                   pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_real_tensors_dequantize_bit_for_bit(model):
    """Every tensor type of the packaged GGUFs (a histogram: the known answer), up to two tensors each (the first
    256 rows): reference, native and scalar dequantizers give gguf-py's values bit for bit. About 4 s (SmolLM2)."""
    reader = GGUFReader(str(packaged_gguf(model)))
    hist = collections.Counter(t.tensor_type.name for t in reader.tensors)
    assert set(hist) == TYPES_IN[model], hist
    libs = _libs()
    done = collections.Counter()
    for t in reader.tensors:
        fmt = format_of(t.tensor_type)
        if done[fmt.name] == 2:
            continue
        done[fmt.name] += 1
        data = np.asarray(t.data[:256])
        want = dequantize(data, t.tensor_type)
        assert _bits_equal(dequantize_blocks(fmt, data.view(np.uint8)), want), (t.name, fmt.name)
        if fmt.name == "F32":
            continue
        w = QuantWeight.of(fmt, data, int(t.shape[0]))
        for name, lib in libs.items():
            assert _bits_equal(CQ.dequantize(w, lib=lib).numpy(), want), (t.name, fmt.name, name)
    assert set(done) == TYPES_IN[model]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_random_blocks_dequantize_bit_for_bit(fmt):
    """Formats the packaged files lack too (Q4_0, Q5_1, Q5_K), and every code / scale pattern of those they have."""
    rng = np.random.default_rng(FORMATS[fmt].ggml_type)
    b = random_blocks(fmt, 48, 512, rng)
    want = dequantize(b, GGMLQuantizationType(FORMATS[fmt].ggml_type))
    assert _bits_equal(dequantize_blocks(fmt, b), want)
    w = QuantWeight.of(fmt, b, 512)
    for lib in _libs().values():
        assert _bits_equal(CQ.dequantize(w, lib=lib).numpy(), want)
        rows = torch.tensor([7, 0, 47, 7])
        assert _bits_equal(CQ.dequantize(w, rows, lib=lib).numpy(), want[rows.numpy()])
    # the part scale is one fp32 product, as ``w * scale`` on the fp32 tensor
    ws = w.with_scale(0.125 + 1e-3)
    assert _bits_equal(CQ.dequantize(ws).numpy(), (torch.from_numpy(want) * (0.125 + 1e-3)).numpy())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_transposed_layout_is_exact(fmt):
    """Wᵀ with blocks along the output dimension keeps every value (no requantization)."""
    rng = np.random.default_rng(100 + FORMATS[fmt].ggml_type)
    w = random_weight(fmt, 64, 512, rng)
    wt = w.transposed()
    assert wt.code_bits == (4 if FORMATS[fmt].code_bits == 4 else 8)
    assert torch.equal(wt.dequantize_reference(), CQ.dequantize(w).t())
    # bytes per element: codes (4-bit packed or int8) + scale (+ offset) per group, fp16 where the file's are
    per_elem = {"Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 1.0625, "Q5_1": 1.125, "Q8_0": 1.0625, "Q4_K": 0.75,
                "Q5_K": 1.25, "Q6_K": 1.25}
    assert wt.nbytes == 64 * 512 * per_elem[fmt]


def test_transposed_layout_mixed_parts():
    """Gemma-3's fused QKV: Q5_0 query/key rows and Q8_0 value rows share groups of 32 and no offsets."""
    rng = np.random.default_rng(3)
    w = QuantWeight.stack([random_weight("Q5_0", 64, 256, rng), random_weight("Q8_0", 32, 256, rng)])
    assert torch.equal(w.transposed().dequantize_reference(), CQ.dequantize(w).t())
    with pytest.raises(ValueError, match="groups or offsets"):
        QuantWeight.stack([random_weight("Q4_1", 32, 256, rng), random_weight("Q8_0", 32, 256, rng)]).transposed()


def _close(y, y64, mass, rel=1e-6):
    err = (y.double() - y64).abs()
    assert bool((err <= rel * mass + 1e-30).all()), float((err / mass.clamp_min(1e-30)).max())


# |x - x̂| per element of a q8 block, in units of its scale d: 1/2 (round to nearest) and the fp32 rounding of
# x · (1/d) (two roundings of a value up to 127)
Q8_HALF_STEP = 0.5 + 2 * 127 * 2.0**-24
U32 = 2.0**-24                      # fp32's unit roundoff


def _q8_dequant(q, d):
    """x̂ (fp64) of kernels.quant.quantize_q8's (q, d)."""
    return (q.double().reshape(*d.shape, 32) * d.double()[..., None]).reshape(q.shape)


def _q8_bound(d, W):
    """[B, out]: the most |W x - W x̂| can be, Σ_blocks b (d_b / 2) · Σ_{j in b} |W_ij| (d [B, in / 32] the blocks'
    scales, W fp64 [out, in])."""
    wsum = W.abs().reshape(W.shape[0], -1, 32).sum(-1)                  # [out, in / 32]
    return (d.double() * Q8_HALF_STEP) @ wsum.t()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rows_dot_and_linear(fmt, threads):
    rng = np.random.default_rng(200 + FORMATS[fmt].ggml_type)
    torch.manual_seed(FORMATS[fmt].ggml_type)
    w = random_weight(fmt, 160, 512, rng)
    w2 = random_weight(fmt, 160, 512, rng)
    W, W2 = CQ.dequantize(w).double(), CQ.dequantize(w2).double()
    x = torch.randn(3, 512)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, lib in _libs().items():
            # dense GEMV (every row), 1 and 3 tokens
            for B in (1, 3):
                y = CQ.rows_dot(x[:B], w, None, 160, lib=lib)
                _close(y, x[:B].double() @ W.t(), x[:B].double().abs() @ W.abs().t())
            # a gathered set with a second factor and an activation, padded
            rows = torch.tensor(rng.choice(160, 70, replace=False))
            bias = torch.randn(160)
            z = CQ.rows_dot(x, w, rows, 80, w2=w2, bias=bias, act="silu", lib=lib)
            a64 = x.double() @ W[rows].t() + bias.double()[rows]
            u64 = x.double() @ W2[rows].t()
            want = apply_act(a64, "silu") * u64
            # the tolerance propagated through act(a) * u: |d(act)/da| <= 1.1 for SiLU
            mass = (1.1 * (x.double().abs() @ W[rows].abs().t()) * u64.abs()
                    + apply_act(a64, "silu").abs() * (x.double().abs() @ W2[rows].abs().t()))
            _close(z[:, :70], want, mass)
            assert torch.equal(z[:, 70:], torch.zeros(3, 10)), name
    finally:
        torch.set_num_threads(prev)
    # linear(): the GEMV for few tokens, an exact dequantization + matmul for many (prefill)
    xl = torch.randn(2, 12, 512)
    y = CQ.linear(xl, w)
    assert y.shape == (2, 12, 160)
    _close(y, xl.double() @ W.t(), xl.double().abs() @ W.abs().t())


def test_multi_part_weight_with_scales(gen):
    """A fused QKV of mixed formats, the query part scaled: rows of every part, 2 threads splitting by bytes."""
    rng = np.random.default_rng(5)
    w = QuantWeight.stack([random_weight("Q5_0", 96, 256, rng, scale=0.125), random_weight("Q5_0", 32, 256, rng),
                           random_weight("Q8_0", 32, 256, rng)])
    W = CQ.dequantize(w).double()
    assert torch.equal(CQ.dequantize(w)[:96], CQ.dequantize(QuantWeight(w.parts[:1], 256)))
    x = torch.randn(1, 256, generator=gen)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = CQ.rows_dot(x, w, None, 160)
    finally:
        torch.set_num_threads(prev)
    _close(y, x.double() @ W.t(), x.double().abs() @ W.abs().t())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gated,act", [(True, "silu"), (True, "gelu_tanh"), (False, "relu")])
def test_dense_ffn(gated, act, threads, gen):
    rng = np.random.default_rng(7)
    d, D = 256, 512
    wg = random_weight("Q4_K", D, d, rng) if gated else None
    wu, wd = random_weight("Q5_0", D, d, rng), random_weight("Q6_K", d, D, rng)
    b_up = None if gated else torch.randn(D, generator=gen)
    b_down = None if gated else torch.randn(d, generator=gen)
    x = torch.randn(2, d, generator=gen)
    Wu, Wd = CQ.dequantize(wu).double(), CQ.dequantize(wd).double()
    z = x.double() @ Wu.t() + (b_up.double() if b_up is not None else 0)
    if gated:
        Wg = CQ.dequantize(wg).double()
        h = apply_act(x.double() @ Wg.t(), act) * z
    else:
        h = apply_act(z, act)
    want = h @ Wd.t() + (b_down.double() if b_down is not None else 0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lib in _libs().values():
            y = CQ.dense_ffn(x, wg, wu, wd, act, b_up=b_up, b_down=b_down, lib=lib)
            # h carries its own fp32 error (relative ~1e-6 of its mass) into the down product
            _close(y, want, h.abs() @ Wd.abs().t() + (b_down.double().abs() if b_down is not None else 0), rel=1e-5)
    finally:
        torch.set_num_threads(prev)
    # many tokens: the dequantized matmul path, same function
    xm = torch.randn(12, d, generator=gen)
    ym = CQ.dense_ffn(xm, wg, wu, wd, act, b_up=b_up, b_down=b_down)
    zm = xm.double() @ Wu.t() + (b_up.double() if b_up is not None else 0)
    hm = apply_act(xm.double() @ Wg.t(), act) * zm if gated else apply_act(zm, act)
    _close(ym, hm @ Wd.t() + (b_down.double() if b_down is not None else 0),
           hm.abs() @ Wd.abs().t() + (b_down.double().abs() if b_down is not None else 0), rel=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_rows_axpy_transposed(fmt, threads, gen):
    """The down projection over active neurons through rows of the exact Wᵀ: sorted and unsorted indices, every
    row, a bias; against the fp64 product over the dequantized W."""
    rng = np.random.default_rng(300 + FORMATS[fmt].ggml_type)
    d, D = 320, 512
    w = random_weight(fmt, d, D, rng)                  # W_down [d, D], blocks along D
    wt = w.transposed()
    WT = CQ.dequantize(w).double().t()                 # [D, d]
    bias = torch.randn(d, generator=gen)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lib in _libs().values():
            for rows in (torch.tensor(sorted(rng.choice(D, 200, replace=False).tolist())),
                         torch.tensor(rng.choice(D, 50, replace=False)), None):
                k = D if rows is None else rows.numel()
                h = torch.randn(2, k + 3, generator=gen)
                y = CQ.rows_axpy_t(h, wt, rows, bias=bias, lib=lib)
                sel = WT if rows is None else WT[rows]
                _close(y, h[:, :k].double() @ sel + bias.double(), h[:, :k].double().abs() @ sel.abs() + bias.abs(),
                       rel=1e-6)
    finally:
        torch.set_num_threads(prev)


def test_index_errors_and_embedding():
    rng = np.random.default_rng(9)
    w = random_weight("Q8_0", 64, 256, rng)
    with pytest.raises(IndexError):
        CQ.rows_dot(torch.randn(1, 256), w, torch.tensor([3, 64]), 2)
    with pytest.raises(IndexError):
        CQ.rows_axpy_t(torch.randn(1, 2), w.transposed(), torch.tensor([0, 256]))
    with pytest.raises(ValueError, match="does not match"):
        CQ.rows_dot(torch.randn(1, 128), w, None, 64)
    ids = torch.tensor([[5, 0], [63, 5]])
    e = CQ.embedding(ids, w)
    full = torch.from_numpy(dequantize_blocks("Q8_0", w.parts[0].data.numpy()))
    assert e.shape == (2, 2, 256) and torch.equal(e, full[ids])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_q8_activations_multiply_the_quantized_x(fmt, gen):
    """The "q8" option (llama.cpp's way): the kernels' product is W x̂ with x̂ = kernels.quant.quantize_q8(x),
    to fp32 summation order, in every build and at 2 threads; it differs from W x by the quantization of x: at
    most Σ_blocks (d_b / 2) Σ_{j in b} |w_j|, and by more than fp32 rounding (the activations are quantized)."""
    rng = np.random.default_rng(400 + FORMATS[fmt].ggml_type)
    w = random_weight(fmt, 96, 512, rng).with_activations("q8")
    W = CQ.dequantize(w).double()
    x = torch.randn(3, 512, generator=gen)
    q, d = quantize_q8(x)
    xh = _q8_dequant(q, d)
    assert (xh - x.double()).abs().max() <= d.max() * Q8_HALF_STEP        # half a step of the block's scale
    exact, mass = x.double() @ W.t(), x.double().abs() @ W.abs().t()
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for lib in _libs().values():
            y = CQ.rows_dot(x, w, None, 96, lib=lib)
            _close(y, xh @ W.t(), xh.abs() @ W.abs().t())
            err = (y.double() - exact).abs()
            assert bool((err <= _q8_bound(d, W) + 1e-6 * (xh.abs() @ W.abs().t())).all())
            assert float((err / mass).max()) > 1e-5        # fp32 activations would be within 1e-6 of the mass
    finally:
        torch.set_num_threads(prev)


def test_q8_dense_ffn_within_the_quantization_bound(gen):
    """The q8 dense FFN quantizes x (for gate and up) and its hidden h (for down), 8 bits per 32 each: y = W_down ĥ,
    ĥ = q8(h), h = act(W_gate x̂) · (W_up x̂), x̂ = quantize_q8(x) (the kernels' own, exact). The kernel's h is the
    fp64 h64 of x̂ within its fp32 rounding eps_h (1e-6 of its products' mass, through act as in
    test_rows_dot_and_linear), so its ĥ is the fp64 one, q8(h64), element by element: the block's scale within
    max(eps_h) / 127 (+ its rounding), the code round(h / d) the same except where h64 / d lies within that
    rounding of a rounding boundary (then one of its two neighbours). Hence |y - W_down q8(h64)| is bounded by
    those differences weighted by |W_down| plus the down product's rounding -- and, the error model, |y - W_down h64|
    by h's rounding plus its quantization (d_h / 2 an element). In every build; and the 8-bit arithmetic acts: y
    moves from the fp32-activation FFN's by far more than fp32 rounding."""
    rng = np.random.default_rng(11)
    d, D = 256, 512
    ws = [random_weight("Q4_1", D, d, rng), random_weight("Q4_1", D, d, rng), random_weight("Q4_1", d, D, rng)]
    Wg, Wu, Wd = (CQ.dequantize(w).double() for w in ws)
    x = torch.randn(2, d, generator=gen)
    xh = _q8_dequant(*quantize_q8(x))
    a, u = xh @ Wg.t(), xh @ Wu.t()
    h = apply_act(a, "silu") * u
    eps_h = 1e-6 * (1.1 * (xh.abs() @ Wg.abs().t()) * u.abs() + apply_act(a, "silu").abs() * (xh.abs() @ Wu.abs().t()))
    hb, eb = h.reshape(2, -1, 32), eps_h.reshape(2, -1, 32)
    d64 = hb.abs().amax(-1, keepdim=True) / 127
    assert bool((d64 > 0).all())
    dd = eb.amax(-1, keepdim=True) / 127 + U32 * d64                        # |d_kernel - d64|, at most
    t = hb / d64
    margin = (eb + hb.abs() * dd / d64) / (d64 - dd) + 2 * 127 * U32        # |h'/d' - h64/d64|, at most
    q = torch.round(t)
    near = ((t - t.floor() - 0.5).abs() <= margin).double()                 # the code may be either neighbour
    hq = (d64 * q).reshape(2, D)                                            # q8(h64)
    per = (dd * q.abs() + (d64 + dd) * near).reshape(2, D)                  # |ĥ - q8(h64)|, at most
    tight = per @ Wd.abs().t() + 1e-6 * ((hq.abs() + per) @ Wd.abs().t())
    per_model = eps_h + ((hb.abs() + eb).amax(-1, keepdim=True) / 127 * Q8_HALF_STEP).expand(-1, -1, 32).reshape(2, D)
    model = per_model @ Wd.abs().t() + 1e-6 * ((h.abs() + per_model) @ Wd.abs().t())   # |h - ĥ| <= per_model
    assert float(near.mean()) < 0.01                                        # nearly every code is determined
    w8 = [w.with_activations("q8") for w in ws]
    for name, lib in _libs().items():
        y8 = CQ.dense_ffn(x, *w8, "silu", lib=lib).double()
        err = (y8 - hq @ Wd.t()).abs()
        assert bool((err <= tight).all()), (name, float((err / tight).max()))
        err = (y8 - h @ Wd.t()).abs()
        assert bool((err <= model).all()), (name, float((err / model).max()))
        y32 = CQ.dense_ffn(x, *ws, "silu", lib=lib).double()
        assert float((y8 - y32).norm() / y32.norm()) > 1e-4, name      # fp32 rounding alone: ~1e-7


# ---------------------------------------------------------------------------------------------------------
# whole decoder layers in one native call (LayerStack / cs_q_layers)
def _rope(L: int, hd: int):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(L).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], 1)
    return ang.cos().contiguous(), ang.sin().contiguous()


def _layer_specs(rng, gen, *, gemma: bool, bias: bool, fmts, d: int, D: int, H: int, KV: int, hd: int, L: int,
                 n: int = 2):
    """``n`` random layers: QKV stacked from three formats (the query part scaled as the runtime folds the
    attention scale), O / gate / up / down of their own formats; Gemma-style q/k norms, sandwich norms and a
    sliding window on layer 0 when ``gemma``; Qwen2-style QKV biases when ``bias``; caches already filled."""
    fq, fk, fv, fo, fg, fu, fd = fmts
    cos, sin = _rope(L, hd)

    def vec(m, base=1.0):
        return (base + 0.3 * torch.randn(m, generator=gen)).contiguous()

    specs = []
    for l in range(n):
        specs.append(CQ.LayerSpec(
            qkv=QuantWeight.stack([random_weight(fq, H * hd, d, rng, scale=0.25), random_weight(fk, KV * hd, d, rng),
                                   random_weight(fv, KV * hd, d, rng)]),
            o=random_weight(fo, d, H * hd, rng), gate=random_weight(fg, D, d, rng), up=random_weight(fu, D, d, rng),
            down=random_weight(fd, d, D, rng), n1=vec(d), n2=vec(d),
            k_cache=torch.randn(1, KV, L, hd, generator=gen), v_cache=torch.randn(1, KV, L, hd, generator=gen),
            b_qkv=0.1 * torch.randn((H + 2 * KV) * hd, generator=gen) if bias else None,
            post_attn=vec(d) if gemma else None, post_ffn=vec(d) if gemma else None,
            qn=vec(hd) if gemma else None, kn=vec(hd) if gemma else None, cos=cos, sin=sin,
            window=4 if gemma and l == 0 else None))
    return specs


def _per_op_layer(s, x, pos: int, *, H, KV, hd, eps, norm, act, seen=None):
    """One layer through the per-op kernels (the runtime's step with the native glue), caches written; ``seen``
    (a dict) gets the attention output ("att" [1, H·hd], O's input) and the FFN's normed input ("ffn_in")."""
    from kernels import cpu as C

    one_plus = norm == "rms1p"
    h = C.rms_norm(x, s.n1, eps, one_plus)
    qkv = CQ.linear(h, s.qkv, s.b_qkv)
    q = qkv[:, : H * hd].unflatten(-1, (H, hd))
    k = qkv[:, H * hd: (H + KV) * hd].unflatten(-1, (KV, hd))
    v = qkv[:, (H + KV) * hd:].unflatten(-1, (KV, hd))
    a = C.decode_attention(q, k, v, s.k_cache, s.v_cache, torch.tensor([pos]), s.cos, s.sin, s.qn, s.kn, eps,
                           s.window)
    o = CQ.linear(a, s.o, s.b_o)
    if s.post_attn is not None:
        o = C.rms_norm(o, s.post_attn, eps, one_plus)
    x, h = C.add_rms_norm(x, o, s.n2, eps, one_plus)
    if seen is not None:
        seen.update(att=a.reshape(1, -1), ffn_in=h)
    y = CQ.dense_ffn(h, s.gate, s.up, s.down, act, b_up=s.b_up, b_down=s.b_down)
    if s.post_ffn is not None:
        y = C.rms_norm(y, s.post_ffn, eps, one_plus)
    return x + y


def _copy_caches(specs):
    import dataclasses

    return [dataclasses.replace(s, k_cache=s.k_cache.clone(), v_cache=s.v_cache.clone()) for s in specs]


LAYER_CASES = {   # name: (gemma, bias, formats q, k, v, o, gate, up, down, d, D, H, KV, hd, act, norm)
    "llama": (False, False, ("Q4_1",) * 7, 64, 96, 4, 2, 16, "silu", "rms"),
    "qwen2-mixed": (False, True, ("Q5_0", "Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_1", "Q8_0"), 64, 128, 4, 1, 16,
                    "silu", "rms"),
    "gemma3-kquants": (True, False, ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q5_0", "Q6_K"), 256, 512, 4, 1, 64,
                       "gelu_tanh", "rms1p"),
}


@pytest.mark.every_isa
@pytest.mark.parametrize("activations", ["fp32", "q8"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_stack_equals_the_per_op_layer_bit_for_bit(case, activations, gen, cpu_isa):
    """Whole layers in one native call give the per-op kernels' stream and caches BIT FOR BIT (the same row
    products on the same values in any thread split, and the same glue code, compiled with the same contraction):
    per layer and for both layers in one call, at 1 and 2 threads, at a position inside and at the end of the
    cache, with Llama, Qwen2 (QKV bias, a fused QKV of two formats) and Gemma-3 (q/k norms, sandwich norms, a
    sliding window, K-quants) layers; fp32 and 8-bit activations; in every build (both native libraries built
    for the one instruction set: their glue vectorized alike)."""
    gemma, bias, fmts, d, D, H, KV, hd, act, norm = LAYER_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    L, eps = 12, 1e-6
    specs = _layer_specs(rng, gen, gemma=gemma, bias=bias, fmts=fmts, d=d, D=D, H=H, KV=KV, hd=hd, L=L)
    if activations == "q8":
        import dataclasses

        specs = [dataclasses.replace(s, **{f: getattr(s, f).with_activations("q8")
                                           for f in ("qkv", "o", "gate", "up", "down")}) for s in specs]
    x0 = torch.randn(1, d, generator=gen)
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for pos in (7, L - 1):
                ref_specs, nat_specs = _copy_caches(specs), _copy_caches(specs)
                st = CQ.LayerStack(nat_specs, n_heads=H, n_kv_heads=KV, head_dim=hd, eps=eps, norm=norm, act=act,
                                   activations=activations)
                x_ref, x_nat = x0, x0
                for l, s in enumerate(ref_specs):
                    x_ref = _per_op_layer(s, x_ref, pos, H=H, KV=KV, hd=hd, eps=eps, norm=norm, act=act)
                    x_nat = st.run(l, l + 1, x_nat, pos)
                    assert torch.equal(x_nat.view(torch.int32), x_ref.view(torch.int32)), (threads, pos, l)
                for s, t in zip(ref_specs, nat_specs):
                    assert torch.equal(s.k_cache, t.k_cache) and torch.equal(s.v_cache, t.v_cache)
                both = CQ.LayerStack(_copy_caches(specs), n_heads=H, n_kv_heads=KV, head_dim=hd, eps=eps, norm=norm,
                                     act=act, activations=activations).run(0, len(specs), x0, pos)
                assert torch.equal(both.view(torch.int32), x_ref.view(torch.int32))
                assert x_ref.abs().max() < 1e4 and not torch.equal(x_ref, x0)    # it computed something finite
    finally:
        torch.set_num_threads(prev)


def test_layer_stack_refusals(gen):
    """Positions outside the cache, shapes the kernels do not take and mixed activation modes are refused with a
    clear error. (Each build's layers: test_layer_stack_equals_the_per_op_layer_bit_for_bit.)"""
    rng = np.random.default_rng(13)
    d, D, H, KV, hd, L, eps = 64, 96, 4, 2, 16, 8, 1e-5
    specs = _layer_specs(rng, gen, gemma=False, bias=True, fmts=("Q4_1",) * 3 + ("Q8_0",) * 4, d=d, D=D, H=H,
                         KV=KV, hd=hd, L=L, n=1)
    x = torch.randn(1, d, generator=gen)
    kw = dict(n_heads=H, n_kv_heads=KV, head_dim=hd, eps=eps, norm="rms", act="silu")
    st = CQ.LayerStack(_copy_caches(specs), **kw)
    with pytest.raises(ValueError, match="position 8 outside"):
        st.run(0, 1, x, L)
    with pytest.raises(IndexError):
        st.run(0, 2, x, 0)
    import dataclasses

    odd = dataclasses.replace(specs[0], o=QuantWeight.of("F32", torch.randn(d, 48).view(torch.uint8).numpy(), 48))
    with pytest.raises(ValueError, match="multiples of 32"):
        CQ.LayerStack([odd], **dict(kw, head_dim=12))
    mixed = dataclasses.replace(specs[0], up=specs[0].up.with_activations("q8"))
    with pytest.raises(ValueError, match="activations"):
        CQ.LayerStack([mixed], **kw)


# ---------------------------------------------------------------------------------------------------------
# the thread team at 4 and 8 threads (users decode on every core; the tests above run 1-2): oversubscribed on a
# small machine, a correctness test
TEAM = (4, 8)


def _gamma(n: int) -> float:
    """γ_n = n·u / (1 - n·u): the relative error bound of an fp32 sum of n terms in any order (Higham)."""
    return n * U32 / (1 - n * U32)


def _at_threads(threads: int, fn):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(prev)


def _sparse_groups(specs, names, thr):
    """Input-sparse groups of every layer (kernels.cpu_quant.SparseLayers' ``groups``), one threshold each part."""
    make = {"qkv": lambda s: CQ.TransposedParts.of(s.qkv), "o": lambda s: CQ.TransposedParts.of(s.o),
            "gu": lambda s: CQ.TransposedParts.of(s.gate, s.up), "down": lambda s: CQ.TransposedParts.of(s.down)}
    out = {}
    for l, s in enumerate(specs):
        out[l] = {}
        for g in names:
            tp = make[g](s)
            out[l][g] = (tp, [thr] * len(tp.parts))
    return out


@pytest.mark.every_isa
def test_layer_stack_thread_team_at_4_and_8_threads(gen, cpu_isa):
    """cs_q_layers at 4 and 8 threads against 1 thread, two layers in one call. Each output's reduction order is
    fixed, whatever the split, for the dense rows (a row chunk a task), the attention (a head a task), QKV and
    gate|up over their active inputs (columns split), and O and down on a masked input (dense_above 0: their dense
    rows): the stream and the caches BIT FOR BIT, every layer case, fp32 and 8-bit activations. O and down over
    their active rows split by ROWS on several threads (cpu_quant_layers.c sp_rows_partial: per-thread partial sums,
    then their sum): a different fp32 summation order of the same terms, so within 2·γ_n of Σ_j |a_j·W_ij| (both
    orders within γ_n of the exact sum, n = the inputs + 2) plus the residual add's rounding -- checked one
    projection at a time on a Llama layer of offset-free formats (each term's magnitude |a_j·W_ij|), with O's
    case on an FFN of zero weights (the stream after the layer is x + O's output)."""
    pos = 7
    # dense layers, every case and activation mode: bit for bit
    for case, (gemma, bias, fmts, d, D, H, KV, hd, act, norm) in LAYER_CASES.items():
        rng = np.random.default_rng(sum(map(ord, case)))
        specs = _layer_specs(rng, gen, gemma=gemma, bias=bias, fmts=fmts, d=d, D=D, H=H, KV=KV, hd=hd, L=12)
        x = torch.randn(1, d, generator=gen)
        for acts in ("fp32", "q8"):
            if acts == "q8":
                import dataclasses

                specs = [dataclasses.replace(s, **{f: getattr(s, f).with_activations("q8")
                                                   for f in ("qkv", "o", "gate", "up", "down")}) for s in specs]
            kw = dict(n_heads=H, n_kv_heads=KV, head_dim=hd, eps=1e-6, norm=norm, act=act, activations=acts)

            def run(sparse_names=(), dense_above=1.0, specs=specs, kw=kw, x=x):
                cs = _copy_caches(specs)
                st = CQ.LayerStack(cs, **kw)
                sp = (None if not sparse_names else
                      CQ.SparseLayers(st.n, _sparse_groups(cs, sparse_names, 0.5), dense_above=dense_above))
                return st.run(0, st.n, x, pos, sparse=sp), cs

            variants = [((), 1.0)]
            if acts == "fp32" and KV * hd % 32 == 0:             # input-sparse parts: multiples of 32 outputs
                variants += [(("qkv", "gu"), 1.0), (("qkv", "o", "gu", "down"), 0.0)]
            for names, da in variants:
                y1, c1 = _at_threads(1, lambda: run(names, da))
                assert torch.isfinite(y1).all() and not torch.equal(y1, x)
                for T in TEAM:
                    yT, cT = _at_threads(T, lambda: run(names, da))
                    assert torch.equal(yT.view(torch.int32), y1.view(torch.int32)), (case, acts, names, da, T)
                    for a, b in zip(c1, cT):
                        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
    # O and down over their active rows: per-thread partial sums
    d, D, H, KV, hd, eps = 64, 128, 4, 2, 16, 1e-6
    rng = np.random.default_rng(17)
    fmts = ("Q5_0", "Q5_0", "Q8_0", "Q4_0", "Q5_0", "Q8_0", "Q4_0")      # no offsets: |term| = |a_j|·|W_ij|
    base = _layer_specs(rng, gen, gemma=False, bias=False, fmts=fmts, d=d, D=D, H=H, KV=KV, hd=hd, L=12, n=1)[0]
    zero_down = QuantWeight.of("Q8_0", np.zeros((d, D // 32 * 34), dtype=np.uint8), D)
    import dataclasses

    kw = dict(n_heads=H, n_kv_heads=KV, head_dim=hd, eps=eps, norm="rms", act="silu")
    x = torch.randn(1, d, generator=gen)
    for group, spec in (("o", dataclasses.replace(base, down=zero_down)), ("down", base)):
        seen = {}
        _per_op_layer(_copy_caches([spec])[0], x, pos, H=H, KV=KV, hd=hd, eps=eps, norm="rms", act="silu",
                      seen=seen)
        if group == "o":
            inp, W = seen["att"], CQ.dequantize(spec.o).double()
        else:
            inp, W = CQ.rows_dot(seen["ffn_in"], spec.gate, None, D, w2=spec.up, act="silu"), \
                CQ.dequantize(spec.down).double()
        t = float(inp.abs().median())                                 # about half the inputs active
        mass = (inp.double().abs() * (inp.abs() > t)) @ W.abs().t()    # Σ_j |a_j·W_ij| over the active inputs

        def run(spec=spec, group=group, t=t):
            cs = _copy_caches([spec])
            st = CQ.LayerStack(cs, **kw)
            counts = torch.zeros(1, 7, dtype=torch.float64)
            y = st.run(0, 1, x, pos, sparse=CQ.SparseLayers(1, _sparse_groups(cs, [group], t), counts, 1.0))
            return y, counts

        y1, counts = _at_threads(1, run)
        col = 3 if group == "o" else 6
        assert 0 < counts[0, col] < inp.shape[1], counts                 # input-sparse, not dense
        for T in TEAM:
            yT, _ = _at_threads(T, run)
            bound = 2 * _gamma(inp.shape[1] + 2) * mass + 2 * U32 * y1.double().abs()
            err = (yT.double() - y1.double()).abs()
            assert bool((err <= bound).all()), (group, T, float((err / bound).max()))


@pytest.mark.parametrize("fmts", [("Q4_1", "Q8_0"), ("Q5_0", "Q4_K")])
def test_input_sparse_parts_thread_team_at_4_and_8_threads(fmts, gen):
    """kernels.cpu_quant.input_sparse_linear_parts (cs_qt_axpy: threads split the output columns, no partial
    sums) at 4 and 8 threads: the 1-thread result bit for bit, in every build, 1 and 3 tokens."""
    rng = np.random.default_rng(23)
    n_in = 256
    tp = CQ.TransposedParts.of(random_weight(fmts[0], 384, n_in, rng, scale=0.125), random_weight(fmts[1], 256, n_in,
                                                                                                   rng))
    thr = torch.tensor([0.6, 0.9])
    for lib in _libs().values():
        for B in (1, 3):
            x = torch.randn(B, n_in, generator=gen)
            y1 = _at_threads(1, lambda: CQ.input_sparse_linear_parts(x, tp, thr, lib=lib))
            assert y1.abs().max() > 0
            for T in TEAM:
                yT = _at_threads(T, lambda: CQ.input_sparse_linear_parts(x, tp, thr, lib=lib))
                assert torch.equal(yT.view(torch.int32), y1.view(torch.int32)), (T, B)
