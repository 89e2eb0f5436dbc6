"""Frozen launch configurations and the dense-fallback crossover table.

Both are measured with ``python -m benchmarks.kernels`` on an H200 (see kernels/NOTES.md for the runs) and
frozen here: nothing is autotuned at run time, so a CUDA-graph capture never triggers a tuning sweep.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .common import next_pow2 as _next_pow2


@lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 2  # CPU / Triton interpreter: keep grids tiny
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.device.type == "cuda" else None)


# --- FFN (gate/up + down) -------------------------------------------------------------------------
# "fused": one kernel per split of the active rows computes gate, up, act*up and accumulates the
#          down projection over the whole d in registers -> fp32 partials [nsplit, B, d], then a
#          fixed-order reduce kernel (2 launches).
# "split": gather-GEMV kernel (gate, up, act) -> h [B, K]; down kernel over (d-chunk, K-split) ->
#          partials; reduce (3 launches). Used where the fused kernel's registers do not fit.
FUSED_MAX_ELEMS = 8192  # B_PAD * D_PAD held as an fp32 accumulator per program

# Keyed by B_PAD (1, 2, 4, 8). Frozen from the run-3..5 tunes on an H200 (kernels/NOTES.md): batch 1 uses
# the fused kernel (BLOCK_R=2/8 warps/2 per SM and BLOCK_R=1/4 warps/3 per SM tie within noise; run 5 picked
# the first); at batch 2 the split path with tensor-core tl.dot beat the fused kernel (217.6 vs 236.5 µs
# summed over the tuned points), so FUSED has no entry for 2 and ffn_path() picks "split" there.
# pdl: the reduce launched by programmatic dependent launch (sm_90+), so its launch overlaps the fused kernel's
# tail; off: on an H200 it changed nothing (38.4 vs 38.7 µs at s = 0.5, 13.5 vs 13.4 at 0.9: inside a CUDA graph
# the reduce's launch already overlaps; python -m benchmarks.kernels --profile runs the op both ways).
FUSED = {
    1: dict(BLOCK_R=2, num_warps=8, progs_per_sm=2, early_down=True, pdl=False),
}
GATHER = {  # gather-GEMV (gate/up, fc1, qkv): rows per program, d chunk (None: whole d), tl.dot for batch >= 2
    1: dict(BLOCK_R=2, BLOCK_K=None, num_warps=4),
    2: dict(BLOCK_R=32, BLOCK_K=256, num_warps=4, dot=True),
    4: dict(BLOCK_R=32, BLOCK_K=256, num_warps=4, dot=True),
    8: dict(BLOCK_R=32, BLOCK_K=256, num_warps=4, dot=True),
}
DOWN = {  # down / out projection over W^T rows: d chunk, rows per step, K splits
    1: dict(BLOCK_D=128, BLOCK_R=64, splits=8, num_warps=4),
    2: dict(BLOCK_D=128, BLOCK_R=32, splits=16, num_warps=4, dot=True),
    4: dict(BLOCK_D=128, BLOCK_R=32, splits=16, num_warps=4, dot=True),
    8: dict(BLOCK_D=128, BLOCK_R=32, splits=16, num_warps=4, dot=True),
}


# Non-gated (OPT-style fc1/fc2) MLP at batch 1: its own entry (one weight matrix fewer per row than the
# gated FFN, so it wants more rows in flight). Sub-dicts override FUSED/GATHER/DOWN for that call.
# Run 5 (opt-6.7b, s=.3/.5/.7/.9): BLOCK_R=2, 4 warps, 3/SM had the best mean time over the tuned points;
# the tl.dot split path lost at s=.3/.7/.9 by 14-52 % but was 13 % faster at s=.5 (see NOTES.md).
MLP_B1 = dict(path="fused", fused=dict(BLOCK_R=2, num_warps=4, progs_per_sm=3, early_down=True))

# --- input sparsity (TEAL/WINA column-sparse GEMV over W^T [in, out]) -------------------------------
# Keyed by B_PAD. BLOCK_N output columns x BLOCK_K input rows per step; the K range is split until the grid
# has progs_per_sm x SMs programs (0: never split, each program writes y itself), the partials summed in a fixed
# order by the last program of each column block ("ticket") or by a second launch ("kernel"). dot: tensor-core
# tl.dot with the batch padded to 16 rows and a cp.async pipeline (num_stages); else the register-prefetched
# loop with CUDA-core FMAs (mma=True: tensor cores in that loop). Frozen from the H200 tune of run 4
# (kernels/NOTES.md, "Input sparsity"); batch >= 2 is slower than dense cuBLAS at every sparsity measured.
INPUT_SPARSE = {
    1: dict(BLOCK_N=64, BLOCK_K=16, num_warps=4, progs_per_sm=8, reduce="ticket", dot=False),
    2: dict(BLOCK_N=128, BLOCK_K=16, num_warps=4, progs_per_sm=4, reduce="ticket", dot=False),
    4: dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5, progs_per_sm=2, reduce="ticket", dot=True),
    8: dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5, progs_per_sm=2, reduce="ticket", dot=True),
}

# The in-program compaction path ("local", batch 1): channels per K slice (a power of two), column block, active
# rows per step, one config per projection kind (the H200 tunes in kernels/NOTES.md, "Input sparsity").
INPUT_PATHS = ("mask", "local", "tile", "dense")   # the input-sparse op's paths (kernels/input_sparse_triton.py)
# "widest_out" (the decode runtime's gate|up, one launch over both, out >= 16,384): 1,024-channel slices, measured
# on an H200 (2026-12-02, benchmarks/results/h200_input_sparse_wide_probe2_2026-12-02.json) against the 512 of
# "wide_out" at s = .4 / .5 / .7: Llama-2 4096 -> 22016 35.5 / 31.8 / 24.6 µs vs 45.0 / 40.9 / 32.6, Llama-3
# 4096 -> 28672 45.1 / 40.5 / 32.4 vs 53.5 / 47.3 / 37.9, Qwen2 3584 -> 37888 51.1 / 45.1 / 36.4 vs 57.6 / 54.8 /
# 43.1 (wider column blocks of 512 were as fast on Llama-3 and slower elsewhere; on one 11008-wide projection
# and the fused QKV the 512-channel slices stay the fastest).
INPUT_SPARSE_LOCAL = {
    "wide_in": dict(per=1024, BLOCK_N=128, BLOCK_R=64, num_warps=4),    # in >= 8192 (down)
    "widest_out": dict(per=1024, BLOCK_N=256, BLOCK_R=32, num_warps=4),  # out >= 16384 (gate|up in one launch)
    "wide_out": dict(per=512, BLOCK_N=256, BLOCK_R=32, num_warps=4),    # out >= 8192 (gate or up, fused QKV)
    "square": dict(per=512, BLOCK_N=128, BLOCK_R=32, num_warps=4),      # q, o
}


def input_sparse_local(k: int, n: int) -> dict:
    """The local path's launch config for a projection of ``k`` inputs and ``n`` outputs."""
    kind = ("wide_in" if k >= 8192 else "widest_out" if n >= 16384 else "wide_out" if n >= 8192 else "square")
    return dict(INPUT_SPARSE_LOCAL[kind])


