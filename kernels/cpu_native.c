/* CPU kernels for kernels/cpu.py: fp32, OpenMP, no copies of the weights.
 *
 * Two primitives, both reading weight rows in place:
 *   rows_dot    out[b, j] = act(<W[r_j], x_b> + bias[r_j]) * <W2[r_j], x_b> * scale[b, j]
 *               (output sparsity: gate/up/fc1/qkv rows of a [N, d] matrix by an index; a row is read once for
 *               all B tokens that share the set)
 *   rows_axpy   y_b = sum_j w[b, j] * Wt[r_j, :]
 *               (a weighted sum of rows of Wt = W^T [in, out]: the down projection over the active neurons,
 *               input sparsity over the active inputs)
 * Each thread takes a contiguous range of the active rows (streaming reads of whole rows) and keeps its own
 * partial sums; the partials are added at the end. Errors (an index out of range) return -1; nothing is
 * written then except scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define LANES 32
#ifndef PF_DIST
#define PF_DIST 4        /* software prefetch: rows this many active rows ahead (random rows defeat the */
#endif                   /* hardware prefetcher at every row start) */
#ifndef PF_FULL
#define PF_FULL 1        /* 1: every line of the row, 0: its first line only */
#endif

static inline void pf_row(const float *p, int64_t n) {
#if PF_FULL
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
#else
    (void)n;
    __builtin_prefetch(p, 0, 3);
#endif
}

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

/* idx: NULL -> rows 0..k-1. k rows are computed; positions j in [k, kpad) are written 0 (the index-buffer
 * convention: entries past count are never read). out [B, kpad]; scale [B, kpad] or NULL. */
int cs_rows_dot(const float *W, const float *W2, const float *bias, int64_t nrows, int64_t d, const int64_t *idx,
                int64_t k, int64_t kpad, const float *x, int64_t B, int act, const float *scale, float *out,
                int nt) {
    if (idx)
        for (int64_t j = 0; j < k; ++j)
            if (idx[j] < 0 || idx[j] >= nrows) return -1;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = k; j < kpad; ++j) out[b * kpad + j] = 0.f;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j = 0; j < k; ++j) {
        const int64_t r = idx ? idx[j] : j;
        const float *w = W + r * d;
        const float *w2 = W2 ? W2 + r * d : NULL;
        if (j + PF_DIST < k) {
            const int64_t rn = idx ? idx[j + PF_DIST] : j + PF_DIST;
            pf_row(W + rn * d, d);
            if (W2) pf_row(W2 + rn * d, d);
        }
        for (int64_t b = 0; b < B; ++b) {
            float z = dot_f(w, x + b * d, d);
            if (bias) z += bias[r];
            z = act_f(z, act);
            if (w2) z *= dot_f(w2, x + b * d, d);
            if (scale) z *= scale[b * kpad + j];
            out[b * kpad + j] = z;
        }
    }
    return 0;
}

/* y[b, :n] = bias + sum_{p in [off[b], off[b+1])} w[p] * Wt[r_p, :n] (rows ld apart) with r_p = idx[p] (idx NULL: p - off[b]).
 * shared != 0: every token uses the rows idx[0..k) (k = off[1] - off[0]) with weights w[b*wstride + j]; each row
 * is read once for all tokens. Otherwise per-token bags (off[B+1]). Threads split the rows of a bag when there
 * are fewer bags than threads (each its own partial sums, added by the calling thread afterwards), else take
 * whole bags. scratch: nt * B * n floats when shared or B < nt. */
int cs_rows_axpy(const float *Wt, int64_t nrows, int64_t n, int64_t ld, const int64_t *idx, const float *w, int64_t wstride,
                 const int64_t *off, int64_t B, int shared, const float *bias, float *y, float *scratch, int nt) {
    if (idx) {
        int64_t total = shared ? off[1] - off[0] : off[B] - off[0];
        for (int64_t p = off[0]; p < off[0] + total; ++p)
            if (idx[p] < 0 || idx[p] >= nrows) return -1;
    }
    if (!shared && B >= nt) {                 /* whole bags per thread */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            float *yb = y + b * n;
            if (bias) memcpy(yb, bias, n * sizeof(float)); else memset(yb, 0, n * sizeof(float));
            for (int64_t p = off[b]; p < off[b + 1]; ++p) {
                const int64_t r = idx ? idx[p] : p - off[b];
                if (p + PF_DIST < off[b + 1]) pf_row(Wt + (idx ? idx[p + PF_DIST] : p + PF_DIST - off[b]) * ld, n);
                axpy_f(yb, Wt + r * ld, w[p], n);
            }
        }
        return 0;
    }
    int nthreads = nt < 1 ? 1 : nt;
    memset(scratch, 0, (size_t)nthreads * B * n * sizeof(float));
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        float *part = scratch + (size_t)t * B * n;
        if (shared) {
            const int64_t k = off[1] - off[0];
            const int64_t lo = k * t / T, hi = k * (t + 1) / T;
            for (int64_t j = lo; j < hi; ++j) {
                const int64_t r = idx ? idx[off[0] + j] : j;
                if (j + PF_DIST < hi) pf_row(Wt + (idx ? idx[off[0] + j + PF_DIST] : j + PF_DIST) * ld, n);
                const float *row = Wt + r * ld;
                for (int64_t b = 0; b < B; ++b) axpy_f(part + b * n, row, w[b * wstride + j], n);
            }
        } else {
            for (int64_t b = 0; b < B; ++b) {
                const int64_t k = off[b + 1] - off[b];
                const int64_t lo = off[b] + k * t / T, hi = off[b] + k * (t + 1) / T;
                for (int64_t p = lo; p < hi; ++p) {
                    const int64_t r = idx ? idx[p] : p - off[b];
                    if (p + PF_DIST < hi) pf_row(Wt + (idx ? idx[p + PF_DIST] : p + PF_DIST - off[b]) * ld, n);
                    axpy_f(part + b * n, Wt + r * ld, w[p], n);
                }
            }
        }
    }
    const int64_t tot = B * n;
    for (int64_t e = 0; e < tot; ++e) {
        float s = bias ? bias[e % n] : 0.f;
        for (int u = 0; u < nthreads; ++u) s += scratch[(size_t)u * tot + e];
        y[e] = s;
    }
    return 0;
}

