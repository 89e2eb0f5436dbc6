/* The GGUF block formats (a part of cpu_quant.c: one translation unit; cpu_quant.h): block sizes and the exact
 * dequantizers (the same fp32 operations as gguf-py: kernels/quant.py's table), the rows of a weight's parts, and
 * cs_q_dequant (rows -> fp32, on the team for many rows). */
#include "cpu_quant.h"

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