# The batch-1 tile kernel ("tile"): a K slice of BLOCK_M * TILES channels (a power of two) x BLOCK_N columns per
# program; compact: the fraction of a slice's channels at or below which the program compacts its active rows
# (BLOCK_R per step, ``depth`` steps of rows in flight, a scratch row per program if ``private``) instead of
# loading TILES masked [BLOCK_M, BLOCK_N] tiles (0 never, 1 always); reduce: "ticket" (the column block's last
# program sums the partials) or "kernel" (a second launch). Frozen per projection kind from the H200 tune of
# 2026-12-02 (kernels/NOTES.md, "Input sparsity", run 8): the best geometric mean over s = .4/.5/.7/.9.
INPUT_SPARSE_TILE = {
    "wide_in": dict(BLOCK_M=1024, TILES=1, BLOCK_N=128, BLOCK_R=32, num_warps=4, compact=1.0, depth=2,
                    private=True, order="col"),
    "wide_out": dict(BLOCK_M=1024, TILES=1, BLOCK_N=128, BLOCK_R=32, num_warps=4, compact=1.0, depth=2,
                     private=True, order="col"),
    "square": dict(BLOCK_M=512, TILES=1, BLOCK_N=64, BLOCK_R=64, num_warps=4, compact=1.0, depth=2,
                   private=True, order="col"),
    "narrow_out": dict(BLOCK_M=32, TILES=8, BLOCK_N=128, num_warps=4, compact=0.0, order="col"),
}


def tile_kind(k: int, n: int) -> str:
    """The projection kind a config is frozen for: wide input (down), wide output (gate|up, the fused QKV of
    MHA models), narrow output (GQA k, v), else square (q, o, a GQA model's fused QKV)."""
    return "wide_in" if k >= 8192 else "wide_out" if n >= 8192 else "narrow_out" if n <= 2048 else "square"


def input_sparse_tile(k: int, n: int) -> dict:
    """The tile kernel's launch config for a projection of ``k`` inputs and ``n`` outputs."""
    return dict(INPUT_SPARSE_TILE[tile_kind(k, n)])


# The batch-1 CUDA default kernel (measured on an H200, 2026-12-02, kernels/NOTES.md run 9): the tile kernel up to
# INPUT_TILE_MAX_OUT output columns with fewer than 8,192 inputs (q, o, GQA k and v: the fastest of the three at
# every sparsity), the local path otherwise (gate|up, down, fused QKV: 4-16 % faster than the tile kernel at
# s = .4/.5, within 6 % at .7, 4-15 % slower at .9). Batch >= 2: cuBLAS (below).
INPUT_TILE_MAX_OUT = 4096


