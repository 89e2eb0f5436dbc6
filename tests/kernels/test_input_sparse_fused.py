"""The input-sparse kernels with the decoder layer fused around them: the RMS-norm prologues (Llama's and
Gemma's) before QKV and gate|up, act(gate) * up before down, the residual add in the epilogue of O and down.
Against the reference composed of the layer's own ops (the prologue in x's dtype, then the masked product in
fp64, then the residual add); the residual epilogue bit for bit against the unfused kernel + add; masked rows
never read; the paths without the fusion (batch > 1 norms, the masked-load kernel, cuBLAS) compose the same ops."""
import pytest
import torch

from tests.kernels.kernel_support import INTERPRETED, grid, in_default, rel_err, rnd, TOL, up
from tests.kernels.test_input_sparse import CONFIGS, IN, OUT

from kernels import input_sparse_triton as T
from kernels import reference as R
from kernels.common import Prologue

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FUSED = ("local", "local_nosplit", "tile_masked", "tile_compact", "tile_auto")
SIZES = (40, 27, 33)    # three segments (fused QKV), not multiples of the column blocks


def _prologue(kind, gen, dtype, device):
    if kind == "act_mul":
        return Prologue("act_mul", act="silu")
    if kind == "rms1p":     # Gemma's: the weight is 1 + w in fp32
        return Prologue("rms1p", 1.0 + 0.3 * rnd((IN,), gen, F32, device), 1e-6)
    return Prologue("rms", 1.0 + 0.3 * rnd((IN,), gen, dtype, device), 1e-5)


def _gap_thresholds(h, qs):
    """One threshold per quantile, each the midpoint of the widest gap between neighbouring |h| values near it:
    a last-bit difference in the fused norm's 1/rms cannot move an entry across it."""
    a = h.float().abs().flatten().sort().values.cpu()
    out = []
    for q in qs:
        i = int(q * (a.numel() - 1))
        lo, hi = max(i - 4, 0), min(i + 4, a.numel() - 1)
        j = lo + int((a[lo + 1:hi + 1] - a[lo:hi]).argmax())
        out.append(float(a[j] + a[j + 1]) / 2)
    return torch.tensor(out, device=h.device)


def _case(kind, batch, dtype, device, gen, with_res=True):
    p = _prologue(kind, gen, dtype, device)
    x = rnd((batch, 2 * IN if kind == "act_mul" else IN), gen, dtype, device)
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    bias = rnd((OUT,), gen, dtype, device)
    res = rnd((batch, OUT), gen, dtype, device) if with_res else None
    h = R.apply_prologue(x, p)          # what the unfused layer hands the projection
    th = _gap_thresholds(h, (0.3, 0.6, 0.9))
    return p, x, w_t, bias, res, h, th


@grid("dtype,cfg,kind", [[F16, BF16, F32], list(FUSED), ["rms", "rms1p", "act_mul"]],
      in_default((F16, "local", "rms"), (BF16, "tile_masked", "act_mul"), (F32, "tile_compact", "rms1p"),
                 (F16, "tile_auto", "rms"), (BF16, "local_nosplit", "act_mul")))
def test_fused_matches_composed_reference(dtype, cfg, kind, device, gen, poison):
    p, x, w_t, bias, res, h, th = _case(kind, 1, dtype, device, gen)
    out = T.input_sparse_linear_segments(x, w_t, th, SIZES, bias, config=CONFIGS[cfg], prologue=p, residual=res)
    ref = up(res) + R.input_sparse_linear_segments(up(h), up(w_t), th, SIZES, up(bias))
    assert out.shape == (1, OUT) and out.dtype == dtype
    err = rel_err(out, ref)
    assert err <= 2 * TOL[dtype], f"{cfg}/{kind}: rel err {err:.3g} (seed {gen.initial_seed()})"
    # every row inactive on the prologue's output is never read (NaN there would show)
    w_nan = w_t.clone()
    lo = 0
    for s, t in zip(SIZES, th):
        w_nan[~(h.float().abs() > t).any(dim=0), lo:lo + s] = float("nan")
        lo += s
    out_nan = T.input_sparse_linear_segments(x, w_nan, th, SIZES, bias, config=CONFIGS[cfg], prologue=p,
                                             residual=res)
    assert torch.equal(out_nan, out)


@grid("dtype,cfg", [[F16, BF16, F32], list(FUSED)], in_default((BF16, "local"), (F16, "tile_auto")))
def test_residual_epilogue_is_the_add_bit_for_bit(dtype, cfg, device, gen, poison):
    """The epilogue rounds the product to x's dtype and adds the residual as the layer's own add does."""
    x = rnd((1, IN), gen, dtype, device)
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    res = rnd((1, OUT), gen, dtype, device)
    t = torch.quantile(x.float().abs().flatten().cpu(), 0.5).to(device)
    fused = T.input_sparse_linear(x, w_t, t, config=CONFIGS[cfg], residual=res)
    unfused = res + T.input_sparse_linear(x, w_t, t, config=CONFIGS[cfg])
    if dtype == BF16 and INTERPRETED:
        # the interpreter's fp32 -> bf16 cast rounds some ties other than the GPU's round-to-nearest-even
        # (seen on ties): at most one bf16 step apart there
        step = unfused.float().abs().clamp_min(1e-30) * 2.0**-7
        assert ((fused.float() - unfused.float()).abs() <= step).all()
    else:
        assert torch.equal(fused, unfused)


