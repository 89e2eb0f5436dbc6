/* CPU kernels for kernels/cpu.py: fp32, OpenMP, no copies of the weights.
 *
 * Two primitives, both reading weight rows in place:
 *   rows_dot    out[b, j] = act(<W[r_j], x_b> + bias[r_j]) * <W2[r_j], x_b> * scale[b, j]
 *               (output sparsity: gate/up/fc1/qkv rows of a [N, d] matrix by an index; a row is read once for
 *               all B tokens that share the set)
 *   rows_axpy   y_b = sum_j w[b, j] * Wt[r_j, :]
 *               (a weighted sum of rows of Wt = W^T [in, out]: the down projection over the active neurons)
 * and three fused ops built on them: the whole FFN over an active set (cs_ffn), the FFN after a dense gate
 * kept by a threshold on |act(gate)| (cs_ffn_thr), input sparsity with one threshold (or one threshold per
 * input channel) per output segment, or each token's own top-k (cs_input_sparse_seg).
 * Each thread takes a contiguous range of the active rows (streaming reads of whole rows) and keeps its own
 * partial sums; the partials are added at the end (input sparsity: each thread its own output columns). With
 * one thread nothing enters an OpenMP region: the loop body runs directly. Errors (an index out of range)
 * return -1; nothing is written then except scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_act.h"
#include "cpu_glue.h"

#ifndef PF_DIST
#define PF_DIST 4        /* software prefetch: rows this many active rows ahead (random rows defeat the */
#endif                   /* hardware prefetcher at every row start) */
#ifndef PF_FULL
#define PF_FULL 1        /* 1: every line of the row, 0: its first line only */
#endif

#ifndef PF_ROW_LOC
#define PF_ROW_LOC 1     /* locality of the whole-row prefetches: 1 -> L2 (prefetcht2), 3 -> L1 (prefetcht0) */
#endif

static inline void pf_row(const float *p, int64_t n) {
#if PF_FULL
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, PF_ROW_LOC);
#else
    (void)n;
    __builtin_prefetch(p, 0, PF_ROW_LOC);
#endif
}

/* Sum nt partial vectors of length tot (+ bias of length n, repeated) into y. */
static void reduce_parts(const float *scratch, int nt, int64_t tot, const float *bias, int64_t n, float *y) {
    for (int64_t e = 0; e < tot; ++e) {
        float s = bias ? bias[e % n] : 0.f;
        for (int u = 0; u < nt; ++u) s += scratch[(size_t)u * tot + e];
        y[e] = s;
    }
}

/* ------------------------------------------------------------------------------------------------ rows_dot */
static void rows_dot_body(const float *W, const float *W2, const float *bias, int64_t d, const int64_t *idx,
                          int64_t lo, int64_t hi, int64_t k, int64_t kpad, const float *x, int64_t B, int act,
                          const float *scale, float *out) {
    for (int64_t j = lo; j < hi; ++j) {
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
    if (nt <= 1) {
        rows_dot_body(W, W2, bias, d, idx, 0, k, k, kpad, x, B, act, scale, out);
        return 0;
    }
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        rows_dot_body(W, W2, bias, d, idx, k * t / T, k * (t + 1) / T, k, kpad, x, B, act, scale, out);
    }
    return 0;
}

/* ----------------------------------------------------------------------------------------------- rows_axpy */
/* One bag: yb += sum_{p in [lo, hi)} w[p] * Wt[r_p] with r_p = idx[p] (idx NULL: p - base). */
static void bag_body(const float *Wt, int64_t n, int64_t ld, const int64_t *idx, const float *w, int64_t base,
                     int64_t lo, int64_t hi, float *yb) {
    for (int64_t p = lo; p < hi; ++p) {
        const int64_t r = idx ? idx[p] : p - base;
        if (p + PF_DIST < hi) pf_row(Wt + (idx ? idx[p + PF_DIST] : p + PF_DIST - base) * ld, n);
        axpy_f(yb, Wt + r * ld, w[p], n);
    }
}

