/* Row products per instruction set (a part of cpu_quant.c: one translation unit; cpu_quant.h): <row, x> block by
 * block for every format, AVX-512 / AVX2 + FMA where the compiler targets them, else scalar; the 8-bit activation
 * option; cs_q_rows (rows by an index, or all) and cs_q_ffn (the dense FFN) on the team. */
#include "cpu_quant.h"

static inline float dot_plain(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

static inline float sum32(const float *a) {
    float s = 0.f;
    for (int i = 0; i < 32; ++i) s += a[i];
    return s;
}

#if QSIMD
static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* 16 byte codes (unsigned / signed) times x[0..16) */
static inline __m256 dot16_u8(__m128i q, const float *x) {
    __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))),
                           _mm256_loadu_ps(x + 8), a);
}

static inline __m256 dot16_i8(__m128i q, const float *x) {
    __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))),
                           _mm256_loadu_ps(x + 8), a);
}

static inline __m256 dot32_u8(__m256i q, const float *x) {
    return _mm256_add_ps(dot16_u8(_mm256_castsi256_si128(q), x), dot16_u8(_mm256_extracti128_si256(q, 1), x + 16));
}

static inline __m256 dot32_i8(__m256i q, const float *x) {
    return _mm256_add_ps(dot16_i8(_mm256_castsi256_si128(q), x), dot16_i8(_mm256_extracti128_si256(q, 1), x + 16));
}

static inline __m256i join128(__m128i lo, __m128i hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* 32 bits (little-endian) -> 32 bytes, 0xFF where the bit is set */
static inline __m256i bytes_from_bits(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

static inline __m256i srl16(__m256i v, int s) {
    return _mm256_srl_epi16(v, _mm_cvtsi32_si128(s));
}
#endif

/* <row, x> for one row of n = cols elements; xs: sums of x over each 32 elements */
static float row_dot(int t, const uint8_t *row, const float *x, const float *xs, int64_t n) {
#if QSIMD
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    switch (t) {
    case T_F32:
    case T_F16: {
        int64_t i = 0;
        if (t == T_F32) {
            const float *w = (const float *)row;
            for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
            for (; i < n; ++i) off += w[i] * x[i];
        } else {
            for (; i + 8 <= n; i += 8)
                acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))),
                                      _mm256_loadu_ps(x + i), acc);
            for (; i < n; ++i) off += h2f(row + 2 * i) * x[i];
        }
        return hsum8(acc) + off;
    }
    case T_Q4_0: case T_Q4_1: {
        /* bytes straight into 32-bit lanes (vpmovzxbd from memory), then each nibble: 16 codes per 8 bytes */
#if defined(__AVX512F__)
        {                                          /* 16 lanes: the whole block's 16 bytes in one load */
            const __m512i m4z = _mm512_set1_epi32(15);
            const int one = t == T_Q4_1, bb = one ? 20 : 18;
            __m512 accz = _mm512_setzero_ps();
            for (int64_t k = 0; k < n / 32; ++k) {
                const uint8_t *b = row + k * bb;
                const float *xb = x + 32 * k;
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 2 * one)));
                __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, m4z)), _mm512_loadu_ps(xb));
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_loadu_ps(xb + 16), a);
                const float d = h2f(b);
                accz = _mm512_fmadd_ps(_mm512_set1_ps(d), a, accz);
                off += (one ? h2f(b + 2) : -8.f * d) * xs[k];
            }
            return _mm512_reduce_add_ps(accz) + off;
        }
