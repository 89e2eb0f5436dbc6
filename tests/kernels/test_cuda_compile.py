"""The interpreter runs a kernel's Python, not its compilation: the kernels and launch options the CPU cannot
time are compiled here for sm_90 (Triton's own LLVM and ptxas, no GPU needed), in a fresh process without
TRITON_INTERPRET (which would make @triton.jit return interpreted functions)."""
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.select_triton import (
    MULTI_CHUNK, MULTI_WARPS, _multi_hist_hi_kernel, _multi_hist_lo_kernel, _multi_write_kernel, _topk_select_kernel,
)
from kernels.decode_attn_triton import NUM_WARPS, _combine_kernel, block_n_for, _decode_attn_kernel
from kernels.ffn_triton import _fused_ffn_kernel, _reduce_kernel

INT_PTRS = {"pos_ptr": "*i64", "qidx_ptr": "*i32", "qcount_ptr": "*i32", "idx_ptr": "*i32", "count_ptr": "*i32"}
F32_PTRS = {"cos_ptr", "sin_ptr", "qn_ptr", "kn_ptr", "ws_ptr", "b1_ptr", "s_ptr", "bias_ptr"}  # the rest: dt
FLOATS = {"eps"}


def compile_sm90(kernel, dt, consts, ptrs=None, **options):
    sig = {}
    for name in kernel.arg_names:
        if ptrs and name in ptrs:
            sig[name] = ptrs[name]
        elif name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = INT_PTRS.get(name) or ("*fp32" if name in F32_PTRS else "*" + dt)
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, **options})
    assert k.asm["cubin"], (kernel.__name__, dt, consts)


# decode attention: fp16 / bf16 / fp32, every optional part off and on, one program or split + combine
for dt, flags in (("fp16", (0, 0, 1, 0, 0, 0)), ("bf16", (1, 1, 1, 1, 1, 1)), ("fp32", (0, 0, 0, 0, 0, 1)),
                  ("fp16", (1, 1, 1, 0, 0, 1))):
    consts = dict(zip(("HAS_IDX", "HAS_COUNT", "ROPE", "NORM", "WINDOW", "SPLIT"), map(bool, flags)), HD_PAD=128,
                  BLOCK_N=block_n_for(128))
    compile_sm90(_decode_attn_kernel, dt, consts, num_warps=NUM_WARPS)
    compile_sm90(_combine_kernel, dt, dict(HD_PAD=128, SP_PAD=8))
# the fused FFN kernel and its reduce with programmatic dependent launch
for pdl in (False, True):
    compile_sm90(_fused_ffn_kernel, "fp16", dict(MODE=1, ACT=2, HAS_COUNT=True, HAS_BIAS=False, B_PAD=1,
                                                 BLOCK_R=2, D_PAD=4096, EARLY_DOWN=True, PDL=pdl), num_warps=8)
    compile_sm90(_reduce_kernel, "fp16", dict(HAS_BIAS=False, S_PAD=512, BLOCK=16, PDL=pdl), launch_pdl=pdl)
# the top-k select: packed counts (1 and 2 bits a step), 16- and 32-bit keys
for bits in (1, 2):
    for dt, key_bits in (("fp16", 16), ("fp32", 32)):
        compile_sm90(_topk_select_kernel, dt, dict(KEY_BITS=key_bits, BITS=bits, BLOCK=16384),
                     ptrs={"s_ptr": "*" + dt, "out_ptr": "*i32"}, num_warps=16)
# the multi-CTA select's three kernels (16-bit keys)
for dt in ("fp16", "bf16"):
    ptrs = {"s_ptr": "*" + dt, "hist_ptr": "*i32", "part_ptr": "*i32", "out_ptr": "*i32"}
    compile_sm90(_multi_hist_hi_kernel, dt, dict(CHUNK=MULTI_CHUNK), ptrs=ptrs, num_warps=MULTI_WARPS)
    for kern in (_multi_hist_lo_kernel, _multi_write_kernel):
        compile_sm90(kern, dt, dict(P_PAD=64, CHUNK=MULTI_CHUNK), ptrs=ptrs, num_warps=MULTI_WARPS)
print("OK")
"""


def test_kernels_compile_for_hopper():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
