/* H2SVC stage (b) on CPU: the sequential part of STCE (docs/h2svc.md §3) for every row in one call.
 *
 * Called by hermes_kernels/policies/h2svc/stce.py (`stce_select_torch` on CPU tensors, through bindings.py) after the
 * shared torch set-up (`_trajectory`): per row, the frame index of each of its M = W + F lanes (held frames in temporal
 * order, -1 past the row's held count, then the F arrivals) and the squared distances d2 [M, M] of their features. This
 * file runs the same state machine as the torch twin's loop and the Triton program: a doubly linked list of the live
 * lanes, each arrival appended at the tail, its predecessor rescored, and while more than `capacity` frames live the
 * lowest score evicted (the first minimum in lane order, i.e. the older frame on ties; endpoints score +inf) and its
 * two neighbours rescored. A row costs O(F · M) scalar operations, where the torch twin pays tens of tensor ops per
 * arrival.
 *
 * Scores are computed in d2's dtype (float or double) with the torch twin's operations in its order — IEEE sqrt,
 * products, sums and one division, each rounded once (built with -ffp-contract=off) — and log(t_n - t_p) read
 * from a table the caller computed with torch, so every score, and so every decision, is bit-identical to the
 * torch twin's.
 */
#include <math.h>
#include <stdint.h>

#define MAX_LANES 4096

/* I(j) from d2(j, p), d2(j, n), d2(p, n) and log(t_n - t_p), as `_curvature_torch`; a NaN score is 0 (torch's
 * min and clamp propagate NaN, these comparisons would not: a NaN input scores 0 here directly). */
#define DEFINE_CURVATURE(NAME, REAL, SQRT)                                                                    \
    static REAL NAME(REAL d_in, REAL d_out, REAL d_pn, REAL log_gap) {                                    \
        if (isnan(d_in) || isnan(d_out) || isnan(d_pn)) return (REAL)0;                                   \
        const REAL norm_in = SQRT(d_in), norm_out = SQRT(d_out);                                              \
        const REAL norms = norm_in * norm_out;                                                            \
        REAL cos = norms > 0 ? (REAL)0.5 * (d_pn - d_in - d_out) / norms : (REAL)0;                         \
        cos = cos < (REAL)-1 ? (REAL)-1 : (cos > (REAL)1 ? (REAL)1 : cos);                                 \
        const REAL shorter = norm_in < norm_out ? norm_in : norm_out;                                      \
        const REAL score = ((REAL)1 - cos) * shorter * log_gap;                                              \
        return isnan(score) ? (REAL)0 : score;                                                               \
    }

