/* The predicted output head's CPU kernels (kernels/cpu.py: head_screen, topk_index; references in
 * kernels/reference.py), compiled with cpu_native.c.
 *
 *   head_screen  out[b, v] = scale[v] * sum_j z[b, j] * code[v, j]: the screen's scores of every vocabulary row,
 *                int8 codes with one fp32 scale per row, stored in tiles of HS_TILE rows, [V / HS_TILE][r][HS_TILE]
 *                (a tile's j-th input for its HS_TILE rows side by side): the sums of HS_NT tiles stay in registers
 *                while their bytes stream in, with no horizontal sums. The vocabulary is split over threads by
 *                groups of tiles; every output's sum runs in the order j = 0..r-1 whatever the split.
 *   topk_index   the indices of each row's k largest values (unsorted; of values equal to the k-th largest, the
 *                lowest indices): a strided sample gives a threshold a little below the k-th largest, one pass
 *                gathers the values at or above it, and a selection on those gives the exact set (a radix
 *                select over the whole row where the sample's guess holds fewer than k or too many).
 */

#define HS_TILE 16
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* NT tiles' sums side by side (independent FMA chains: one tile's chain alone waits on the FMA latency):
 * acc[i * HS_TILE + l] = sum_j z[j] * c[i * r * HS_TILE + j * HS_TILE + l], in the order j = 0..r-1 on every build */
#define HS_NT 4
static inline void hs_tiles(const int8_t *c, int nt_tiles, const float *z, int64_t r, float *acc) {
    const int64_t ts = r * HS_TILE;
#if defined(__AVX512F__)
    __m512 a[HS_NT];
    for (int i = 0; i < HS_NT; i++) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; j++) {
        const __m512 zj = _mm512_set1_ps(z[j]);
        for (int i = 0; i < nt_tiles; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(c + i * ts + j * HS_TILE));
            a[i] = _mm512_fmadd_ps(zj, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), a[i]);
        }
    }
    for (int i = 0; i < nt_tiles; i++) _mm512_storeu_ps(acc + i * HS_TILE, a[i]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[HS_NT], hi[HS_NT];
    for (int i = 0; i < HS_NT; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; j++) {
        const __m256 zj = _mm256_set1_ps(z[j]);
        for (int i = 0; i < nt_tiles; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(c + i * ts + j * HS_TILE));
            lo[i] = _mm256_fmadd_ps(zj, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), lo[i]);
            hi[i] = _mm256_fmadd_ps(zj, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), hi[i]);
        }
    }
    for (int i = 0; i < nt_tiles; i++) {
        _mm256_storeu_ps(acc + i * HS_TILE, lo[i]);
        _mm256_storeu_ps(acc + i * HS_TILE + 8, hi[i]);
    }
#else
    for (int l = 0; l < nt_tiles * HS_TILE; l++) acc[l] = 0.0f;
    for (int i = 0; i < nt_tiles; i++)
        for (int64_t j = 0; j < r; j++)
            for (int l = 0; l < HS_TILE; l++)
                acc[i * HS_TILE + l] = fmaf(z[j], (float)c[i * ts + j * HS_TILE + l], acc[i * HS_TILE + l]);
#endif
}

int cs_head_screen(const int8_t *codes, const float *scale, int64_t V, int64_t r, const float *z, int64_t B,
                   float *out, int nt) {
    if (V % HS_TILE || B < 1) return -1;
    const int64_t groups = (V / HS_TILE + HS_NT - 1) / HS_NT;
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = g * HS_NT;
        const int n = (int)((V / HS_TILE - t0) < HS_NT ? (V / HS_TILE - t0) : HS_NT);
        for (int64_t b = 0; b < B; b++) {
            float acc[HS_NT * HS_TILE];
            hs_tiles(codes + t0 * r * HS_TILE, n, z + b * r, r, acc);
            float *o = out + b * V + t0 * HS_TILE;
            for (int l = 0; l < n * HS_TILE; l++) o[l] = acc[l] * scale[t0 * HS_TILE + l];
        }
    }
    return 0;
}

