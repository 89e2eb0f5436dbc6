/* The thread team of the quantized kernels (a part of cpu_quant.c: one translation unit; cpu_quant.h).
 *
 * The threads of the parallel kernels: an OpenMP region (the team torch's own ops use: a second pool of
 * threads beside it fought it for the cores, and a per-op step at 2 threads, its attention in OpenMP, ran 3x
 * slower), with our own barrier inside: it spins QSPIN_NS, then sleeps on a futex (Linux; elsewhere it yields).
 * OpenMP's barriers spin for milliseconds first: with another process on the cores, a spinning thread that the
 * scheduler preempts stays preempted for the other's time slice (it is runnable, not woken: no wake-up
 * preemption) while the team waits for it; a sleeping one is woken at once. */
#include "cpu_quant.h"

#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

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
