"""H2SVC stage (b): the frames each episodic (layer, KV head) keeps after a chunk of arrivals, by semantic trajectory
curvature eviction (STCE). Both backends share one set-up in torch ops with no host sync (`_trajectory`: every row's
frames in temporal order and their squared distances, from one Gram matrix); they differ in the sequential arrival
loop: one Triton program per row (`stce_select_triton`), or torch ops over all rows, run in C on CPU
(`stce_select_torch`). All evict the same frames, for non-finite features too. The rule: docs/h2svc.md §3; the
choices it leaves open (ours): docs/decisions.md#h2svc-kernels, docs/gpu.md#contracts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...engine import bindings, native
from ...engine.launch import launch

__all__ = ["stce_select_torch", "stce_select_triton"]

_BIG = 2 ** 62  # sorts empty slots (frame -1) after every real frame index
_INF = float("inf")
_MAX_LANES = 4096  # stce_cpu.c's per-row state limit (W + F lanes)
# the C path's log table has one entry per frame index up to the newest (held endpoints are never evicted, so the
# widest gap grows with the stream): built per call up to 2^20 frames (4 MiB of float32; 12 days at 1 fps)
_MAX_LOG_TABLE = 1 << 20


def _trajectory(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor,
                first_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lanes of every row and their squared distances (the set-up both backends share; no host sync).

    features float32 [H, B, W, D] (any slot order; empty slots may hold anything, NaN included), slot_frames int64
    [H, B, W] (-1 empty, valid ones distinct), arriving [H, B, F, D] of features' dtype, in arrival order.
    Returns times int64 [H·B, W + F] (lane k < W: the k-th oldest held frame, -1 past the row's held count; lane
    W + i: arrival i, frame first_frame + i) and d2 [H·B, W + F, W + F] in features' dtype (float32; float64
    features stay float64, like every work dtype in the tree); entries of empty lanes are never read.
    """
    H, B, W, D = features.shape
    F = arriving.shape[2]
    order = slot_frames.masked_fill(slot_frames < 0, _BIG).argsort(dim=-1)
    held_times = slot_frames.gather(-1, order)
    held = features.gather(-2, order.unsqueeze(-1).expand(H, B, W, D))
    lane_valid = torch.cat([held_times >= 0, torch.ones(H, B, F, dtype=torch.bool, device=slot_frames.device)], dim=-1)
    x = torch.cat([held, arriving], dim=-2).masked_fill_(~lane_valid.unsqueeze(-1), 0)
    # centring (ours): distances are translation invariant; the Gram entries they cancel become smaller
    center = x.sum(dim=-2, keepdim=True) / lane_valid.sum(dim=-1, keepdim=True).unsqueeze(-1)
    x = (x - center).masked_fill_(~lane_valid.unsqueeze(-1), 0)
    gram = torch.matmul(x, x.transpose(-1, -2))
    square = gram.diagonal(dim1=-2, dim2=-1)
    d2 = (square.unsqueeze(-1) + square.unsqueeze(-2)).sub_(gram, alpha=2).clamp_(min=0)
    arrivals = first_frame + torch.arange(F, device=slot_frames.device)
    times = torch.cat([held_times, arrivals.expand(H, B, F)], dim=-1)
    return times.reshape(H * B, W + F), d2.reshape(H * B, W + F, W + F)


# ----------------------------------------------------------------------------------------------------------------
# torch twin
# ----------------------------------------------------------------------------------------------------------------

