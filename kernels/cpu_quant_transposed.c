/* Rows of Wᵀ in the transposed layout (a part of cpu_quant.c: one translation unit; cpu_quant.h): weighted sums
 * of the rows of kernels.quant.QuantWeightT's codes (the down projection over active neurons, input sparsity),
 * AVX-512 / AVX2 + FMA / scalar; cs_qt_axpy, and qt_body for the layers' input-sparse groups. */
#include "cpu_quant.h"

#ifndef QSP_PF
#define QSP_PF 32            /* one token's Wᵀ rows: prefetch this many rows past the group being summed */
#endif
#ifndef QSP_HINT
#define QSP_HINT 1           /* __builtin_prefetch locality of those rows */
#endif

/* Wt [nin, nout] (kernels.quant.QuantWeightT): codes int8 [nin, nout] (bits 8) or 4-bit [nin, nout / 2] packed
 * per 32 outputs (16 bytes: low nibbles the first 16, stored = code + cbias); scale, offset [nin / group, nout]
 * fp32, or fp16 (half != 0) (offset NULL: none). Wt[i, o] = scale[g, o] * code[i, o] + offset[g, o], g = i / group.
 *
 * y_b = ybias + sum_j w[b * wstride + j] * Wt[r_j, :] (r_j = idx[j], idx NULL: j) for the k rows. Consecutive
 * rows of one group share its scales: their codes are summed first (t_o = sum_j w_j code[r_j, o], s = sum_j w_j),
 * then y_o += scale[g, o] * t_o + offset[g, o] * s: the scales are read once per group that has a row (sorted
 * indices: once per group). Threads split the output columns (multiples of 32); no partial sums. */
/* y[o] += scale[o] * t[o] + offset[o] * sw for o in [0, m) (scale/offset fp16 or fp32 rows at column c0) */
static void qt_flush(const void *scale, const void *offset, int half, int64_t c0, int64_t m, const float *t,
                     float sw, float *y) {
    int64_t o = 0;
#if QSIMD
    const __m256 swv = _mm256_set1_ps(sw);
    for (; o + 8 <= m; o += 8) {
        const __m256 sv = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)scale + c0 + o)))
                               : _mm256_loadu_ps((const float *)scale + c0 + o);
        __m256 v = _mm256_fmadd_ps(sv, _mm256_loadu_ps(t + o), _mm256_loadu_ps(y + o));
        if (offset) {
            const __m256 ov = half
                ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)offset + c0 + o)))
                : _mm256_loadu_ps((const float *)offset + c0 + o);
            v = _mm256_fmadd_ps(ov, swv, v);
        }
        _mm256_storeu_ps(y + o, v);
    }
#endif
    for (; o < m; ++o) {
        const float sc = half ? h2f((const uint8_t *)scale + 2 * (c0 + o)) : ((const float *)scale)[c0 + o];
        float v = fmaf(sc, t[o], y[o]);
        if (offset) {
            const float of = half ? h2f((const uint8_t *)offset + 2 * (c0 + o)) : ((const float *)offset)[c0 + o];
            v = fmaf(of, sw, v);
        }
        y[o] = v;
    }
}

#if QSIMD && defined(__AVX512F__)
/* One token (B = 1), m a multiple of 32: the rows j0..j1-1 of one scale group (idx[j], or j) summed 128 (then 32)
 * columns at a time in registers, rows inner (each row's codes converted once, no column sums in memory), then
 * flushed. 4-bit codes go into 32-bit lanes unbiased (one widening a 16-byte run) and the code bias comes off once
 * per group, t = sum w c - bias * sum w: not the general loop's bits (its products are w (c - bias)), equal within
 * fp32 rounding; every caller of qt_body (cs_qt_axpy, cs_q_layers) takes this path for one token, so the per-op
 * and the native step still agree bit for bit. On SmolLM2's layers (Q4_1, one thread, 2-core VM) the rows
 * QSP_PF ahead are what makes it pay: without the prefetch the sparse layers took twice dense's time. */