#endif
        const __m256i m4 = _mm256_set1_epi32(15);
        const int one = t == T_Q4_1, bb = one ? 20 : 18;
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * bb, *q = b + 2 + 2 * one;
            const float *xb = x + 32 * k;
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
            __m256 a0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, m4)), _mm256_loadu_ps(xb));
            __m256 a1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, m4)), _mm256_loadu_ps(xb + 8));
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(xb + 16), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), _mm256_loadu_ps(xb + 24), a1);
            const float d = h2f(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(a0, a1), acc);
            off += (one ? h2f(b + 2) : -8.f * d) * xs[k];        /* the offset (Q4_1) or the code bias (Q4_0) */
        }
        return hsum8(acc) + off;
    }
    case T_Q5_0: case T_Q5_1: {
#if defined(__AVX512F__)
        {                                          /* the fifth bits straight from qh as lane masks */
            const __m512i m4z = _mm512_set1_epi32(15), s16 = _mm512_set1_epi32(16);
            const int one = t == T_Q5_1, bb = one ? 24 : 22;
            __m512 accz = _mm512_setzero_ps();
            for (int64_t k = 0; k < n / 32; ++k) {
                const uint8_t *b = row + k * bb;
                const float *xb = x + 32 * k;
                uint32_t qh;
                memcpy(&qh, b + 2 + 2 * one, 4);
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6 + 2 * one)));
                const __m512i lo = _mm512_mask_or_epi32(_mm512_and_si512(v, m4z), (__mmask16)(qh & 0xFFFFu),
                                                        _mm512_and_si512(v, m4z), s16);
                const __m512i hi = _mm512_mask_or_epi32(_mm512_srli_epi32(v, 4), (__mmask16)(qh >> 16),
                                                        _mm512_srli_epi32(v, 4), s16);
                __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_loadu_ps(xb));
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_loadu_ps(xb + 16), a);
                const float d = h2f(b);
                accz = _mm512_fmadd_ps(_mm512_set1_ps(d), a, accz);
                off += (one ? h2f(b + 2) : -16.f * d) * xs[k];    /* the offset (Q5_1) or the code bias (Q5_0) */
            }
            return _mm512_reduce_add_ps(accz) + off;
        }
#endif
        const __m128i m4 = _mm_set1_epi8(15);
        const __m256i b16 = _mm256_set1_epi8(16);
        const int one = t == T_Q5_1, bb = one ? 24 : 22;
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * bb;
            const __m128i v = _mm_loadu_si128((const __m128i *)(b + 6 + 2 * one));
            __m256i q = join128(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(b + 2 + 2 * one), b16));
            __m256 s;
            if (one) {
                s = dot32_u8(q, x + 32 * k);
                off += h2f(b + 2) * xs[k];
            } else {
                s = dot32_i8(_mm256_sub_epi8(q, b16), x + 32 * k);
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b)), s, acc);
        }
        return hsum8(acc) + off;
    }
    case T_Q8_0:
#if defined(__AVX512F__)
        {
            __m512 accz = _mm512_setzero_ps();
            for (int64_t k = 0; k < n / 32; ++k) {
                const uint8_t *b = row + k * 34;
                const float *xb = x + 32 * k;
                __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128((const __m128i *)(b + 2)))), _mm512_loadu_ps(xb));
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(b + 18)))), _mm512_loadu_ps(xb + 16), a);
                accz = _mm512_fmadd_ps(_mm512_set1_ps(h2f(b)), a, accz);
            }
            return _mm512_reduce_add_ps(accz);
        }
#endif
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * 34;
            const float *xb = x + 32 * k;
            __m256 a[4];
            for (int u = 0; u < 4; ++u)
                a[u] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                           _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * u)))), _mm256_loadu_ps(xb + 8 * u));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b)), _mm256_add_ps(_mm256_add_ps(a[0], a[1]),
                                                                         _mm256_add_ps(a[2], a[3])), acc);
        }
        return hsum8(acc);
    case T_Q4_K: {
#if defined(__AVX512F__)
        {
            const __m512i m4z = _mm512_set1_epi32(15);
            __m512 accz = _mm512_setzero_ps();
            for (int64_t k = 0; k < n / QK; ++k) {
                const uint8_t *b = row + k * 144;
                const float d = h2f(b), dmin = h2f(b + 2);
                uint8_t sc[8], mn[8];
                k_scale_min(b + 4, sc, mn);
                const float *xb = x + QK * k;
                for (int c = 0; c < 4; ++c) {
                    const uint8_t *q = b + 16 + 32 * c;
                    const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
                    const float *xc = xb + 64 * c;
                    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, m4z)), _mm512_loadu_ps(xc));
                    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v1, m4z)), _mm512_loadu_ps(xc + 16), lo);
                    __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(xc + 32));
                    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), _mm512_loadu_ps(xc + 48), hi);
                    accz = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[2 * c]), lo, accz);
                    accz = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[2 * c + 1]), hi, accz);
                    off -= (dmin * (float)mn[2 * c]) * xs[8 * k + 2 * c]
                         + (dmin * (float)mn[2 * c + 1]) * xs[8 * k + 2 * c + 1];
                }
            }
            return _mm512_reduce_add_ps(accz) + off;
        }
