/* Stage 4 on CPU: the row work of the in-place compaction (docs/hermes.md §2.6-2.8) in one pass over the cache.
 *
 * Called by hermes_kernels/engine/rows_native.py (`move_rows_native`: HERMES's `compact_torch` and H2SVC's step on CPU
 * tensors; through bindings.py, as every function here) after the caller has planned everything small in torch: each
 * kept token's source slot and rotation-table rows, the deep layers' pruned slots and their table rows. This file
 * only moves rows. Worker t of T takes the (layer, stream, KV head) rows t, t + T, ... and walks each row's tokens
 * left to right, writing kept token i's key, rotated by its delta, and its value to slot P + i. In place is sound
 * because slot P + i never lies right of its source P + keep[i] (keep ascending): every slot left of the source
 * being read has already been read. Deep rows merge their pruned slots into the same walk: values summed, keys rotated to the summary target and summed (double accumulators; the caller divides
 * and writes the summary slot). Every cached row is read at most once and every kept row written once.
 *
 * Cache dtypes fp32 and bf16 (fp16 stays with the torch ops: its scalar conversions here did not vectorise and
 * ran slower than torch). Arithmetic is fp32 as in the reference: each element is widened exactly, rotated in
 * fp32 and rounded once to the cache dtype (to nearest, ties to even, as torch's conversion); values move as raw
 * bytes.
 * Rotation (rotate-half, §2.8) over the first R = 2·rh channels of a head of D >= R (partial rotary when less):
 * pair q < rh couples channels q and q + rh and turns by the angle of its axis axis[q] (`RotaryLayout.axis`: 1D
 * RoPE, contiguous or interleaved M-RoPE sections alike; 1D has one axis); channels [R, D) never turn: a row that
 * moves takes them as bytes, a row rotated in place leaves them, a summary adds them as they are. cos/sin come
 * from a table [rows, rh] that the caller computed with torch from the integer deltas, so every angle is
 * fp32(delta)·inv_freq exactly as in `hermes_kernels.rope`. Products and sums each round once (built with
 * -ffp-contract=off), as in the torch ops of the reference.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define MAX_THREADS 256
#define MAX_HALF 512 /* rows of D <= 2·MAX_HALF channels (bindings.C_MAX_HEAD_DIM; wider: the torch ops) */
#define INLINE static inline __attribute__((always_inline))

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

typedef struct {
    char *k, *v;
    int dtype;
    int64_t L, B, H, D, rh;       /* rh = R/2 rotary pairs <= D/2 */
    const int64_t *kstride, *vstride; /* layer, stream, head, token strides in elements */
    int64_t P, n;
    const int64_t *src;           /* [L, B, n] source slot of kept token i, -1 past the row's kept count */
    const int32_t *ktab;          /* [L, B, A, n] table row per kept token and axis */
    int64_t A;                    /* axes: 1 (1D) or 3 (M-RoPE) */
    const int32_t *axis;          /* [rh] axis of each frequency pair, in [0, A) */
    const float *tab_cos, *tab_sin; /* [rows, rh] */
    int32_t zero_row;             /* table row of delta 0, -1 if absent */
    int64_t first, m;             /* first summary layer; pruned tokens per deep (layer, stream), 0 = no summary */
    const int64_t *pruned;        /* [L - first, B, m] pruned slots, ascending */
    const int32_t *ptab;          /* [L - first, B, A, m] table row per pruned token and axis */
    double *ksum, *vsum;          /* [L - first, B, H, D] */
    int stream;                   /* moved rows bypass the cache (put_row) */
    int threads, worker;
} job_t;

