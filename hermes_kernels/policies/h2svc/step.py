"""H2SVC stage (c): the in-place, frame-granular update of one class block after a chunk (docs/h2svc.md §3-§5).
The state, the four steps (keep set, slot plan, bookkeeping, right-aligned re-index), the bytes moved and why in
place is safe are in docs/h2svc.md#s7-2; the backends and the host-sync promise in docs/h2svc.md#s7-3.

`plan_step` plans a step in torch ops shared by both backends, reading no device tensor on the host (`RowWork`);
the row work is what the backends differ in: `h2svc_step_triton` (one move launch after an episodic block's
feature and STCE launches) and `h2svc_step_torch` (the C row walk of `rows_native`, else `rows_torch`'s torch ops).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import triton
import triton.language as tl

from ...engine import bindings, native, ranks, rows_native, rows_torch
from ...engine.dtypes import TRITON_WORK, work_dtype
from ...engine.launch import launch
from ...rope import RotaryLayout
from . import features as _features
from . import stce as _stce
from .checks import check_arriving_features
from .clock import StreamClock
from .config import EPISODIC, H2SVCConfig

__all__ = ["h2svc_step_torch", "h2svc_step_triton", "plan_step", "RowWork", "fifo_keep_mask", "slot_plan"]

# Triton move kernel (4 warps): bytes of one [token, pair] K or V half tile in the widest dtype a thread holds it in,
# 32 per thread. A copy holds the cache dtype: two 16-byte vectors per half and thread (fp16 at D = 128: 32 tokens x
# 64 pairs); a rotation holds float32 (16 tokens x 64 pairs; an fp16 row part is then one 16-byte vector)
_TILE_BYTES = 4096


def _frame_of_slot(slot_frames: torch.Tensor, held: int, num_frames: int, first_frame: int) -> torch.Tensor:
    """int64 [H_c, B, held + F]: the stream frame index in every frame slot (held frames, then the arrivals)."""
    H, B, _ = slot_frames.shape
    arrivals = first_frame + torch.arange(num_frames, device=slot_frames.device)
    return torch.cat([slot_frames[..., :held], arrivals.expand(H, B, num_frames)], dim=-1)


def fifo_keep_mask(frame_of_slot: torch.Tensor, held: int, window: int) -> torch.Tensor:
    """bool [H_c, B, held + F]: which frame slots a FIFO head keeps, the newest min(W, held + F) frames (§1).

    Arrivals are newer than every held frame, so the newest min(F, K) arrivals are kept and, of the held frames,
    the K - min(F, K) newest (ranked by frame index, whatever their slot order).
    """
    H, B, S = frame_of_slot.shape
    F = S - held
    kept = min(window, S)
    from_arrivals = min(F, kept)
    held_frames = frame_of_slot[..., :held]
    newer = (held_frames.unsqueeze(-1) < held_frames.unsqueeze(-2)).sum(dim=-1)
    arrivals = torch.arange(F, device=frame_of_slot.device) >= F - from_arrivals
    return torch.cat([newer < kept - from_arrivals, arrivals.expand(H, B, F)], dim=-1)


def slot_plan(kept_slot: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot plan of step 2 from the keep mask bool [H_c, B, S] over frame slots (S = held + F).

    Returns source int64 [H_c, B, held'] (the frame slot each home slot takes its frame from after the step: itself,
    or the overflow slot of the mover it receives) and destination int64 [H_c, B, S - held'] (the home slot each
    overflow slot's frame moves to, -1 if it was evicted). Assumes the keep set has held' frames (so movers and free
    slots pair up), as FIFO and STCE keep sets do.
    """
    H, B, S = kept_slot.shape
    home_count = min(window, S)
    overflow = S - home_count
    device = kept_slot.device
    home = torch.arange(home_count, device=device).expand(H, B, home_count)
    if overflow == 0:
        return home.contiguous(), torch.empty((H, B, 0), dtype=torch.int64, device=device)
    free = ~kept_slot[..., :home_count]
    mover = kept_slot[..., window:]
    # free slots by rank (ascending); slots that are not free go to the extra column `overflow`, dropped
    by_rank = torch.full((H, B, overflow + 1), -1, dtype=torch.int64, device=device)
    by_rank.scatter_(-1, torch.where(free, free.cumsum(dim=-1) - 1, overflow).clamp_(max=overflow), home)
    destination = torch.where(mover, by_rank.gather(-1, (mover.cumsum(dim=-1) - 1).clamp_(min=0)), -1)
    # every home slot keeps its own frame unless a mover lands there; non-movers scatter into an extra column
    source = torch.cat([home, home[..., :1]], dim=-1).contiguous()
    overflow_slots = (window + torch.arange(overflow, device=device)).expand(H, B, overflow)
    source.scatter_(-1, torch.where(mover, destination, home_count), overflow_slots)
    return source[..., :home_count], destination


