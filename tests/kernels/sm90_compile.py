"""Compile every Triton kernel of ``kernels/`` for sm_90 (Triton's own LLVM and ptxas, no GPU needed) and check that
none is left out: ``python -m tests.kernels.sm90_compile`` (run by tests/kernels/test_cuda_compile.py).

Must run without TRITON_INTERPRET (which makes @triton.jit return interpreted functions). A kernel is a @triton.jit
function of a ``kernels`` module that some module launches (``name[grid](...)``); every kernel needs a case in
CASES (its launch options as the code or configs.py pick them on a GPU), and every other @triton.jit function (a
helper) must be called by a compiled kernel. A new kernel without a case fails here. The cases compile in
parallel worker processes (the two cores of CI: about half the time).
"""
from __future__ import annotations

import importlib
import inspect
import multiprocessing as mp
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"

# argument types by name; other pointers point to the activation dtype, other scalars are i32
INT_PTRS = {"pos_ptr": "*i64", "qidx_ptr": "*i32", "qcount_ptr": "*i32", "idx_ptr": "*i32", "count_ptr": "*i32",
            "q_idx_ptr": "*i32", "q_count_ptr": "*i32", "kv_idx_ptr": "*i32", "kv_count_ptr": "*i32",
            "kv_slot_ptr": "*i32", "idx2_ptr": "*i32", "count2_ptr": "*i32", "keep_ptr": "*i8", "cnt_ptr": "*i32",
            "sidx_ptr": "*i32", "hist_ptr": "*i32", "part_ptr": "*i32"}
F32_PTRS = {"cos_ptr", "sin_ptr", "qn_ptr", "kn_ptr", "ws_ptr", "b1_ptr", "s_ptr", "bias_ptr", "thr_ptr", "sv_ptr",
            "v_ptr", "v2_ptr"}
FLOATS = {"eps", "thr", "t0", "t1", "t2", "t3"}
# a floating-point atomic (atom / red on f16, bf16, f32, f64, packed pairs): its summation order varies run to run
FLOAT_ATOMIC = re.compile(r"\b(?:atom|red)(?:\.\w+)*\.(?:f16|bf16|f32|f64)(?:x2)?\b")


class Case(NamedTuple):
    module: str                 # kernels.<module>
    kernel: str
    dtype: str                  # the activation dtype: fp16 / bf16 / fp32
    consts: dict
    ptrs: dict                  # argument types that differ from the defaults above
    options: dict               # num_warps, num_stages, launch_pdl


def _case(module, kernel, dtype, consts, ptrs=None, **options) -> Case:
    return Case(module, kernel, dtype, consts, ptrs or {}, {"num_warps": 4, **options})