#endif
        const __m256i m4 = _mm256_set1_epi32(15);
        for (int64_t k = 0; k < n / QK; ++k) {
            const uint8_t *b = row + k * 144;
            const float d = h2f(b), dmin = h2f(b + 2);
            uint8_t sc[8], mn[8];
            k_scale_min(b + 4, sc, mn);
            const float *xb = x + QK * k;
            for (int c = 0; c < 4; ++c) {          /* 32 bytes: group 2c in the low nibbles, 2c + 1 in the high */
                const uint8_t *q = b + 16 + 32 * c;
                __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
                for (int u = 0; u < 4; ++u) {
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * u)));
                    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m4)),
                                         _mm256_loadu_ps(xb + 64 * c + 8 * u), lo);
                    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)),
                                         _mm256_loadu_ps(xb + 64 * c + 32 + 8 * u), hi);
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c]), lo, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c + 1]), hi, acc);
                off -= (dmin * (float)mn[2 * c]) * xs[8 * k + 2 * c]
                     + (dmin * (float)mn[2 * c + 1]) * xs[8 * k + 2 * c + 1];
            }
        }
        return hsum8(acc) + off;
    }
    case T_Q5_K: {
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        for (int64_t k = 0; k < n / QK; ++k) {
            const uint8_t *b = row + k * 176;
            const float d = h2f(b), dmin = h2f(b + 2);
            uint8_t sc[8], mn[8];
            k_scale_min(b + 4, sc, mn);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
            const float *xb = x + QK * k;
            for (int c = 0; c < 4; ++c) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(srl16(v, 4), m4);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2 * c + 1), one), 4));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c]), dot32_u8(lo, xb + 64 * c), acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c + 1]), dot32_u8(hi, xb + 64 * c + 32), acc);
                off -= (dmin * (float)mn[2 * c]) * xs[8 * k + 2 * c]
                     + (dmin * (float)mn[2 * c + 1]) * xs[8 * k + 2 * c + 1];
            }
        }
        return hsum8(acc) + off;
    }
    case T_Q6_K: {
#if defined(__AVX512F__)
        {                                          /* 16 elements (one scale) per step, codes built in 32-bit lanes */
            const __m512i m4z = _mm512_set1_epi32(15), m3z = _mm512_set1_epi32(3), b32z = _mm512_set1_epi32(32);
            __m512 accz = _mm512_setzero_ps();
            for (int64_t k = 0; k < n / QK; ++k) {
                const uint8_t *b = row + k * 210;
                const int8_t *sc = (const int8_t *)(b + 192);
                const float d = h2f(b + 208);
                for (int h = 0; h < 2; ++h)
                    for (int hh = 0; hh < 2; ++hh) {
                        const uint8_t *ql = b + 64 * h + 16 * hh, *qh = b + 128 + 32 * h + 16 * hh;
                        const __m512i vh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
                        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
                        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32)));
                        const __m512i c[4] = {
                            _mm512_or_si512(_mm512_and_si512(v0, m4z),
                                            _mm512_slli_epi32(_mm512_and_si512(vh, m3z), 4)),
                            _mm512_or_si512(_mm512_and_si512(v1, m4z),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(vh, 2), m3z), 4)),
                            _mm512_or_si512(_mm512_srli_epi32(v0, 4),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(vh, 4), m3z), 4)),
                            _mm512_or_si512(_mm512_srli_epi32(v1, 4), _mm512_slli_epi32(_mm512_srli_epi32(vh, 6), 4))};
                        for (int i = 0; i < 4; ++i) {
                            const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c[i], b32z)),
                                                           _mm512_loadu_ps(x + QK * k + 128 * h + 32 * i + 16 * hh));
                            accz = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * i + hh]), p, accz);
                        }
                    }
            }
            return _mm512_reduce_add_ps(accz);
        }