def _tokens(frame_slots: torch.Tensor, prefix_len: int, tokens_per_frame: int) -> torch.Tensor:
    """int64 [..., n·T_f]: the cache token slots of frame slots [..., n], frame by frame."""
    token = torch.arange(tokens_per_frame, device=frame_slots.device)
    return (prefix_len + frame_slots.unsqueeze(-1) * tokens_per_frame + token).flatten(-2)


def _right_aligned(old: torch.Tensor, next_position: int) -> torch.Tensor:
    """New positions [H_c, B, A, n] of retained visual tokens with old positions `old` (step 4, §4).

    Per row and axis: dense rank among the row's values on that axis, shifted so the largest coordinate of the
    row (over all axes) is next_position - 1. Ranks: compaction's counting rank on CPU (it reads value spans on
    the host, free for CPU tensors), its sort rank elsewhere (no host sync).
    """
    dense_rank = ranks.dense_rank_counting if old.device.type == "cpu" else ranks.dense_rank
    rank = dense_rank(old, torch.ones(1, dtype=torch.bool, device=old.device))
    extent = rank.amax(dim=-1).amax(dim=-1) + 1  # E: the largest number of distinct values over the axes
    return rank + (next_position - extent).view(*extent.shape, 1, 1)


def _reindex_native(pos: torch.Tensor, source: torch.Tensor, prefix_len: int, tokens_per_frame: int,
                    next_position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(new, delta) of step 4 in one call of compact_cpu.c's `hermes_frame_reindex`: the gather of the old
    positions, the per-axis counting ranks and the right alignment, one pass per (row, stream) instead of about ten
    torch passes over int64 [H_c, B, A, held'·T_f]. None when it cannot run (not CPU, no library, a row's span too
    wide to count: the caller's torch ops decide). Reads pos [H_c, B, A, C] only."""
    if pos.device.type != "cpu" or native.library("compact_cpu") is None:
        return None
    H, B, A, _ = pos.shape
    n = source.shape[-1] * tokens_per_frame
    new = torch.empty((H, B, A, n), dtype=torch.int64)
    delta = torch.empty_like(new)
    if not bindings.frame_reindex(pos, source.contiguous(), prefix_len, tokens_per_frame, next_position,
                                  ranks.counting_span_limit(n), new, delta):
        return None
    return new, delta


@dataclasses.dataclass
class RowWork:
    """The row work of one step, planned: what the backends' movers execute (docs/h2svc.md#s7-3).

    held: held' = min(W, held + F). source int64 [H_c, B, held']: the frame slot each home slot takes its frame
    from (itself, or a mover's overflow slot). destination int64 [H_c, B, held + F - held']: the home slot each
    overflow slot's frame moves to, -1 when it was evicted. delta: None without re-indexing, else int64
    [H_c, B, A, held'·T_f], the rotation of every retained token (home slot order, token order).
    """

    held: int
    window: int
    source: torch.Tensor
    destination: torch.Tensor
    delta: torch.Tensor | None


def plan_step(keys, values, positions, slot_frames, cfg: H2SVCConfig, cls: int, layout: RotaryLayout,
              clock: StreamClock, features, feature_op, stce_op) -> RowWork:
    """Steps 1-4 except the row work, in place: keep sets, slot plan, positions, slot_frames and features.

    Arguments as `h2svc_step_torch`; feature_op / stce_op are the backend's stage (a) and (b) implementations.
    Reads old positions (of the tokens each home slot will hold) before writing the new ones; K/V are not touched.
    """
    held, num_frames, first_frame, next_position = clock.held, clock.num_frames, clock.first_frame, clock.next_position
    W, P, T = cfg.window(cls), cfg.prefix_len, cfg.tokens_per_frame
    H, B = slot_frames.shape[:2]
    S = held + num_frames
    held_after = min(W, S)
    frame_of_slot = _frame_of_slot(slot_frames, held, num_frames, first_frame)
    arriving = None
    if cls == EPISODIC:
        arriving = feature_op(values[:, :, P + held * T:P + S * T], T)
        check_arriving_features(arriving)  # nothing is written yet
        # only the first `held` home slots hold frames (validated on CPU; enforced here on every device)
        frames = slot_frames.masked_fill(torch.arange(W, device=slot_frames.device) >= held, -1)
        keep = stce_op(features, frames, arriving, first_frame, W)
        kept_slot = (frame_of_slot.unsqueeze(-1) == keep.unsqueeze(-2)).any(dim=-1)
    else:
        kept_slot = fifo_keep_mask(frame_of_slot, held, W)
    source, destination = slot_plan(kept_slot, W)

    pos = positions if layout.num_axes == 3 else positions.unsqueeze(2)  # [H_c, B, A, C] view
    A = pos.shape[2]
    delta = None
    if bool(clock.reindexed):
        planned = _reindex_native(pos, source, P, T, next_position)
        if planned is None:
            old = pos.gather(-1, _tokens(source, P, T).unsqueeze(2).expand(H, B, A, held_after * T))
            new = _right_aligned(old, next_position)
            planned = new, new - old
        new, delta = planned
        pos[..., P:P + held_after * T] = new
    elif destination.shape[-1]:
        overflow = W + torch.arange(destination.shape[-1], device=keys.device)
        # evicted overflow frames write their positions onto themselves: a no-op that keeps the op one scatter
        src_tokens = _tokens(overflow.expand_as(destination), P, T)
        dst_tokens = _tokens(torch.where(destination >= 0, destination, overflow), P, T)
        pos.scatter_(-1, dst_tokens.unsqueeze(2).expand(H, B, A, -1),
                     pos.gather(-1, src_tokens.unsqueeze(2).expand(H, B, A, -1)))

    slot_frames[..., :held_after] = frame_of_slot.gather(-1, source)
    slot_frames[..., held_after:] = -1
    if arriving is not None:
        arrived = (source >= held).unsqueeze(-1)  # a frame of this chunk now sits in that home slot
        incoming = arriving.gather(-2, (source - held).clamp_(min=0).unsqueeze(-1).expand_as(
            features[..., :held_after, :]))
        features[..., :held_after, :] = torch.where(arrived, incoming, features[..., :held_after, :])
    return RowWork(held_after, W, source, destination, delta)


# ----------------------------------------------------------------------------------------------------------------
# torch twin
# ----------------------------------------------------------------------------------------------------------------

def _move_rows_torch(keys, values, work: RowWork, cfg: H2SVCConfig, inv_freq, layout: RotaryLayout) -> None:
    """Row work on torch tensors: compaction's C walk on CPU fp32/bf16 caches, else torch ops over all rows."""
    P, T = cfg.prefix_len, cfg.tokens_per_frame
    H, B = keys.shape[:2]
    moves = work.destination.shape[-1]
    if work.delta is None and moves == 0:
        return
    k5, v5 = keys.unsqueeze(2), values.unsqueeze(2)  # compaction's movers take [L, B, Hkv, N, D]
    home_tokens = _tokens(work.source, P, T)  # the C walk and the tiled rotation write list entry i to slot P + i
    if rows_native.use_native(None, k5, v5):
        # without re-indexing (delta None) the walk skips every token that stays and copies the movers exactly
        rows_native.move_rows_native(k5, v5, P, home_tokens, work.delta, H, None, None, inv_freq, layout,
                                     stream=True)
    elif work.delta is not None:
        rows_torch.move_rows_torch(k5, v5, P, home_tokens, work.delta, H, None, None, inv_freq, layout)
    else:
        # whole frames move: index the [H_c, B, frame slot] dims of a [H_c, B, S, T_f, D] view, so each mover is
        # one block copy; evicted overflow frames are copied onto themselves (a no-op that keeps it one index op)
        overflow = work.window + torch.arange(moves, device=keys.device)
        row_ids = torch.arange(H, device=keys.device).view(H, 1, 1)
        streams = torch.arange(B, device=keys.device).view(1, B, 1)
        target = torch.where(work.destination >= 0, work.destination, overflow)
        for x in (keys, values):
            frames = x[:, :, P:P + (work.window + moves) * T].unflatten(2, (work.window + moves, T))
            frames[row_ids, streams, target] = frames[:, :, work.window:].clone()  # the movers, read before any write


def h2svc_step_torch(keys, values, positions, slot_frames, cfg: H2SVCConfig, cls: int, inv_freq,
                     rotary: Sequence[int] | RotaryLayout | None, clock: StreamClock,
                     features: torch.Tensor | None) -> int:
    """One H2SVC step on a class block, in place, vectorised over rows and streams; inputs validated (the state
    and the steps: docs/h2svc.md#s7-2). Returns held' = min(W, held + F). inv_freq [R/2]: re-indexed
    keys turn in channels [0, R) and keep [R, D) bit for bit (partial rotary)."""
    layout = RotaryLayout.of(rotary, inv_freq.numel())
    work = plan_step(keys, values, positions, slot_frames, cfg, cls, layout, clock, features,
                     _features.frame_features_torch, _stce.stce_select_torch)
    _move_rows_torch(keys, values, work, cfg, inv_freq, layout)
    return work.held


# ----------------------------------------------------------------------------------------------------------------
# Triton: one move launch
# ----------------------------------------------------------------------------------------------------------------

# Grid (H_c·B·J, cdiv(T_f, BLOCK_T)): a program takes one tile of one work item's tokens: it reads each token's key
# row (and value row, when the item changes slot) once from the source frame slot and writes it to the destination.
# Sources are the item's own slot or an overflow slot, which no program writes, so programs need no ordering.
# Values are moved before keys are read, so a thread never holds both tiles. B and J (streams, work items) are
# runtime values, not specialised, and each pair's M-RoPE axis is read from the layout's axis map (int32 [HALF_R]):
# one compile serves every stream count, every held count of a filling memory and every rotary layout. When keys
# rotate, lane q < HALF_R turns the pair (q, q + HALF_R) (rotate-half over the first R channels) and a partial-rotary
# head's tail [R, D) is copied as the cache's own bytes (never rotated by angle 0: that turns -0.0 into +0.0), lane q
# holding (R + q, R + q + HALF - HALF_R); HALF_R is a runtime value, so full and partial rotary share a compile.
# Every access is a contiguous run of lanes at a scalar offset: 16-byte vectors.
@triton.jit(do_not_specialize=["B", "J"])
def _frame_move_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, delta_ptr, inv_freq_ptr, axis_ptr,
                       sk_h, sk_b, sk_n, sk_d, sv_h, sv_b, sv_n, sv_d,
                       B, J, T, P, HALF, HALF_R,
                       A: tl.constexpr, ROTATE: tl.constexpr, WORK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_PAIRS: tl.constexpr):
    pid = tl.program_id(0)  # (row, stream, item), item fastest
    item = pid % J
    row_stream = pid // J
    row = row_stream // B
    stream = row_stream % B
    src = tl.load(src_ptr + pid)
    dst = tl.load(dst_ptr + pid)
    token = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    pair = tl.arange(0, BLOCK_PAIRS)
    in_dim = pair < HALF
    live = (token < T) & (tl.zeros_like(token) + dst >= 0)
    moved = tl.zeros_like(token) + src != dst
    src_row = (P + src * T + token).to(tl.int64)[:, None]
    dst_row = (P + dst * T + token).to(tl.int64)[:, None]

    # values: a plain copy when the item changes slot
    v_base = v_ptr + row.to(tl.int64) * sv_h + stream.to(tl.int64) * sv_b
    mask_v = (live & moved)[:, None] & in_dim[None, :]
    v1 = tl.load(v_base + src_row * sv_n + pair[None, :] * sv_d, mask=mask_v, other=0)
    v2 = tl.load(v_base + src_row * sv_n + (pair + HALF)[None, :] * sv_d, mask=mask_v, other=0)
    tl.store(v_base + dst_row * sv_n + pair[None, :] * sv_d, v1, mask=mask_v)
    tl.store(v_base + dst_row * sv_n + (pair + HALF)[None, :] * sv_d, v2, mask=mask_v)

    # keys: the channels that do not turn move as bytes when the item changes slot, lane q holding (first + q,
    # first + width + q): the whole row without re-indexing, the tail [R, D) of a partial-rotary head with it (none
    # at full rotary); then, when re-indexing, the rotary pairs turn (copying the tail first keeps the registers of
    # the rotation free: after it, the step spilled at D = 256 on sm_90, bench/kernels.py)
    k_base = k_ptr + row.to(tl.int64) * sk_h + stream.to(tl.int64) * sk_b
    if ROTATE:
        first, width = 2 * HALF_R, HALF - HALF_R
    else:
        first, width = 0, HALF
    if width > 0:
        mask_c = (live & moved)[:, None] & (pair < width)[None, :]
        c1 = tl.load(k_base + src_row * sk_n + (first + pair)[None, :] * sk_d, mask=mask_c, other=0)
        c2 = tl.load(k_base + src_row * sk_n + (first + width + pair)[None, :] * sk_d, mask=mask_c, other=0)
        tl.store(k_base + dst_row * sk_n + (first + pair)[None, :] * sk_d, c1, mask=mask_c)
        tl.store(k_base + dst_row * sk_n + (first + width + pair)[None, :] * sk_d, c2, mask=mask_c)
    if ROTATE:
        # §4: angle = delta·inv_freq from the integer delta of each pair's axis; each axis's delta is converted to
        # the work dtype before the per-pair pick (the same values), so the [token, pair] tile is not int64. The
        # axis map is loaded straight into the tile's layout (a few L1 hits): loaded as a vector and broadcast, it
        # went through shared memory and spilled at D = 256 on sm_90 (bench/kernels.py)
        turns = pair < HALF_R
        inv_freq = tl.load(inv_freq_ptr + pair, mask=turns, other=0)
        delta_row = delta_ptr + row_stream.to(tl.int64) * A * J * T + item * T + token
        d0 = tl.load(delta_row, mask=live, other=0).to(WORK)
        if A == 3:
            d1 = tl.load(delta_row + J * T, mask=live, other=0).to(WORK)
            d2 = tl.load(delta_row + 2 * J * T, mask=live, other=0).to(WORK)
            axis = tl.load(axis_ptr + pair[None, :] + 0 * token[:, None], mask=turns[None, :], other=0)
            turned = (d0 != 0) | (d1 != 0) | (d2 != 0)
            delta = tl.where(axis == 0, d0[:, None], tl.where(axis == 1, d1[:, None], d2[:, None]))
        else:
            turned = d0 != 0
            delta = d0[:, None]
        mask_k = (live & (moved | turned))[:, None] & turns[None, :]
        k1 = tl.load(k_base + src_row * sk_n + pair[None, :] * sk_d, mask=mask_k, other=0)
        k2 = tl.load(k_base + src_row * sk_n + (pair + HALF_R)[None, :] * sk_d, mask=mask_k, other=0)
        angle = delta * inv_freq[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        w1 = k1.to(WORK)
        w2 = k2.to(WORK)
        tl.store(k_base + dst_row * sk_n + pair[None, :] * sk_d, (w1 * cos - w2 * sin).to(k_ptr.dtype.element_ty),
                 mask=mask_k)
        tl.store(k_base + dst_row * sk_n + (pair + HALF_R)[None, :] * sk_d,
                 (w2 * cos + w1 * sin).to(k_ptr.dtype.element_ty), mask=mask_k)


def _move_rows_triton(keys, values, work: RowWork, cfg: H2SVCConfig, inv_freq, layout: RotaryLayout) -> None:
    """Row work in one launch of `_frame_move_kernel`: re-indexing, one item per home slot (every retained key
    rotates); otherwise one per overflow slot (only movers change slot). Nothing launches when there is no work."""
    P, T = cfg.prefix_len, cfg.tokens_per_frame
    H, B, _, D = keys.shape
    rotate = work.delta is not None
    if rotate:
        home = torch.arange(work.held, device=keys.device).expand_as(work.source)
        source, destination = work.source.contiguous(), home.contiguous()
        delta = work.delta.contiguous()
    else:
        overflow = work.window + torch.arange(work.destination.shape[-1], device=keys.device)
        source, destination = overflow.expand_as(work.destination).contiguous(), work.destination.contiguous()
        delta = destination  # not read (ROTATE off)
    J = source.shape[-1]
    if J == 0:
        return
    half = D // 2
    arith = work_dtype(keys)
    block_pairs = triton.next_power_of_2(half)
    # a half tile of _TILE_BYTES in the widest dtype a thread holds it in (the cache's, or the rotation's work
    # dtype): every dtype gets the same registers per thread, each thread's share still whole 16-byte vectors
    element = max(keys.element_size(), arith.itemsize if rotate else 0)
    block_t = min(triton.next_power_of_2(T), max(1, _TILE_BYTES // (block_pairs * element)))
    launch(_frame_move_kernel, (H * B * J, triton.cdiv(T, block_t)), keys, values, source, destination, delta,
           inv_freq.to(device=keys.device, dtype=arith), layout.axis_tensor(keys.device), *keys.stride(),
           *values.stride(), B, J, T, P, half, layout.pairs, A=layout.num_axes, ROTATE=rotate, WORK=TRITON_WORK[arith],
           BLOCK_T=block_t, BLOCK_PAIRS=block_pairs)


def h2svc_step_triton(keys, values, positions, slot_frames, cfg: H2SVCConfig, cls: int, inv_freq,
                      rotary: Sequence[int] | RotaryLayout | None, clock: StreamClock,
                      features: torch.Tensor | None) -> int:
    """`h2svc_step_torch` with the features, the STCE walk and the row work as Triton launches (3 for an
    EPISODIC block, 1 for a FIFO block, none when nothing moves); the plan is torch ops, no host sync."""
    layout = RotaryLayout.of(rotary, inv_freq.numel())
    work = plan_step(keys, values, positions, slot_frames, cfg, cls, layout, clock, features,
                     _features.frame_features_triton, _stce.stce_select_triton)
    _move_rows_triton(keys, values, work, cfg, inv_freq, layout)
    return work.held