/* Input sparsity: y[b, :] = bias + sum_{i : |x[b, i]| > t} x[b, i] * Wt[i, :]. Active inputs are found here
 * (no index tensor built by the caller). idx_scratch: B * in int64, w_scratch: B * in floats, off: B + 1. */
int cs_input_sparse(const float *Wt, int64_t in, int64_t n, int64_t ld, const float *x, int64_t B, float t, const float *bias,
                    float *y, int64_t *idx_scratch, float *w_scratch, int64_t *off, float *scratch, int nt) {
    int64_t p = 0;
    off[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * in;
        for (int64_t i = 0; i < in; ++i)
            if (fabsf(xb[i]) > t) { idx_scratch[p] = i; w_scratch[p] = xb[i]; ++p; }
        off[b + 1] = p;
    }
    return cs_rows_axpy(Wt, in, n, ld, idx_scratch, w_scratch, 0, off, B, 0, bias, y, scratch, nt);
}

/* Per-token sets: out[p] = <W[col[p]], x[tok[p]]> (+ bias[col[p]]) for P (token, row) pairs. */
int cs_pair_dot(const float *W, const float *bias, int64_t nrows, int64_t d, const int64_t *tok, const int64_t *col,
                int64_t P, const float *x, float *out, int nt) {
    for (int64_t p = 0; p < P; ++p)
        if (col[p] < 0 || col[p] >= nrows) return -1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t p = 0; p < P; ++p) {
        float z = dot_f(W + col[p] * d, x + tok[p] * d, d);
        out[p] = bias ? z + bias[col[p]] : z;
    }
    return 0;
}

/* The whole FFN over the active neurons in one pass, batch B sharing the set:
 *   y_b = bd + sum_j a_bj * Wdt[r_j, :],  a_bj = act(<W1[r_j], x_b> + b1[r_j]) * (Wg ? <Wu[r_j], x_b> : 1)
 * with W1 = Wg (gated) or Wu (fc1). Each thread takes a range of the active neurons and adds their down rows to
 * its own partial right after computing them (no h round trip, one parallel region); the calling thread adds
 * the partials. idx NULL: every neuron (the dense FFN). scratch: nt * B * d floats. */
int cs_ffn(const float *Wg, const float *Wu, const float *b1, const float *Wdt, const float *bd, int64_t nrows,
           int64_t d, const int64_t *idx, int64_t k, const float *x, int64_t B, int act, float *y, float *scratch,
           int nt) {
    if (idx)
        for (int64_t j = 0; j < k; ++j)
            if (idx[j] < 0 || idx[j] >= nrows) return -1;
    const float *W1 = Wg ? Wg : Wu;
    int T = nt < 1 ? 1 : nt;
    if (k < 64 * T) T = 1;
    memset(scratch, 0, (size_t)T * B * d * sizeof(float));
#pragma omp parallel num_threads(T) if (T > 1)
    {
        const int t = omp_get_thread_num(), TT = omp_get_num_threads();
        float *part = scratch + (size_t)t * B * d;
        const int64_t lo = k * t / TT, hi = k * (t + 1) / TT;
        for (int64_t j = lo; j < hi; ++j) {
            const int64_t r = idx ? idx[j] : j;
            if (j + PF_DIST < hi) {
                const int64_t rn = idx ? idx[j + PF_DIST] : j + PF_DIST;
                pf_row(W1 + rn * d, d);
                if (Wg) pf_row(Wu + rn * d, d);
                pf_row(Wdt + rn * d, d);
            }
            const float *w1 = W1 + r * d, *wd = Wdt + r * d;
            for (int64_t b = 0; b < B; ++b) {
                float a = dot_f(w1, x + b * d, d);
                if (b1) a += b1[r];
                a = act_f(a, act);
                if (Wg) a *= dot_f(Wu + r * d, x + b * d, d);
                axpy_f(part + b * d, wd, a, d);
            }
        }
    }
    for (int64_t e = 0; e < B * d; ++e) {
        float s = bd ? bd[e % d] : 0.f;
        for (int u = 0; u < T; ++u) s += scratch[(size_t)u * B * d + e];
        y[e] = s;
    }
    return 0;
}
