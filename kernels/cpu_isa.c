/* What a native CPU library was compiled for (kernels/isa.py): kernels.cpu.compile_native links this file into
 * every library it builds (cpu_native.c, cpu_quant.c), compiled with the same flags, so the answer is what the
 * compiler targeted for that library's kernels, not what the CPU could run.
 *
 *   512: AVX-512F (and the AVX2/FMA paths)   2: AVX2 + FMA   1: NEON (AArch64)   0: scalar (no SIMD paths)
 */
int cs_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#elif defined(__ARM_NEON) || defined(__aarch64__)
    return 1;
#else
    return 0;
#endif
}
