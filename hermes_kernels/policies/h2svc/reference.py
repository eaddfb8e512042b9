"""The plain per-head PyTorch oracle of H2SVC (docs/h2svc.md §2–4; the step of docs/h2svc.md §7): slow on purpose,
each block naming the formula it computes, the one oracle every H2SVC kernel test imports; its arithmetic and
arguments are on docs/api.md#h2svc-reference.

- §2 offline routing: `tad_v2v`, `tad_t2v`, `head_scores`, `classify_heads`.
- §3 frame features and STCE: `frame_features`, `stce_scores`, `stce_select`, `stce_trace`.
- FIFO classes: `fifo_keep`; one step of a class block (slot plan + §4 right-aligned re-index): `h2svc_step`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from ...engine.dtypes import work_dtype
from ...results import H2SVCStepResult
from ...rope import RotaryLayout, apply_rotary_delta, compact_positions
from .checks import (check_attention_profile, check_fifo, check_frame_features, check_h2svc_step, check_head_scores,
                     check_stce, check_tad_pair, check_trajectory)
from .clock import StreamClock
from .config import EPISODIC, INSTANT, SHORT, H2SVCConfig


@dataclasses.dataclass
class STCETrace:
    """`stce_select`'s answer plus what each arrival evicted, so tests can draw tie-free inputs.

    keep:    int64 [H, B, capacity], retained frame indices ascending, −1 padded.
    evicted: int64 [H, B, F], the frame evicted after arrival i, −1 when nothing was (memory not full).
    gap:     float64 [H, B, F], second-lowest minus lowest evictable score at that eviction (+inf when no
             eviction happened or only one frame was evictable).
    margin:  float64 [H, B, F], gap / max(|lowest|, |second-lowest|) (0 for an exact tie of zeros, +inf as gap).
    """

    keep: torch.Tensor
    evicted: torch.Tensor
    gap: torch.Tensor
    margin: torch.Tensor


# ---------------------------------------------------------------------------------------------------------------
# §2 offline routing (spatio-temporal attention profiling)
# ---------------------------------------------------------------------------------------------------------------

def _frame_mass(probs: torch.Tensor, frame_of_token: torch.Tensor, num_frames: int) -> torch.Tensor:
    """A[q, F_j] float64 [S, n]: attention mass of each query on the tokens of frame j (summed over the frame)."""
    mass = torch.zeros(probs.shape[0], num_frames, dtype=torch.float64, device=probs.device)
    for j in range(num_frames):
        mass[:, j] = probs[:, frame_of_token == j].sum(dim=1)
    return mass


def _kv_head_probs(probs: torch.Tensor, layer: int, kv_head: int, num_kv_heads: int) -> torch.Tensor:
    """float64 [S, S]: the attention probabilities of `kv_head`'s GQA group (consecutive query heads) averaged."""
    group = probs.shape[1] // num_kv_heads
    return probs[layer, kv_head * group:(kv_head + 1) * group].to(torch.float64).mean(dim=0)


