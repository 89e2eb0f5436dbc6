/* Whole decoder layers (a part of cpu_quant.c: one translation unit; cpu_quant.h).
 *
 * One token (batch 1) through decoder layers l0..l1-1 in one call, the ops of workers/decode/layer.py's step
 * with the quantized weights and the native glue, in the same order on the same values (so the same bits):
 *     h = norm(x, n1); qkv = W_qkv h + b_qkv; K/V of every KV head normed, rotated and written at pos;
 *     every query head normed, rotated, attends over the cache -> a; o = W_o a + b_o; (o = norm(o, post_attn));
 *     x += o; h = norm(x, n2); f = act(W_gate h) * (W_up h) (non-gated: act(W_up h + b_up));
 *     y = W_down f + b_down; (y = norm(y, post_ffn)); x += y
 * Threads (nt > 1): one job of the team (cpu_quant_team.c) for all the layers, six phases a layer (QKV, K/V write,
 * attention, O, gate/up, down), each a list of tasks that the threads take from a shared counter (a
 * projection's rows in chunks of about QCHUNK_BYTES, 32 rows at least for gate/up: their outputs' 32-blocks; a
 * KV head; a query head), then the team's barrier (spins QSPIN_NS, then sleeps). A thread that another process
 * slows takes fewer tasks. The norms are computed by every thread into its own buffer (no hand-off), the
 * residual stream is written by slices. One thread: no team, no atomics. */
#include "cpu_quant.h"

/* the decode glue (norms, RoPE, attention) with contraction on, as cpu_native.c compiles it: same bits */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "cpu_glue.h"
#pragma GCC pop_options

#define QALIGN 64

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