#endif
        const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), b32 = _mm256_set1_epi8(32);
        for (int64_t k = 0; k < n / QK; ++k) {
            const uint8_t *b = row + k * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(b + 208);
            for (int h = 0; h < 2; ++h) {
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(q0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
                c[1] = _mm256_or_si256(_mm256_and_si256(q1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2), m3), 4));
                c[2] = _mm256_or_si256(_mm256_and_si256(srl16(q0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 4), m3), 4));
                c[3] = _mm256_or_si256(_mm256_and_si256(srl16(q1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 6), m3), 4));
                const float *xb = x + QK * k + 128 * h;
                for (int i = 0; i < 4; ++i) {
                    const __m256i q = _mm256_sub_epi8(c[i], b32);
                    const int s = 8 * h + 2 * i;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[s]),
                                          dot16_i8(_mm256_castsi256_si128(q), xb + 32 * i), acc);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[s + 1]),
                                          dot16_i8(_mm256_extracti128_si256(q, 1), xb + 32 * i + 16), acc);
                }
            }
        }
        return hsum8(acc);
    }
    default:
        return 0.f;
    }
#else
    (void)xs;
    const int be = blk_elems(t), bb = blk_bytes(t);
    float tmp[QK], s = 0.f;
    const int chunk = be == 1 ? QK : be;          /* float formats: 256 elements at a time */
    for (int64_t i = 0; i < n; i += chunk) {
        const int64_t m = n - i < chunk ? n - i : chunk;
        for (int64_t e = 0; e < m; e += be) deq_block(t, row + (i + e) / be * bb, tmp + e);
        s += dot_plain(tmp, x + i, m);
    }
    return s;
#endif
}

/* ------------------------------------------------------------------------ 8-bit activations (an option) */
/* llama.cpp's way, as an option: x quantized per 32 elements to int8 (d = max|x| / 127, q = round-half-even(
 * x / d), x^ = d * q), the weight codes times q in integers (VNNI dpbusd, or maddubs + madd), one fp32 scale
 * product per group. The result is the fp32 product W x^ (to fp32 summation order), not W x: x^ differs from x by
 * up to d / 2 per element. kernels.quant.quantize_q8 is the reference of the quantization. */