def tad_v2v(probs: torch.Tensor, frame_of_token: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """TAD_V2V of one video, float64 [L, Hkv] (docs/h2svc.md §2):

        TAD_V2V(h) = (1/n) Σ_{i=1..n} mean_{q ∈ F_i} Σ_{j ≤ i} (i − j)·A[q, F_j]

    probs: float32/float64 [L, H, S, S] softmax attention of one video (rows queries, softmax over all keys);
    frame_of_token: int64 [S], 0-based frame of each token (−1 for prefix/text). With 0-based frames the
    distance i − j is the same. Callers average over videos.
    """
    n = check_attention_profile(probs, frame_of_token, num_kv_heads)
    L = probs.shape[0]
    out = torch.zeros(L, num_kv_heads, dtype=torch.float64)
    for layer in range(L):
        for kv_head in range(num_kv_heads):
            A = _frame_mass(_kv_head_probs(probs, layer, kv_head, num_kv_heads), frame_of_token, n)
            total = 0.0
            for i in range(n):
                distance = torch.tensor([float(i - j) for j in range(i + 1)], dtype=torch.float64, device=A.device)
                per_query = A[frame_of_token == i, :i + 1] @ distance  # Σ_{j ≤ i} (i − j)·A[q, F_j]
                total += float(per_query.mean())
            out[layer, kv_head] = total / n
    return out


def tad_t2v(probs: torch.Tensor, frame_of_token: torch.Tensor, text_queries: torch.Tensor,
            num_kv_heads: int) -> torch.Tensor:
    """TAD_T2V of one video, float64 [L, Hkv] (docs/h2svc.md §2):

        TAD_T2V(h) = mean_{q ∈ text} Σ_{j=1..n} (n − j)·A[q, F_j]

    text_queries: int64 [Q], the question (and answer) tokens after all n frames. 0-based frame f sits at
    distance n − 1 − f: the newest frame is at distance 0, as in V2V (ours, docs/h2svc.md §2).
    """
    n = check_attention_profile(probs, frame_of_token, num_kv_heads, text_queries)
    L = probs.shape[0]
    out = torch.zeros(L, num_kv_heads, dtype=torch.float64)
    distance = torch.tensor([float(n - 1 - f) for f in range(n)], dtype=torch.float64, device=probs.device)
    for layer in range(L):
        for kv_head in range(num_kv_heads):
            A = _frame_mass(_kv_head_probs(probs, layer, kv_head, num_kv_heads), frame_of_token, n)
            out[layer, kv_head] = float((A[text_queries] @ distance).mean())
    return out


def head_scores(v2v: torch.Tensor, t2v: torch.Tensor) -> torch.Tensor:
    """S(h) = ½(N(TAD_V2V) + N(TAD_T2V)), float64 [L, Hkv] (docs/h2svc.md §2), each metric min-max normalised over all
    L·Hkv heads: N(x) = (x − min)/(max − min), 0 when max = min. v2v, t2v: float [L, Hkv] (already averaged
    over the sample videos)."""
    check_tad_pair(v2v, t2v)

    def normalise(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        low, high = x.min(), x.max()
        if high == low:
            return torch.zeros_like(x)
        return (x - low) / (high - low)

    return 0.5 * (normalise(v2v) + normalise(t2v))


def classify_heads(scores: torch.Tensor, instant_ratio: float = 0.1, short_ratio: float = 0.4) -> torch.Tensor:
    """The head map, int64 [L, Hkv] (docs/h2svc.md §2): heads sorted by S ascending, ties by (layer, head); the first
    n_i = ⌊r_i·H + ½⌋ instant, the next n_s = ⌊(r_i + r_s)·H + ½⌋ − n_i short, the rest episodic."""
    n_i, n_s, _ = check_head_scores(scores, instant_ratio, short_ratio)
    # a stable sort of the row-major flattening breaks ties by (layer, head)
    order = torch.sort(scores.flatten(), stable=True).indices.tolist()
    classes = torch.empty(scores.numel(), dtype=torch.int64)
    for rank, head in enumerate(order):
        classes[head] = INSTANT if rank < n_i else SHORT if rank < n_i + n_s else EPISODIC
    return classes.view(scores.shape)


# ---------------------------------------------------------------------------------------------------------------
# §3 frame features and semantic trajectory curvature eviction (STCE)
# ---------------------------------------------------------------------------------------------------------------

def frame_features(values: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """V_j = mean of the value vectors of frame j's tokens (docs/h2svc.md §3), float32 [H, B, F, D] (float64 for
    float64 input). values: [H, B, F·T_f, D] any float dtype; values carry no RoPE, so keys are never used."""
    F = check_frame_features(values, tokens_per_frame)
    work = work_dtype(values)
    H, B, _, D = values.shape
    out = torch.empty(H, B, F, D, dtype=work, device=values.device)
    for f in range(F):
        out[:, :, f] = values[:, :, f * tokens_per_frame:(f + 1) * tokens_per_frame].to(work).mean(dim=2)
    return out


def _curvature(v_prev: torch.Tensor, v_j: torch.Tensor, v_next: torch.Tensor, t_prev: int, t_next: int) -> float:
    """I(j) of an interior frame j with retained neighbours p, n (docs/h2svc.md §3):

        I(j) = (1 − cos(v_in, v_out)) · min(‖v_in‖, ‖v_out‖) · log(t_n − t_p),  v_in = V_j − V_p, v_out = V_n − V_j

    computed in the features' dtype; cos := 0 when ‖v_in‖·‖v_out‖ = 0 (then I = 0 anyway; ours).
    t are stream frame indices, so t_n − t_p >= 2 and the log is positive.
    """
    v_in, v_out = v_j - v_prev, v_next - v_j
    norm_in, norm_out = torch.linalg.vector_norm(v_in), torch.linalg.vector_norm(v_out)
    speeds = norm_in * norm_out
    cos = (v_in @ v_out) / speeds if speeds > 0 else torch.zeros((), dtype=v_j.dtype, device=v_j.device)
    span = torch.tensor(float(t_next - t_prev), dtype=v_j.dtype, device=v_j.device)
    return float((1 - cos) * torch.minimum(norm_in, norm_out) * torch.log(span))


def stce_scores(features: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """I(j) of every retained frame of one head, in temporal order (docs/h2svc.md §3), from scratch.

    features: float32/float64 [n, D], the frames' features; times: int64 [n] strictly increasing stream indices.
    Returns [n] in features' dtype; the oldest and the newest frame score +inf (never evicted; ours).
    """
    check_trajectory(features, times)
    n = features.shape[0]
    scores = torch.full((n,), math.inf, dtype=features.dtype, device=features.device)
    for j in range(1, n - 1):
        scores[j] = _curvature(features[j - 1], features[j], features[j + 1], int(times[j - 1]), int(times[j + 1]))
    return scores


class _Trajectory:
    """The retained frames of one (layer, stream, episodic head) as an explicit doubly linked list in temporal
    order, with each frame's current score I(j). Node ids are 0, 1, … in insertion order."""

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []
        self.times: list[int] = []
        self.prev: list[int] = []
        self.next: list[int] = []
        self.score: list[float] = []
        self.oldest = self.newest = -1
        self.size = 0

    def rescore(self, node: int) -> None:
        """O(1): a frame's score depends only on its two current neighbours; endpoints score +inf."""
        p, n = self.prev[node], self.next[node]
        if p < 0 or n < 0:
            self.score[node] = math.inf
        else:
            self.score[node] = _curvature(self.features[p], self.features[node], self.features[n],
                                          self.times[p], self.times[n])

    def append(self, feature: torch.Tensor, time: int) -> None:
        """Link a frame newer than all retained ones after the newest; the previous newest becomes interior and
        its score is computed now (docs/h2svc.md §3)."""
        node = len(self.times)
        self.features.append(feature)
        self.times.append(time)
        self.prev.append(self.newest)
        self.next.append(-1)
        self.score.append(math.inf)
        if self.newest >= 0:
            self.next[self.newest] = node
            self.rescore(self.newest)
        else:
            self.oldest = node
        self.newest = node
        self.size += 1

    def lowest_two(self) -> tuple[int, float, float]:
        """(node, its score, the second-lowest score) over the interior frames, scanning oldest first so that a
        tie goes to the older frame (strict <). Endpoints are skipped explicitly, never by their +inf."""
        best, best_score, second = -1, math.inf, math.inf
        node = self.next[self.oldest]
        while node != self.newest:
            score = self.score[node]
            if best < 0 or score < best_score:
                best, best_score, second = node, score, best_score
            elif score < second:
                second = score
            node = self.next[node]
        return best, best_score, second

    def evict(self, node: int) -> None:
        """Unlink an interior frame; only its two neighbours' scores change (the O(1) update of §3)."""
        p, n = self.prev[node], self.next[node]
        self.next[p], self.prev[n] = n, p
        self.rescore(p)
        self.rescore(n)
        self.size -= 1

    def retained_times(self) -> list[int]:
        out, node = [], self.oldest
        while node >= 0:
            out.append(self.times[node])
            node = self.next[node]
        return out


def stce_trace(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
               capacity: int) -> STCETrace:
    """STCE over one chunk of F arrivals for every row (docs/h2svc.md §3), with each eviction's score margin.

    features: float32/float64 [H, B, W, D] held frames' features (any slot order); slot_frames: int64 [H, B, W] their
    stream indices (−1 empty); arriving: [H, B, F, D] in arrival order, arrival i is frame first_frame + i;
    capacity: N_e >= 2. Per row: the held frames are linked in temporal order and scored, then the arrivals
    come one at a time; after each, if more than N_e frames are retained, the interior frame of lowest I is
    evicted (ties: the older frame; the oldest and newest frame never) and only its neighbours are rescored.
    """
    F = check_stce(features, slot_frames, arriving, first_frame, capacity, contents=True)
    H, B = slot_frames.shape[:2]
    keep = torch.full((H, B, capacity), -1, dtype=torch.int64, device=slot_frames.device)
    evicted = torch.full((H, B, F), -1, dtype=torch.int64, device=slot_frames.device)
    gap = torch.full((H, B, F), math.inf, dtype=torch.float64, device=slot_frames.device)
    margin = torch.full((H, B, F), math.inf, dtype=torch.float64, device=slot_frames.device)
    for h in range(H):
        for b in range(B):
            trajectory = _Trajectory()
            held = sorted((int(t), slot) for slot, t in enumerate(slot_frames[h, b].tolist()) if t >= 0)
            for time, slot in held:
                trajectory.append(features[h, b, slot], time)
            for i in range(F):
                trajectory.append(arriving[h, b, i], first_frame + i)
                if trajectory.size <= capacity:
                    continue
                node, lowest, second = trajectory.lowest_two()
                evicted[h, b, i] = trajectory.times[node]
                if second < math.inf:  # with one evictable frame gap and margin stay +inf
                    gap[h, b, i] = second - lowest
                    scale = max(abs(lowest), abs(second))
                    margin[h, b, i] = (second - lowest) / scale if scale > 0 else 0.0
                trajectory.evict(node)
            times = trajectory.retained_times()
            keep[h, b, :len(times)] = torch.tensor(times, dtype=torch.int64)
    return STCETrace(keep=keep, evicted=evicted, gap=gap, margin=margin)


def stce_select(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
                capacity: int) -> torch.Tensor:
    """Kept frame indices per row after one chunk of arrivals, int64 [H, B, capacity], ascending, −1 padded
    (docs/h2svc.md §3; arguments as `stce_trace`, the same contract as `hermes_kernels.stce_select`)."""
    return stce_trace(features, slot_frames, arriving, first_frame, capacity).keep


# ---------------------------------------------------------------------------------------------------------------
# FIFO classes (instant, short)
# ---------------------------------------------------------------------------------------------------------------

def fifo_keep(slot_frames: torch.Tensor, first_frame: int, num_frames: int, window: int) -> torch.Tensor:
    """Kept frame indices of FIFO heads after a chunk, int64 [H, B, window], ascending, −1 padded (docs/h2svc.md §1):
    the newest `window` of the held frames (slot_frames int64 [H, B, W'], −1 empty) and the arrivals
    first_frame, …, first_frame + num_frames − 1."""
    check_fifo(slot_frames, first_frame, num_frames, window, contents=True)
    H, B = slot_frames.shape[:2]
    keep = torch.full((H, B, window), -1, dtype=torch.int64, device=slot_frames.device)
    for h in range(H):
        for b in range(B):
            held = sorted(t for t in slot_frames[h, b].tolist() if t >= 0)
            newest = (held + list(range(first_frame, first_frame + num_frames)))[-window:]
            keep[h, b, :len(newest)] = torch.tensor(newest, dtype=torch.int64)
    return keep


# ---------------------------------------------------------------------------------------------------------------
# one step of a class block: keep sets, slot plan, §4 right-aligned re-index
# ---------------------------------------------------------------------------------------------------------------

def h2svc_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_frames: torch.Tensor,
               cfg: H2SVCConfig, cls, inv_freq: torch.Tensor,
               rotary: Sequence[int] | RotaryLayout | None = None, *, clock: StreamClock,
               features: torch.Tensor | None = None) -> H2SVCStepResult:
    """One H2SVC step of one class block, in place, after the chunk's prefill (docs/h2svc.md §7).

    keys/values: [H_c, B, C, D] fp16/bf16/fp32/fp64; positions: int64 [H_c, B, C] or [H_c, B, 3, C] (M-RoPE:
    `rotary` three contiguous pair counts or a `RotaryLayout`); slot_frames: int64 [H_c, B, W] (W =
    cfg.window(cls)); clock: the stream's host values (`StreamClock`); features (EPISODIC only): float32 [H_c, B, W, D]
    (float64 for a float64 cache). Token slots [0, P) hold the prefix; frame slot s covers [P + s·T_f, P + (s+1)·T_f).
    `clock.held` frames sit in home slots [0, held); the F = clock.num_frames arrivals (frames first_frame + i) were
    written at frame slots held + i, some possibly past W (overflow slots).

    1. keep set per row: FIFO keeps the newest min(W, held + F) frames; EPISODIC runs STCE (capacity W) over
       the held frames then the arrivals, whose features are `frame_features` of their values.
    2. slot plan (ours): kept frames in home slots stay; the home slots below held' = min(W, held + F) whose frame
       is not kept are filled, ascending, by the kept frames of the overflow slots in arrival order (K, V of all
       T_f tokens, positions and feature move; sources are left as they were).
    3. slot_frames = the frame now in each home slot, −1 from held' on.
    4. when clock.reindexed (docs/h2svc.md §4): per row and axis, the retained visual tokens take P + shift +
       dense rank, with shift = (next_position − P) − E and E the largest number of distinct values over the
       axes, so every row's largest coordinate is next_position − 1 (right alignment); keys rotate by the integer
       delta (§2.8 of docs/hermes.md, `hermes_kernels.rope`); the prefix is untouched.
    Everything is checked before anything is written.
    """
    cls = check_h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq, rotary, clock, features,
                           contents=True)
    layout = RotaryLayout.of(rotary, keys.shape[-1] // 2)  # checked above
    held, num_frames, first_frame = clock.held, clock.num_frames, clock.first_frame
    reindex_now, next_position = bool(clock.reindexed), clock.next_position
    P, T_f, W, F = cfg.prefix_len, cfg.tokens_per_frame, cfg.window(cls), num_frames
    held_after = min(W, held + F)
    H_c, B = keys.shape[:2]

    # 1. keep sets (read everything before the first write)
    if cls == EPISODIC:
        arriving = frame_features(values[:, :, P + held * T_f:P + (held + F) * T_f], T_f)
        keep = stce_select(features, slot_frames, arriving, first_frame, W)
    else:
        keep = fifo_keep(slot_frames, first_frame, F, W)

    for row in range(H_c):
        for b in range(B):
            kept = set(keep[row, b].tolist()) - {-1}
            # frame slot s -> the stream frame in it: held frames, then the arrivals in arrival order
            frame_in_slot = slot_frames[row, b, :held].tolist() + [first_frame + i for i in range(F)]

            # 2. slot plan: freed home slots ascending, filled by the kept overflow frames in arrival order
            free = [s for s in range(held_after) if frame_in_slot[s] not in kept]
            movers = [s for s in range(W, held + F) if frame_in_slot[s] in kept]
            for source, target in zip(movers, free):
                src = slice(P + source * T_f, P + (source + 1) * T_f)
                dst = slice(P + target * T_f, P + (target + 1) * T_f)
                keys[row, b, dst] = keys[row, b, src]
                values[row, b, dst] = values[row, b, src]
                positions[row, b][..., dst] = positions[row, b][..., src]
                frame_in_slot[target] = frame_in_slot[source]
            if cls == EPISODIC:
                for s in range(held_after):
                    if frame_in_slot[s] >= first_frame:  # an arrival now in a home slot: store its feature
                        features[row, b, s] = arriving[row, b, frame_in_slot[s] - first_frame]

            # 3. the frame of every home slot (slots from held' on were empty before and stay −1: held' >= held)
            slot_frames[row, b, :held_after] = torch.tensor(frame_in_slot[:held_after], dtype=torch.int64)

            # 4. docs/h2svc.md §4: right-aligned per-axis dense ranks ending at next_position − 1, keys by the delta
            if reindex_now:
                tokens = slice(P, P + held_after * T_f)
                old = positions[row, b][..., tokens]  # [n] or [3, n]
                rank = compact_positions(old, 0)  # dense rank per axis among the row's retained values
                distinct = int(rank.max()) + 1  # E: the largest distinct count over the axes
                new = rank + (next_position - distinct)
                keys[row, b, tokens] = apply_rotary_delta(keys[row, b, tokens], new - old, inv_freq, layout)
                positions[row, b][..., tokens] = new
    return H2SVCStepResult(held=held_after, keep=slot_frames, reindexed=clock.reindexed)