@grid("cfg,kind", [["local", "nosplit", "dense"], ["rms", "act_mul"]],
      in_default(("local", "rms"), ("nosplit", "act_mul"), ("dense", "rms")))
def test_unfused_paths_compose_the_same_ops(cfg, kind, device, gen, poison):
    """Batch 3 (the norms' 1/rms is per token: not fused), the masked-load kernel and cuBLAS: the prologue's
    output through the op, then the add."""
    p, x, w_t, bias, res, h, th = _case(kind, 3, F16, device, gen)
    out = T.input_sparse_linear_segments(x, w_t, th, SIZES, bias, config=CONFIGS[cfg], prologue=p, residual=res)
    ref = up(res) + R.input_sparse_linear_segments(up(h), up(w_t), th, SIZES, up(bias))
    assert rel_err(out, ref) <= 2 * TOL[F16]


def test_bad_prologue_is_rejected(device, gen):
    x = rnd((1, IN), gen, F16, device)
    w_t = rnd((IN, OUT), gen, F16, device)
    with pytest.raises(ValueError, match="prologue kind"):
        T.input_sparse_linear(x, w_t, 0.5, prologue=Prologue("layernorm", x[0]))
    with pytest.raises(AssertionError, match="after the prologue"):      # act_mul wants [B, 2 * in]
        T.input_sparse_linear(x, w_t, 0.5, prologue=Prologue("act_mul", act="silu"))
    with pytest.raises(ValueError, match="unknown activation"):
        T.input_sparse_linear(torch.cat([x, x], 1), w_t, 0.5, prologue=Prologue("act_mul", act="swish"))
    with pytest.raises(AssertionError, match="residual"):
        T.input_sparse_linear(x, w_t, 0.5, residual=x)


@pytest.mark.slow
def test_fused_layer_benchmark_smoke(monkeypatch, capsys):
    """benchmarks.fused_layer on a tiny shape through the interpreted kernels: both chains run, agree, and the
    fused one repeats bit for bit. (slow: 20 s of interpreted kernels for the benchmark script; the kernels it
    times are the default suite's in test_runtime_fused_layer_matches_unfused.)"""
    from benchmarks import fused_layer

    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")
    assert fused_layer.main(["--smoke", "--sparsities", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "repeat identical True" in out and "down + act*up prologue + residual" in out
    err = float(out.split("rel err ")[1].split(",")[0])
    assert err < 2e-2, out


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_ops_fuses_or_composes(backend, monkeypatch, device, gen):
    """kernels.ops hands the prologue and the residual to a backend whose kernel takes them (Triton) and
    composes the same ops around the others (the CPU row kernels): both equal the composed reference."""
    from kernels import ops

    monkeypatch.setenv("CTXSPARSE_KERNELS", backend)
    p, x, w_t, bias, res, h, th = _case("act_mul", 1, F32, "cpu" if backend == "cpu" else device, gen)
    out = ops.input_sparse_linear_segments(x, w_t, th, SIZES, bias, prologue=p, residual=res)
    ref = up(res) + R.input_sparse_linear_segments(up(h), up(w_t), th, SIZES, up(bias))
    assert rel_err(out, ref) <= 2 * TOL[F32]


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "qwen2"])   # qwen2: + QKV bias
def test_runtime_fused_layer_matches_unfused(family, monkeypatch):
    """The decode runtime with input sparsity on every projection, through the Triton kernels (interpreted here):
    each layer runs fused (four launches + attention, counted) and the logits and greedy tokens are those of the
    same runtime unfused and of the HF model under sparse_exec (Qwen2: the QKV bias with the norm prologue)."""
    from tests.workers.decode.test_runtime_inputs import (_assert_logits, _hf_sparse_decode, _input_plan,
                                                          _runtime_decode)
    from tests.workers.tiny_model_support import tiny_model
    from workers.decode import layer as layer_mod
    from workers.decode.runtime import DecodeRuntime

    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")
    m = tiny_model(family)
    g = torch.Generator().manual_seed(5)
    plan = _input_plan(m, torch.randint(0, 128, (2, 24), generator=g), 0.4)
    ids = torch.randint(0, 128, (1, 12), generator=g)      # 10 prompt tokens, 2 decode steps
    calls = []
    real = layer_mod.Step.fused
    monkeypatch.setattr(layer_mod.Step, "fused", lambda self, l, L, x: calls.append(l) or real(self, l, L, x))
    runs = {}
    for fuse in (True, False):
        rt = DecodeRuntime.from_hf(m, count_inputs=False, fuse=fuse).set_plan(plan)
        runs[fuse] = _runtime_decode(rt, ids, 10)
        if fuse:
            assert calls == [0, 1] * 2, calls        # every layer of every decode step fused, none unfused
            calls.clear()
    assert not calls
    want, _ = _hf_sparse_decode(m, plan, ids, 10)
    _assert_logits(runs[True], want)
    _assert_logits(runs[True], runs[False])