#if QSIMD
static inline __m256i mul_sum_us8(__m256i u, __m256i s) {      /* 8 int32 sums of 4 (u8 * s8) products each */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else                                                          /* |u| <= 128, |s| <= 127: no int16 saturation */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256 cvt8(__m256i p) { return _mm256_cvtepi32_ps(p); }
#endif

/* <row, x^> for a block format; xq int8 [n], xd [n / 32] scales, xq16 [n / 16]: xd * (sum of q over 16) */
static float row_dot8(int t, const uint8_t *row, const int8_t *xq, const float *xd, const float *xq16, int64_t n) {
#if QSIMD
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    switch (t) {
    case T_Q4_0: case T_Q4_1: {
        const __m128i m4 = _mm_set1_epi8(15);
        const int one = t == T_Q4_1, bb = one ? 20 : 18;
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * bb;
            const float d = h2f(b);
            const __m128i v = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * one));
            const __m256i u = join128(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            const __m256i p = mul_sum_us8(u, _mm256_loadu_si256((const __m256i *)(xq + 32 * k)));
            acc = _mm256_fmadd_ps(cvt8(p), _mm256_set1_ps(d * xd[k]), acc);
            off += (one ? h2f(b + 2) : -8.f * d) * (xq16[2 * k] + xq16[2 * k + 1]);
        }
        return hsum8(acc) + off;
    }
    case T_Q5_0: case T_Q5_1: {
        const __m128i m4 = _mm_set1_epi8(15);
        const __m256i b16 = _mm256_set1_epi8(16);
        const int one = t == T_Q5_1, bb = one ? 24 : 22;
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * bb;
            const float d = h2f(b);
            const __m128i v = _mm_loadu_si128((const __m128i *)(b + 6 + 2 * one));
            __m256i u = join128(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(b + 2 + 2 * one), b16));
            const __m256i p = mul_sum_us8(u, _mm256_loadu_si256((const __m256i *)(xq + 32 * k)));
            acc = _mm256_fmadd_ps(cvt8(p), _mm256_set1_ps(d * xd[k]), acc);
            off += (one ? h2f(b + 2) : -16.f * d) * (xq16[2 * k] + xq16[2 * k + 1]);
        }
        return hsum8(acc) + off;
    }
    case T_Q8_0:
        for (int64_t k = 0; k < n / 32; ++k) {
            const uint8_t *b = row + k * 34;
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
            const __m256i s = _mm256_loadu_si256((const __m256i *)(xq + 32 * k));
            const __m256i p = mul_sum_us8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
            acc = _mm256_fmadd_ps(cvt8(p), _mm256_set1_ps(h2f(b) * xd[k]), acc);
        }
        return hsum8(acc);
    case T_Q4_K: case T_Q5_K: {
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        const int five = t == T_Q5_K, bb = five ? 176 : 144;
        for (int64_t k = 0; k < n / QK; ++k) {
            const uint8_t *b = row + k * bb;
            const float d = h2f(b), dmin = h2f(b + 2);
            uint8_t sc[8], mn[8];
            k_scale_min(b + 4, sc, mn);
            const uint8_t *qs = b + (five ? 48 : 16);
            const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(srl16(v, 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2 * c + 1), one), 4));
                }
                const int64_t g = 8 * k + 2 * c;          /* the x block of group 2c */
                const __m256i p0 = mul_sum_us8(lo, _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                const __m256i p1 = mul_sum_us8(hi, _mm256_loadu_si256((const __m256i *)(xq + 32 * g + 32)));
                acc = _mm256_fmadd_ps(cvt8(p0), _mm256_set1_ps(d * (float)sc[2 * c] * xd[g]), acc);
                acc = _mm256_fmadd_ps(cvt8(p1), _mm256_set1_ps(d * (float)sc[2 * c + 1] * xd[g + 1]), acc);
                off -= (dmin * (float)mn[2 * c]) * (xq16[2 * g] + xq16[2 * g + 1])
                     + (dmin * (float)mn[2 * c + 1]) * (xq16[2 * g + 2] + xq16[2 * g + 3]);
            }
        }
        return hsum8(acc) + off;
    }
    case T_Q6_K: {
        const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
        for (int64_t k = 0; k < n / QK; ++k) {
            const uint8_t *b = row + k * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(b + 208);
            for (int h = 0; h < 2; ++h) {
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(q0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
                c[1] = _mm256_or_si256(_mm256_and_si256(q1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 2), m3), 4));
                c[2] = _mm256_or_si256(_mm256_and_si256(srl16(q0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 4), m3), 4));
                c[3] = _mm256_or_si256(_mm256_and_si256(srl16(q1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(srl16(hb, 6), m3), 4));
                for (int i = 0; i < 4; ++i) {
                    const int64_t g = 8 * k + 4 * h + i;  /* the x block */
                    const int s = 8 * h + 2 * i;
                    const float sa = d * (float)sc[s], sb = d * (float)sc[s + 1];
                    const __m256i p = mul_sum_us8(c[i], _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                    const __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sa * xd[g])),
                                                           _mm_set1_ps(sb * xd[g]), 1);
                    acc = _mm256_fmadd_ps(cvt8(p), sv, acc);
                    off -= 32.f * (sa * xq16[2 * g] + sb * xq16[2 * g + 1]);
                }
            }
        }
        return hsum8(acc) + off;
    }
    default:
        return 0.f;
    }
#else
    (void)xq16;
    const int be = blk_elems(t), bb = blk_bytes(t);
    float tmp[QK], s = 0.f;
    for (int64_t i = 0; i < n; i += be) {
        deq_block(t, row + i / be * bb, tmp);
        for (int e = 0; e < be; ++e) s += tmp[e] * (xd[(i + e) / 32] * (float)xq[i + e]);
    }
    return s;
#endif
}

/* one 32-block of x -> int8 q, its scale, and the scaled sums of q over each 16 */
static void quant_block(const float *x, int8_t *q, float *d, float *q16) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 32; ++i) {
        const int v = (int)nearbyintf(x[i] * id);
        q[i] = (int8_t)v;
        if (i < 16) s0 += v; else s1 += v;
    }
    *d = dd;
    q16[0] = dd * (float)s0;
    q16[1] = dd * (float)s1;
}