/* Shared set: part[b] += sum_{j in [lo, hi)} w[b*wstride + j] * Wt[r_j] (every row read once for all tokens). */
static void shared_body(const float *Wt, int64_t n, int64_t ld, const int64_t *idx, const float *w,
                        int64_t wstride, int64_t B, int64_t lo, int64_t hi, float *part) {
    for (int64_t j = lo; j < hi; ++j) {
        const int64_t r = idx ? idx[j] : j;
        if (j + PF_DIST < hi) pf_row(Wt + (idx ? idx[j + PF_DIST] : j + PF_DIST) * ld, n);
        const float *row = Wt + r * ld;
        for (int64_t b = 0; b < B; ++b) axpy_f(part + b * n, row, w[b * wstride + j], n);
    }
}

/* y[b, :n] = bias + sum_{p in [off[b], off[b+1])} w[p] * Wt[r_p, :n] (rows ld apart) with r_p = idx[p] (idx NULL: p - off[b]).
 * shared != 0: every token uses the rows idx[0..k) (k = off[1] - off[0]) with weights w[b*wstride + j]; each row
 * is read once for all tokens. Otherwise per-token bags (off[B+1]). Threads split the rows of a bag when there
 * are fewer bags than threads (each its own partial sums, added by the calling thread afterwards), else take
 * whole bags. scratch: nt * B * n floats when nt > 1 and (shared or B < nt). */
int cs_rows_axpy(const float *Wt, int64_t nrows, int64_t n, int64_t ld, const int64_t *idx, const float *w, int64_t wstride,
                 const int64_t *off, int64_t B, int shared, const float *bias, float *y, float *scratch, int nt) {
    if (idx) {
        int64_t total = shared ? off[1] - off[0] : off[B] - off[0];
        for (int64_t p = off[0]; p < off[0] + total; ++p)
            if (idx[p] < 0 || idx[p] >= nrows) return -1;
    }
    if (nt <= 1) {                            /* no OpenMP region: accumulate straight into y */
        for (int64_t b = 0; b < B; ++b) {
            if (bias) memcpy(y + b * n, bias, n * sizeof(float)); else memset(y + b * n, 0, n * sizeof(float));
        }
        if (shared) {
            shared_body(Wt, n, ld, idx ? idx + off[0] : NULL, w, wstride, B, 0, off[1] - off[0], y);
        } else {
            for (int64_t b = 0; b < B; ++b) bag_body(Wt, n, ld, idx, w, off[b], off[b], off[b + 1], y + b * n);
        }
        return 0;
    }
    if (!shared && B >= nt) {                 /* whole bags per thread */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            float *yb = y + b * n;
            if (bias) memcpy(yb, bias, n * sizeof(float)); else memset(yb, 0, n * sizeof(float));
            bag_body(Wt, n, ld, idx, w, off[b], off[b], off[b + 1], yb);
        }
        return 0;
    }
    memset(scratch, 0, (size_t)nt * B * n * sizeof(float));
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        float *part = scratch + (size_t)t * B * n;
        if (shared) {
            const int64_t k = off[1] - off[0];
            shared_body(Wt, n, ld, idx ? idx + off[0] : NULL, w, wstride, B, k * t / T, k * (t + 1) / T, part);
        } else {
            for (int64_t b = 0; b < B; ++b) {
                const int64_t k = off[b + 1] - off[b];
                bag_body(Wt, n, ld, idx, w, off[b], off[b] + k * t / T, off[b] + k * (t + 1) / T, part + b * n);
            }
        }
    }
    reduce_parts(scratch, nt, B * n, bias, n, y);
    return 0;
}

/* ----------------------------------------------------------------------------------------- input sparsity */
/* Input sparsity over column segments of one Wt = W^T [in, n] (rows ld apart): for token b and segment s
 * (columns seg[s]..seg[s+1]),
 *     y[b, seg_s] = bias[seg_s] + sum_{i : |x[b, i]| > t_s(i)} x[b, i] * Wt[i, seg_s]
 * with t_s(i) = thr[s] (tvec NULL) or tvec[s * in + i] (a threshold per input channel: WINA's
 * |x_i| * ||W[:, i]|| > t is |x_i| > t / ||W[:, i]||, the product unchanged). The active rows of the batch (the
 * union) are listed first, then streamed once in order with prefetch, each token adding its own active segments
 * into its out-length fp32 row of y (in cache). Threads (nt > 1) take disjoint column ranges: no partials.
 * stats (NULL or nseg doubles): += number of active (token, input) entries per segment. nseg <= 8. */