def cases() -> list[Case]:
    from kernels.decode_attn_triton import NUM_WARPS, block_n_for
    from kernels.select_triton import MULTI_CHUNK, MULTI_WARPS
    from kernels.topk_mask_triton import MAX_N

    out = []
    # decode attention: fp16 / bf16 / fp32, every optional part off and on, one program or split + combine
    for dt, flags in (("fp16", (0, 0, 1, 0, 0, 0)), ("bf16", (1, 1, 1, 1, 1, 1)), ("fp32", (0, 0, 0, 0, 0, 1)),
                      ("fp16", (1, 1, 1, 0, 0, 1))):
        consts = dict(zip(("HAS_IDX", "HAS_COUNT", "ROPE", "NORM", "WINDOW", "SPLIT"), map(bool, flags)), HD_PAD=128,
                      BLOCK_N=block_n_for(128))
        out.append(_case("decode_attn_triton", "_decode_attn_kernel", dt, consts, num_warps=NUM_WARPS))
        out.append(_case("decode_attn_triton", "_combine_kernel", dt, dict(HD_PAD=128, SP_PAD=8)))
    # the fused FFN kernel (batch 1) and its reduce, with programmatic dependent launch and without
    for pdl in (False, True):
        out.append(_case("ffn_triton", "_fused_ffn_kernel", "fp16",
                         dict(MODE=1, ACT=2, HAS_COUNT=True, HAS_BIAS=False, B_PAD=1, BLOCK_R=2, D_PAD=4096,
                              EARLY_DOWN=True, PDL=pdl), num_warps=8))
        out.append(_case("_launch", "_reduce_kernel", "fp16", dict(HAS_BIAS=False, S_PAD=512, BLOCK=16, PDL=pdl),
                         launch_pdl=pdl))
    # the split path (configs.GATHER / DOWN): batch-1 CUDA-core rows, batch >= 2 tensor-core tl.dot; the sequential
    # pipeline's gate filter and scaled up projection; the head-grouped down (the attention output projection)
    gemv = dict(ACT=1, HAS_COUNT=True, HAS_BIAS=False, FILTER=False, DOT_F32=False)
    out.append(_case("ffn_triton", "_gather_gemv_kernel", "fp16",
                     dict(gemv, MODE=1, B_PAD=1, BLOCK_R=2, BLOCK_K=4096, USE_DOT=False)))
    out.append(_case("ffn_triton", "_gather_gemv_kernel", "bf16",
                     dict(gemv, MODE=1, B_PAD=16, BLOCK_R=32, BLOCK_K=256, USE_DOT=True), ptrs={"out_ptr": "*fp32"}))
    out.append(_case("ffn_triton", "_gather_gemv_kernel", "fp16",
                     dict(gemv, MODE=0, FILTER=True, B_PAD=2, BLOCK_R=32, BLOCK_K=256, USE_DOT=True),
                     ptrs={"out_ptr": "*fp32"}))
    out.append(_case("ffn_triton", "_gather_gemv_kernel", "bf16",
                     dict(gemv, MODE=2, ACT=0, B_PAD=1, BLOCK_R=2, BLOCK_K=4096, USE_DOT=False),
                     ptrs={"out_ptr": "*fp32"}))
    down = dict(HAS_COUNT=True, DOT_F32=False, BLOCK_D=128)
    out.append(_case("_launch", "_gather_down_kernel", "fp16",
                     dict(down, GROUP=1, B_PAD=1, BLOCK_R=64, USE_DOT=False), ptrs={"h_ptr": "*fp32"}))
    out.append(_case("_launch", "_gather_down_kernel", "bf16",
                     dict(down, GROUP=1, B_PAD=16, BLOCK_R=32, USE_DOT=True), ptrs={"h_ptr": "*fp32"}))
    out.append(_case("_launch", "_gather_down_kernel", "fp16", dict(down, GROUP=128, B_PAD=1, BLOCK_R=64,
                                                                     USE_DOT=False)))
    # device-side compaction: one scan, and chunked past COMPACT_CHUNK entries
    for n_pad in (4096, 32768):
        out.append(_case("ffn_triton", "_compact_kernel", "fp32",
                         dict(HAS_IDX=True, HAS_V=True, B_PAD=1, N_PAD=n_pad, CHUNK=8192), num_warps=16))
    # head-sparse attention projections
    out.append(_case("attn_triton", "_kv_heads_kernel", "fp16", dict(HAS_COUNT=True, Q_PAD=32, KV_PAD=8)))
    out.append(_case("attn_triton", "_qkv_kernel", "fp16",
                     dict(HD=128, HAS_QC=True, HAS_KVC=True, HAS_BIAS=True, B_PAD=1, BLOCK_R=2, BLOCK_K=4096)))
    # input sparsity (configs.INPUT_SPARSE / INPUT_SPARSE_LOCAL): batch 1 CUDA-core loop with the ticket reduce,
    # the register-prefetched tensor-core loop, batch >= 4 tl.dot over three segments with per-channel (WINA)
    # thresholds, and the in-program compaction path
    isp = dict(NSEG=1, THR_PTR=True, THR_VEC=False, HAS_BIAS=False, PARTIAL=True, TICKET=True, S_PAD=64, B_R=1,
               DOT_F32=False, IEEE=False)
    out.append(_case("input_sparse_triton", "_input_sparse_kernel", "fp16",
                     dict(isp, B_PAD=1, BLOCK_K=16, BLOCK_N=64, USE_DOT=False, MMA=False)))
    out.append(_case("input_sparse_triton", "_input_sparse_kernel", "bf16",
                     dict(isp, B_R=2, B_PAD=2, BLOCK_K=16, BLOCK_N=128, USE_DOT=False, MMA=True)))
    out.append(_case("input_sparse_triton", "_input_sparse_kernel", "fp16",
                     dict(isp, NSEG=3, THR_VEC=True, HAS_BIAS=True, B_R=4, B_PAD=16, BLOCK_K=64, BLOCK_N=128,
                          USE_DOT=True, MMA=False), num_stages=5))
    # the in-program compaction path plain, and with the layer fused around it (Llama's norm prologue + the
    # residual epilogue; act(gate) * up before down at batch 2)
    loc = dict(NSEG=1, THR_PTR=True, THR_VEC=False, HAS_BIAS=False, PARTIAL=True, TICKET=True, S_PAD=32, B_R=1,
               B_PAD=1, PER=512, BLOCK_R=32, BLOCK_N=128, XPRO=0, ACT=0, HAS_RES=False)
    out.append(_case("input_sparse_triton", "_input_sparse_local_kernel", "bf16", loc))
    out.append(_case("input_sparse_triton", "_input_sparse_local_kernel", "fp16", dict(loc, XPRO=1, HAS_RES=True)))
    out.append(_case("input_sparse_triton", "_input_sparse_local_kernel", "bf16",
                     dict(loc, XPRO=3, ACT=2, HAS_RES=True, B_R=2, B_PAD=2)))
    # the batch-1 tile kernel (configs.INPUT_SPARSE_TILE): masked tiles with the ticket, compacted rows two steps
    # ahead in private scratch rows, the per-program choice over three segments with per-channel thresholds and
    # a reduce launch; the dense path's mask launch
    tile = dict(NSEG=1, THR_PTR=True, THR_VEC=False, HAS_BIAS=False, PARTIAL=True, S_PAD=16, EVEN_N=True,
                SPLIT_MAJOR=False, TICKET=True, PRIVATE=False, DEPTH=1, BLOCK_R=32, XPRO=0, ACT=0, HAS_RES=False)
    out.append(_case("input_sparse_triton", "_input_sparse_tile_kernel", "fp16",
                     dict(tile, COMPACT=0, BLOCK_M=32, TILES=8, BLOCK_N=128)))
    out.append(_case("input_sparse_triton", "_input_sparse_tile_kernel", "bf16",
                     dict(tile, COMPACT=1, PRIVATE=True, DEPTH=2, BLOCK_M=1024, TILES=1, BLOCK_N=128)))
    out.append(_case("input_sparse_triton", "_input_sparse_tile_kernel", "fp16",
                     dict(tile, NSEG=3, THR_VEC=True, HAS_BIAS=True, EVEN_N=False, SPLIT_MAJOR=True, TICKET=False,
                          COMPACT=2, BLOCK_M=64, TILES=4, BLOCK_N=64, BLOCK_R=64)))
    # the fused layer's prologues and epilogue: Gemma's norm (fp32 weight) on compacted rows, act(gate) * up on
    # masked tiles with the residual add
    out.append(_case("input_sparse_triton", "_input_sparse_tile_kernel", "bf16",
                     dict(tile, COMPACT=1, PRIVATE=True, BLOCK_M=1024, TILES=1, BLOCK_N=128, XPRO=2),
                     {"g_ptr": "*fp32"}))
    out.append(_case("input_sparse_triton", "_input_sparse_tile_kernel", "fp16",
                     dict(tile, COMPACT=0, BLOCK_M=32, TILES=8, BLOCK_N=128, XPRO=3, ACT=2, HAS_RES=True)))
    for dt, vec in (("fp16", False), ("bf16", True)):
        out.append(_case("input_sparse_triton", "_mask_kernel", dt,
                         dict(NSEG=3, THR_PTR=True, THR_VEC=vec, BLOCK=1024)))
    # the one-CTA top-k select: packed counts (1 and 2 bits a step), 16- and 32-bit keys
    for bits in (1, 2):
        for dt, key_bits in (("fp16", 16), ("fp32", 32)):
            out.append(_case("select_triton", "_topk_select_kernel", dt, dict(KEY_BITS=key_bits, BITS=bits,
                                                                              BLOCK=16384),
                             ptrs={"s_ptr": "*" + dt, "out_ptr": "*i32"}, num_warps=16))
    # the k-th largest |x| as a threshold (LaRoSA's top-k into the input-sparse kernels): every activation dtype
    # (the longest row at its 16 warps once; shorter rows for the other dtypes)
    for dt, nseg, block, warps in (("fp16", 3, 16384, 16), ("bf16", 1, 1024, 4), ("fp32", 2, 4096, 8)):
        out.append(_case("select_triton", "_topk_threshold_kernel", dt,
                         dict(NSEG=nseg, NSEG_P=4 if nseg == 3 else nseg, BITS=2, BLOCK=block),
                         ptrs={"x_ptr": "*" + dt, "out_ptr": "*fp32"}, num_warps=warps))
    # the multi-CTA select's three kernels (16-bit keys)
    for dt in ("fp16", "bf16"):
        ptrs = {"s_ptr": "*" + dt, "out_ptr": "*i32"}
        out.append(_case("select_triton", "_multi_hist_hi_kernel", dt, dict(CHUNK=MULTI_CHUNK), ptrs,
                         num_warps=MULTI_WARPS))
        for kern in ("_multi_hist_lo_kernel", "_multi_write_kernel"):
            out.append(_case("select_triton", kern, dt, dict(P_PAD=64, CHUNK=MULTI_CHUNK), ptrs, num_warps=MULTI_WARPS))
    # the scoring forward's fused RMS norm (Llama's gain; Gemma's 1 + w) and rotary embedding (head_dim 64)
    for one_plus in (False, True):
        out.append(_case("norm_rope_triton", "_rms_norm_kernel", "fp32", dict(ONE_PLUS=one_plus, BLOCK=1024)))
    out.append(_case("norm_rope_triton", "_rope_kernel", "fp32", dict(BLOCK_H=16, BLOCK=32), num_warps=4))
    # an input-sparse projection's masked input in one pass (TEAL's |x|, WINA's |x| · column norm)
    for has_scale in (False, True):
        out.append(_case("input_mask_triton", "_masked_inputs_kernel", "fp32", dict(HAS_SCALE=has_scale, BLOCK=2048),
                         num_warps=8))
    # a top-k mask in one pass (the oracle's, Deja Vu's and the SVD predictor's in a scoring forward): the block of
    # SmolLM2's and Gemma-3's FFN widths, and of the widest row one program holds
    for block in (2048, MAX_N):
        out.append(_case("topk_mask_triton", "_topk_mask_kernel", "fp32", dict(BLOCK=block), {"out_ptr": "*i1"},
                         num_warps=4 if block <= 4096 else 8))
    return out


