"""Input-sparse (TEAL/WINA) column-sparse GEMV vs the torch reference (fp64 ground truth): every launch path
(no split, split + reduce kernel, split + ticket reduce, CUDA-core FMA, register-prefetched tensor-core MMA, the
local compaction, the batch-1 tile kernel's masked tiles / compacted rows / per-program choice, cuBLAS on the
masked x), masked rows never read, per-channel (WINA) thresholds, edges, bits, the path and dense rules, and the
peer benchmark's loader."""
import sys

import pytest
import torch

from tests.kernels.kernel_support import grid, grid_of, in_default, rel_err, rnd, TOL, up

from kernels import input_sparse_triton as T
from kernels import ops
from kernels import reference as R

IN, OUT = 72, 100  # not multiples of the blocks: K and column tails are exercised
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# every launch path; blocks small enough that the test shapes span several of them
MASK = dict(path="mask")   # the masked-load kernel (at batch >= 2 the op's own choice on a GPU is cuBLAS)
CONFIGS = {
    "nosplit": dict(MASK, BLOCK_N=32, BLOCK_K=32, splits=1, dot=True),
    "split_reduce": dict(MASK, BLOCK_N=32, BLOCK_K=16, splits=3, dot=True, reduce="kernel"),
    "split_ticket": dict(MASK, BLOCK_N=16, BLOCK_K=16, splits=4, dot=True, reduce="ticket"),
    "fma": dict(MASK, BLOCK_N=32, BLOCK_K=16, splits=2, dot=False, reduce="ticket"),
    "fma_nosplit": dict(MASK, BLOCK_N=64, BLOCK_K=32, splits=1, dot=False),
    "mma": dict(MASK, BLOCK_N=32, BLOCK_K=16, splits=3, dot=False, mma=True, reduce="ticket"),
    # compaction inside each program: K slices of 32 channels (the last one partial), 8 active rows per step
    "local": dict(path="local", per=32, BLOCK_N=32, BLOCK_R=8, num_warps=4),
    "local_nosplit": dict(path="local", per=128, BLOCK_N=64, BLOCK_R=16, num_warps=4),
    # the batch-1 tile kernel (a batch > 1 takes the masked-load kernel): K slices of 32 channels (3, the last
    # partial), 32-column blocks (the last partial); masked tiles with the ticket, compacted rows two steps ahead
    # in private scratch rows, and the per-program choice (half the slice) with a reduce launch, slices adjacent
    "tile_masked": dict(path="tile", BLOCK_M=8, TILES=4, BLOCK_N=32, compact=0.0, num_warps=4),
    "tile_compact": dict(path="tile", BLOCK_M=32, TILES=1, BLOCK_N=32, BLOCK_R=8, compact=1.0, depth=2,
                         private=True, num_warps=4),
    "tile_auto": dict(path="tile", BLOCK_M=8, TILES=4, BLOCK_N=32, BLOCK_R=8, compact=0.5, depth=1,
                      reduce="kernel", order="split", num_warps=4),
    "dense": dict(path="dense"),
}
TILES = ("tile_masked", "tile_compact", "tile_auto")


def _thr(x, s):
    """Threshold at the s-quantile of |x| (fp32, as a 0-d tensor on x's device)."""
    return torch.quantile(x.float().abs().flatten().cpu(), s).to(x.device)


def _check(out, ref, dtype, gen, what=""):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what} rel err {err:.3g} > {TOL[dtype]} (seed {gen.initial_seed()})"


# every dtype and both batch shapes on the paths the frozen configs take (CUDA-core FMA with a ticket reduce at
# batch 1-2, the tensor-core dot at batch 4-8); the other launch paths once per dtype, the tile kernel at batch 1
MATRIX = ([(dtype, batch, cfg) for cfg in ("fma", "split_ticket") for dtype in DTYPES for batch in (1, 3)]
          + [(dtype, 1 if cfg in TILES else 3 if i % 2 else 1, cfg)
             for cfg in sorted(set(CONFIGS) - {"fma", "split_ticket"}) for i, dtype in enumerate(DTYPES)])
