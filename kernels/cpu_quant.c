/* CPU kernels over GGUF block-quantized weights (kernels/cpu_quant.py; formats in kernels/quant.py), fp32
 * activations and accumulation: the weights are dequantized inside the kernel, so a product equals the one over
 * the dequantized fp32 weights up to fp32 summation order.
 *
 *   cs_q_dequant   rows of a weight -> fp32, bit for bit gguf-py's dequantizer (scalar code; the library is
 *                  compiled with -ffp-contract=off so that d*q + m stays two roundings)
 *   cs_q_rows      out[b, j] = act(<W[r_j], x_b> + bias[r_j]) * <W2[r_j], x_b>   (rows by an index, or all:
 *                  the dense GEMV, the output-sparse gather; W may be several parts of different formats)
 *   cs_q_ffn       the dense FFN in one job of the team: h = act(gate x) * (up x), barrier, y = down h
 *   (both with an option q8: activations quantized to 8 bits per 32 and integer products, llama.cpp's way)
 *   cs_qt_axpy     y_b = sum_j w[b, j] * Wt[r_j, :] over the exact transposed layout (rows of W^T: the down
 *                  projection over active neurons, input sparsity)
 *   cs_q_layers    whole decoder layers of one token (batch 1) in one call and one parallel region: norm, QKV,
 *                  RoPE + cache write + attention (cpu_glue.h, the glue cpu_native.c runs), O, residual add,
 *                  norm, the FFN, residual add; the same products and glue as the per-op path, so the same bits
 *
 * A row dot works block by block: the block's integer codes times x in fp32 (FMA), times the block's scale, and
 * for formats with an offset (Q4_1, Q5_1, K-quants' mins) offset * sum(x over the block), with the block sums of x
 * computed once per call. AVX2 + FMA where the compiler targets them (-march=native; AVX-512 for the fp32-activation
 * rows where the CPU has it: about 20 % faster on a Zen 4 core), else a scalar path that dequantizes each block and
 * takes a plain dot. Threads: one OpenMP region a call, each thread its contiguous share of a projection's row
 * chunks, then what is left of the others' ("the team": cpu_quant_team.c; cs_qt_axpy: columns by count); one
 * thread runs with no region. Errors (an index out of range, a bad format) return -1.
 *
 * The library is this file, one header and five parts, by job:
 *   cpu_quant.h             the includes, the instruction-set switch, the format codes, the structs that
 *                           kernels/cpu_quant.py mirrors, the shared types, what each part gives the others
 *   cpu_quant_formats.c     block sizes, the exact dequantizers, the rows of a weight's parts; cs_q_dequant
 *   cpu_quant_team.c        the thread team: its barrier, the job runner, the task claims
 *   cpu_quant_rows.c        row products per instruction set (AVX-512, AVX2 + FMA, scalar; fp32 or 8-bit
 *                           activations); cs_q_rows, cs_q_ffn
 *   cpu_quant_transposed.c  rows of Wᵀ (the transposed layout); cs_qt_axpy
 *   cpu_quant_layers.c      whole decoder layers; cs_q_layers
 * compiled as ONE translation unit: this file includes the parts in that order, and kernels.cpu compiles it alone
 * (its cache key hashes the parts this file includes). Not one object per part, because the hot paths cross the
 * parts through static functions that GCC inlines or specializes only within a unit (the build has no LTO): in
 * the native build the layers inline qt_body and ffn_down_body, the row products the formats' helpers (h2f,
 * k_scale_min, blk_elems, row_of) and the team's claim_init and chunk_rows, and q_rows_body gets a clone for the
 * layers' constant arguments. One unit keeps them static (the library exports the cs_* entry points alone) and
 * the machine code as it was: the split left the library's .text, .rodata and symbols byte for byte those of the
 * single file it came from (GCC 12; the native, avx2 and scalar builds, and -march=sapphirerapids, x86-64-v4 and
 * alderlake for the AVX-512 and VNNI paths).
 */
#include "cpu_quant.h"

#include "cpu_quant_formats.c"
#include "cpu_quant_team.c"
#include "cpu_quant_rows.c"
#include "cpu_quant_transposed.c"
#include "cpu_quant_layers.c"

/* 1 when the SIMD paths are compiled in (AVX2 + FMA), 0 for the scalar fallback */
int cs_q_simd(void) { return QSIMD; }