#ifndef PF_BYTES
#define PF_BYTES 32768   /* input sparsity: prefetch the active row this many bytes ahead (whole rows, >= 1) */
#endif
#define IS_CHUNK 256     /* columns per chunk: each chunk prefetches the same columns of a row ahead */
#ifndef PF_LOC
#define PF_LOC 1         /* its locality: 1 -> L2 (prefetcht2; measured 1.5x the bandwidth of L1's on
                            sparse rows of a Zen 4 core: more misses in flight), 3 -> L1 */
#endif

static void in_sparse_body(const float *Wt, int64_t in, int64_t n, int64_t ld, const float *x, int64_t B,
                           int nseg, const int64_t *seg, const int64_t *list, int64_t np, const unsigned char *mb,
                           const float *bias, float *y, int64_t c0, int64_t c1) {
    const unsigned char full = (unsigned char)((1u << nseg) - 1u);
    for (int64_t b = 0; b < B; ++b) {
        float *yb = y + b * n;
        if (bias) memcpy(yb + c0, bias + c0, (c1 - c0) * sizeof(float));
        else memset(yb + c0, 0, (c1 - c0) * sizeof(float));
    }
    const int64_t w = c1 - c0;
    int64_t ahead = (PF_BYTES / (int64_t)sizeof(float) + w - 1) / w;
    if (ahead < 1) ahead = 1;
    for (int64_t p = 0; p < np; ++p) {
        const int64_t i = list[p];
        const float *row = Wt + i * ld;
        const float *nxt = p + ahead < np ? Wt + list[p + ahead] * ld : NULL;
        for (int64_t c = c0; c < c1; c += IS_CHUNK) {
            const int64_t e = c + IS_CHUNK < c1 ? c + IS_CHUNK : c1;
            if (nxt)
                for (int64_t q = c; q < e; q += 16) __builtin_prefetch(nxt + q, 0, PF_LOC);
            for (int64_t b = 0; b < B; ++b) {
                const unsigned char bits = mb[b * in + i];
                if (!bits) continue;
                const float xi = x[b * in + i];
                float *yb = y + b * n;
                if (bits == full) {
                    axpy_f(yb + c, row + c, xi, e - c);
                } else {
                    for (int s = 0; s < nseg; ++s) {
                        if (!(bits >> s & 1u)) continue;
                        const int64_t lo = seg[s] > c ? seg[s] : c, hi = seg[s + 1] < e ? seg[s + 1] : e;
                        if (hi > lo) axpy_f(yb + lo, row + lo, xi, hi - lo);
                    }
                }
            }
        }
    }
}

/* The threshold keeping the k largest |x| of a row under the rule |x| > t: the float just below the k-th
 * largest |x| (-1 where that is 0). A quickselect on a copy of |x| in buf [n] (Hoare partitions, median of
 * three). */
static float topk_thr_row(const float *x, int64_t n, int64_t k, float *a) {
    for (int64_t i = 0; i < n; ++i) a[i] = fabsf(x[i]);
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;                          /* position of the k-th largest, descending */
    while (hi > lo) {
        const int64_t mid = lo + (hi - lo) / 2;
        const float p0 = a[lo], p1 = a[mid], p2 = a[hi];
        const float piv = p0 > p1 ? (p1 > p2 ? p1 : (p0 > p2 ? p2 : p0)) : (p0 > p2 ? p0 : (p1 > p2 ? p2 : p1));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > piv) ++i;
            while (a[j] < piv) --j;
            if (i <= j) { const float t = a[i]; a[i] = a[j]; a[j] = t; ++i; --j; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;                                      /* between j and i: every entry equals the pivot */
    }
    return a[want] > 0.0f ? nextafterf(a[want], 0.0f) : -1.0f;
}