/* NB blocks of 32 columns from column o of the group's rows (2 NB accumulators: independent FMA chains) */
#define QT_BLOCKS(NB)                                                                                          \
    do {                                                                                                       \
        __m512 a[2 * (NB)];                                                                                    \
        for (int u = 0; u < 2 * (NB); ++u) a[u] = _mm512_setzero_ps();                                         \
        for (int64_t j = j0; j < j1; ++j) {                                                                    \
            if (w[j] == 0.f) continue;                                                                         \
            const __m512 wv = _mm512_set1_ps(w[j]);                                                            \
            const uint8_t *row = codes + (idx ? idx[j] : j) * ld;                                              \
            for (int u = 0; u < (NB); ++u) {                                                                   \
                __m512i q0, q1;                                                                                \
                if (bits == 4) {      /* the code bias comes off at the flush: (sum w c) - bias * (sum w) */  \
                    const __m512i v = _mm512_cvtepu8_epi32(                                                    \
                        _mm_loadu_si128((const __m128i *)(row + (c0 + o) / 2 + 16 * u)));                      \
                    q0 = _mm512_and_si512(v, m4);                                                              \
                    q1 = _mm512_srli_epi32(v, 4);                                                              \
                } else {                                                                                       \
                    q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c0 + o + 32 * u)));      \
                    q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c0 + o + 32 * u + 16))); \
                }                                                                                              \
                a[2 * u] = _mm512_fmadd_ps(wv, _mm512_cvtepi32_ps(q0), a[2 * u]);                              \
                a[2 * u + 1] = _mm512_fmadd_ps(wv, _mm512_cvtepi32_ps(q1), a[2 * u + 1]);                      \
            }                                                                                                  \
        }                                                                                                      \
        if (bits == 4)                                                                                         \
            for (int u = 0; u < 2 * (NB); ++u) a[u] = _mm512_fnmadd_ps(cbw, swv, a[u]);                      \
        for (int u = 0; u < 2 * (NB); ++u) qt_flush16(sg, og, half, c0 + o + 16 * u, a[u], swv, y + o + 16 * u); \
        o += 32 * (NB);                                                                                        \
    } while (0)

/* y[0..16) = fma(offset, sw, fma(scale, a, y)) at column c of the group's scales */
static inline void qt_flush16(const void *sg, const void *og, int half, int64_t c, __m512 a, __m512 swv, float *y) {
    const __m512 sc = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)sg + c)))
                           : _mm512_loadu_ps((const float *)sg + c);
    __m512 v = _mm512_fmadd_ps(sc, a, _mm512_loadu_ps(y));
    if (og) {
        const __m512 of = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)og + c)))
                               : _mm512_loadu_ps((const float *)og + c);
        v = _mm512_fmadd_ps(of, swv, v);
    }
    _mm512_storeu_ps(y, v);
}

static void qt_group1(const uint8_t *codes, int64_t ld, int bits, int cbias, const int64_t *idx, int64_t j0,
                      int64_t j1, const float *w, const void *sg, const void *og, int half, int64_t c0, int64_t m,
                      float *y) {
    float sw = 0.f;
    for (int64_t j = j0; j < j1; ++j)
        if (w[j] != 0.f) sw += w[j];
    const __m512 swv = _mm512_set1_ps(sw);
    const __m512i m4 = _mm512_set1_epi32(15);
    const __m512 cbw = _mm512_set1_ps((float)cbias);
    int64_t o = 0;
    while (o + 128 <= m) QT_BLOCKS(4);
    while (o < m) QT_BLOCKS(1);
}
#endif