/* the activations of a call (xbuf, cpu_quant.h): B rows of n, their sums and 8-bit codes on the heap */
static int xbuf_alloc(xbuf *a, const float *x, int64_t B, int64_t n, int q8) {
    const int64_t nb = n / 32;
    a->n = n;
    a->x = x;
    a->xs = (float *)malloc((size_t)(B * nb * (q8 ? 4 : 1) + 1) * sizeof(float));
    a->q = q8 ? (int8_t *)malloc((size_t)(B * n) + 1) : NULL;
    a->d = q8 && a->xs ? a->xs + B * nb : NULL;
    a->q16 = q8 && a->xs ? a->xs + 2 * B * nb : NULL;
    if (!a->xs || (q8 && !a->q)) {
        free(a->xs);
        free(a->q);
        return -1;
    }
    return 0;
}

static void xbuf_free(xbuf *a) {
    free(a->xs);
    free(a->q);
}

/* fill blocks [k0, k1) (of n / 32) of token b */
static void xbuf_fill(xbuf *a, int64_t b, int64_t k0, int64_t k1) {
    const int64_t n = a->n, nb = n / 32;
    for (int64_t k = k0; k < k1; ++k) {
        const float *xb = a->x + b * n + 32 * k;
        a->xs[b * nb + k] = sum32(xb);
        if (a->q) quant_block(xb, a->q + b * n + 32 * k, a->d + b * nb + k, a->q16 + b * 2 * nb + 2 * k);
    }
}

/* <row, x_b> of one format: the 8-bit path for block formats in q8 mode, else fp32 */
static inline float row_dot_x(int t, const uint8_t *row, const xbuf *a, int64_t b) {
    const int64_t n = a->n, nb = n / 32;
    if (a->q && blk_elems(t) > 1)
        return row_dot8(t, row, a->q + b * n, a->d + b * nb, a->q16 + b * 2 * nb, n);
    return row_dot(t, row, a->x + b * n, a->xs + b * nb, n);
}

/* prefetch n bytes from p, every 64-byte line */
static inline void pf_bytes(const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 1);
}

/* rows j in [lo, hi) of cs_q_rows */
static void q_rows_body(const qpart *P, int np, const qpart *P2, int np2, int64_t n, const float *bias,
                        const int64_t *idx, int64_t lo, int64_t hi, int64_t k, int64_t kpad, const xbuf *xa,
                        int64_t B, int act, float *out) {
    for (int64_t j = lo; j < hi; ++j) {
        const int64_t r = idx ? idx[j] : j;
        int t, t2 = 0;
        float sc, sc2 = 1.f;
        const uint8_t *w = row_of(P, np, r, &t, &sc), *w2 = P2 ? row_of(P2, np2, r, &t2, &sc2) : NULL;
        if (idx && j + QPF_DIST < k) {
            int tt;
            float ss;
            const uint8_t *nx = row_of(P, np, idx[j + QPF_DIST], &tt, &ss);
            pf_bytes(nx, n / blk_elems(tt) * blk_bytes(tt));
            if (P2) {
                nx = row_of(P2, np2, idx[j + QPF_DIST], &tt, &ss);
                pf_bytes(nx, n / blk_elems(tt) * blk_bytes(tt));
            }
        }
        for (int64_t b = 0; b < B; ++b) {
            float z = row_dot_x(t, w, xa, b) * sc;
            if (bias) z += bias[r];
            z = act_f(z, act);
            if (w2) z *= row_dot_x(t2, w2, xa, b) * sc2;
            out[b * kpad + j] = z;
        }
    }
}

typedef struct {             /* cs_q_rows on the team: chunks of rows, claimed static first */
    const qpart *P;
    int np;
    const qpart *P2;
    int np2;
    int64_t n;
    const float *bias;
    const int64_t *idx;
    int64_t k, kpad;
    const xbuf *xa;
    int64_t B;
    int act;
    float *out;
    int64_t chunk;
    atomic_int *flag;        /* a claim word per chunk, zeroed */
} rows_job;