/* Each row's topk_thr_row, nseg copies per row (kernels.reference.topk_threshold). */
int cs_topk_threshold(const float *x, int64_t B, int64_t n, int64_t k, int nseg, float *out) {
    if (k < 1 || k > n || nseg < 1) return -1;
    float *a = (float *)malloc((size_t)n * sizeof(float));
    if (!a) return -1;
    for (int64_t b = 0; b < B; ++b) {
        const float t = topk_thr_row(x + b * n, n, k, a);
        for (int s = 0; s < nseg; ++s) out[b * nseg + s] = t;
    }
    free(a);
    return 0;
}

int cs_input_sparse_seg(const float *Wt, int64_t in, int64_t n, int64_t ld, const float *x, int64_t B, int nseg,
                        const int64_t *seg, const float *thr, const float *tvec, const float *bias, float *y,
                        double *stats, int64_t topk, int nt) {
    if (nseg < 1 || nseg > 8 || seg[0] != 0 || seg[nseg] != n || topk > in) return -1;
    int64_t *list = (int64_t *)malloc((size_t)in * sizeof(int64_t));
    unsigned char *mb = (unsigned char *)malloc((size_t)(B * in) + 1);
    /* topk > 0: each token's own threshold, its k-th largest |x| (every segment) */
    float *tok = topk > 0 ? (float *)malloc((size_t)(B + in) * sizeof(float)) : NULL;
    if (!list || !mb || (topk > 0 && !tok)) { free(list); free(mb); free(tok); return -1; }
    if (tok)
        for (int64_t b = 0; b < B; ++b) tok[b] = topk_thr_row(x + b * in, in, topk, tok + B);
    int64_t cnt[8] = {0};
    int64_t np = 0;
    for (int64_t i = 0; i < in; ++i) {
        unsigned char any = 0;
        for (int64_t b = 0; b < B; ++b) {
            const float a = fabsf(x[b * in + i]);
            unsigned char bits = 0;
            for (int s = 0; s < nseg; ++s) {
                const float t = tok ? tok[b] : tvec ? tvec[(int64_t)s * in + i] : thr[s];
                if (a > t) { bits |= (unsigned char)(1u << s); ++cnt[s]; }
            }
            mb[b * in + i] = bits;
            any |= bits;
        }
        if (any) list[np++] = i;
    }
    if (stats)
        for (int s = 0; s < nseg; ++s) stats[s] += (double)cnt[s];
    /* column split only when each thread still gets long contiguous pieces of a row */
    const int T = (nt > 1 && n >= 256 * (int64_t)nt) ? nt : 1;
    if (T == 1) {
        in_sparse_body(Wt, in, n, ld, x, B, nseg, seg, list, np, mb, bias, y, 0, n);
    } else {
#pragma omp parallel num_threads(T)
        {
            const int t = omp_get_thread_num(), TT = omp_get_num_threads();
            int64_t c0 = (n * t / TT) & ~(int64_t)15, c1 = t + 1 == TT ? n : (n * (t + 1) / TT) & ~(int64_t)15;
            if (c1 > c0) in_sparse_body(Wt, in, n, ld, x, B, nseg, seg, list, np, mb, bias, y, c0, c1);
        }
    }
    free(list);
    free(mb);
    free(tok);
    return 0;
}