def compile_case(c: Case) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(f"kernels.{c.module}"), c.kernel)
    sig = {}
    for name in kernel.arg_names:
        if name in c.ptrs:
            sig[name] = c.ptrs[name]
        elif name in c.consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = INT_PTRS.get(name) or ("*fp32" if name in F32_PTRS else "*" + c.dtype)
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=c.consts), target=GPUTarget("cuda", 90, 32),
                       options=c.options)
    assert k.asm["cubin"], c
    # bit-reproducible (README): no floating-point atomic add anywhere, only integer ones (counters, histograms)
    assert not FLOAT_ATOMIC.search(k.asm["ptx"]), f"{c.module}.{c.kernel}: a floating-point atomic"
    return f"{c.module}.{c.kernel}"


def jit_sources() -> dict[str, str]:
    """Every @triton.jit function defined in a kernels module, compiled or interpreted: {"module.name": source}."""
    from triton.runtime.jit import KernelInterface

    found = {}
    for path in sorted(KERNELS_DIR.glob("*.py")):
        mod = importlib.import_module(f"kernels.{path.stem}")
        for name, obj in vars(mod).items():
            if isinstance(obj, KernelInterface) and getattr(obj, "fn", None) is not None \
                    and obj.fn.__module__ == mod.__name__:
                found[f"{path.stem}.{name}"] = inspect.getsource(obj.fn)
    return found


def uncovered(compiled: set[str]) -> tuple[list[str], list[str]]:
    """(kernels launched somewhere in kernels/ without a compile case, helpers no compiled kernel reaches)."""
    jit = jit_sources()
    sources = "\n".join(p.read_text() for p in KERNELS_DIR.glob("*.py"))
    launched = {q for q in jit if re.search(rf"\b{q.split('.')[1]}\[", sources)}
    reached, todo = set(), [q for q in compiled if q in jit]
    while todo:
        q = todo.pop()
        if q in reached:
            continue
        reached.add(q)
        todo += [h for h in jit if h not in reached and re.search(rf"\b{h.split('.')[1]}\(", jit[q])]
    return sorted(launched - compiled), sorted(set(jit) - launched - reached)


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET (it makes @triton.jit interpreted)"
    todo = cases()
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        compiled = set(pool.map(compile_case, todo))
    missing, orphans = uncovered(compiled)
    if missing or orphans:
        print(f"kernels without a compile case: {missing}; @triton.jit helpers no compiled kernel calls: {orphans}",
              file=sys.stderr)
        return 1
    print(f"OK: {len(todo)} cases, {len(compiled)} kernels compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