F32, F16, BF16 = DTYPES
# in the interpreter (no GPU) the default suite takes every launch path once, every dtype and batch shape among
# them, and the tile kernel's three loops in fp16 and bf16; the rest of MATRIX is marked grid
MATRIX_DEFAULT = {(F16, 1, "fma"), (BF16, 1, "split_ticket"), (F32, 1, "nosplit"), (F16, 3, "split_reduce"),
                  (BF16, 1, "fma_nosplit"), (F32, 1, "mma"), (F32, 1, "local"),
                  (F16, 3, "local_nosplit"), (F16, 3, "dense")} | {m for m in MATRIX if m[2] in TILES and m[0] != F32}
assert MATRIX_DEFAULT <= set(MATRIX) and {c for _, _, c in MATRIX_DEFAULT} == set(CONFIGS)


@grid_of("dtype,batch,cfg", MATRIX, lambda *m: m in MATRIX_DEFAULT)
def test_matches_reference(dtype, batch, cfg, device, gen, poison):
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    bias = rnd((OUT,), gen, dtype, device) if batch == 3 else None
    for s in (0.0, 0.5, 0.9):
        x = rnd((batch, IN), gen, dtype, device)
        t = _thr(x, s)
        out = T.input_sparse_linear(x, w_t, t, bias, config=CONFIGS[cfg])
        ref = R.input_sparse_linear(up(x), up(w_t), t, up(bias))
        assert out.shape == (batch, OUT) and out.dtype == dtype
        _check(out, ref, dtype, gen, f"s={s}")


@grid("batch,cfg", [[1, 2], ["nosplit", "split_ticket", "fma", "mma", "local", *TILES]],
      lambda batch, cfg: batch == 2 and cfg not in TILES or batch == 1 and cfg in ("fma", "local", *TILES[:2]))
def test_inactive_rows_are_never_read(batch, cfg, device, gen, poison):
    """Rows of w_t whose channel is inactive for every token hold NaN: a read would poison y."""
    dtype = torch.float16
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((batch, IN), gen, dtype, device)
    t = _thr(x, 0.6)
    union = (x.float().abs() > t).any(dim=0)
    assert 0 < int(union.sum()) < IN
    w_nan = w_t.clone()
    w_nan[~union] = float("nan")
    out = T.input_sparse_linear(x, w_nan, t, config=CONFIGS[cfg])
    assert torch.isfinite(out).all()
    ref = R.input_sparse_linear(up(x), up(w_t), t)  # the NaN rows are exactly the skipped ones
    _check(out, ref, dtype, gen)


@grid("cfg", [["nosplit", "split_reduce", "split_ticket", "local", *TILES, "dense"]],
      lambda cfg: cfg not in ("split_ticket", "tile_masked", "tile_auto"))
def test_nothing_active_and_all_active(cfg, device, gen, poison):
    dtype = torch.float32
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((1 if cfg in TILES else 2, IN), gen, dtype, device)
    bias = rnd((OUT,), gen, dtype, device)
    big = float(x.abs().max()) + 1.0
    none = T.input_sparse_linear(x, w_t, big, config=CONFIGS[cfg])
    assert torch.equal(none, torch.zeros_like(none))
    none_b = T.input_sparse_linear(x, w_t, big, bias, config=CONFIGS[cfg])
    assert torch.equal(none_b, bias[None, :].expand(x.shape[0], OUT))
    for t in (-1.0, 0.0):  # every channel active (x has no exact zeros): the dense product
        out = T.input_sparse_linear(x, w_t, t, bias, config=CONFIGS[cfg])
        _check(out, up(x) @ up(w_t) + up(bias), dtype, gen, f"t={t}")


def test_threshold_forms_agree(device, gen):
    dtype = torch.float16
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((3, IN), gen, dtype, device)
    t = _thr(x, 0.5)
    a = T.input_sparse_linear(x, w_t, t)
    b = T.input_sparse_linear(x, w_t, float(t))
    c = T.input_sparse_linear(x, w_t, t.reshape(1).double())  # same value, another shape and dtype
    assert torch.equal(a, b) and torch.equal(a, c)