static void rows_job_run(void *arg, int t, int T) {
    rows_job *j = (rows_job *)arg;
    qclaim c;
    claim_init(&c, j->flag, 1, (j->k + j->chunk - 1) / j->chunk, t, T);
    for (int64_t i; (i = claim_next(&c)) >= 0;) {
        const int64_t lo = i * j->chunk, hi = lo + j->chunk < j->k ? lo + j->chunk : j->k;
        q_rows_body(j->P, j->np, j->P2, j->np2, j->n, j->bias, j->idx, lo, hi, j->k, j->kpad, j->xa, j->B, j->act,
                    j->out);
    }
}

/* out [B, kpad]: out[b, j] = act(<W[r_j], x_b> * scale + bias[r_j]) * (<W2[r_j], x_b> * scale2) for j < k
 * (r_j = idx[j], idx NULL: j), 0 for j in [k, kpad). P2 NULL: no second factor. x [B, n]. q8: 8-bit activations
 * for the block formats' rows (see above). */
int cs_q_rows(const qpart *P, int np, const qpart *P2, int np2, int64_t n, const float *bias, const int64_t *idx,
              int64_t k, int64_t kpad, const float *x, int64_t B, int act, int q8, float *out, int nt) {
    if (check_parts(P, np, n) || (P2 && check_parts(P2, np2, n)) || (n % 32 && blk_elems(P[0].type) != 1))
        return -1;
    const int64_t R = total_rows(P, np);
    if (P2 && total_rows(P2, np2) != R) return -1;
    if (idx) {
        for (int64_t j = 0; j < k; ++j)
            if (idx[j] < 0 || idx[j] >= R) return -1;
    } else if (k > R) {
        return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = k; j < kpad; ++j) out[b * kpad + j] = 0.f;
    xbuf xa;
    if (xbuf_alloc(&xa, x, B, n, q8 && n % 32 == 0)) return -1;
    for (int64_t b = 0; b < B; ++b) xbuf_fill(&xa, b, 0, n / 32);
    if (nt <= 1 || k < 64) {
        q_rows_body(P, np, P2, np2, n, bias, idx, 0, k, k, kpad, &xa, B, act, out);
    } else {
        int64_t rb = 0;
        for (int p = 0; p < np; ++p) rb = P[p].row_bytes > rb ? P[p].row_bytes : rb;
        atomic_int flag[QMAXTASKS];
        memset(flag, 0, sizeof(flag));
        rows_job job = {P, np, P2, np2, n, bias, idx, k, kpad, &xa, B, act, out, 0, flag};
        job.chunk = chunk_rows(k, rb * (P2 ? 2 : 1) * B, nt, 1);
        qteam_run(rows_job_run, &job, nt);
    }
    xbuf_free(&xa);
    return 0;
}

/* ------------------------------------------------------------------------------------------ the dense FFN */
/* phase 1 for neurons [lo, hi): h[b, j] = act(<G_j, x_b> + b1[j]) * <U_j, x_b> (gated; G NULL: act(<U_j, x_b> +
 * b1[j])), then h's sums (and 8-bit quantization) for the neurons' whole blocks (lo, hi multiples of 32) */
static void ffn_up_body(const qpart *G, int ng, const qpart *U, int nu, const float *b1, const xbuf *xa,
                        xbuf *ha, int64_t B, int act, int64_t lo, int64_t hi) {
    const int64_t D = ha->n;
    float *h = (float *)ha->x;
    for (int64_t j = lo; j < hi; ++j) {
        int tg = 0, tu;
        float sg = 1.f, su;
        const uint8_t *wg = G ? row_of(G, ng, j, &tg, &sg) : NULL, *wu = row_of(U, nu, j, &tu, &su);
        for (int64_t b = 0; b < B; ++b) {
            float a;
            if (wg) {
                a = row_dot_x(tg, wg, xa, b) * sg;
                if (b1) a += b1[j];
                a = act_f(a, act) * (row_dot_x(tu, wu, xa, b) * su);
            } else {
                a = row_dot_x(tu, wu, xa, b) * su;
                if (b1) a += b1[j];
                a = act_f(a, act);
            }
            h[b * D + j] = a;
        }
    }
    for (int64_t b = 0; b < B; ++b) xbuf_fill(ha, b, lo / 32, hi / 32);
}