static void qt_body(const uint8_t *codes, int bits, int cbias, const void *scale, const void *offset, int half,
                    int64_t group, int64_t nout, const int64_t *idx, int64_t k, const float *w, int64_t wstride,
                    int64_t B, const float *ybias, float *y, int64_t c0, int64_t c1, float *t, float *s) {
    const int64_t m = c1 - c0, ld = bits == 4 ? nout / 2 : nout;
    for (int64_t b = 0; b < B; ++b) {
        if (ybias) memcpy(y + b * nout + c0, ybias + c0, m * sizeof(float));
        else memset(y + b * nout + c0, 0, m * sizeof(float));
    }
#if QSIMD && defined(__AVX512F__)
    if (B == 1 && m % 32 == 0 && c0 % 32 == 0) {
        const size_t es = half ? 2 : 4;
        int64_t jp = 0;              /* the next row to prefetch */
        for (int64_t j0 = 0, j1; j0 < k; j0 = j1) {
            const int64_t g = (idx ? idx[j0] : j0) / group;
            for (j1 = j0 + 1; j1 < k && (idx ? idx[j1] : j1) / group == g; ++j1) {}
            for (; jp < k && jp < j1 + QSP_PF; ++jp) {      /* the rows QSP_PF ahead of this group's end */
                const uint8_t *pr = codes + (idx ? idx[jp] : jp) * ld + (bits == 4 ? c0 / 2 : c0);
                for (int64_t i = 0, nb = bits == 4 ? m / 2 : m; i < nb; i += 64) __builtin_prefetch(pr + i, 0, QSP_HINT);
            }
            qt_group1(codes, ld, bits, cbias, idx, j0, j1, w, (const uint8_t *)scale + (size_t)(g * nout) * es,
                      offset ? (const uint8_t *)offset + (size_t)(g * nout) * es : NULL, half, c0, m, y + c0);
        }
        return;
    }
#endif
    int64_t g = -1;
    for (int64_t j = 0; j <= k; ++j) {
        const int64_t r = j < k ? (idx ? idx[j] : j) : -1;
        const int64_t gr = j < k ? r / group : -2;
        if (gr != g) {
            if (g >= 0) {                          /* flush the group */
                const size_t es = half ? 2 : 4;
                const void *sg = (const uint8_t *)scale + (size_t)(g * nout) * es;
                const void *og = offset ? (const uint8_t *)offset + (size_t)(g * nout) * es : NULL;
                for (int64_t b = 0; b < B; ++b) qt_flush(sg, og, half, c0, m, t + b * m, s[b], y + b * nout + c0);
            }
            if (j == k) break;
            g = gr;
            memset(t, 0, (size_t)(B * m) * sizeof(float));
            for (int64_t b = 0; b < B; ++b) s[b] = 0.f;
        }
        if (j + QPF_DIST < k) {
            const int64_t rn = idx ? idx[j + QPF_DIST] : j + QPF_DIST;
            pf_bytes(codes + rn * ld + (bits == 4 ? c0 / 2 : c0), bits == 4 ? m / 2 : m);
        }
        const uint8_t *row = codes + r * ld;
        for (int64_t b = 0; b < B; ++b) {
            const float wb = w[b * wstride + j];
            if (wb == 0.f) continue;
            s[b] += wb;
            float *tb = t + b * m;
#if QSIMD
            const __m256 wv = _mm256_set1_ps(wb);
            if (bits == 4) {
                const __m128i m4 = _mm_set1_epi8(15), cb = _mm_set1_epi8((char)cbias);
                for (int64_t o = 0; o < m; o += 32) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(row + (c0 + o) / 2));
                    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), cb);
                    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4), cb);
                    const __m128i q[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
                    for (int u = 0; u < 4; ++u) {
                        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[u]));
                        _mm256_storeu_ps(tb + o + 8 * u, _mm256_fmadd_ps(wv, c, _mm256_loadu_ps(tb + o + 8 * u)));
                    }
                }
            } else {
                const int8_t *rc = (const int8_t *)row + c0;
                int64_t o = 0;
                for (; o + 8 <= m; o += 8) {
                    const __m128i q8 = _mm_loadl_epi64((const __m128i *)(rc + o));
                    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    _mm256_storeu_ps(tb + o, _mm256_fmadd_ps(wv, c, _mm256_loadu_ps(tb + o)));
                }
                for (; o < m; ++o) tb[o] = fmaf(wb, (float)rc[o], tb[o]);
            }
#else
            if (bits == 4) {
                for (int64_t o = 0; o < m; o += 32) {
                    const uint8_t *p = row + (c0 + o) / 2;
                    for (int l = 0; l < 16; ++l) {
                        tb[o + l] = fmaf(wb, (float)((p[l] & 15) - cbias), tb[o + l]);
                        tb[o + 16 + l] = fmaf(wb, (float)((p[l] >> 4) - cbias), tb[o + 16 + l]);
                    }
                }
            } else {
                const int8_t *rc = (const int8_t *)row + c0;
                for (int64_t o = 0; o < m; ++o) tb[o] = fmaf(wb, (float)rc[o], tb[o]);
            }
#endif
        }
    }
}

int cs_qt_axpy(const uint8_t *codes, int bits, int cbias, const void *scale, const void *offset, int half,
               int64_t group, int64_t nin, int64_t nout, const int64_t *idx, int64_t k, const float *w, int64_t wstride,
               int64_t B, const float *ybias, float *y, int nt) {
    if ((bits != 4 && bits != 8) || group <= 0 || nin % group || (bits == 4 && nout % 32)) return -1;
    if (idx) {
        for (int64_t j = 0; j < k; ++j)
            if (idx[j] < 0 || idx[j] >= nin) return -1;
    } else if (k > nin) {
        return -1;
    }
    const int64_t step = 32;
    int T = nt < 1 ? 1 : nt;
    if (nout < step * T) T = 1;
    int rc = 0;
#pragma omp parallel num_threads(T) if (T > 1) reduction(| : rc)
    {
        const int t = omp_get_thread_num(), TT = omp_get_num_threads();
        const int64_t chunks = (nout + step - 1) / step;
        const int64_t c0 = chunks * t / TT * step;
        int64_t c1 = chunks * (t + 1) / TT * step;
        if (c1 > nout) c1 = nout;
        if (c1 > c0) {
            float *tmp = (float *)malloc((size_t)(B * (c1 - c0) + B) * sizeof(float));
            if (!tmp) {
                rc = 1;
            } else {
                qt_body(codes, bits, cbias, scale, offset, half, group, nout, idx, k, w, wstride, B, ybias, y, c0,
                        c1, tmp, tmp + B * (c1 - c0));
                free(tmp);
            }
        }
    }
    return rc ? -1 : 0;
}