# run-to-run identity is about the order of the split reductions on a GPU; the interpreter runs a launch's programs
# one after another, so there it cannot differ: slow there (tests/kernels/kernel_support.py)
@grid("cfg", [["split_reduce", "split_ticket", "fma", "mma", "local", *TILES]], lambda cfg: False)
def test_bit_identical_repeats(cfg, device, gen):
    dtype = torch.bfloat16
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((1 if cfg in TILES else 3, IN), gen, dtype, device)
    t = _thr(x, 0.4)
    first = T.input_sparse_linear(x, w_t, t, config=CONFIGS[cfg])
    for _ in range(4):
        assert torch.equal(T.input_sparse_linear(x, w_t, t, config=CONFIGS[cfg]), first)


@grid("dtype,cfg", [[F32, BF16], ["nosplit", "split_ticket", "split_reduce", "local", *TILES, "dense"]],
      in_default((BF16, "nosplit"), (F32, "local"), (BF16, "tile_auto"), (F32, "dense")))
def test_segments_per_projection_thresholds(dtype, cfg, device, gen, poison):
    """Fused QKV: one x, three output segments (sizes not multiples of BLOCK_N), one threshold each."""
    sizes = (40, 27, 33)
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((1 if cfg in TILES else 2, IN), gen, dtype, device)
    bias = rnd((OUT,), gen, dtype, device)
    qs = (0.2, 0.6, 0.9)
    th = torch.stack([_thr(x, q) for q in qs])
    ref = R.input_sparse_linear_segments(up(x), up(w_t), th, sizes, up(bias))
    out = T.input_sparse_linear_segments(x, w_t, th, sizes, bias, config=CONFIGS[cfg])
    _check(out, ref, dtype, gen, "tensor thresholds")
    out_f = T.input_sparse_linear_segments(x, w_t, [float(v) for v in th], sizes, bias, config=CONFIGS[cfg])
    assert torch.equal(out, out_f)
    # each segment reads only the rows active under its own threshold (cuBLAS reads them all)
    w_nan = w_t.clone()
    lo = 0
    for s, t in zip(sizes, th):
        w_nan[~(x.float().abs() > t).any(dim=0), lo:lo + s] = float("nan")
        lo += s
    if cfg != "dense":
        out_nan = T.input_sparse_linear_segments(x, w_nan, th, sizes, bias, config=CONFIGS[cfg])
        assert torch.equal(out_nan, out)
    # one segment == the plain op
    one = T.input_sparse_linear_segments(x, w_t, th[1:2], (OUT,), bias, config=CONFIGS[cfg])
    assert torch.equal(one, T.input_sparse_linear(x, w_t, th[1], bias, config=CONFIGS[cfg]))


@grid("dtype,cfg", [[F16, BF16, F32], ["fma", "split_ticket", "nosplit", "mma", "local", *TILES, "dense"]],
      in_default((F16, "fma"), (BF16, "nosplit"), (F16, "local"), (F16, "tile_compact"), (BF16, "dense")))
def test_per_channel_thresholds(dtype, cfg, device, gen, poison):
    """WINA: one threshold per segment and input channel (t / ‖W[:, i]‖), read with x: the same product as the
    reference, only rows active under their own channel's threshold read, and a row of equal thresholds gives
    the scalar op's bits."""
    sizes = (40, 27, 33)
    w_t = rnd((IN, OUT), gen, dtype, device, IN**-0.5)
    x = rnd((1 if cfg in TILES else 2, IN), gen, dtype, device)
    norms = torch.rand(len(sizes), IN, generator=gen).to(device) * 3 + 0.1
    score_t = torch.stack([_thr(x.float() * n, q) for n, q in zip(norms, (0.3, 0.6, 0.85))])
    th = (score_t[:, None] / norms).float().contiguous()              # [nseg, in]
    ref = R.input_sparse_linear_segments(up(x), up(w_t), th, sizes)
    out = T.input_sparse_linear_segments(x, w_t, th, sizes, config=CONFIGS[cfg])
    _check(out, ref, dtype, gen, "per-channel")
    w_nan = w_t.clone()
    lo = 0
    for s, t in zip(sizes, th):
        on = (x.float().abs() > t[None, :]).any(dim=0)
        assert 0 < int(on.sum()) < IN
        w_nan[~on, lo:lo + s] = float("nan")
        lo += s
    if cfg != "dense":
        assert torch.equal(T.input_sparse_linear_segments(x, w_nan, th, sizes, config=CONFIGS[cfg]), out)
    one = T.input_sparse_linear(x, w_t, th[1], config=CONFIGS[cfg])          # [in]: one segment
    _check(one, R.input_sparse_linear(up(x), up(w_t), th[1]), dtype, gen, "one segment")
    flat = torch.full((1, IN), float(score_t[1] / 2), device=device)
    assert torch.equal(T.input_sparse_linear(x, w_t, flat, config=CONFIGS[cfg]),
                       T.input_sparse_linear(x, w_t, flat[0, 0], config=CONFIGS[cfg]))