/* Bytes per element (a compile-time constant wherever dtype is one, so row copies inline). */
INLINE int64_t element_size(const int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* Element q of a row of `dtype`, widened exactly to fp32. */
INLINE float load(const char *row, int64_t q, const int dtype) {
    if (dtype == DTYPE_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[q] << 16;
        float x;
        memcpy(&x, &bits, sizeof x);
        return x;
    }
    return ((const float *)row)[q];
}

/* Element q of a row of `dtype` <- x rounded to nearest, ties to even (NaN stays a quiet NaN). */
INLINE void store(char *row, int64_t q, float x, const int dtype) {
    if (dtype == DTYPE_BF16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        const uint16_t nan = 0x7fc0, rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        ((uint16_t *)row)[q] = x != x ? nan : rounded;
        return;
    }
    ((float *)row)[q] = x;
}

/* out (of out_dtype) <- x (of dtype) with channels [0, 2·rh) rotated by the angles of table rows rows[a * stride],
 * one per axis, and channels [2·rh, D) copied: as bytes when out_dtype is dtype, widened exactly otherwise (the
 * summary's fp32 rows). out may equal x: in place the tail is left as it is. */
INLINE void rotate(const char *x, char *out, const int32_t *rows, int64_t stride, const job_t *j, const int64_t rh,
                   const int64_t D, const int dtype, const int out_dtype) {
    const float *c = j->tab_cos + rows[0] * rh, *s = j->tab_sin + rows[0] * rh;
    float cos_row[MAX_HALF], sin_row[MAX_HALF];
    if (j->A > 1) { /* M-RoPE: each pair's angle from the table row of its own axis */
        for (int64_t q = 0; q < rh; ++q) {
            const int64_t at = (int64_t)rows[j->axis[q] * stride] * rh + q;
            cos_row[q] = j->tab_cos[at];
            sin_row[q] = j->tab_sin[at];
        }
        c = cos_row;
        s = sin_row;
    }
    if (x != out) { /* another row: the compiler's overlap check passes and this loop runs vectorised */
        for (int64_t q = 0; q < rh; ++q) {
            const float x1 = load(x, q, dtype), x2 = load(x, q + rh, dtype);
            store(out, q, x1 * c[q] - x2 * s[q], out_dtype);
            store(out, q + rh, x2 * c[q] + x1 * s[q], out_dtype);
        }
        if (out_dtype == dtype) {
            const int64_t size = element_size(dtype);
            memcpy(out + 2 * rh * size, x + 2 * rh * size, (size_t)((D - 2 * rh) * size));
        } else {
            for (int64_t q = 2 * rh; q < D; ++q) store(out, q, load(x, q, dtype), out_dtype);
        }
        return;
    }
    /* in place, that check fails and the loop above would run scalar: widen the rotary channels into a local copy
     * first, so the products read only memory the stores cannot touch */
    float w[2 * MAX_HALF];
    for (int64_t q = 0; q < 2 * rh; ++q) w[q] = load(x, q, dtype);
    for (int64_t q = 0; q < rh; ++q) {
        store(out, q, w[q] * c[q] - w[q + rh] * s[q], out_dtype);
        store(out, q + rh, w[q + rh] * c[q] + w[q] * s[q], out_dtype);
    }
}

/* dst <- bytes of src for a row written to a slot other than its own. With `stream` (the caller's choice), AVX and
 * a 32-byte aligned whole row the stores stream past the cache: nothing in the walk reads a destination again, and
 * an ordinary store that misses first reads the line it overwrites (a third of a move's traffic). H2SVC's moves
 * come from overflow slots a window away, whose destinations are cold: they stream. HERMES's kept tokens move a short
 * way left onto lines the walk has just read, still in cache, so an ordinary store there costs no extra read: it
 * keeps ordinary stores. The worker fences before it returns. */
INLINE void put_row(char *dst, const char *src, const size_t bytes, const int stream) {
#if defined(__AVX__)
    if (stream && ((uintptr_t)dst & 31) == 0 && (bytes & 31) == 0) {
        for (size_t o = 0; o < bytes; o += 32)
            _mm256_stream_si256((__m256i *)(dst + o), _mm256_loadu_si256((const __m256i *)(src + o)));
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* Kept token: key from slot s rotated into slot d, value copied (d <= s). */
INLINE void move(const job_t *j, char *kr, char *vr, int64_t s, int64_t d, const int32_t *rows, const int64_t rh,
                 const int64_t D, const int dtype) {
    const int64_t size = element_size(dtype), kt = j->kstride[3] * size, vt = j->vstride[3] * size;
    const size_t bytes = (size_t)(D * size);
    int unturned = 1;
    for (int64_t a = 0; unturned && a < j->A; ++a) unturned = rows[a * j->n] == j->zero_row;
    if (s == d) {
        if (!unturned) rotate(kr + s * kt, kr + d * kt, rows, j->n, j, rh, D, dtype, dtype); /* in place */
        return; /* same slot, zero delta: nothing changes */
    }
    if (unturned) { /* zero delta: the key moves as bytes */
        put_row(kr + d * kt, kr + s * kt, bytes, j->stream);
    } else if (j->stream) { /* rotated in L1, then streamed */
        float turned[2 * MAX_HALF]; /* room for a row of either dtype */
        rotate(kr + s * kt, (char *)turned, rows, j->n, j, rh, D, dtype, dtype);
        put_row(kr + d * kt, (const char *)turned, bytes, 1);
    } else {
        rotate(kr + s * kt, kr + d * kt, rows, j->n, j, rh, D, dtype, dtype);
    }
    put_row(vr + d * vt, vr + s * vt, bytes, j->stream);
}

INLINE void walk_row(const job_t *j, int64_t l, int64_t b, int64_t h, const int64_t rh, const int64_t D,
                     const int dtype) {
    const int64_t A = j->A, size = element_size(dtype);
    char *kr = j->k + (l * j->kstride[0] + b * j->kstride[1] + h * j->kstride[2]) * size;
    char *vr = j->v + (l * j->vstride[0] + b * j->vstride[1] + h * j->vstride[2]) * size;
    const int64_t *src = j->src + (l * j->B + b) * j->n;
    const int32_t *ktab = j->ktab + (l * j->B + b) * A * j->n;
    int64_t kept = 0;
    while (kept < j->n && src[kept] >= 0) ++kept;
    if (j->m == 0 || l < j->first) {
        for (int64_t i = 0; i < kept; ++i) move(j, kr, vr, src[i], j->P + i, ktab + i, rh, D, dtype);
        return;
    }
    const int64_t deep = (l - j->first) * j->B + b;
    const int64_t *pruned = j->pruned + deep * j->m;
    const int32_t *ptab = j->ptab + deep * A * j->m;
    double k_acc[2 * MAX_HALF], v_acc[2 * MAX_HALF];
    float turned[2 * MAX_HALF];
    memset(k_acc, 0, (size_t)D * sizeof(double));
    memset(v_acc, 0, (size_t)D * sizeof(double));
    for (int64_t i = 0, p = 0; i < kept || p < j->m;) {
        if (p < j->m && (i == kept || pruned[p] < src[i])) {
            const char *value = vr + pruned[p] * j->vstride[3] * size;
            /* the whole key widened into `turned`: the rotary channels turned to the target, the tail as it is */
            rotate(kr + pruned[p] * j->kstride[3] * size, (char *)turned, ptab + p, j->m, j, rh, D, dtype,
                   DTYPE_F32);
            for (int64_t c = 0; c < D; ++c) {
                k_acc[c] += (double)turned[c];
                v_acc[c] += (double)load(value, c, dtype);
            }
            ++p;
        } else {
            move(j, kr, vr, src[i], j->P + i, ktab + i, rh, D, dtype);
            ++i;
        }
    }
    memcpy(j->ksum + (deep * j->H + h) * D, k_acc, (size_t)D * sizeof(double));
    memcpy(j->vsum + (deep * j->H + h) * D, v_acc, (size_t)D * sizeof(double));
}

/* One row walk per dtype, each compiled on its own; the (rotary pairs, head dim) of common models get constant trip
 * counts, which the compiler unrolls and vectorises: full rotary at D = 64, 128, 256 and Qwen3.5's R = 64 of 256. */
#define DEFINE_WALK(NAME, DTYPE)                                                                              \
    static __attribute__((noinline)) void NAME(const job_t *j, int64_t l, int64_t b, int64_t h) {            \
        const int64_t rh = j->rh, D = j->D;                                                                \
        if (rh == 32 && D == 64) walk_row(j, l, b, h, 32, 64, DTYPE);                                     \
        else if (rh == 64 && D == 128) walk_row(j, l, b, h, 64, 128, DTYPE);                              \
        else if (rh == 128 && D == 256) walk_row(j, l, b, h, 128, 256, DTYPE);                            \
        else if (rh == 32 && D == 256) walk_row(j, l, b, h, 32, 256, DTYPE);                              \
        else walk_row(j, l, b, h, rh, D, DTYPE);                                                           \
    }
DEFINE_WALK(walk_f32, DTYPE_F32)
DEFINE_WALK(walk_bf16, DTYPE_BF16)

/* Workers for `items` independent pieces of work: the caller's thread count, at least 1, at most MAX_THREADS and
 * never more than there are items. */
static int worker_count(int threads, int64_t items) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = (int)items;
    return threads < 1 ? 1 : threads;
}

/* fn on jobs[0 .. threads) (each `size` bytes): workers 1.. on threads of their own; worker 0, and any worker whose
 * thread could not start, on the calling thread. Returns nonzero if a thread could not be joined. */
static int run_workers(void *(*fn)(void *), char *jobs, size_t size, int threads) {
    pthread_t ids[MAX_THREADS];
    int started = 0, status = 0;
    for (int t = 1; t < threads; ++t) {
        if (pthread_create(&ids[t], NULL, fn, jobs + t * size) != 0) break;
        started = t;
    }
    fn(jobs);
    for (int t = started + 1; t < threads; ++t) fn(jobs + t * size);
    for (int t = 1; t <= started; ++t) status |= pthread_join(ids[t], NULL);
    return status;
}

static void *worker(void *arg) {
    const job_t *j = (const job_t *)arg;
    const int64_t rows = j->L * j->B * j->H;
    for (int64_t r = j->worker; r < rows; r += j->threads) {
        const int64_t l = r / (j->B * j->H), b = (r / j->H) % j->B, h = r % j->H;
        switch (j->dtype) {
        case DTYPE_BF16: walk_bf16(j, l, b, h); break;
        default: walk_f32(j, l, b, h);
        }
    }
#if defined(__AVX__)
    _mm_sfence(); /* the streamed rows are in memory before the caller joins this worker */
#endif
    return NULL;
}

/* Returns 0 on success, 1 for an unsupported dtype, head dim, rotary pair count (rh in [1, D/2]), axis count or an
 * axis map entry outside [0, A) (nothing written), 2 if a worker thread could not be joined. Rows of workers whose
 * thread could not start run on the calling thread. */
int hermes_compact_rows(void *k, void *v, int dtype, const int64_t *shape, const int64_t *kstride,
                        const int64_t *vstride, int64_t P, int64_t n, const int64_t *src, const int32_t *ktab,
                        int64_t A, int64_t rh, const int32_t *axis, const float *tab_cos, const float *tab_sin,
                        int32_t zero_row, int64_t first, int64_t m, const int64_t *pruned, const int32_t *ptab,
                        double *ksum, double *vsum, int stream, int threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (shape[3] % 2 || shape[3] / 2 > MAX_HALF || rh < 1 || rh > shape[3] / 2 || A < 1 || A > 3) return 1;
    for (int64_t q = 0; q < rh; ++q)
        if (axis[q] < 0 || axis[q] >= A) return 1;
    threads = worker_count(threads, shape[0] * shape[1] * shape[2]);
    job_t jobs[MAX_THREADS];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (job_t){(char *)k, (char *)v, dtype, shape[0], shape[1], shape[2], shape[3], rh, kstride,
                          vstride, P, n, src, ktab, A, axis, tab_cos, tab_sin, zero_row, first, m, pruned,
                          ptab, ksum, vsum, stream, threads, t};
    return run_workers(worker, (char *)jobs, sizeof jobs[0], threads) ? 2 : 0;
}

/* Dense ranks by counting, for the position re-index of both policies' planning (`dense_rank_counting` in
 * ranks.py, and H2SVC's `hermes_frame_reindex` below). Row r of values [rows, n]: rank[i] = the number of distinct
 * valid values of the row below values[i] (0-based dense rank); an invalid lane (valid[i] == 0; valid NULL: all
 * valid) gets the row's distinct count, past every valid rank. Per row: min/max of the valid values, a presence
 * table over that span, an exclusive prefix count, one lookup per lane: linear in n + span. A row whose span exceeds
 * max_span (values far apart, where a sort is cheaper) stops the call with status 3 and the caller sorts instead. */
typedef struct {
    int64_t *slots, capacity; /* presence table, reused from row to row */
} rank_table_t;

/* Ranks of one row x[0..n) (stride 1) into out; returns the distinct count, -3 if the span exceeds max_span, -2 if
 * the table could not be grown. */
static int64_t rank_row(const int64_t *x, const uint8_t *ok, int64_t n, int64_t max_span, rank_table_t *t,
                        int64_t *out) {
    int64_t low = INT64_MAX, high = INT64_MIN;
    for (int64_t i = 0; i < n; ++i) {
        if (ok && !ok[i]) continue;
        if (x[i] < low) low = x[i];
        if (x[i] > high) high = x[i];
    }
    if (low > high) { /* no valid lane */
        for (int64_t i = 0; i < n; ++i) out[i] = 0;
        return 0;
    }
    if (high - low >= max_span) return -3;
    const int64_t span = high - low + 1;
    if (span > t->capacity) {
        free(t->slots);
        t->slots = (int64_t *)malloc((size_t)span * sizeof(int64_t));
        t->capacity = t->slots ? span : 0;
        if (!t->slots) return -2;
    }
    int64_t *table = t->slots;
    memset(table, 0, (size_t)span * sizeof(int64_t));
    for (int64_t i = 0; i < n; ++i)
        if (!ok || ok[i]) table[x[i] - low] = 1;
    int64_t distinct = 0;
    for (int64_t v = 0; v < span; ++v) {
        const int64_t present = table[v];
        table[v] = distinct;
        distinct += present;
    }
    for (int64_t i = 0; i < n; ++i) out[i] = (!ok || ok[i]) ? table[x[i] - low] : distinct;
    return distinct;
}

typedef struct {
    const int64_t *values;
    const uint8_t *valid;
    int64_t *rank;
    int64_t rows, n, max_span;
    int threads, worker, failed;
} rank_job_t;

static void *rank_worker(void *arg) {
    rank_job_t *j = (rank_job_t *)arg;
    rank_table_t table = {NULL, 0};
    for (int64_t r = j->worker; r < j->rows && !j->failed; r += j->threads) {
        const int64_t got = rank_row(j->values + r * j->n, j->valid ? j->valid + r * j->n : NULL, j->n,
                                     j->max_span, &table, j->rank + r * j->n);
        if (got < 0) j->failed = (int)-got;
    }
    free(table.slots);
    return NULL;
}

/* The larger failure status of jobs[0 .. threads) (each `size` bytes, `failed` at byte `offset`). */
static int worst_status(const char *jobs, size_t size, size_t offset, int threads) {
    int status = 0;
    for (int t = 0; t < threads; ++t) {
        const int failed = *(const int *)(jobs + t * size + offset);
        if (failed > status) status = failed;
    }
    return status;
}

/* Returns 0 on success; 3 if a row's span exceeds max_span; 2 if a worker thread could not be joined or a table
 * could not be allocated (rank is incomplete unless 0). Rows of workers whose thread could not start run on the
 * calling thread. */
int hermes_dense_rank(const int64_t *values, const uint8_t *valid, int64_t rows, int64_t n, int64_t max_span,
                      int64_t *rank, int threads) {
    threads = worker_count(threads, rows);
    rank_job_t jobs[MAX_THREADS];
    for (int t = 0; t < threads; ++t) jobs[t] = (rank_job_t){values, valid, rank, rows, n, max_span, threads, t, 0};
    if (run_workers(rank_worker, (char *)jobs, sizeof jobs[0], threads)) return 2;
    return worst_status((const char *)jobs, sizeof jobs[0], offsetof(rank_job_t, failed), threads);
}

/* H2SVC's re-index of one class block (policies/h2svc/step.py, step 4; `_reindex_native` there), in one pass per
 * (row, stream) and no temporaries in torch. positions [rows, B, A, C] (int64, element strides pstride), source
 * [rows, B, held] (int64, contiguous): the frame slot each home slot takes its frame from. For the n = held·T
 * retained tokens of a (row, stream), token i = (home slot h, offset t) reads its old coordinate on axis a from
 * positions[.., a, P + source[h]·T + t]; per axis its dense rank among the row's n coordinates; E = the largest
 * distinct count over the axes; new = rank + next_position − E (the newest coordinate of the row lands at
 * next_position − 1). Writes new [rows, B, A, n] and delta = new − old [rows, B, A, n]; positions are only read
 * (the caller writes new into the home slots once every row has planned, so a failure leaves them untouched). */
typedef struct {
    const int64_t *pos, *pstride, *source;
    int64_t rows, B, A, held, P, T, next_position, max_span;
    int64_t *out_new, *out_delta;
    int threads, worker, failed;
} reindex_job_t;

static void *reindex_worker(void *arg) {
    reindex_job_t *j = (reindex_job_t *)arg;
    const int64_t n = j->held * j->T, A = j->A;
    rank_table_t table = {NULL, 0};
    for (int64_t r = j->worker; r < j->rows * j->B && !j->failed; r += j->threads) {
        const int64_t row = r / j->B, stream = r % j->B;
        const int64_t *source = j->source + r * j->held;
        int64_t *old = j->out_delta + r * A * n, *rank = j->out_new + r * A * n;
        int64_t extent = 0;
        for (int64_t a = 0; a < A && !j->failed; ++a) {
            const int64_t *axis = j->pos + row * j->pstride[0] + stream * j->pstride[1] + a * j->pstride[2];
            int64_t *o = old + a * n;
            for (int64_t h = 0; h < j->held; ++h) {
                const int64_t *from = axis + (j->P + source[h] * j->T) * j->pstride[3];
                for (int64_t t = 0; t < j->T; ++t) o[h * j->T + t] = from[t * j->pstride[3]];
            }
            const int64_t distinct = rank_row(o, NULL, n, j->max_span, &table, rank + a * n);
            if (distinct < 0) j->failed = (int)-distinct;
            if (distinct > extent) extent = distinct;
        }
        const int64_t shift = j->next_position - extent;
        for (int64_t i = 0; i < A * n; ++i) {
            rank[i] += shift;
            old[i] = rank[i] - old[i];
        }
    }
    free(table.slots);
    return NULL;
}

/* Returns 0 on success; 3 if a row's span on some axis exceeds max_span (the caller ranks by sorting instead);
 * 2 if a worker thread could not be joined or a table could not be allocated. */
int hermes_frame_reindex(const int64_t *pos, const int64_t *pstride, int64_t rows, int64_t B, int64_t A,
                         const int64_t *source, int64_t held, int64_t P, int64_t T, int64_t next_position,
                         int64_t max_span, int64_t *out_new, int64_t *out_delta, int threads) {
    threads = worker_count(threads, rows * B);
    reindex_job_t jobs[MAX_THREADS];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (reindex_job_t){pos, pstride, source, rows, B, A, held, P, T, next_position, max_span,
                                  out_new, out_delta, threads, t, 0};
    if (run_workers(reindex_worker, (char *)jobs, sizeof jobs[0], threads)) return 2;
    return worst_status((const char *)jobs, sizeof jobs[0], offsetof(reindex_job_t, failed), threads);
}
