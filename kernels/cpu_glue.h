/* The decode step's glue in C (fp32), shared by cpu_native.c (cs_add_rmsnorm, cs_decode_attn: the glue of the
 * per-op step, kernels/cpu.py) and cpu_quant.c (cs_q_layers: a whole quantized decoder layer in one call), so
 * that both run the same code: the residual add + RMS norm of a row, the q/k norm + RoPE of a head's row, the
 * cache write of a KV head, and the attention of query slots over the static cache.
 *
 * The functions are compiled with floating-point contraction (FMA) on, the compiler's default for
 * cpu_native.c; cpu_quant.c (-ffp-contract=off for its exact dequantizer) includes this header in its part
 * cpu_quant_layers.c, inside a `#pragma GCC optimize("fp-contract=fast")` region, so the same row gives the same
 * bits in either library.
 */
#ifndef CTXSPARSE_CPU_GLUE_H
#define CTXSPARSE_CPU_GLUE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 32

static inline float dot_f(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
    }
#ifndef DOT_FOLD
#define DOT_FOLD 1
#endif
#if DOT_FOLD            /* fold the lanes as a vector tree, not a chain of LANES dependent scalar adds */
    for (int l = 0; l < LANES / 2; ++l) acc[l] += acc[l + LANES / 2];
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int l = 0; l < LANES / 2; ++l) s += acc[l];
#else
    float s = 0.f;
    for (int l = 0; l < LANES; ++l) s += acc[l];
#endif
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

static inline void axpy_f(float *y, const float *row, float w, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += w * row[i];
}

/* Residual add + RMS norm of one row: xo = x + y (y NULL: no add, xo unused), h = norm(xo). one_plus 0 (Llama):
 * h = w * (xo * r); 1 (Gemma, w already 1 + w): h = (xo * r) * w; r = 1 / sqrt(mean(xo^2) + eps). */
static void add_rmsnorm_row(const float *x, const float *y, float *xo, const float *w, float *h, int64_t d,
                            float eps, int one_plus) {
    const float *src = x;
    if (y) {
        for (int64_t i = 0; i < d; ++i) xo[i] = x[i] + y[i];
        src = xo;
    }
    const float r = 1.f / sqrtf(dot_f(src, src, d) / (float)d + eps);
    if (one_plus)
        for (int64_t i = 0; i < d; ++i) h[i] = (src[i] * r) * w[i];
    else
        for (int64_t i = 0; i < d; ++i) h[i] = w[i] * (src[i] * r);
}

/* One row of a query or key head: the Gemma q/k norm (w != NULL; w is 1 + w, times the attention scale for q),
 * then rotate-half RoPE (cs != NULL: cos = cs[0:hd], sin = sn[0:hd]), into o[0:hd]. */
static void prep_row(const float *x, const float *w, float eps, const float *cs, const float *sn, int64_t hd,
                     float *o) {
    float r = 1.f;
    if (w) r = 1.f / sqrtf(dot_f(x, x, hd) / (float)hd + eps);
    for (int64_t i = 0; i < hd; ++i) o[i] = w ? (x[i] * r) * w[i] : x[i];
    if (!cs) return;
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; ++i) {      /* rot_half(x) = (-x[half:], x[:half]) */
        const float a = o[i], b = o[i + half];
        o[i] = a * cs[i] - b * sn[i];
        o[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

/* A KV head's row at the current position: its key normed and rotated into kc, its value copied into vc. */
static void write_kv_row(const float *k, const float *v, const float *kn, float eps, const float *cs,
                         const float *sn, int64_t hd, float *kc, float *vc) {
    prep_row(k, kn, eps, cs, sn, hd, kc);
    memcpy(vc, v, (size_t)hd * sizeof(float));
}

/* Attention of one query slot over the positions [lo, pos] of its KV head (two-pass softmax, as the reference:
 * scores, max, exp, sum, then the weighted sum of the value rows). sc: pos + 1 floats of scratch. */
static void attn_slot(const float *qx, const float *kh, const float *vh, int64_t sc_l, int64_t lo, int64_t pos,
                      int64_t hd, float *sc, float *o) {
    float m = -INFINITY;
    for (int64_t n = lo; n <= pos; ++n) {
        const float s = dot_f(qx, kh + n * sc_l, hd);
        sc[n] = s;
        if (s > m) m = s;
    }
    float sum = 0.f;
    for (int64_t n = lo; n <= pos; ++n) {
        sc[n] = expf(sc[n] - m);
        sum += sc[n];
    }
    for (int64_t i = 0; i < hd; ++i) o[i] = 0.f;
    const float inv = 1.f / sum;
    for (int64_t n = lo; n <= pos; ++n) axpy_f(o, vh + n * sc_l, sc[n] * inv, hd);
}

/* Query slots t in [t0, t1) of the flattened (batch, slot) grid: slot j of sequence b is query head qidx[j]
 * (qidx NULL: j), of KV head (that head) / group; slots j >= n_active are written 0. sc: pos + 1 + hd floats of
 * scratch. */
static void decode_attn_body(const float *q, int64_t sq_b, int64_t sq_h, const float *kc, const float *vc,
                             int64_t sc_b, int64_t sc_h, int64_t sc_l, int64_t pos, int64_t lo, const float *cs,
                             const float *sn, const float *qn, float eps, const int64_t *qidx, int64_t n_active,
                             float *out, int64_t so_b, int64_t S, int64_t group, int64_t hd, int64_t t0,
                             int64_t t1, float *sc) {
    float *qx = sc + pos + 1;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / S, j = t % S;
        float *o = out + b * so_b + j * hd;
        if (j >= n_active) {
            for (int64_t i = 0; i < hd; ++i) o[i] = 0.f;
            continue;
        }
        const int64_t g = (qidx ? qidx[j] : j) / group;
        prep_row(q + b * sq_b + j * sq_h, qn, eps, cs, sn, hd, qx);
        attn_slot(qx, kc + b * sc_b + g * sc_h, vc + b * sc_b + g * sc_h, sc_l, lo, pos, hd, sc, o);
    }
}
#endif