def _curvature_torch(d_in: torch.Tensor, d_out: torch.Tensor, d_pn: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    """I(j) from d2(j, p), d2(j, n), d2(p, n) and t_n - t_p (elementwise, in d2's dtype; the Triton `_score`).

    |v_in| = sqrt(d2(j, p)), |v_out| = sqrt(d2(j, n)) and, by polarisation, v_in · v_out = (d2(p, n) - d2(j, p) -
    d2(j, n)) / 2. The cosine is clamped to [-1, 1] against rounding (so I >= 0) and is 0 when |v_in|·|v_out| = 0;
    a score that is not a number is 0, NaN propagating through every min and clamp before that (docs/gpu.md#contracts).
    """
    norm_in, norm_out = d_in.sqrt(), d_out.sqrt()
    norms = norm_in * norm_out
    cos = torch.where(norms > 0, 0.5 * (d_pn - d_in - d_out) / norms, 0.0).clamp_(-1.0, 1.0)
    score = (1.0 - cos) * torch.minimum(norm_in, norm_out) * gap.to(d_in.dtype).log()
    return score.masked_fill_(score.isnan(), 0.0)


def stce_select_torch(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
                      capacity: int) -> torch.Tensor:
    """Kept frame indices int64 [H, B, capacity] after the F arrivals (ascending, -1 padded); inputs validated.

    features float32 [H, B, W, D], slot_frames int64 [H, B, W], arriving float32 [H, B, F, D] (see `_trajectory`).
    State [R, M + 2] per row (R = H·B, M = W + F lanes): alive, prev/next lanes, score. Two extra lanes stand for
    "no lane": NONE (= M; read-only: its prev and next are NONE, its d2 entries 0, its score +inf, never alive) and
    TRASH (= M + 1; write-only: conditional writes are routed there instead of being masked). A row that does not
    evict this round "evicts" NONE, which turns every write of the round into a write to TRASH. So each arrival is
    a fixed sequence of gathers and scatters over all rows at once: a Python loop over the F arrivals only, no host
    sync. On CPU tensors the same loop runs in C (stce_cpu.c, one call for all rows, bit-identical scores and
    decisions) when the library builds; `HERMES_KERNELS_NATIVE=0` keeps the torch ops.
    """
    H, B, W, _ = features.shape
    F = arriving.shape[2]
    times, d2 = _trajectory(features, slot_frames, arriving, first_frame)
    in_c = times.device.type == "cpu" and native.library("stce_cpu") is not None
    if in_c and W + F <= _MAX_LANES and first_frame + F <= _MAX_LOG_TABLE:
        return _select_rows_native(times, d2, W, first_frame + F, capacity).view(H, B, capacity)
    R, M = times.shape
    NONE, TRASH, lanes = M, M + 1, M + 2
    device = times.device
    d2 = torch.nn.functional.pad(d2, (0, 2, 0, 2)).view(R, lanes * lanes)
    times = torch.nn.functional.pad(times, (0, 2), value=-1)
    lane = torch.arange(lanes, device=device).expand(R, lanes)

    def curvature(j: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """I(j) for lanes j [R, k] with neighbours p, n (values at NONE lanes are never kept)."""
        return _curvature_torch(d2.gather(1, j * lanes + p), d2.gather(1, j * lanes + n), d2.gather(1, p * lanes + n),
                                times.gather(1, n) - times.gather(1, p))

    def route(at: torch.Tensor) -> torch.Tensor:
        return torch.where(at == NONE, TRASH, at)

    alive = (lane < W) & (times >= 0)
    held = alive.sum(dim=1, keepdim=True)
    prev = torch.where(alive & (lane >= 1), lane - 1, NONE)
    nxt = torch.where(alive & (lane + 1 < held), lane + 1, NONE)
    score = torch.where((prev != NONE) & (nxt != NONE), curvature(lane, prev, nxt), _INF)
    count = held
    tail = torch.where(held > 0, held - 1, NONE)
    for i in range(F):
        arrival = torch.full_like(tail, W + i)
        # §3: append the arrival; the previous newest frame becomes interior when it has an older neighbour
        nxt.scatter_(1, route(tail), arrival)
        prev[:, W + i] = tail.squeeze(1)
        alive[:, W + i] = True
        before = prev.gather(1, tail)
        score.scatter_(1, torch.where(before == NONE, TRASH, tail), curvature(tail, before, arrival))
        tail = arrival
        count = count + 1
        # over capacity: evict the lowest score (argmin takes the first, i.e. the older, of equal minima)
        gone = torch.where(count > capacity, torch.where(alive, score, _INF).argmin(dim=1, keepdim=True), NONE)
        p, n = prev.gather(1, gone), nxt.gather(1, gone)
        alive.scatter_(1, route(gone), False)
        score.scatter_(1, route(gone), _INF)
        nxt.scatter_(1, route(p), n)
        prev.scatter_(1, route(n), p)
        count = count - (gone != NONE).to(count.dtype)
        # the O(1) update: only the two neighbours are rescored, both in one call (an endpoint keeps +inf)
        j = torch.cat([p, n], 1)
        before, after = torch.cat([prev.gather(1, p), p], 1), torch.cat([n, nxt.gather(1, n)], 1)
        score.scatter_(1, torch.where((before == NONE) | (after == NONE), TRASH, j), curvature(j, before, after))
    # lanes are in temporal order: the alive ones, packed left, are the kept frames ascending
    alive, times = alive[:, :M], times[:, :M]
    slot = torch.where(alive, alive.cumsum(dim=1) - 1, capacity).clamp_(max=capacity)
    kept = torch.full((R, capacity + 1), -1, dtype=torch.int64, device=device)
    kept.scatter_(1, slot, torch.where(alive, times, -1))
    return kept[:, :capacity].reshape(H, B, capacity)


def _select_rows_native(times: torch.Tensor, d2: torch.Tensor, W: int, gaps: int, capacity: int) -> torch.Tensor:
    """The arrival loop of every row in one call of stce_cpu.c (CPU tensors): kept int64 [R, capacity].

    times int64 [R, M] and d2 [R, M, M] from `_trajectory`; `gaps` bounds every t_n - t_p a row can meet (the
    newest arrival's frame + 1: held frames are older and >= 0). log(gap) comes from a torch-computed table, so
    the C scores are the torch twin's bit for bit.
    """
    times, d2 = times.contiguous(), d2.contiguous()
    log_gap = torch.arange(gaps, dtype=torch.int64).to(d2.dtype).log()
    kept = _output((times.shape[0], capacity), torch.int64, times.device)
    bindings.stce_rows(times, d2, log_gap, W, capacity, kept)
    return kept


# ----------------------------------------------------------------------------------------------------------------
# Triton: one launch, one program per row
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _pick(vector, lanes, lane):
    """vector[lane] for a scalar lane, -1 when lane is -1 (vectors of lanes or frame indices, all >= -1)."""
    return tl.max(tl.where(lanes == lane, vector, -1), axis=0)


@triton.jit
def _score(d_in, d_out, d_pn, gap):
    """I(j) from d2(j, p), d2(j, n), d2(p, n) and t_n - t_p, as `_curvature_torch` (IEEE sqrt and division: the
    fast approximate ones of fp32 would move scores by more than torch's rounding). min, max and the clamp
    propagate NaN as torch's do (a GPU's default min/max return the other operand); a NaN score is 0."""
    if d_in.dtype == tl.float64:
        norm_in = tl.sqrt(d_in)
        norm_out = tl.sqrt(d_out)
    else:
        norm_in = tl.sqrt_rn(d_in)
        norm_out = tl.sqrt_rn(d_out)
    norms = norm_in * norm_out
    dot = 0.5 * (d_pn - d_in - d_out)
    safe = tl.where(norms > 0, norms, 1.0)
    if d_in.dtype == tl.float64:
        ratio = dot / safe
    else:
        ratio = tl.div_rn(dot, safe)
    cos = tl.clamp(tl.where(norms > 0, ratio, 0.0), -1.0, 1.0, propagate_nan=tl.PropagateNan.ALL)
    score = (1.0 - cos) * tl.minimum(norm_in, norm_out, propagate_nan=tl.PropagateNan.ALL) * tl.log(gap.to(d_in.dtype))
    return tl.where(score != score, 0.0, score)


@triton.jit
def _curvature(d2_row, times, lanes, j, p, n, M, ok):
    """I(j) with neighbours p, n (scalar lanes), reading d2(j, p), d2(j, n), d2(p, n); any value where not `ok`."""
    d_in = tl.load(d2_row + j * M + p, mask=ok, other=0.0)
    d_out = tl.load(d2_row + j * M + n, mask=ok, other=0.0)
    d_pn = tl.load(d2_row + p * M + n, mask=ok, other=0.0)
    gap = tl.where(ok, _pick(times, lanes, n) - _pick(times, lanes, p), 1)
    return _score(d_in, d_out, d_pn, gap)


def _output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A kernel's output (Triton or stce_cpu.c), uninitialised: the kernel writes every element (tests poison it
    here)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Grid (H·B,): one program per row. It reads the row's W + F frame indices once and, per rescored frame, three
# entries of the row's d2 matrix (L2-resident after the Gram matmul); it writes the `capacity` kept indices. The
# row's state (scores, liveness, the doubly linked neighbour list) lives in registers as vectors of BLOCK =
# next_pow2(W + F) lanes, held frames in temporal order then the arrivals; scalars are read out of them by masked
# reductions (`_pick`), and the F arrivals are a loop inside the program. F (the chunk's frames) is a runtime value,
# not specialised: a ragged last chunk needs no new compile.
# Compile spec (GPU guard): the H2SVC step's, `gpu_specs.step`, which launches it as a step does.
@triton.jit(do_not_specialize=["F"])
def _stce_kernel(d2_ptr, times_ptr, out_ptr, W, F, capacity,
                 BLOCK: tl.constexpr, BLOCK_CAP: tl.constexpr):
    row = tl.program_id(0)
    M = W + F
    lanes = tl.arange(0, BLOCK)
    d2_row = d2_ptr + row.to(tl.int64) * M * M
    times = tl.load(times_ptr + row.to(tl.int64) * M + lanes, mask=lanes < M, other=-1)
    alive = (lanes < W) & (times >= 0)
    count = tl.sum(alive.to(tl.int32), axis=0)
    prev = tl.where(alive & (lanes >= 1), lanes - 1, -1)
    nxt = tl.where(alive & (lanes + 1 < count), lanes + 1, -1)
    # held interior frames, all at once: neighbours are the adjacent lanes
    inner = (prev >= 0) & (nxt >= 0)
    d_in = tl.load(d2_row + lanes * M + lanes - 1, mask=inner, other=0.0)
    d_out = tl.load(d2_row + lanes * M + lanes + 1, mask=inner, other=0.0)
    d_pn = tl.load(d2_row + (lanes - 1) * M + lanes + 1, mask=inner, other=0.0)
    t_prev = tl.load(times_ptr + row.to(tl.int64) * M + lanes - 1, mask=inner, other=0)
    t_next = tl.load(times_ptr + row.to(tl.int64) * M + lanes + 1, mask=inner, other=1)
    score = tl.where(inner, _score(d_in, d_out, d_pn, t_next - t_prev), float("inf"))
    tail = count - 1
    for i in range(0, F):
        arrival = W + i
        # §3: append; the previous newest frame becomes interior when it has an older neighbour
        nxt = tl.where(lanes == tail, arrival, nxt)
        prev = tl.where(lanes == arrival, tail, prev)
        alive = alive | (lanes == arrival)
        before = _pick(prev, lanes, tail)
        rescored = _curvature(d2_row, times, lanes, tail, before, arrival, M, before >= 0)
        score = tl.where(lanes == tl.where(before >= 0, tail, -1), rescored, score)
        tail = arrival
        count += 1
        # over capacity: evict the lowest score; of equal minima the lowest lane, i.e. the older frame (picked
        # explicitly: argmin's tie rule is not one the interpreter can check). Conditions are applied as lane
        # selections (lane -1 matches nothing), so no vector is combined with a scalar mask.
        evict = count > capacity
        live_score = tl.where(alive, score, float("inf"))
        lowest = tl.min(live_score, axis=0)
        gone = tl.where(evict, tl.min(tl.where(live_score == lowest, lanes, BLOCK), axis=0), -1)
        p = _pick(prev, lanes, gone)
        n = _pick(nxt, lanes, gone)
        alive = alive & (lanes != gone)
        score = tl.where(lanes == gone, float("inf"), score)
        nxt = tl.where(lanes == p, n, nxt)
        prev = tl.where(lanes == n, p, prev)
        # the O(1) update: only the two neighbours are rescored (an endpoint keeps +inf)
        pp = _pick(prev, lanes, p)
        nn = _pick(nxt, lanes, n)
        score_p = _curvature(d2_row, times, lanes, p, pp, n, M, pp >= 0)
        score_n = _curvature(d2_row, times, lanes, n, p, nn, M, nn >= 0)
        score = tl.where(lanes == tl.where(pp >= 0, p, -1), score_p, score)
        score = tl.where(lanes == tl.where(nn >= 0, n, -1), score_n, score)
        count -= evict.to(tl.int32)
    # lanes are in temporal order: the alive ones, packed left, are the kept frames ascending
    slot = tl.cumsum(alive.to(tl.int32), axis=0) - 1
    out = out_ptr + row.to(tl.int64) * capacity
    tl.store(out + slot, times, mask=alive & (slot < capacity))
    pad = tl.arange(0, BLOCK_CAP)
    tl.store(out + pad, tl.full([BLOCK_CAP], -1, tl.int64), mask=(pad >= count) & (pad < capacity))


def stce_select_triton(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
                       capacity: int) -> torch.Tensor:
    """`stce_select_torch` with the sequential part in ONE Triton launch; inputs validated, no host sync.

    The shared set-up (sort, Gram matmul, d2) is torch ops; the kernel runs one program of one warp per row, so
    every reduction over the row's lanes stays inside the warp.
    """
    H, B, W, _ = features.shape
    F = arriving.shape[2]
    times, d2 = _trajectory(features, slot_frames, arriving, first_frame)
    out = _output((H, B, capacity), torch.int64, features.device)
    launch(_stce_kernel, (H * B,), d2, times, out, W, F, capacity,
           BLOCK=triton.next_power_of_2(W + F), BLOCK_CAP=triton.next_power_of_2(capacity), num_warps=1)
    return out