static void ffn_down_body(const qpart *Dn, int nd, const float *b2, int64_t d, const xbuf *ha, int64_t B,
                          int64_t lo, int64_t hi, float *y) {
    for (int64_t o = lo; o < hi; ++o) {
        int t;
        float sc;
        const uint8_t *w = row_of(Dn, nd, o, &t, &sc);
        for (int64_t b = 0; b < B; ++b) {
            const float z = row_dot_x(t, w, ha, b) * sc;
            y[b * d + o] = b2 ? z + b2[o] : z;
        }
    }
}

typedef struct {             /* cs_q_ffn on the team: the neurons' chunks, the barrier, the output rows' chunks */
    const qpart *G;
    int ng;
    const qpart *U;
    int nu;
    const qpart *Dn;
    int nd;
    const float *b1, *b2;
    const xbuf *xa;
    xbuf *ha;
    int64_t B;
    int act;
    int64_t d, D;
    float *y;
    int64_t cu, cd;
    atomic_int *flag;        /* 2 * QMAXTASKS claim words, zeroed */
    qbar bar;
} ffn_job;

static void ffn_job_run(void *arg, int t, int T) {
    ffn_job *j = (ffn_job *)arg;
    qclaim c;
    claim_init(&c, j->flag, 1, (j->D + j->cu - 1) / j->cu, t, T);
    for (int64_t i; (i = claim_next(&c)) >= 0;)
        ffn_up_body(j->G, j->ng, j->U, j->nu, j->b1, j->xa, j->ha, j->B, j->act, i * j->cu,
                    i * j->cu + j->cu < j->D ? i * j->cu + j->cu : j->D);
    qbarrier(&j->bar, T);
    claim_init(&c, j->flag + QMAXTASKS, 1, (j->d + j->cd - 1) / j->cd, t, T);
    for (int64_t i; (i = claim_next(&c)) >= 0;)
        ffn_down_body(j->Dn, j->nd, j->b2, j->d, j->ha, j->B, i * j->cd,
                      i * j->cd + j->cd < j->d ? i * j->cd + j->cd : j->d, j->y);
}

/* The dense FFN: h = act(G x + b1) * (U x) (G NULL: act(U x + b1)), y = Dn h + b2. G, U [D, d], Dn [d, D];
 * x [B, d], h: B * D floats of scratch, y [B, d]; q8: 8-bit activations (x, and h) for the block formats. One
 * job of the team: the neurons in chunks of whole 32-blocks, a barrier, then the output rows. */
int cs_q_ffn(const qpart *G, int ng, const qpart *U, int nu, const qpart *Dn, int nd, int64_t d, int64_t D,
             const float *b1, const float *b2, const float *x, int64_t B, int act, int q8, float *h, float *y,
             int nt) {
    if ((G && (check_parts(G, ng, d) || total_rows(G, ng) != D)) || check_parts(U, nu, d) ||
        total_rows(U, nu) != D || check_parts(Dn, nd, D) || total_rows(Dn, nd) != d || d % 32 || D % 32)
        return -1;
    xbuf xa, ha;
    if (xbuf_alloc(&xa, x, B, d, q8)) return -1;
    if (xbuf_alloc(&ha, h, B, D, q8)) {
        xbuf_free(&xa);
        return -1;
    }
    for (int64_t b = 0; b < B; ++b) xbuf_fill(&xa, b, 0, d / 32);
    if (nt <= 1) {
        ffn_up_body(G, ng, U, nu, b1, &xa, &ha, B, act, 0, D);
        ffn_down_body(Dn, nd, b2, d, &ha, B, 0, d, y);
    } else {
        atomic_int flag[2 * QMAXTASKS];
        memset(flag, 0, sizeof(flag));
        int64_t rb = 0;
        for (int p = 0; p < nu; ++p) rb = U[p].row_bytes > rb ? U[p].row_bytes : rb;
        ffn_job job = {G, ng, U, nu, Dn, nd, b1, b2, &xa, &ha, B, act, d, D, y,
                       chunk_rows(D, rb * (G ? 2 : 1) * B, nt, 32), 0, flag, {0}};
        for (int p = 0; p < nd; ++p) rb = Dn[p].row_bytes > rb ? Dn[p].row_bytes : rb;
        job.cd = chunk_rows(d, rb * B, nt, 1);
        qteam_run(ffn_job_run, &job, nt);
    }
    xbuf_free(&xa);
    xbuf_free(&ha);
    return 0;
}