def test_bad_input_is_rejected(device, gen):
    w_t = rnd((IN, OUT), gen, torch.float16, device)
    x = rnd((1, IN), gen, torch.float16, device)
    with pytest.raises(AssertionError, match="dtype"):
        T.input_sparse_linear(x.float(), w_t, 0.1)
    with pytest.raises(AssertionError, match="contiguous"):
        T.input_sparse_linear(x, rnd((OUT, IN), gen, torch.float16, device).t(), 0.1)
    with pytest.raises(AssertionError, match="x has d"):
        T.input_sparse_linear(rnd((1, IN + 1), gen, torch.float16, device), w_t, 0.1)
    with pytest.raises(AssertionError, match="batch"):
        T.input_sparse_linear(rnd((9, IN), gen, torch.float16, device), w_t, 0.1)
    with pytest.raises(AssertionError, match="threshold"):
        T.input_sparse_linear(x, w_t, torch.tensor([0.1, 0.2], device=device))
    with pytest.raises(AssertionError, match="per-channel"):
        T.input_sparse_linear_segments(x, w_t, torch.zeros(2, IN + 1, device=device), (50, 50))
    with pytest.raises(AssertionError, match="sum to"):
        T.input_sparse_linear_segments(x, w_t, [0.1, 0.2], (50, 49))
    with pytest.raises(AssertionError, match="thresholds expected"):
        T.input_sparse_linear_segments(x, w_t, [0.1], (50, 50))


def test_ops_dispatch(monkeypatch, device, gen):
    w_t = rnd((IN, OUT), gen, torch.float32, device, IN**-0.5)
    x = rnd((2, IN), gen, torch.float32, device)
    t = _thr(x, 0.5)
    ref = R.input_sparse_linear(up(x), up(w_t), t)
    for name in ("triton", "reference", "npu"):
        monkeypatch.setenv("CTXSPARSE_KERNELS", name)
        _check(ops.input_sparse_linear(x, w_t, t), ref, torch.float32, gen, name)
        seg = ops.input_sparse_linear_segments(x, w_t, torch.stack([t, t]), (60, 40))
        _check(seg, ref, torch.float32, gen, name + " segments")
        per = torch.stack([torch.full((IN,), float(t), device=device), torch.rand(IN, generator=gen).to(device)])
        _check(ops.input_sparse_linear_segments(x, w_t, per, (60, 40)),
               R.input_sparse_linear_segments(up(x), up(w_t), per, (60, 40)), torch.float32, gen,
               name + " per-channel")