/* ----------------------------------------------------------------------------------------------- pair_dot */
/* Per-token sets: out[p] = <W[col[p]], x[tok[p]]> (+ bias[col[p]]) for P (token, row) pairs. */
int cs_pair_dot(const float *W, const float *bias, int64_t nrows, int64_t d, const int64_t *tok, const int64_t *col,
                int64_t P, const float *x, float *out, int nt) {
    for (int64_t p = 0; p < P; ++p)
        if (col[p] < 0 || col[p] >= nrows) return -1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t p = 0; p < P; ++p) {
        float z = dot_f(W + col[p] * d, x + tok[p] * d, d);
        out[p] = bias ? z + bias[col[p]] : z;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ the FFN */
/* Neurons list[lo..hi) of the FFN into part [B, d]:
 *   coef NULL:  a_bj = act(<W1[r], x_b> + b1[r]) * (Wg ? <Wu[r], x_b> : 1), W1 = Wg (gated) or Wu (fc1)
 *   coef given: a_bj = coef[b * cstride + r] * (Wu ? <Wu[r], x_b> : 1)   (the first projection done before)
 * and part_b += a_bj * Wdt[r]. A zero coefficient skips the token's products (exact: its term is 0). */
static void ffn_body(const float *Wg, const float *Wu, const float *b1, const float *Wdt, int64_t d,
                     const int64_t *idx, int64_t lo, int64_t hi, const float *x, int64_t B, int act,
                     const float *coef, int64_t cstride, float *part) {
    const float *W1 = Wg ? Wg : Wu;
    for (int64_t j = lo; j < hi; ++j) {
        const int64_t r = idx ? idx[j] : j;
        if (j + PF_DIST < hi) {
            const int64_t rn = idx ? idx[j + PF_DIST] : j + PF_DIST;
            if (!coef) {
                pf_row(W1 + rn * d, d);
                if (Wg) pf_row(Wu + rn * d, d);
            } else if (Wu) {
                pf_row(Wu + rn * d, d);
            }
            pf_row(Wdt + rn * d, d);
        }
        const float *wd = Wdt + r * d;
        for (int64_t b = 0; b < B; ++b) {
            float a;
            if (coef) {
                a = coef[b * cstride + r];
                if (a == 0.f) continue;
                if (Wu) a *= dot_f(Wu + r * d, x + b * d, d);
            } else {
                a = dot_f(W1 + r * d, x + b * d, d);
                if (b1) a += b1[r];
                a = act_f(a, act);
                if (Wg) a *= dot_f(Wu + r * d, x + b * d, d);
            }
            axpy_f(part + b * d, wd, a, d);
        }
    }
}

/* Run ffn_body over k neurons (idx NULL: 0..k-1) on nt threads, y = bd + sum of the parts. scratch: nt*B*d. */
static void ffn_run(const float *Wg, const float *Wu, const float *b1, const float *Wdt, const float *bd, int64_t d,
                    const int64_t *idx, int64_t k, const float *x, int64_t B, int act, const float *coef,
                    int64_t cstride, float *y, float *scratch, int nt) {
    int T = nt < 1 ? 1 : nt;
    if (k < 64 * T) T = 1;
    if (T == 1) {                             /* no OpenMP region: accumulate straight into y */
        for (int64_t b = 0; b < B; ++b) {
            if (bd) memcpy(y + b * d, bd, d * sizeof(float)); else memset(y + b * d, 0, d * sizeof(float));
        }
        ffn_body(Wg, Wu, b1, Wdt, d, idx, 0, k, x, B, act, coef, cstride, y);
        return;
    }
    memset(scratch, 0, (size_t)T * B * d * sizeof(float));
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), TT = omp_get_num_threads();
        ffn_body(Wg, Wu, b1, Wdt, d, idx, k * t / TT, k * (t + 1) / TT, x, B, act, coef, cstride,
                 scratch + (size_t)t * B * d);
    }
    reduce_parts(scratch, T, B * d, bd, d, y);
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
    ffn_run(Wg, Wu, b1, Wdt, bd, d, idx, k, x, B, act, NULL, 0, y, scratch, nt);
    return 0;
}

/* The FFN after its first projection z = x W1^T [B, D] was computed dense (no bias), kept by a threshold:
 *   a_bj = act(z_bj + b_act[j]),  s_bj = act(z_bj + b_score[j]) (the same as a when b_score == b_act),
 *   token b keeps neuron j iff |s_bj| > t;  y_b = bd + sum_{j kept by b} a_bj * (Wu ? <Wu[j], x_b> : 1) * Wdt[j].
 * Only the neurons some token keeps are read (their up and down rows: 2/3 of the gated FFN's rows at s = 0),
 * each once for the batch. coef: B * D floats of scratch, list: D int64, scratch: nt * B * d floats. stat (NULL
 * or one double) += the number of neurons read. Returns that number. */