/* an order-preserving unsigned key of a float (larger float, larger key) */
static inline uint32_t fkey(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The k-th largest key of x[0..n) (1 <= k <= n) by three histogram passes (11, 11, 10 bits); *above: how many
 * keys are strictly larger. hist: 2048 counters. */
static uint32_t kth_key(const float *x, const int64_t *sel, int64_t n, int64_t k, int64_t *above, uint32_t *hist) {
    static const int shift[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
    uint32_t prefix = 0, mask = 0;
    int64_t need = k, more = 0;
    for (int p = 0; p < 3; p++) {
        const int nb = 1 << bits[p];
        memset(hist, 0, (size_t)nb * sizeof(uint32_t));
        for (int64_t i = 0; i < n; i++) {
            const uint32_t key = fkey(sel ? x[sel[i]] : x[i]);
            if ((key & mask) == prefix) hist[(key >> shift[p]) & (uint32_t)(nb - 1)]++;
        }
        int64_t acc = 0;
        int b = nb - 1;
        for (; b > 0; b--) {
            if (acc + hist[b] >= need) break;
            acc += hist[b];
        }
        need -= acc;
        more += acc;
        prefix |= (uint32_t)b << shift[p];
        mask |= (uint32_t)(nb - 1) << shift[p];
    }
    *above = more;
    return prefix;
}

/* The k largest of x[0..n) into out (unsorted), ties at the k-th value by lowest index; buf: n indices of scratch. */
static void topk_index_row(const float *x, int64_t n, int64_t k, int64_t *out, int64_t *buf, float *sample,
                           uint32_t *hist) {
    const int64_t step = 16;
    const int64_t ns = n / step;
    int64_t m = -1;
    uint32_t low = 0;
    if (ns >= 64 && k * 4 <= n) {
        /* the sample's rank a little deeper than k / step: its value is below the k-th largest in all but rare rows */
        int64_t ks = k / step + 3 * (int64_t)sqrt((double)(k / step) + 1.0) + 8;
        if (ks > ns) ks = ns;
        for (int64_t i = 0; i < ns; i++) sample[i] = x[i * step];
        int64_t above;
        low = kth_key(sample, NULL, ns, ks, &above, hist);
        m = 0;
        for (int64_t i = 0; i < n; i++)
            if (fkey(x[i]) >= low) buf[m++] = i;
        if (m < k || m > 8 * k + 1024) m = -1;      /* the guess failed: select over the whole row */
    }
    int64_t above;
    uint32_t t;
    if (m < 0) {
        t = kth_key(x, NULL, n, k, &above, hist);
        m = n;
        for (int64_t i = 0; i < n; i++) buf[i] = i;
    } else {
        t = kth_key(x, buf, m, k, &above, hist);
    }
    int64_t ties = k - above, o = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t j = buf[i];
        const uint32_t key = fkey(x[j]);
        if (key > t) out[o++] = j;
        else if (key == t && ties > 0) { out[o++] = j; ties--; }
    }
}

int cs_topk_index(const float *x, int64_t B, int64_t n, int64_t k, int64_t *out, int nt) {
    if (k < 1 || k > n || B < 1) return -1;
    int bad = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:bad) if (nt > 1 && B > 1)
    for (int64_t b = 0; b < B; b++) {
        int64_t *buf = (int64_t *)malloc((size_t)n * sizeof(int64_t));
        float *sample = (float *)malloc((size_t)(n / 16 + 1) * sizeof(float));
        uint32_t *hist = (uint32_t *)malloc(2048 * sizeof(uint32_t));
        if (buf && sample && hist) topk_index_row(x + b * n, n, k, out + b * k, buf, sample, hist);
        else bad = 1;
        free(buf);
        free(sample);
        free(hist);
    }
    return bad ? -1 : 0;
}
