/* CPU kernels over GGUF block-quantized weights (kernels/cpu_quant.py; formats in kernels/quant.py), fp32
 * activations and accumulation: the weights are dequantized inside the kernel, so a product equals the one over
 * the dequantized fp32 weights up to fp32 summation order.
 *
 *   cs_q_dequant   rows of a weight -> fp32, bit for bit gguf-py's dequantizer (scalar code; this file is
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
 * chunks, then what is left of the others' ("the team" below; cs_qt_axpy: columns by count); one thread runs
 * with no region. Errors (an index out of range, a bad format) return -1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_act.h"
/* the decode glue (norms, RoPE, attention) with contraction on, as cpu_native.c compiles it: same bits */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "cpu_glue.h"
#pragma GCC pop_options

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QSIMD 1
#else
#define QSIMD 0
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14 };
#define QK 256

typedef struct {             /* rows of one format (kernels.quant.QuantPart) */
    int32_t type;
    int64_t rows;
    int64_t row_bytes;
    const uint8_t *data;
    float scale;             /* values times this (1: none) */
} qpart;

static int blk_elems(int t) {
    switch (t) {
    case T_F32: case T_F16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return QK;
    default: return 0;
    }
}

static int blk_bytes(int t) {
    switch (t) {
    case T_F32: return 4;
    case T_F16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    if (e == 0) {
        if (m == 0) {
            f = sign;
        } else {                                  /* subnormal: normalise */
            int s = -1;
            do { ++s; m <<= 1; } while (!(m & 0x400u));
            f = sign | ((uint32_t)(112 - s) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        f = sign | 0x7f800000u | (m << 13);
    } else {
        f = sign | ((e + 112u) << 23) | (m << 13);
    }
    float r;
    memcpy(&r, &f, 4);
    return r;
#endif
}

/* Q4_K / Q5_K: the 12 scale bytes -> 6-bit scales and mins of the 8 groups */
static inline void k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* ------------------------------------------------------------------------------ exact block dequantizers */
/* One block -> blk_elems(t) floats, the same fp32 operations as gguf-py (kernels/quant.py's table). */
static void deq_block(int t, const uint8_t *b, float *y) {
    switch (t) {
    case T_F32:
        memcpy(y, b, 4);
        return;
    case T_F16:
        y[0] = h2f(b);
        return;
    case T_Q4_0: {
        const float d = h2f(b);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)((b[2 + j] & 15) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        return;
    }
    case T_Q4_1: {
        const float d = h2f(b), m = h2f(b + 2);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)(b[4 + j] & 15) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = t == T_Q5_1;
        const float d = h2f(b), m = one ? h2f(b + 2) : 0.f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int j = 0; j < 16; ++j) {
            const int lo = (qs[j] & 15) | (int)(((qh >> j) & 1u) << 4);
            const int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            if (one) {
                y[j] = d * (float)lo + m;
                y[j + 16] = d * (float)hi + m;
            } else {
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
            }
        }
        return;
    }
    case T_Q8_0: {
        const float d = h2f(b);
        for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        const float d = h2f(b), dmin = h2f(b + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(b + 4, sc, mn);
        const int five = t == T_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int s = 0; s < 8; ++s) {
            const float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
            const int c = s / 2, sh = 4 * (s & 1);
            for (int l = 0; l < 32; ++l) {
                int q = (qs[c * 32 + l] >> sh) & 15;
                if (five) q |= ((qh[l] >> s) & 1) << 4;
                y[s * 32 + l] = ds * (float)q - dm;
            }
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = h2f(b + 208);
        for (int e = 0; e < QK; ++e) {
            const int h = e >> 7, r = e & 127;
            const int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15;
            const int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
            y[e] = (d * (float)sc[e >> 4]) * (float)((lo | (hi << 4)) - 32);
        }
        return;
    }
    default:
        return;
    }
}

static void deq_row(int t, const uint8_t *row, int64_t n, float scale, float *y) {
    const int be = blk_elems(t), bb = blk_bytes(t);
    for (int64_t k = 0; k < n / be; ++k) deq_block(t, row + k * bb, y + k * be);
    if (scale != 1.f)
        for (int64_t i = 0; i < n; ++i) y[i] = y[i] * scale;
}

/* global row r of the parts -> its bytes (and format, scale); NULL when out of range */
static inline const uint8_t *row_of(const qpart *P, int np, int64_t r, int *t, float *scale) {
    for (int p = 0; p < np; ++p) {
        if (r < P[p].rows) {
            *t = P[p].type;
            *scale = P[p].scale;
            return P[p].data + r * P[p].row_bytes;
        }
        r -= P[p].rows;
    }
    return NULL;
}

static int64_t total_rows(const qpart *P, int np) {
    int64_t n = 0;
    for (int p = 0; p < np; ++p) n += P[p].rows;
    return n;
}

static int check_parts(const qpart *P, int np, int64_t cols) {
    for (int p = 0; p < np; ++p) {
        const int be = blk_elems(P[p].type);
        if (!be || cols % be || P[p].row_bytes != cols / be * blk_bytes(P[p].type)) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ the team */
/* The threads of the parallel kernels: an OpenMP region (the team torch's own ops use: a second pool of
 * threads beside it fought it for the cores, and a per-op step at 2 threads, its attention in OpenMP, ran 3x
 * slower), with our own barrier inside: it spins QSPIN_NS, then sleeps on a futex (Linux; elsewhere it yields).
 * OpenMP's barriers spin for milliseconds first: with another process on the cores, a spinning thread that the
 * scheduler preempts stays preempted for the other's time slice (it is runnable, not woken: no wake-up
 * preemption) while the team waits for it; a sleeping one is woken at once. */
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#define QALIGN 64
#ifndef QSPIN_NS
#define QSPIN_NS 20000       /* a barrier spins this long, then sleeps */
#endif

static inline void cpu_relax(void) {
#if QSIMD
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {             /* a barrier of T threads (zeroed before use) */
    atomic_int count, gen, sleepers;
} qbar;

static void qbarrier(qbar *s, int T) {
    if (T <= 1) return;
    const int g = atomic_load(&s->gen);
    if (atomic_fetch_add(&s->count, 1) == T - 1) {
        atomic_store(&s->count, 0);
        atomic_store(&s->gen, g + 1);
#if defined(__linux__)
        if (atomic_load(&s->sleepers) > 0) syscall(SYS_futex, (int *)&s->gen, FUTEX_WAKE_PRIVATE, T, NULL, NULL, 0);
#endif
        return;
    }
    const int64_t t0 = now_ns();
    for (int i = 1;; ++i) {
        if (atomic_load_explicit(&s->gen, memory_order_acquire) != g) return;
        cpu_relax();
        if ((i & 63) == 0 && now_ns() - t0 > QSPIN_NS) break;
    }
    atomic_fetch_add(&s->sleepers, 1);      /* seq_cst: the last thread sees it, or this one sees the new gen */
    while (atomic_load(&s->gen) == g) {
#if defined(__linux__)
        syscall(SYS_futex, (int *)&s->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&s->sleepers, 1);
}

typedef void (*qjob_fn)(void *arg, int t, int T);

/* fn(arg, t, T) for t = 0..T-1 on T threads, returning when all are done */
static void qteam_run(qjob_fn fn, void *arg, int T) {
    if (T <= 1) {
        fn(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), TT = omp_get_num_threads();
        if (TT == T) fn(arg, t, T);
        else if (t == 0) fn(arg, 0, 1);     /* fewer threads than asked (a nested region): serial */
    }
}

/* Tasks 0..n-1 of a phase among T threads, static first: thread t owns the contiguous range
 * [n t / T, n (t + 1) / T) and takes it in order (one stream through memory: interleaving small chunks among the
 * threads lost all of the second thread's gain on a 2-core Zen 4 VM), then takes what is left of the other
 * threads' ranges from their ends (a thread slowed by another process loses its tail instead of holding the
 * team at the barrier). Each task is claimed by swapping the phase's epoch into its word: no zeroing between
 * uses, one atomic per task. */
#define QMAXTASKS 256

typedef struct {
    atomic_int *flag;        /* n claim words */
    int epoch;
    int64_t n, own, own_end, steal;
    int t, T, victim;
} qclaim;

static void claim_init(qclaim *c, atomic_int *flag, int epoch, int64_t n, int t, int T) {
    c->flag = flag;
    c->epoch = epoch;
    c->n = n;
    c->t = t;
    c->T = T;
    c->own = T > 1 ? n * t / T : 0;
    c->own_end = T > 1 ? n * (t + 1) / T : n;
    c->victim = 1;
    c->steal = -1;
}

static inline int claim(qclaim *c, int64_t i) {
    return atomic_exchange_explicit(&c->flag[i], c->epoch, memory_order_relaxed) != c->epoch;
}

/* the next task of this thread, -1 when none is left */
static int64_t claim_next(qclaim *c) {
    if (c->T <= 1) return c->own < c->n ? c->own++ : -1;
    while (c->own < c->own_end) {
        const int64_t i = c->own++;
        if (claim(c, i)) return i;
        c->own = c->own_end;               /* the rest of the range was taken from its end */
    }
    for (; c->victim < c->T; ++c->victim, c->steal = -1) {
        const int u = (c->t + c->victim) % c->T;
        const int64_t lo = c->n * u / c->T;
        if (c->steal < 0) c->steal = c->n * (u + 1) / c->T - 1;
        while (c->steal >= lo) {
            const int64_t i = c->steal--;
            if (claim(c, i)) return i;
        }
    }
    return -1;
}

/* rows per task: about QCHUNK_BYTES, at least 4 tasks a thread, at most QMAXTASKS tasks, a multiple of align */
#ifndef QCHUNK_BYTES
#define QCHUNK_BYTES 16384
#endif
static int64_t chunk_rows(int64_t R, int64_t row_bytes, int T, int64_t align) {
    int64_t c = QCHUNK_BYTES / (row_bytes > 0 ? row_bytes : 1);
    const int64_t fair = R / (4 * (int64_t)T), least = (R + QMAXTASKS - 1) / QMAXTASKS;
    if (c > fair) c = fair;
    if (c < least) c = least;
    c = (c + align - 1) / align * align;
    return c < align ? align : c;
}

/* rows (optionally by an index) -> fp32 [k, cols] */
typedef struct {
    const qpart *P;
    int np;
    int64_t cols;
    const int64_t *idx;
    int64_t k, chunk;
    float *out;
    atomic_int *flag;
} deq_job;

static void deq_rows(const deq_job *j, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
        int t;
        float sc;
        const uint8_t *row = row_of(j->P, j->np, j->idx ? j->idx[r] : r, &t, &sc);
        deq_row(t, row, j->cols, sc, j->out + r * j->cols);
    }
}

static void deq_job_run(void *arg, int t, int T) {
    const deq_job *j = (const deq_job *)arg;
    qclaim c;
    claim_init(&c, j->flag, 1, (j->k + j->chunk - 1) / j->chunk, t, T);
    for (int64_t i; (i = claim_next(&c)) >= 0;)
        deq_rows(j, i * j->chunk, i * j->chunk + j->chunk < j->k ? i * j->chunk + j->chunk : j->k);
}

int cs_q_dequant(const qpart *P, int np, int64_t cols, const int64_t *idx, int64_t k, float *out, int nt) {
    if (check_parts(P, np, cols)) return -1;
    const int64_t R = total_rows(P, np);
    for (int64_t j = 0; j < k; ++j)
        if ((idx ? idx[j] : j) < 0 || (idx ? idx[j] : j) >= R) return -1;
    atomic_int flag[QMAXTASKS];
    deq_job job = {P, np, cols, idx, k, k, out, flag};
    if (nt <= 1 || k <= 64) {
        deq_rows(&job, 0, k);
        return 0;
    }
    memset(flag, 0, sizeof(flag));
    job.chunk = chunk_rows(k, cols * 4, nt, 1);     /* by the bytes written */
    qteam_run(deq_job_run, &job, nt);
    return 0;
}

/* ------------------------------------------------------------------------------------------- row dots */
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

/* B activation rows of n: x and its 32-sums, and in q8 mode (q != NULL) their 8-bit quantization */
typedef struct {
    int64_t n;
    const float *x;
    float *xs;          /* [B, n / 32] sums of x */
    int8_t *q;          /* [B, n] or NULL (fp32 mode) */
    float *d;           /* [B, n / 32] */
    float *q16;         /* [B, n / 16] */
} xbuf;

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

#ifndef QSP_HINT
#define QSP_HINT 1           /* __builtin_prefetch locality of those rows */
#endif
#ifndef QSP_PF
#define QSP_PF 32            /* one token's Wᵀ rows: prefetch this many rows past the group being summed */
#endif
#ifndef QPF_DIST
#define QPF_DIST 4           /* gathered rows: prefetch this many rows ahead (every line of the row) */
#endif

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

/* ------------------------------------------------------------------------------ the transposed layout */
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

/* ------------------------------------------------------------------------------- whole decoder layers */
/* One token (batch 1) through decoder layers l0..l1-1 in one call, the ops of workers/decode/layer.py's step
 * with the quantized weights and the native glue, in the same order on the same values (so the same bits):
 *     h = norm(x, n1); qkv = W_qkv h + b_qkv; K/V of every KV head normed, rotated and written at pos;
 *     every query head normed, rotated, attends over the cache -> a; o = W_o a + b_o; (o = norm(o, post_attn));
 *     x += o; h = norm(x, n2); f = act(W_gate h) * (W_up h) (non-gated: act(W_up h + b_up));
 *     y = W_down f + b_down; (y = norm(y, post_ffn)); x += y
 * Threads (nt > 1): one job of the team (above) for all the layers, six phases a layer (QKV, K/V write,
 * attention, O, gate/up, down), each a list of tasks that the threads take from a shared counter (a
 * projection's rows in chunks of about QCHUNK_BYTES, 32 rows at least for gate/up: their outputs' 32-blocks; a
 * KV head; a query head), then the team's barrier (spins QSPIN_NS, then sleeps). A thread that another process
 * slows takes fewer tasks. The norms are computed by every thread into its own buffer (no hand-off), the
 * residual stream is written by slices. One thread: no team, no atomics. */
typedef struct {             /* one layer (workers/decode/native_layer.py packs these; all fields 8 bytes) */
    const qpart *qkv, *o, *gate, *up, *down;   /* gate NULL: non-gated */
    int64_t nqkv, no, ngate, nup, ndown;       /* parts of each */
    const float *b_qkv, *b_o, *b_up, *b_down;  /* NULL: none */
    const float *n1, *n2, *post_attn, *post_ffn;   /* norms (post_*: Gemma's sandwich norms, NULL: none) */
    const float *qn, *kn;                      /* q/k norms (NULL: none) */
    const float *cos_t, *sin_t;                /* RoPE tables [positions, hd] (NULL: none) */
    float *kc, *vc;                            /* this layer's cache [KV, L, hd] */
    int64_t window;                            /* sliding window (0: none) */
} qlayer;

typedef struct {             /* the model's shapes */
    int64_t d, D, H, KV, hd, L;                /* L: the cache's positions */
    int64_t one_plus, act, q8;                 /* norm kind (1: Gemma's (x r) w), activation code, 8-bit x */
    double eps;
} qdims;

/* Input sparsity inside the layer (workers/decode/native_layer.py packs these per plan): a projection group
 * (QKV, O, gate|up, down) given here reads, per part (q, k, v; gate, up), only the rows of its Wᵀ whose input
 * passes |x_i| > thr, through qt_body (the per-op kernel cs_qt_axpy's body, so the same bits); threads split the
 * output columns. A NULL group runs dense as above. */
typedef struct {             /* one part: its Wᵀ in kernels.quant.QuantWeightT's layout (every field 8 bytes) */
    const uint8_t *codes;
    const void *scale, *offset;              /* offset NULL: none */
    int64_t bits, cbias, half, group, nout;  /* nout: this part's outputs */
    double post;                             /* the part's scale on its outputs (1: none) */
    double thr;                              /* input i is read iff |x_i| > thr */
} qtpart;

typedef struct {             /* one layer's input sparsity */
    const qtpart *qkv, *o, *gu, *down;       /* NULL: dense */
    int64_t nqkv, ngu;                       /* parts of qkv (q, k, v) and of gu (gate, up) */
    double *counts;                          /* [7]: active inputs added per q, k, v, o, gate, up, down (or NULL) */
    double dense_above;                      /* a group more active than this share runs its dense rows (sp_begin) */
} qsparse;

#define QSPARTS 3            /* parts of a group at most */

#define QPHASES 6            /* task phases a layer */

typedef struct {             /* the team's barrier (zeroed per call) and the phases' claim words (zeroed once) */
    qbar bar;
    int epoch;               /* this call's: 1 + the last call's */
    char pad[QALIGN - sizeof(qbar) - sizeof(int)];
    atomic_int flag[];       /* QMAXTASKS per phase, QPHASES phases a layer of the call */
} qsync;

typedef struct {             /* one thread's own buffers */
    float *h, *xo, *o2, *sc;
    xbuf hx;
    int64_t *idx;            /* the active inputs of each part: QSPARTS x nmax */
    float *wv;               /* their values */
    float *tt;               /* qt_body's column sums (nmax + 1) */
    float *part;             /* this thread's share of a row-split product (nmax) */
    int64_t nmax, k[QSPARTS];
} qpriv;

typedef struct {             /* shared buffers */
    float *qkv, *att, *o, *ff, *y, *xmid, *gu;
    xbuf ax, fx;
    qsync *sync;
} qshared;

/* tasks i = 0..n-1 (n <= QMAXTASKS) of phase ph among the team (static first, then taken from the others'
 * ends), then the barrier */
#define QTASKS(S, ph, t, T, n, i, ...)                                                 \
    do {                                                                                  \
        qclaim c_;                                                                        \
        claim_init(&c_, (S)->sync->flag + (int64_t)(ph) * QMAXTASKS, (S)->sync->epoch, (n), (t), (T)); \
        for (int64_t i; (i = claim_next(&c_)) >= 0;) {                                    \
            __VA_ARGS__;                                                                  \
        }                                                                                 \
        qbarrier(&(S)->sync->bar, (T));                                                   \
    } while (0)

/* the scratch's layout: a running byte offset, each buffer 64-byte aligned; base NULL only measures */
static void *carve(uint8_t *base, int64_t *off, int64_t bytes) {
    void *p = base ? base + *off : NULL;
    *off += (bytes + QALIGN - 1) / QALIGN * QALIGN;
    return p;
}

static void xbuf_carve(xbuf *a, uint8_t *base, int64_t *off, const float *x, int64_t n, int q8) {
    a->n = n;
    a->x = x;
    a->xs = (float *)carve(base, off, n / 32 * 4);
    a->q = q8 ? (int8_t *)carve(base, off, n) : NULL;
    a->d = q8 ? (float *)carve(base, off, n / 32 * 4) : NULL;
    a->q16 = q8 ? (float *)carve(base, off, n / 16 * 4) : NULL;
}

static int64_t layer_scratch(const qdims *M, int nt, int64_t nl, uint8_t *base, qshared *S, qpriv *P) {
    const int64_t d = M->d, D = M->D, qd = M->H * M->hd, nqkv = (M->H + 2 * M->KV) * M->hd;
    const int q8 = (int)M->q8;
    const int64_t nmax = d > D ? (d > qd ? d : qd) : (D > qd ? D : qd);
    int64_t off = 0;
    qshared s;
    s.sync = carve(base, &off, (int64_t)sizeof(qsync) + QPHASES * nl * QMAXTASKS * (int64_t)sizeof(atomic_int));
    s.qkv = carve(base, &off, nqkv * 4);
    s.att = carve(base, &off, qd * 4);
    s.o = carve(base, &off, d * 4);
    s.ff = carve(base, &off, D * 4);
    s.y = carve(base, &off, d * 4);
    s.xmid = carve(base, &off, d * 4);
    s.gu = carve(base, &off, 2 * D * 4);
    xbuf_carve(&s.ax, base, &off, s.att, qd, q8);
    xbuf_carve(&s.fx, base, &off, s.ff, D, q8);
    if (S) *S = s;
    for (int t = 0; t < nt; ++t) {
        qpriv p;
        p.h = carve(base, &off, d * 4);
        p.xo = carve(base, &off, d * 4);
        p.o2 = carve(base, &off, d * 4);
        p.sc = carve(base, &off, (M->L + M->hd) * 4);
        xbuf_carve(&p.hx, base, &off, p.h, d, q8);
        p.nmax = nmax;
        p.idx = carve(base, &off, QSPARTS * nmax * 8);
        p.wv = carve(base, &off, QSPARTS * nmax * 4);
        p.tt = carve(base, &off, (nmax + 1) * 4);
        p.part = carve(base, &off, nmax * 4);
        if (P) P[t] = p;
    }
    return off;
}

/* bytes of scratch cs_q_layers needs for nt threads and calls of up to nl layers */
int64_t cs_q_layers_scratch(const qdims *M, int nt, int64_t nl) {
    return layer_scratch(M, nt < 1 ? 1 : nt, nl < 1 ? 1 : nl, NULL, NULL, NULL) + QALIGN;
}

static int64_t row_bytes_of(const qpart *P, int np) {
    int64_t b = 0;
    for (int p = 0; p < np; ++p) b = P[p].row_bytes > b ? P[p].row_bytes : b;
    return b;
}

#define CHUNK(i, c, R, lo, hi) const int64_t lo = (i) * (c), hi = lo + (c) < (R) ? lo + (c) : (R)

/* the active inputs of x [n] for each part of a group (every thread its own lists); counts (thread 0 passes
 * them) get each part's number added at column col0 + part */
static void sp_active(const qtpart *tp, int64_t np, const float *x, int64_t n, qpriv *P, double *counts,
                      int col0) {
    for (int64_t s = 0; s < np; ++s) {
        const float t = (float)tp[s].thr;
        int64_t *ix = P->idx + s * P->nmax, k = 0;
        float *wv = P->wv + s * P->nmax;
        for (int64_t i = 0; i < n; ++i)
            if (fabsf(x[i]) > t) {
                ix[k] = i;
                wv[k++] = x[i];
            }
        P->k[s] = k;
        if (counts) counts[col0 + s] += (double)k;
    }
}

/* sp_active, then the choice between the active rows and the dense kernel: where the group's active share is
 * above ``dense_above`` (the layer's qsparse), its parts share one threshold and x may be changed (``maskable``),
 * x's inactive entries are zeroed and 1 returned: the caller runs the dense rows on the masked input, the same
 * products (up to summation order) at the dense kernel's cost, which at such shares is below the transposed rows'
 * (SmolLM2's Q4_1 layers at 70 % active, all four groups, one thread: 0.87x dense without the choice, 0.93x with
 * it). QKV's and gate|up's inputs are each thread's own copy; O's and down's, shared on several threads, go
 * through sp_begin_shared. */
static int sp_begin(const qtpart *tp, int64_t np, float *x, int64_t n, qpriv *P, double *counts, int col0,
                    int maskable, double dense_above) {
    int one = maskable;
    for (int64_t s = 1; s < np && one; ++s) one = tp[s].thr == tp[0].thr;
    if (one) {               /* one threshold: count first, build no lists where the dense rows run */
        const float t = (float)tp[0].thr;
        int64_t k = 0;
        for (int64_t i = 0; i < n; ++i) k += fabsf(x[i]) > t;
        if ((double)k > dense_above * (double)n) {
            for (int64_t s = 0; s < np && counts; ++s) counts[col0 + s] += (double)k;
            for (int64_t i = 0; i < n; ++i)
                if (!(fabsf(x[i]) > t)) x[i] = 0.f;
            return 1;
        }
    }
    sp_active(tp, np, x, n, P, counts, col0);
    return 0;
}

/* O or down (one part) on T > 1 threads, whose input x is shared: every thread counts x's active entries (the
 * same k); above ``dense_above`` of n, after a barrier (no thread still counting) each zeroes the inactive
 * entries of its own 32-blocks and refreshes their xbuf, and after a second barrier 1 is returned: the caller
 * runs the dense rows on the masked input. 0: nothing changed, the caller runs the active rows. */
static int sp_begin_shared(const qtpart *q, float *x, int64_t n, xbuf *xb, double dense_above, double *counts,
                           int col, qbar *bar, int t, int T) {
    const float thr = (float)q->thr;
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) k += fabsf(x[i]) > thr;
    if (!((double)k > dense_above * (double)n)) return 0;
    if (counts) counts[col] += (double)k;
    qbarrier(bar, T);
    const int64_t nb = n / 32, b0 = nb * t / T, b1 = nb * (t + 1) / T;
    for (int64_t i = b0 * 32; i < b1 * 32; ++i)
        if (!(fabsf(x[i]) > thr)) x[i] = 0.f;
    xbuf_fill(xb, 0, b0, b1);
    qbarrier(bar, T);
    return 1;
}

/* columns per task of a group of total outputs: about a quarter of a thread's share, 32-aligned, within
 * [64, 1024] (row pieces of 32+ bytes, column sums in L1) and at most QMAXTASKS tasks */
#ifndef QSP_MAXCOLS
#define QSP_MAXCOLS 1024
#endif
#ifndef QSP_SPLIT
#define QSP_SPLIT 2
#endif
static int64_t sp_chunk(int64_t total, int T) {
    int64_t c = total / (QSP_SPLIT * (int64_t)T);
    if (c > QSP_MAXCOLS) c = QSP_MAXCOLS;
    if (c < 64) c = 64;
    const int64_t least = (total + QMAXTASKS - 1) / QMAXTASKS;
    if (c < least) c = least;
    return (c + 31) / 32 * 32;
}

static int64_t sp_ntasks(const qtpart *tp, int64_t np, int64_t ct) {
    int64_t n = 0;
    for (int64_t s = 0; s < np; ++s) n += (tp[s].nout + ct - 1) / ct;
    return n;
}

/* task i of a group: columns [c0, c1) of one part into y (the group's outputs, parts one after another; bias
 * the group's or NULL); *lo / *hi: the columns written, in the group's numbering */
static void sp_task(const qtpart *tp, int64_t ct, int64_t i, const float *bias, float *y, qpriv *P, int64_t *lo,
                    int64_t *hi) {
    int64_t s = 0, off = 0;
    for (;; ++s) {
        const int64_t n = (tp[s].nout + ct - 1) / ct;
        if (i < n) break;
        i -= n;
        off += tp[s].nout;
    }
    const qtpart *q = tp + s;
    const int64_t c0 = i * ct, c1 = c0 + ct < q->nout ? c0 + ct : q->nout;
    const int post = q->post != 1.0;
    const float *b = bias ? bias + off : NULL;
    qt_body(q->codes, (int)q->bits, (int)q->cbias, q->scale, q->offset, (int)q->half, q->group, q->nout,
            P->idx + s * P->nmax, P->k[s], P->wv + s * P->nmax, 0, 1, post ? NULL : b, y + off, c0, c1, P->tt,
            P->tt + (c1 - c0));
    if (post) {              /* y * post (+ b): the per-op path's two roundings */
        const float ps = (float)q->post;
        for (int64_t o = c0; o < c1; ++o) y[off + o] = b ? y[off + o] * ps + b[o] : y[off + o] * ps;
    }
    *lo = off + c0;
    *hi = off + c1;
}

/* A one-part group of few outputs (O, down) on T > 1 threads: split by output columns, each thread would read
 * pieces of 144 bytes of every active row; split by rows instead, each thread sums whole rows of its own scale
 * groups (the groups' range cut in T) into its own buffer, then (after the barrier) each thread adds the T
 * buffers for its slice of outputs: y[r] = bias[r] + sum_t part_t[r]. The sums depend on T (as any split). */
static void sp_rows_partial(const qtpart *q, int64_t nin, qpriv *P, int t, int T) {
    const int64_t G = nin / q->group, g0 = G * t / T, g1 = G * (t + 1) / T, k = P->k[0];
    const int64_t *ix = P->idx;
    int64_t j0 = 0, j1;
    while (j0 < k && ix[j0] < g0 * q->group) ++j0;
    for (j1 = j0; j1 < k && ix[j1] < g1 * q->group; ++j1) {}
    qt_body(q->codes, (int)q->bits, (int)q->cbias, q->scale, q->offset, (int)q->half, q->group, q->nout, ix + j0,
            j1 - j0, P->wv + j0, 0, 1, NULL, P->part, 0, q->nout, P->tt, P->tt + q->nout);
}

static inline float sp_rows_sum(const qpriv *Pall, int T, const float *bias, int64_t r) {
    float v = bias ? bias[r] : 0.f;
    for (int u = 0; u < T; ++u) v += Pall[u].part[r];
    return v;
}

/* layer Y on the stream x (in place); ph: this layer's first task phase */
static void layer_run(const qlayer *Y, const qsparse *Z, const qdims *M, float *x, int64_t pos, const qshared *S,
                      qpriv *Pall, int64_t ph, int t, int T) {
    qpriv *P = Pall + t;
    const int64_t d = M->d, D = M->D, H = M->H, KV = M->KV, hd = M->hd, L = M->L, nqkv = (H + 2 * KV) * hd;
    const float eps = (float)M->eps;
    const int one_plus = (int)M->one_plus;
    const float *cs = Y->cos_t ? Y->cos_t + pos * hd : NULL, *sn = Y->sin_t ? Y->sin_t + pos * hd : NULL;
    xbuf *ax = (xbuf *)&S->ax, *fx = (xbuf *)&S->fx;
    /* the attention norm, by every thread into its own buffer */
    add_rmsnorm_row(x, NULL, NULL, Y->n1, P->h, d, eps, one_plus);
    double *counts = Z && t == 0 ? Z->counts : NULL;
    if (Z && Z->qkv && !sp_begin(Z->qkv, Z->nqkv, P->h, d, P, counts, 0, 1, Z->dense_above)) {
        const int64_t ct = sp_chunk(nqkv, T);
        QTASKS(S, ph, t, T, sp_ntasks(Z->qkv, Z->nqkv, ct), i, {
            int64_t lo, hi;
            sp_task(Z->qkv, ct, i, Y->b_qkv, S->qkv, P, &lo, &hi);
        });
    } else {
        xbuf_fill(&P->hx, 0, 0, d / 32);
        const int64_t cq = chunk_rows(nqkv, row_bytes_of(Y->qkv, (int)Y->nqkv), T, 1);
        QTASKS(S, ph, t, T, (nqkv + cq - 1) / cq, i, {
            CHUNK(i, cq, nqkv, lo, hi);
            q_rows_body(Y->qkv, (int)Y->nqkv, NULL, 0, d, Y->b_qkv, NULL, lo, hi, nqkv, nqkv, &P->hx, 1, 0,
                        S->qkv);
        });
    }
    /* K/V at pos, a KV head a task; then the query heads, a head a task (its 32-blocks' sums with it) */
    QTASKS(S, ph + 1, t, T, KV, g,
           write_kv_row(S->qkv + (H + g) * hd, S->qkv + (H + KV + g) * hd, Y->kn, eps, cs, sn, hd,
                        Y->kc + g * L * hd + pos * hd, Y->vc + g * L * hd + pos * hd));
    const int64_t lo_pos = Y->window > 0 && pos - Y->window + 1 > 0 ? pos - Y->window + 1 : 0;
    QTASKS(S, ph + 2, t, T, H, j, {
        decode_attn_body(S->qkv, 0, hd, Y->kc, Y->vc, 0, L * hd, hd, pos, lo_pos, cs, sn, Y->qn, eps, NULL, H,
                         S->att, 0, H, H / KV, hd, j, j + 1, P->sc);
        if (hd % 32 == 0) xbuf_fill(ax, 0, j * hd / 32, (j + 1) * hd / 32);
    });
    if (hd % 32 != 0) {
        if (t == 0) xbuf_fill(ax, 0, 0, H * hd / 32);
        qbarrier(&S->sync->bar, T);
    }
    /* O: the dense rows (no sparsity, or its input masked: o_dense), else the active rows */
    int o_dense = !Z || !Z->o;
    if (!o_dense && T > 1) {
        o_dense = sp_begin_shared(Z->o, S->att, H * hd, ax, Z->dense_above, counts, 3, &S->sync->bar, t, T);
        if (!o_dense) {
            sp_active(Z->o, 1, S->att, H * hd, P, counts, 3);
            sp_rows_partial(Z->o, H * hd, P, t, T);
            qbarrier(&S->sync->bar, T);
            const int64_t s0 = d * t / T, s1 = d * (t + 1) / T;
            for (int64_t r = s0; r < s1; ++r) S->o[r] = sp_rows_sum(Pall, T, Y->b_o, r);
            qbarrier(&S->sync->bar, T);
        }
    } else if (!o_dense) {
        o_dense = sp_begin(Z->o, 1, S->att, H * hd, P, counts, 3, 1, Z->dense_above);
        if (o_dense) {
            xbuf_fill(ax, 0, 0, H * hd / 32);
        } else {
            const int64_t ct = sp_chunk(d, T);
            QTASKS(S, ph + 3, t, T, sp_ntasks(Z->o, 1, ct), i, {
                int64_t lo, hi;
                sp_task(Z->o, ct, i, Y->b_o, S->o, P, &lo, &hi);
            });
        }
    }
    if (o_dense) {
        const int64_t co = chunk_rows(d, row_bytes_of(Y->o, (int)Y->no), T, 1);
        QTASKS(S, ph + 3, t, T, (d + co - 1) / co, i, {
            CHUNK(i, co, d, lo, hi);
            q_rows_body(Y->o, (int)Y->no, NULL, 0, H * hd, Y->b_o, NULL, lo, hi, d, d, ax, 1, 0, S->o);
        });
    }
    /* the residual add and the FFN norm, by every thread; the stream's slices written once */
    const float *o = S->o;
    if (Y->post_attn) {
        add_rmsnorm_row(S->o, NULL, NULL, Y->post_attn, P->o2, d, eps, one_plus);
        o = P->o2;
    }
    add_rmsnorm_row(x, o, P->xo, Y->n2, P->h, d, eps, one_plus);
    xbuf_fill(&P->hx, 0, 0, d / 32);
    const int64_t s0 = d * t / T, s1 = d * (t + 1) / T;
    memcpy(S->xmid + s0, P->xo + s0, (size_t)(s1 - s0) * sizeof(float));
    int gu_dense = 0;
    if (Z && Z->gu && !(gu_dense = sp_begin(Z->gu, Z->ngu, P->h, d, P, counts, 4, 1, Z->dense_above))) {
        /* gate and up columns [c0, c1) in one task, then act(gate) * up of them */
        const int64_t ct = sp_chunk(D, T);
        float *f = (float *)fx->x;
        QTASKS(S, ph + 4, t, T, sp_ntasks(Z->gu, 1, ct), i, {
            int64_t lo, hi, lo2, hi2;
            sp_task(Z->gu, ct, i, NULL, S->gu, P, &lo, &hi);
            sp_task(Z->gu, ct, i + sp_ntasks(Z->gu, 1, ct), NULL, S->gu, P, &lo2, &hi2);
            for (int64_t j = lo; j < hi; ++j) f[j] = act_f(S->gu[j], (int)M->act) * S->gu[D + j];
            xbuf_fill(fx, 0, lo / 32, hi / 32);
        });
    } else {
        if (gu_dense) xbuf_fill(&P->hx, 0, 0, d / 32);
        const int64_t cf = chunk_rows(D, row_bytes_of(Y->up, (int)Y->nup) + (Y->gate ? row_bytes_of(Y->gate,
                                      (int)Y->ngate) : 0), T, 32);
        QTASKS(S, ph + 4, t, T, (D + cf - 1) / cf, i, {
            CHUNK(i, cf, D, lo, hi);
            ffn_up_body(Y->gate, (int)Y->ngate, Y->up, (int)Y->nup, Y->gate ? NULL : Y->b_up, &P->hx, fx, 1,
                        (int)M->act, lo, hi);
        });
    }
    /* down: likewise */
    int down_dense = !Z || !Z->down;
    if (!down_dense && T > 1) {
        down_dense = sp_begin_shared(Z->down, (float *)fx->x, D, fx, Z->dense_above, counts, 6, &S->sync->bar, t,
                                     T);
        if (!down_dense) {
            sp_active(Z->down, 1, fx->x, D, P, counts, 6);
            sp_rows_partial(Z->down, D, P, t, T);
            qbarrier(&S->sync->bar, T);
            const int64_t r0 = d * t / T, r1 = d * (t + 1) / T;
            for (int64_t r = r0; r < r1; ++r) {
                S->y[r] = sp_rows_sum(Pall, T, Y->b_down, r);
                if (!Y->post_ffn) x[r] = S->xmid[r] + S->y[r];
            }
            qbarrier(&S->sync->bar, T);
        }
    } else if (!down_dense) {
        down_dense = sp_begin(Z->down, 1, (float *)fx->x, D, P, counts, 6, 1, Z->dense_above);
        if (down_dense) {
            xbuf_fill(fx, 0, 0, D / 32);
        } else {
            const int64_t ct = sp_chunk(d, T);
            QTASKS(S, ph + 5, t, T, sp_ntasks(Z->down, 1, ct), i, {
                int64_t lo, hi;
                sp_task(Z->down, ct, i, Y->b_down, S->y, P, &lo, &hi);
                if (!Y->post_ffn)
                    for (int64_t r = lo; r < hi; ++r) x[r] = S->xmid[r] + S->y[r];
            });
        }
    }
    if (down_dense) {
        const int64_t cd = chunk_rows(d, row_bytes_of(Y->down, (int)Y->ndown), T, 1);
        QTASKS(S, ph + 5, t, T, (d + cd - 1) / cd, i, {
            CHUNK(i, cd, d, lo, hi);
            ffn_down_body(Y->down, (int)Y->ndown, Y->b_down, d, fx, 1, lo, hi, S->y);
            if (!Y->post_ffn)      /* x = xmid + y, row by row as the down rows come */
                for (int64_t r = lo; r < hi; ++r) x[r] = S->xmid[r] + S->y[r];
        });
    }
    if (Y->post_ffn) {
        add_rmsnorm_row(S->y, NULL, NULL, Y->post_ffn, P->o2, d, eps, one_plus);
        for (int64_t r = s0; r < s1; ++r) x[r] = S->xmid[r] + P->o2[r];
        qbarrier(&S->sync->bar, T);
    }
}

typedef struct {
    const qlayer *Ls;
    const qsparse *Zs;       /* per layer, or NULL: every layer dense */
    int64_t l0, l1;
    const qdims *M;
    float *x;
    int64_t pos;
    const qshared *S;
    qpriv *P;
} layers_job;

static void layers_job_run(void *arg, int t, int T) {
    const layers_job *j = (const layers_job *)arg;
    for (int64_t l = j->l0; l < j->l1; ++l)
        layer_run(j->Ls + l, j->Zs ? j->Zs + l : NULL, j->M, j->x, j->pos, j->S, j->P, QPHASES * (l - j->l0), t, T);
}

static int sparse_group_check(const qtpart *tp, int64_t np, int64_t nin, int64_t nout) {
    if (!tp) return 0;
    if (np < 1 || np > QSPARTS) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < np; ++s) {
        const qtpart *q = tp + s;
        if (!q->codes || !q->scale || (q->bits != 4 && q->bits != 8) || q->group <= 0 || nin % q->group ||
            q->nout % 32)
            return -1;
        n += q->nout;
    }
    return n == nout ? 0 : -1;
}

static int sparse_check(const qsparse *Z, const qdims *M) {
    const int64_t d = M->d, D = M->D, qd = M->H * M->hd, nqkv = (M->H + 2 * M->KV) * M->hd;
    return sparse_group_check(Z->qkv, Z->nqkv, d, nqkv) || sparse_group_check(Z->o, 1, qd, d) ||
           sparse_group_check(Z->gu, Z->ngu, d, 2 * D) || sparse_group_check(Z->down, 1, D, d) ||
           (Z->gu && (Z->ngu != 2 || Z->gu[0].nout != D));
}

static int layer_check(const qlayer *Y, const qdims *M) {
    const int64_t d = M->d, D = M->D, qd = M->H * M->hd, nqkv = (M->H + 2 * M->KV) * M->hd;
    if (check_parts(Y->qkv, (int)Y->nqkv, d) || total_rows(Y->qkv, (int)Y->nqkv) != nqkv ||
        check_parts(Y->o, (int)Y->no, qd) || total_rows(Y->o, (int)Y->no) != d ||
        check_parts(Y->up, (int)Y->nup, d) || total_rows(Y->up, (int)Y->nup) != D ||
        (Y->gate && (check_parts(Y->gate, (int)Y->ngate, d) || total_rows(Y->gate, (int)Y->ngate) != D)) ||
        check_parts(Y->down, (int)Y->ndown, D) || total_rows(Y->down, (int)Y->ndown) != d ||
        !Y->n1 || !Y->n2 || !Y->kc || !Y->vc)
        return -1;
    return 0;
}

/* Layers l0..l1-1 of Ls on one token: xout = the stream after them, from x (xout may be x). pos: the position
 * written and attended to (< L). scratch: cs_q_layers_scratch(M, nt, l1 - l0) bytes, zeroed before its first
 * use (the claim words; a call leaves them valid for the next). Zs: per layer of Ls, its input sparsity (qsparse,
 * indexed like Ls), or NULL: every layer dense. Returns -1 (xout unwritten) for shapes or layouts the kernels do
 * not take: d, D, H * hd multiples of 32, H a multiple of KV, parts' outputs multiples of 32. */
int cs_q_layers(const qlayer *Ls, const qsparse *Zs, int64_t l0, int64_t l1, const qdims *M, const float *x,
                float *xout, int64_t pos, void *scratch, int64_t scratch_bytes, int nt) {
    const int T = nt < 1 ? 1 : nt;
    if (l1 <= l0 || pos < 0 || pos >= M->L || M->KV <= 0 || M->H % M->KV || M->H > QMAXTASKS || M->d % 32 ||
        M->D % 32 || (M->H * M->hd) % 32 || scratch_bytes < cs_q_layers_scratch(M, T, l1 - l0))
        return -1;
    for (int64_t l = l0; l < l1; ++l)
        if (layer_check(Ls + l, M) || (Zs && (sparse_check(Zs + l, M) || (Zs[l].gu && !Ls[l].gate)))) return -1;
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + QALIGN - 1) / QALIGN * QALIGN);
    qshared S;
    qpriv P[T];
    layer_scratch(M, T, l1 - l0, base, &S, P);
    memset(&S.sync->bar, 0, sizeof(qbar));
    S.sync->epoch = S.sync->epoch % 0x3fffffff + 1;
    if (xout != x) memcpy(xout, x, (size_t)M->d * sizeof(float));
    layers_job job = {Ls, Zs, l0, l1, M, xout, pos, &S, P};
    qteam_run(layers_job_run, &job, T);
    return 0;
}

/* 1 when the SIMD paths are compiled in (AVX2 + FMA), 0 for the scalar fallback */
int cs_q_simd(void) { return QSIMD; }
