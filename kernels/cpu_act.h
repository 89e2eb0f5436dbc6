/* The activations of the CPU kernels (cpu_native.c, cpu_quant.c): codes as kernels.common.ACTS
 * (0 none, 1 relu, 2 silu, 3 gelu_tanh, 4 gelu). */
#ifndef CTXSPARSE_CPU_ACT_H
#define CTXSPARSE_CPU_ACT_H
#include <math.h>

static inline float act_f(float v, int act) {
    if (act == 1) return v > 0.f ? v : 0.f;
    if (act == 2) return v / (1.f + expf(-v));
    if (act == 3) {
        const float c = 0.7978845608028654f;
        return 0.5f * v * (1.f + tanhf(c * (v + 0.044715f * v * v * v)));
    }
    if (act == 4) return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
    return v;
}
#endif