/* One row: lanes [M] of times, d2 [M, M], kept [capacity] out (ascending frame indices, -1 padded). */
#define DEFINE_ROW(NAME, REAL, CURVATURE)                                                                     \
    static void NAME(const int64_t *times, const REAL *d2, const REAL *log_gap, int64_t M, int64_t W,        \
                     int64_t capacity, int64_t *kept) {                                                      \
        const int64_t none = -1;                                                                           \
        int64_t prev[MAX_LANES], next[MAX_LANES];                                                          \
        unsigned char alive[MAX_LANES];                                                                    \
        REAL score[MAX_LANES];                                                                             \
        int64_t held = 0;                                                                                  \
        while (held < W && times[held] >= 0) ++held;                                                       \
        for (int64_t k = 0; k < M; ++k) {                                                                  \
            alive[k] = k < held;                                                                           \
            prev[k] = (alive[k] && k >= 1) ? k - 1 : none;                                                 \
            next[k] = (alive[k] && k + 1 < held) ? k + 1 : none;                                           \
            score[k] = (REAL)INFINITY;                                                                     \
        }                                                                                                  \
        for (int64_t k = 1; k + 1 < held; ++k)                                                             \
            score[k] = CURVATURE(d2[k * M + k - 1], d2[k * M + k + 1], d2[(k - 1) * M + k + 1],               \
                                 log_gap[times[k + 1] - times[k - 1]]);                                    \
        int64_t count = held, tail = held > 0 ? held - 1 : none;                                           \
        for (int64_t a = W; a < M; ++a) {                                                                  \
            /* append the arrival; the previous newest frame becomes interior when it has an older neighbour */ \
            alive[a] = 1;                                                                                  \
            prev[a] = tail;                                                                                \
            if (tail != none) {                                                                            \
                next[tail] = a;                                                                            \
                const int64_t p = prev[tail];                                                              \
                if (p != none)                                                                             \
                    score[tail] = CURVATURE(d2[tail * M + p], d2[tail * M + a], d2[p * M + a],               \
                                            log_gap[times[a] - times[p]]);                                 \
            }                                                                                              \
            tail = a;                                                                                      \
            ++count;                                                                                       \
            if (count <= capacity) continue;                                                               \
            /* evict the first lowest score in lane order (dead lanes count as +inf, as in the torch twin) */ \
            int64_t gone = 0;                                                                              \
            REAL lowest = alive[0] ? score[0] : (REAL)INFINITY;                                            \
            for (int64_t k = 1; k < M; ++k) {                                                              \
                const REAL s = alive[k] ? score[k] : (REAL)INFINITY;                                       \
                if (s < lowest) {                                                                          \
                    lowest = s;                                                                            \
                    gone = k;                                                                              \
                }                                                                                          \
            }                                                                                              \
            const int64_t p = prev[gone], n = next[gone];                                                  \
            alive[gone] = 0;                                                                               \
            score[gone] = (REAL)INFINITY;                                                                  \
            if (p != none) next[p] = n;                                                                    \
            if (n != none) prev[n] = p;                                                                    \
            --count;                                                                                       \
            /* the O(1) update: only the two neighbours are rescored (an endpoint keeps +inf) */            \
            if (p != none && prev[p] != none && n != none)                                                 \
                score[p] = CURVATURE(d2[p * M + prev[p]], d2[p * M + n], d2[prev[p] * M + n],                \
                                     log_gap[times[n] - times[prev[p]]]);                                  \
            if (n != none && p != none && next[n] != none)                                                 \
                score[n] = CURVATURE(d2[n * M + p], d2[n * M + next[n]], d2[p * M + next[n]],                \
                                     log_gap[times[next[n]] - times[p]]);                                  \
        }                                                                                                  \
        int64_t slot = 0;                                                                                  \
        for (int64_t k = 0; k < M && slot < capacity; ++k)                                                 \
            if (alive[k]) kept[slot++] = times[k];                                                         \
        while (slot < capacity) kept[slot++] = -1;                                                         \
    }

DEFINE_CURVATURE(curvature_f32, float, sqrtf)
DEFINE_CURVATURE(curvature_f64, double, sqrt)
DEFINE_ROW(row_f32, float, curvature_f32)
DEFINE_ROW(row_f64, double, curvature_f64)

/* times int64 [R, M], d2 [R, M, M] float (is_double 0) or double (1), log_gap [G] of d2's dtype with
 * log_gap[g] = log(g), kept int64 [R, capacity]. A gap t_n - t_p is at most the largest frame index (frames are
 * >= 0), so every read of the table is in bounds when every frame index is below G. Returns 0; 1 when M is over
 * MAX_LANES; 2 when a frame index is G or more (the table is too short). Nothing is written unless it returns 0. */
int hermes_stce_rows(const int64_t *times, const void *d2, int is_double, const void *log_gap, int64_t log_len,
                     int64_t R, int64_t M, int64_t W, int64_t capacity, int64_t *kept) {
    if (M > MAX_LANES || M < W) return 1;
    for (int64_t i = 0; i < R * M; ++i)
        if (times[i] >= log_len) return 2;
    for (int64_t r = 0; r < R; ++r) {
        if (is_double)
            row_f64(times + r * M, (const double *)d2 + r * M * M, (const double *)log_gap, M, W, capacity,
                    kept + r * capacity);
        else
            row_f32(times + r * M, (const float *)d2 + r * M * M, (const float *)log_gap, M, W, capacity,
                    kept + r * capacity);
    }
    return 0;
}