def input_default_path(k: int, n: int) -> str:
    """The batch-1 CUDA default path of a projection of ``k`` inputs and ``n`` outputs."""
    return "tile" if n <= INPUT_TILE_MAX_OUT and k < 8192 else "local"


# Dense crossover of the input-sparse op, the one rule (input_sparse_dense). The "dense" path is cuBLAS on the
# masked x (one launch masks x per segment, then x @ w_t per segment: the same function), measured on an H200
# (2026-12-02, kernels/NOTES.md run 9) at cuBLAS + 1.4-2 µs for one segment. From INPUT_DENSE_FROM_BATCH tokens
# the op takes it: at batch 4 it was 1.4-1.7x the masked-load kernel (gate/up 26.2 vs 44.0 µs, q/o 14.8 vs 21.4,
# fused QKV 42.1 vs 56.4), and the sparse kernels were 0.58-0.92x cuBLAS at batch 2 (input sparsity run 4). At
# batch 1 the op cannot see the sparsity (the threshold lives on the device): a caller that knows it passes
# config={"sparsity": s} and gets the dense path below INPUT_MIN_SPARSITY[kind], the measured sparsity at which
# the kind's default kernel is as fast as the dense path (linear between s = 0 and 0.4). At s = 0 only an
# unmasked product (the caller not sparsifying the projection) matches cuBLAS itself.
INPUT_DENSE_FROM_BATCH = 2
INPUT_MIN_SPARSITY = {"wide_in": 0.0, "wide_out": 0.03, "square": 0.0, "narrow_out": 0.0}


def input_sparse_dense(batch: int, k: int, n: int, sparsity: float | None = None) -> bool:
    """True where cuBLAS on the masked x was measured faster than the sparse kernels."""
    if batch >= INPUT_DENSE_FROM_BATCH:
        return True
    return sparsity is not None and sparsity < INPUT_MIN_SPARSITY[tile_kind(k, n)]


# CPU (Triton interpreter, CI): few big programs keep the interpreter fast; chunks smaller than the
# test shapes keep the d-loop and row-tail masking exercised.
INTERP = {
    "fused": dict(BLOCK_R=16, nsplit=3, num_warps=4),
    "gather": dict(BLOCK_R=32, BLOCK_K=64, num_warps=4),
    "down": dict(BLOCK_D=64, BLOCK_R=32, splits=3, num_warps=4),
    "input_sparse": dict(BLOCK_N=32, BLOCK_K=32, splits=2, num_warps=4),
    "input_sparse_local": dict(per=32, BLOCK_N=32, BLOCK_R=8, num_warps=4),
    "input_sparse_tile": dict(BLOCK_M=8, TILES=4, BLOCK_N=32, BLOCK_R=8, num_warps=4),
}


def b_pad(batch: int) -> int:
    return _next_pow2(batch)


def ffn_path(batch: int, d: int) -> str:
    bp = b_pad(batch)
    if bp in FUSED and bp * _next_pow2(d) <= FUSED_MAX_ELEMS:
        return "fused"
    return "split"


# --- dense fallback -------------------------------------------------------------------------------
# DENSE_FROM_BATCH[s] = smallest batch at which the dense cuBLAS FFN was measured faster than the
# sparse kernels for a union sparsity >= s (None: sparse wins up to MAX_BATCH). Looked up with the
# largest key <= the static sparsity 1 - K/D of the index buffer.
# Measured (runs 4-5, fp16, Llama-2/Llama-3/Mistral/Qwen2 shapes): at s=0 the fused batch-1 kernel beats
# cuBLAS (1.10-1.19x) but from batch 2 dense is faster (0.96-0.98x); from s=0.3 up the sparse kernels win at
# every batch up to 8 (>= 1.22x). The non-gated MLP (opt-6.7b) loses at s=0 already at batch 1 (0.86x).
DENSE_FROM_BATCH = {
    0.0: 2,
    0.3: None,
    0.5: None,
    0.7: None,
    0.8: None,
    0.9: None,
    0.95: None,
}


DENSE_FROM_BATCH_MLP = {**DENSE_FROM_BATCH, 0.0: 1}

# The dense attention output projection (W_o^T [H*hd, d]) through the down kernel over every head, up to this
# batch; cuBLAS above it (0: cuBLAS always).
O_KERNEL_MAX_BATCH = 0


def use_dense(batch: int, k: int, n: int, gated: bool = True) -> bool:
    table = DENSE_FROM_BATCH if gated else DENSE_FROM_BATCH_MLP
    s = 1.0 - k / n
    keys = [key for key in sorted(table) if key <= s + 1e-9]
    if not keys:
        return True
    lim = table[keys[-1]]
    return lim is not None and batch >= lim