int64_t cs_ffn_thr(const float *z, int64_t D, float t, int act, const float *b_act, const float *b_score,
                   const float *Wu, const float *Wdt, const float *bd, int64_t d, const float *x, int64_t B,
                   float *y, float *coef, int64_t *list, float *scratch, double *stat, int nt) {
    int64_t k = 0;
    for (int64_t j = 0; j < D; ++j) {
        int any = 0;
        for (int64_t b = 0; b < B; ++b) {
            const float zz = z[b * D + j];
            const float a = act_f(b_act ? zz + b_act[j] : zz, act);
            const float s = b_score == b_act ? a : act_f(b_score ? zz + b_score[j] : zz, act);
            const int keep = fabsf(s) > t;
            coef[b * D + j] = keep ? a : 0.f;
            any |= keep;
        }
        if (any) list[k++] = j;
    }
    ffn_run(NULL, Wu, NULL, Wdt, bd, d, list, k, x, B, 0, coef, D, y, scratch, nt);
    if (stat) *stat += (double)k;
    return k;
}

/* ------------------------------------------------------------------------------------ decode-step glue */
/* Residual add + RMS norm of B rows (cpu_glue.h's add_rmsnorm_row): xo = x + y (y NULL: no add, xo unused),
 * h = norm(xo). */
void cs_add_rmsnorm(const float *x, const float *y, float *xo, const float *w, float *h, int64_t B, int64_t d,
                    float eps, int one_plus) {
    for (int64_t b = 0; b < B; ++b)
        add_rmsnorm_row(x + b * d, y ? y + b * d : NULL, y ? xo + b * d : NULL, w, h + b * d, d, eps, one_plus);
}

/* One decode position (kernels.reference.decode_attention, fp32): the KV heads' normed, rotated keys and their
 * values written at pos, then every query slot j < S: head qidx[j] (qidx NULL: j) of H, KV head
 * head / (H / KV), attends over [max(0, pos - window + 1), pos] (window 0: from 0); slots j >= n_active are
 * written 0. q [B, S, hd] (strides sq_b, sq_h), k/v [B, KV, hd], caches [B, *, L, hd] (strides sc_b, sc_h, sc_l),
 * out [B, S * hd] (row stride so_b). Returns -1 (nothing written) when pos or a head id is out of range. */
int cs_decode_attn(const float *q, int64_t sq_b, int64_t sq_h, const float *k, int64_t sk_b, int64_t sk_h,
                   const float *v, int64_t sv_b, int64_t sv_h, float *kc, float *vc, int64_t sc_b, int64_t sc_h,
                   int64_t sc_l, int64_t L, int64_t pos, const float *cos_t, const float *sin_t, const float *qn,
                   const float *kn, float eps, const int64_t *qidx, int64_t n_active, float *out, int64_t so_b,
                   int64_t B, int64_t S, int64_t KV, int64_t H, int64_t hd, int64_t window, int nt) {
    if (pos < 0 || pos >= L || KV <= 0 || H % KV != 0) return -1;
    if (qidx)
        for (int64_t j = 0; j < n_active; ++j)
            if (qidx[j] < 0 || qidx[j] >= H) return -1;
    const float *cs = cos_t ? cos_t + pos * hd : NULL, *sn = sin_t ? sin_t + pos * hd : NULL;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < KV; ++g)
            write_kv_row(k + b * sk_b + g * sk_h, v + b * sv_b + g * sv_h, kn, eps, cs, sn, hd,
                         kc + b * sc_b + g * sc_h + pos * sc_l, vc + b * sc_b + g * sc_h + pos * sc_l);
    const int64_t group = H / KV, lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    const int64_t tasks = B * S;
    if (nt <= 1 || tasks < 2) {
        float *sc = malloc((size_t)(pos + 1 + hd) * sizeof(float));
        decode_attn_body(q, sq_b, sq_h, kc, vc, sc_b, sc_h, sc_l, pos, lo, cs, sn, qn, eps, qidx, n_active, out,
                         so_b, S, group, hd, 0, tasks, sc);
        free(sc);
        return 0;
    }
#pragma omp parallel num_threads(nt)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        float *sc = malloc((size_t)(pos + 1 + hd) * sizeof(float));
        decode_attn_body(q, sq_b, sq_h, kc, vc, sc_b, sc_h, sc_l, pos, lo, cs, sn, qn, eps, qidx, n_active, out,
                         so_b, S, group, hd, tasks * t / T, tasks * (t + 1) / T, sc);
        free(sc);
    }
    return 0;
}

#include "cpu_head.c"