def test_path_choice():
    """Batch 1 on CUDA takes the shape's default kernel (tile: q/o and GQA k/v; local: gate|up, fused QKV and
    down), cuBLAS on the masked x from batch 2 and below the kind's crossover when the caller says its
    sparsity, the masked-load kernel on the CPU; an explicit path wins (tile falls back to the masked-load
    kernel past batch 1); a wrong one is refused by name."""
    from kernels import configs as C

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert T._config(1, 4096, 4096, cuda, None)["path"] == "tile"
    assert T._config(1, 4096, 1024, cuda, None)["path"] == "tile"
    assert T._config(1, 4096, 6144, cuda, None)["path"] == "local"     # a GQA model's fused QKV
    assert T._config(1, 4096, 11008, cuda, None)["path"] == "local"
    assert T._config(1, 11008, 4096, cuda, None)["path"] == "local"
    assert T._config(2, 4096, 4096, cuda, None)["path"] == "dense"
    assert T._config(2, 4096, 4096, cpu, None)["path"] == "mask"
    assert T._config(1, 4096, 11008, cpu, None)["path"] == "mask"
    cross = C.INPUT_MIN_SPARSITY["wide_out"]
    assert T._config(1, 4096, 11008, cuda, {"sparsity": cross - 0.01})["path"] == "dense"
    assert T._config(1, 4096, 11008, cuda, {"sparsity": cross})["path"] == "local"
    assert T._config(4, 4096, 4096, cuda, {"path": "tile"})["path"] == "mask"
    assert T._config(1, 4096, 4096, cuda, {"path": "local"})["per"] == C.INPUT_SPARSE_LOCAL["square"]["per"]
    assert T._config(1, 11008, 4096, cuda, None)["BLOCK_R"] == C.INPUT_SPARSE_LOCAL["wide_in"]["BLOCK_R"]
    # gate|up in one launch (out >= 16,384) takes 1,024-channel slices, one of them alone 512
    assert T._config(1, 4096, 22016, cuda, None)["per"] == C.INPUT_SPARSE_LOCAL["widest_out"]["per"] == 1024
    assert T._config(1, 4096, 11008, cuda, None)["per"] == C.INPUT_SPARSE_LOCAL["wide_out"]["per"] == 512
    assert T._config(1, 4096, 1024, cuda, None)["BLOCK_M"] == C.INPUT_SPARSE_TILE["narrow_out"]["BLOCK_M"]
    assert {C.tile_kind(4096, 11008), C.tile_kind(11008, 4096), C.tile_kind(4096, 4096),
            C.tile_kind(4096, 1024)} == set(C.INPUT_SPARSE_TILE) == set(C.INPUT_MIN_SPARSITY)
    with pytest.raises(ValueError, match="path must be one of"):
        T._config(1, 4096, 4096, cuda, {"path": "gather"})


@grid("cfg", [["tile_masked", "tile_compact", "tile_auto"]], lambda cfg: cfg == "tile_auto")
def test_tile_even_blocks(cfg, device, gen, poison):
    """Columns a multiple of BLOCK_N (no column mask in the weight loads) and K a multiple of the slice, fp16,
    at a sparsity where the per-program choice takes both loops."""
    k, n = 64, 128
    w_t = rnd((k, n), gen, torch.float16, device, k**-0.5)
    for s in (0.3, 0.5, 0.8):
        x = rnd((1, k), gen, torch.float16, device)
        t = _thr(x, s)
        out = T.input_sparse_linear(x, w_t, t, config=CONFIGS[cfg])
        _check(out, R.input_sparse_linear(up(x), up(w_t), t), torch.float16, gen, f"s={s}")


def test_peer_loader(tmp_path):
    """The peer benchmark imports a user's file by path, stands in for imports of the file's own project, and
    adapts the call convention it documents (x [1, 1, in], weight [out, in] column-major, float threshold, bin)."""
    from benchmarks.input_sparse import Peer

    f = tmp_path / "user_kernel.py"                  # a masked dense product in the peer's convention, not a kernel
    f.write_text("import torch\nfrom project_only_module import Base\n"
                 "class Wrapper(Base):\n    pass\n"
                 "def masked_product(x, weight, threshold, level):\n"
                 "    assert x.shape[:2] == (1, 1) and weight.stride(1) > 1 and isinstance(threshold, float)\n"
                 "    return torch.where(x.abs() > threshold, x, 0) @ weight.t()\n")
    peer = Peer.load(f"{f}:masked_product")
    assert peer.name == "user_kernel:masked_product"
    gen = torch.Generator().manual_seed(0)
    x, w_t = torch.randn(1, 16, generator=gen), torch.randn(16, 8, generator=gen)
    y = peer.call(x, w_t, 0.5, 0.5)
    assert y.shape == (1, 8) and torch.allclose(y, R.input_sparse_linear(x, w_t, 0.5))
    assert "project_only_module" not in sys.modules   # the stand-in left with the load
    with pytest.raises(AttributeError):
        Peer.load(f"{f}:no_such_function")
