/* The one header of the quantized CPU kernels (cpu_quant.c and its parts): the includes, the instruction-set
 * switch, the block formats' codes, the structs kernels/cpu_quant.py mirrors with ctypes, the types and constants
 * several parts share, and what each part gives the others.
 *
 * cpu_quant.c compiles the parts as one translation unit (it says why), so their functions stay `static`: the
 * library exports only the cs_* entry points. They are declared here, by the part that defines them, so that each
 * part reads on its own.
 */
#ifndef CTXSPARSE_CPU_QUANT_H
#define CTXSPARSE_CPU_QUANT_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_act.h"
#include <stdatomic.h>

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

/* ------------------------------------------------------------------- whole decoder layers: the arguments */
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
 * output columns. A NULL group runs dense (cpu_quant_layers.c). */
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

/* ------------------------------------------------------------------------------------------ the team */
#define QMAXTASKS 256

typedef struct {             /* a barrier of T threads (zeroed before use) */
    atomic_int count, gen, sleepers;
} qbar;

typedef void (*qjob_fn)(void *arg, int t, int T);

typedef struct {
    atomic_int *flag;        /* n claim words */
    int epoch;
    int64_t n, own, own_end, steal;
    int t, T, victim;
} qclaim;

/* ------------------------------------------------------------------------------------- the activations */
/* B activation rows of n: x and its 32-sums, and in q8 mode (q != NULL) their 8-bit quantization */
typedef struct {
    int64_t n;
    const float *x;
    float *xs;          /* [B, n / 32] sums of x */
    int8_t *q;          /* [B, n] or NULL (fp32 mode) */
    float *d;           /* [B, n / 32] */
    float *q16;         /* [B, n / 16] */
} xbuf;

#ifndef QPF_DIST
#define QPF_DIST 4           /* gathered rows: prefetch this many rows ahead (every line of the row) */
#endif

/* ------------------------------------------------------------------------ what each part gives the others */
/* cpu_quant_formats.c */
static int blk_elems(int t);
static int blk_bytes(int t);
static inline float h2f(const uint8_t *p);
static inline void k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn);
static void deq_block(int t, const uint8_t *b, float *y);
static inline const uint8_t *row_of(const qpart *P, int np, int64_t r, int *t, float *scale);
static int64_t total_rows(const qpart *P, int np);
static int check_parts(const qpart *P, int np, int64_t cols);

/* cpu_quant_team.c */
static void qbarrier(qbar *s, int T);
static void qteam_run(qjob_fn fn, void *arg, int T);
static void claim_init(qclaim *c, atomic_int *flag, int epoch, int64_t n, int t, int T);
static int64_t claim_next(qclaim *c);
static int64_t chunk_rows(int64_t R, int64_t row_bytes, int T, int64_t align);

/* cpu_quant_rows.c */
static void xbuf_fill(xbuf *a, int64_t b, int64_t k0, int64_t k1);
static inline void pf_bytes(const uint8_t *p, int64_t n);
static void q_rows_body(const qpart *P, int np, const qpart *P2, int np2, int64_t n, const float *bias,
                        const int64_t *idx, int64_t lo, int64_t hi, int64_t k, int64_t kpad, const xbuf *xa,
                        int64_t B, int act, float *out);
static void ffn_up_body(const qpart *G, int ng, const qpart *U, int nu, const float *b1, const xbuf *xa,
                        xbuf *ha, int64_t B, int act, int64_t lo, int64_t hi);
static void ffn_down_body(const qpart *Dn, int nd, const float *b2, int64_t d, const xbuf *ha, int64_t B,
                          int64_t lo, int64_t hi, float *y);

/* cpu_quant_transposed.c */
static void qt_body(const uint8_t *codes, int bits, int cbias, const void *scale, const void *offset, int half,
                    int64_t group, int64_t nout, const int64_t *idx, int64_t k, const float *w, int64_t wstride,
                    int64_t B, const float *ybias, float *y, int64_t c0, int64_t c1, float *t, float *s);

/* ------------------------------------------------------------------- the entry points (kernels/cpu_quant.py) */
int cs_q_dequant(const qpart *P, int np, int64_t cols, const int64_t *idx, int64_t k, float *out, int nt);
int cs_q_rows(const qpart *P, int np, const qpart *P2, int np2, int64_t n, const float *bias, const int64_t *idx,
              int64_t k, int64_t kpad, const float *x, int64_t B, int act, int q8, float *out, int nt);
int cs_q_ffn(const qpart *G, int ng, const qpart *U, int nu, const qpart *Dn, int nd, int64_t d, int64_t D,
             const float *b1, const float *b2, const float *x, int64_t B, int act, int q8, float *h, float *y,
             int nt);
int cs_qt_axpy(const uint8_t *codes, int bits, int cbias, const void *scale, const void *offset, int half,
               int64_t group, int64_t nin, int64_t nout, const int64_t *idx, int64_t k, const float *w, int64_t wstride,
               int64_t B, const float *ybias, float *y, int nt);
int64_t cs_q_layers_scratch(const qdims *M, int nt, int64_t nl);
int cs_q_layers(const qlayer *Ls, const qsparse *Zs, int64_t l0, int64_t l1, const qdims *M, const float *x,
                float *xout, int64_t pos, void *scratch, int64_t scratch_bytes, int nt);
int cs_q_simd(void);
#endif
