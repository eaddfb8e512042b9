"""Stage 4 on the GPU: the in-place compaction in three Triton launches (the contract and the torch twin are in
`compaction.py`; docs/hermes.md §2.6–2.8).

A rank kernel (one program per layer, stream and axis: dense ranks of the kept tokens' positions, by a radix
sort unless the row is already non-decreasing), a plan kernel (one program per layer and stream: re-index flag,
destination map, rotation deltas, positions updated in place) and a move kernel (one program per layer, stream,
KV head and channel group) that walks the tokens left to right, moves and rotates K/V rows and accumulates the
summary in registers. No host synchronisation.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ...engine import ranks, workspace
from ...engine.dtypes import TRITON_WORK, work_dtype
from ...engine.launch import launch
from ...engine.rounding import div_rn
from ...rope import RotaryLayout
from .config import DEEP, HermesConfig

__all__ = ["compact_triton"]

# Triton: source tokens per move-kernel iteration (no register spills at [32, 32] fp32 tiles on sm_90), and the
# largest vector the rank/plan kernels loop over positions with.
_MOVE_TOKENS = 32
_CHUNK = 1024
# The rank kernel's positions per sweep, radix digit width and warps: one [512, 16] one-hot tile per sweep of the
# sort, at most 16 passes for any int64 span; about 100 registers per thread on sm_80/sm_90, no spills (8 warps
# reached 128 and spilled at B > 1; bench/kernels.py). Its grid (L·B·A programs) leaves every program an SM.
_RANK_CHUNK = 512
_RADIX_BITS = 4
_RANK_WARPS = 16
_BIG_C = tl.constexpr(ranks.BIG)


@triton.jit
def _kept_values(row, keep_row, i, valid, P, sp_n, sk_n):
    """Positions (one axis row) of the kept tokens at keep indices i, 0 on masked lanes."""
    src = tl.load(keep_row + i * sk_n, mask=valid, other=0)
    return tl.load(row + (P + src) * sp_n, mask=valid, other=0)


@triton.jit
def _one_hot(x, valid, digits, RADIX_BITS: tl.constexpr):
    """int32 [CHUNK, 2**RADIX_BITS]: 1 where the low RADIX_BITS of x equal the column's digit (valid lanes)."""
    return (((x & ((1 << RADIX_BITS) - 1))[:, None] == digits[None, :]) & valid[:, None]).to(tl.int32)


# One program per (layer, stream, axis). Reads the axis row of positions (all N, when the kernels decide the lazy
# trigger) and the kept tokens' values (gathered through keep); writes the re-indexed candidate P + dense rank of
# every kept token, in keep order. Everything goes in CHUNK-sized pieces, so registers do not grow with the budget.
# Rows already non-decreasing in cache order take the prefix-sum path; others are sorted in scratch (`sort_ptr`,
# two int64 buffers of n_out per program) by an LSD radix sort of RADIX_BITS-bit digits of (value - row minimum):
# one stable scatter sweep per digit, only as many digits as the row's span has (an in-register sort of the whole
# row spilled registers at the 7B budgets). A key packs (value - minimum, lane) into one int64,
# so a row's retained values must span less than 2**(63 - idx_bits).
@triton.jit
def _rank_kernel(pos_ptr, keep_ptr, cand_ptr, rowmax_ptr, budget_ptr, sort_ptr,
                 sp_l, sp_b, sp_a, sp_n, sk_l, sk_b, sk_n,
                 B, N, P, V, n_out, idx_bits,
                 A: tl.constexpr, LAZY: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr):
    pid = tl.program_id(0)  # (layer, stream, axis), axis fastest
    axis = pid % A
    layer = pid // A // B
    stream = pid // A % B
    row = pos_ptr + layer.to(tl.int64) * sp_l + stream.to(tl.int64) * sp_b + axis.to(tl.int64) * sp_a
    lanes = tl.arange(0, CHUNK)
    if LAZY:
        # §2.7 lazy trigger, part 1: the largest position of this row
        top = tl.full([CHUNK], -_BIG_C, tl.int64)
        for start in range(0, N, CHUNK):
            j = start + lanes
            top = tl.maximum(top, tl.load(row + j.to(tl.int64) * sp_n, mask=j < N, other=-_BIG_C))
        tl.store(rowmax_ptr + pid, tl.max(top, axis=0))

    n_keep = tl.minimum(tl.load(budget_ptr + layer), V).to(tl.int32)
    keep_row = keep_ptr + layer.to(tl.int64) * sk_l + stream.to(tl.int64) * sk_b
    out = cand_ptr + pid.to(tl.int64) * n_out
    descents = 0
    low = tl.full([CHUNK], _BIG_C, tl.int64)
    high = tl.full([CHUNK], -_BIG_C, tl.int64)
    for start in range(0, n_keep, CHUNK):
        i = start + lanes
        valid = i < n_keep
        later = valid & (i > 0)
        old = _kept_values(row, keep_row, i, valid, P, sp_n, sk_n)
        prev = _kept_values(row, keep_row, i - 1, later, P, sp_n, sk_n)
        descents += tl.sum((later & (old < prev)).to(tl.int32), axis=0)
        low = tl.minimum(low, tl.where(valid, old, _BIG_C))
        high = tl.maximum(high, tl.where(valid, old, -_BIG_C))

    changes = tl.zeros([], tl.int64)
    if descents == 0:
        # values already non-decreasing in cache order (1D caches, the t axis): dense rank = changes so far
        for start in range(0, n_keep, CHUNK):
            i = start + lanes
            valid = i < n_keep
            later = valid & (i > 0)
            changed = (later & (_kept_values(row, keep_row, i, valid, P, sp_n, sk_n)
                                != _kept_values(row, keep_row, i - 1, later, P, sp_n, sk_n))).to(tl.int64)
            tl.store(out + i, P + changes + tl.cumsum(changed, axis=0), mask=valid)
            changes += tl.sum(changed, axis=0)
    else:
        # general case (h/w axes cycle inside frames): radix-sort (value, lane) keys, count value changes in
        # sorted order, scatter the ranks back to the lanes
        lowest = tl.min(low, axis=0)
        span = tl.max(high, axis=0) - lowest
        src = sort_ptr + pid.to(tl.int64) * 2 * n_out
        dst = src + n_out
        digits = tl.arange(0, 1 << RADIX_BITS)
        count = tl.zeros([1 << RADIX_BITS], tl.int32)  # keys per value of the next pass's digit
        for start in range(0, n_keep, CHUNK):
            i = start + lanes
            valid = i < n_keep
            key = ((_kept_values(row, keep_row, i, valid, P, sp_n, sk_n) - lowest) << idx_bits) | i.to(tl.int64)
            tl.store(src + i, key, mask=valid)
            count += tl.sum(_one_hot(key >> idx_bits, valid, digits, RADIX_BITS), axis=0)
        passes = 0
        for bit in tl.static_range(0, 64, RADIX_BITS):
            passes += ((span >> bit) != 0).to(tl.int32)
        for step in range(0, passes):
            tl.debug_barrier()  # the previous sweep's keys are stored before any thread reads them
            shift = idx_bits + step * RADIX_BITS
            # stable scatter: a key goes after every smaller digit and after its digit's earlier keys
            slot = tl.cumsum(count, axis=0) - count
            count = tl.zeros([1 << RADIX_BITS], tl.int32)
            for start in range(0, n_keep, CHUNK):
                i = start + lanes
                valid = i < n_keep
                key = tl.load(src + i, mask=valid, other=0)
                hit = _one_hot(key >> shift, valid, digits, RADIX_BITS)
                tl.store(dst + tl.sum(hit * (slot[None, :] + tl.cumsum(hit, axis=0) - hit), axis=1), key,
                         mask=valid)
                slot += tl.sum(hit, axis=0)
                # the next digit's counts are order-free: gather them here instead of in a sweep of their own
                count += tl.sum(_one_hot(key >> tl.minimum(shift + RADIX_BITS, 63), valid, digits, RADIX_BITS),
                                axis=0)
            src, dst = dst, src
        tl.debug_barrier()
        for start in range(0, n_keep, CHUNK):
            i = start + lanes
            valid = i < n_keep
            later = valid & (i > 0)
            key = tl.load(src + i, mask=valid, other=0)
            changed = (later & ((key >> idx_bits) != (tl.load(src + i - 1, mask=later, other=0) >> idx_bits)))
            changed = changed.to(tl.int64)
            tl.store(out + (key & ((1 << idx_bits) - 1)), P + changes + tl.cumsum(changed, axis=0), mask=valid)
            changes += tl.sum(changed, axis=0)


# One program per (layer, stream); everything it touches is that row's: reads positions, keep and the candidates,
# writes the destination map, the rotation deltas (kept: new - old; pruned in summarising layers: t - old) and
# last the new positions in place, chunk by chunk left to right (slot P+i is only read as a source by chunks up
# to i's own, and a barrier separates each chunk's reads from its writes).
@triton.jit
def _plan_kernel(pos_ptr, keep_ptr, cand_ptr, rowmax_ptr, budget_ptr, role_ptr, dest_ptr, delta_ptr, flag_ptr,
                 sp_l, sp_b, sp_a, sp_n, sk_l, sk_b, sk_n,
                 B, P, V, n_out, num_rows, threshold, summary_role,
                 A: tl.constexpr, TRIGGER: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)  # (layer, stream)
    layer = pid // B
    stream = pid % B
    # §2.7: one re-index decision for the whole step: the caller's ("given", read only), or derived by every
    # program alike and written once
    if TRIGGER == "given":
        reindex_now = tl.load(flag_ptr) != 0
    elif TRIGGER == "eager":
        reindex_now = tl.full([], 1, tl.int1)
    else:
        top = tl.full([CHUNK], -_BIG_C, tl.int64)
        for start in range(0, num_rows, CHUNK):
            r = start + tl.arange(0, CHUNK)
            top = tl.maximum(top, tl.load(rowmax_ptr + r, mask=r < num_rows, other=-_BIG_C))
        reindex_now = tl.max(top, axis=0) > threshold
    if TRIGGER != "given":
        tl.store(flag_ptr, reindex_now, mask=pid == 0)

    n_keep = tl.minimum(tl.load(budget_ptr + layer), V).to(tl.int32)
    summarise = (tl.load(role_ptr + layer) == summary_role) & (V > n_keep)
    keep_row = keep_ptr + layer.to(tl.int64) * sk_l + stream.to(tl.int64) * sk_b
    row = pos_ptr + layer.to(tl.int64) * sp_l + stream.to(tl.int64) * sp_b
    cand_row = cand_ptr + pid.to(tl.int64) * A * n_out
    dest_row = dest_ptr + pid.to(tl.int64) * V
    delta_row = delta_ptr + pid.to(tl.int64) * A * V

    for start in range(0, V, CHUNK):
        j = start + tl.arange(0, CHUNK)
        tl.store(dest_row + j, tl.full([CHUNK], -1, tl.int32), mask=j < V)
    # Alg. 1 target t: largest retained position after re-indexing (prefix included, all axes) + 1
    top = tl.full([CHUNK], -_BIG_C, tl.int64)
    for a in tl.static_range(A):
        for start in range(0, P, CHUNK):
            j = start + tl.arange(0, CHUNK)
            top = tl.maximum(top, tl.load(row + a * sp_a + j.to(tl.int64) * sp_n, mask=j < P, other=-_BIG_C))
        for start in range(0, n_keep, CHUNK):
            i = start + tl.arange(0, CHUNK)
            valid = i < n_keep
            src = tl.load(keep_row + i * sk_n, mask=valid, other=0)
            old = tl.load(row + a * sp_a + (P + src) * sp_n, mask=valid, other=0)
            new = tl.where(reindex_now, tl.load(cand_row + a * n_out + i, mask=valid, other=0), old)
            top = tl.maximum(top, tl.where(valid, new, -_BIG_C))
            tl.store(delta_row + a * V + src, new - old, mask=valid)
    target = tl.max(top, axis=0) + 1
    tl.debug_barrier()  # the -1 fill lands before the slots
    for start in range(0, n_keep, CHUNK):
        i = start + tl.arange(0, CHUNK)
        src = tl.load(keep_row + i * sk_n, mask=i < n_keep, other=0)
        tl.store(dest_row + src, i.to(tl.int32), mask=i < n_keep)
    tl.debug_barrier()  # slots visible to every thread before the pruned scan reads them

    if summarise:
        for start in range(0, V, CHUNK):
            j = start + tl.arange(0, CHUNK)
            pruned = (j < V) & (tl.load(dest_row + j, mask=j < V, other=0) < 0)
            for a in tl.static_range(A):
                at = tl.load(row + a * sp_a + (P + j).to(tl.int64) * sp_n, mask=pruned, other=0)
                tl.store(delta_row + a * V + j, target - at, mask=pruned)

    for a in tl.static_range(A):
        for start in range(0, n_keep, CHUNK):
            i = start + tl.arange(0, CHUNK)
            valid = i < n_keep
            src = tl.load(keep_row + i * sk_n, mask=valid, other=0)
            old = tl.load(row + a * sp_a + (P + src) * sp_n, mask=valid, other=0)
            new = tl.where(reindex_now, tl.load(cand_row + a * n_out + i, mask=valid, other=0), old)
            tl.debug_barrier()  # this chunk's old positions are read before its slots are overwritten
            tl.store(row + a * sp_a + (P + i).to(tl.int64) * sp_n, new, mask=valid)
        tl.store(row + a * sp_a + (P + n_keep).to(tl.int64) * sp_n, target, mask=summarise)


# The token walk of one move-kernel program over its channel lanes (`_move_kernel`): tiles of BLOCK_T source tokens
# left to right; loads the K/V rows it needs (moved, rotated, or pruned in a summarising layer) once, and after a
# barrier stores the moved rows at slots <= their sources; later tiles only read slots past this one, so in-place is
# safe. TURN: the lanes are rotary pairs, whose keys turn by delta·inv_freq; otherwise they carry a partial-rotary
# head's tail, whose keys move as the cache's own bytes (never rotated by angle 0: that turns -0.0 into +0.0) and
# enter the summary unrotated. Returns the summary sums of the pruned rows' keys and values, per lane.
@triton.jit
def _walk_tokens(k_base, v_base, dest_row, delta_row, inv_freq, axis, k_col1, k_col2, v_col1, v_col2, in_dim,
                 sk_n, sv_n, P, V, summarise,
                 A: tl.constexpr, WORK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
                 TURN: tl.constexpr):
    sum_k1 = tl.zeros([BLOCK_PAIRS], WORK)
    sum_k2 = tl.zeros([BLOCK_PAIRS], WORK)
    sum_v1 = tl.zeros([BLOCK_PAIRS], WORK)
    sum_v2 = tl.zeros([BLOCK_PAIRS], WORK)
    for start in range(0, V, BLOCK_T):
        j = start + tl.arange(0, BLOCK_T)
        slot = tl.load(dest_row + j, mask=j < V, other=-1)
        kept = slot >= 0
        pruned = tl.where(summarise, (j < V) & (slot < 0), False)  # only summarising layers read them
        if TURN:
            # §2.8: angle = delta·inv_freq in the work dtype from the integer delta of each pair's axis
            needed = kept | pruned
            d0 = tl.load(delta_row + j, mask=needed, other=0)
            if A == 3:
                d1 = tl.load(delta_row + V + j, mask=needed, other=0)
                d2 = tl.load(delta_row + 2 * V + j, mask=needed, other=0)
                rotated = (d0 != 0) | (d1 != 0) | (d2 != 0)
                delta = tl.where(axis[None, :] == 0, d0[:, None],
                                 tl.where(axis[None, :] == 1, d1[:, None], d2[:, None]))
            else:
                rotated = d0 != 0
                delta = d0[:, None]
            angle = delta.to(WORK) * inv_freq[None, :]
            cos = tl.cos(angle)
            sin = tl.sin(angle)
            move_k = kept & ((slot != j) | rotated)
        else:
            move_k = kept & (slot != j)
        move_v = kept & (slot != j)
        src = (P + j).to(tl.int64)[:, None]
        mask_k = (move_k | pruned)[:, None] & in_dim[None, :]
        mask_v = (move_v | pruned)[:, None] & in_dim[None, :]
        k1 = tl.load(k_base + src * sk_n + k_col1, mask=mask_k, other=0)
        k2 = tl.load(k_base + src * sk_n + k_col2, mask=mask_k, other=0)
        v1 = tl.load(v_base + src * sv_n + v_col1, mask=mask_v, other=0)
        v2 = tl.load(v_base + src * sv_n + v_col2, mask=mask_v, other=0)
        r1 = k1.to(WORK)
        r2 = k2.to(WORK)
        if TURN:
            r1, r2 = r1 * cos - r2 * sin, r2 * cos + r1 * sin
        # Alg. 1: pruned keys rotated to the summary target (their delta is t - p_old) and pruned values, summed
        fold = pruned[:, None]
        sum_k1 += tl.sum(tl.where(fold, r1, 0), axis=0)
        sum_k2 += tl.sum(tl.where(fold, r2, 0), axis=0)
        sum_v1 += tl.sum(tl.where(fold, v1.to(WORK), 0), axis=0)
        sum_v2 += tl.sum(tl.where(fold, v2.to(WORK), 0), axis=0)
        tl.debug_barrier()  # the whole tile is read before any thread overwrites a slot inside it
        dst = (P + slot).to(tl.int64)[:, None]
        store_k = move_k[:, None] & in_dim[None, :]
        store_v = move_v[:, None] & in_dim[None, :]
        if TURN:
            tl.store(k_base + dst * sk_n + k_col1, r1.to(k1.dtype), mask=store_k)
            tl.store(k_base + dst * sk_n + k_col2, r2.to(k2.dtype), mask=store_k)
        else:  # the tail: the loaded bytes themselves
            tl.store(k_base + dst * sk_n + k_col1, k1, mask=store_k)
            tl.store(k_base + dst * sk_n + k_col2, k2, mask=store_k)
        tl.store(v_base + dst * sv_n + v_col1, v1, mask=store_v)
        tl.store(v_base + dst * sv_n + v_col2, v2, mask=store_v)
    return sum_k1, sum_k2, sum_v1, sum_v2


# One program per (layer, stream, KV head, channel group) walks its lanes' channels over the tokens (`_walk_tokens`)
# and writes the summary means. Channel groups (rotate-half, docs/hermes.md §2.8): the first cdiv(HALF_R,
# BLOCK_PAIRS) groups hold the R/2 rotary pairs, lane q the channels (q, q + HALF_R); the others (partial rotary,
# R < D) the tail, lane q the channels (R + q, R + q + HALF - HALF_R). Values move with the same lanes, all D
# channels. Each group's channels sit at a scalar offset from its lanes, so row accesses stay contiguous vectors;
# HALF_R is a runtime value, so full rotary (HALF_R = HALF: rotary groups only) and partial rotary share one compile.
# Each pair's M-RoPE axis is read from the layout's axis map (int32 [HALF_R], `RotaryLayout.axis_tensor`), so
# contiguous and interleaved sections of every head dim share one compile too.
@triton.jit
def _move_kernel(k_ptr, v_ptr, dest_ptr, delta_ptr, inv_freq_ptr, axis_ptr, budget_ptr, role_ptr,
                 sk_l, sk_b, sk_h, sk_n, sk_d, sv_l, sv_b, sv_h, sv_n, sv_d,
                 B, Hkv, P, V, HALF, HALF_R, summary_role,
                 A: tl.constexpr, WORK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    pid = tl.program_id(0)  # (layer, stream, head), head fastest
    head = pid % Hkv
    row = pid // Hkv
    layer = row // B
    stream = row % B
    n_keep = tl.minimum(tl.load(budget_ptr + layer), V).to(tl.int32)
    summarise = (tl.load(role_ptr + layer) == summary_role) & (V > n_keep)

    group = tl.program_id(1)
    rotary_groups = tl.cdiv(HALF_R, BLOCK_PAIRS)
    turning = group < rotary_groups  # this group's lanes are rotary pairs, or carry the tail
    pair = tl.where(turning, group, group - rotary_groups) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    width = tl.where(turning, HALF_R, HALF - HALF_R)  # lanes of this part; also the gap between a lane's channels
    in_dim = pair < width
    channel = tl.where(turning, 0, 2 * HALF_R) + pair  # the lane's first channel; its second is `width` further
    k_base = k_ptr + layer.to(tl.int64) * sk_l + stream.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h
    v_base = v_ptr + layer.to(tl.int64) * sv_l + stream.to(tl.int64) * sv_b + head.to(tl.int64) * sv_h
    k_col1 = channel[None, :] * sk_d
    k_col2 = (channel + width)[None, :] * sk_d
    v_col1 = channel[None, :] * sv_d
    v_col2 = (channel + width)[None, :] * sv_d
    dest_row = dest_ptr + row.to(tl.int64) * V
    delta_row = delta_ptr + row.to(tl.int64) * A * V
    if turning:
        inv_freq = tl.load(inv_freq_ptr + pair, mask=in_dim, other=0)
        axis = tl.load(axis_ptr + pair, mask=in_dim & (A == 3), other=0)  # each pair's M-RoPE axis (1D: unread)
        sum_k1, sum_k2, sum_v1, sum_v2 = _walk_tokens(
            k_base, v_base, dest_row, delta_row, inv_freq, axis, k_col1, k_col2, v_col1, v_col2, in_dim, sk_n,
            sv_n, P, V, summarise, A, WORK, BLOCK_T, BLOCK_PAIRS, True)
    else:
        sum_k1, sum_k2, sum_v1, sum_v2 = _walk_tokens(
            k_base, v_base, dest_row, delta_row, None, None, k_col1, k_col2, v_col1, v_col2, in_dim, sk_n,
            sv_n, P, V, summarise, A, WORK, BLOCK_T, BLOCK_PAIRS, False)

    if summarise:
        # Alg. 1: the means go to slot P + n_l, right after the kept tokens
        count = (V - n_keep).to(WORK)  # the means divide correctly rounded, as the torch twin's
        k_at = k_base + (P + n_keep).to(tl.int64) * sk_n
        v_at = v_base + (P + n_keep).to(tl.int64) * sv_n
        tl.store(k_at + k_col1, div_rn(sum_k1, count).to(k_ptr.dtype.element_ty)[None, :], mask=in_dim[None, :])
        tl.store(k_at + k_col2, div_rn(sum_k2, count).to(k_ptr.dtype.element_ty)[None, :], mask=in_dim[None, :])
        tl.store(v_at + v_col1, div_rn(sum_v1, count).to(v_ptr.dtype.element_ty)[None, :], mask=in_dim[None, :])
        tl.store(v_at + v_col2, div_rn(sum_v2, count).to(v_ptr.dtype.element_ty)[None, :], mask=in_dim[None, :])


def compact_triton(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                   cfg: HermesConfig, inv_freq: torch.Tensor,
                   rotary: Sequence[int] | RotaryLayout | None = None, layers: range | None = None,
                   reindexed: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """Fused in-place compaction (Alg. 1, appendix E) in three launches; same result as `reference.compact`.

    keys/values: [L, B, Hkv, N, D] fp16/bf16/fp32/fp64, any strides (e.g. `buffer[..., :N, :]` views);
    positions: int64 [L, B, N] or [L, B, 3, N] (M-RoPE, each pair's axis from `RotaryLayout.of(rotary)`);
    inv_freq [R/2], R <= D: channels [0, R) of a key turn, [R, D) move bit for bit (partial rotary);
    keep: int64 [L, B, n] from `select_keep`.
    layers: the config's layers the tensors hold (L = len(layers); default all): the kernels read those layers'
    budgets and roles. reindexed: 0-dim bool on the cache's device, read by the plan kernel instead of the
    config's decision (default: decided on the device from these positions).
    Launches: rank (grid L·B·A), plan (grid L·B), move (grid L·B·Hkv × channel groups: the rotary pairs', then the
    tail's); O(L·B·A·V) int scratch.
    Returns (P + min(budget, V), the flag used: 0-dim bool on the cache's device); no host synchronisation.
    """
    L, B, Hkv, N, D = keys.shape
    P, V, n = cfg.prefix_len, N - cfg.prefix_len, keep.shape[-1]
    layers = range(L) if layers is None else layers
    device = keys.device
    work = work_dtype(keys)
    half = D // 2
    layout = RotaryLayout.of(rotary, inv_freq.numel())
    pos = positions if layout.num_axes == 3 else positions.unsqueeze(2)  # [L, B, A, N] view
    A = pos.shape[2]
    per_layer = cfg.on(device)
    budget = per_layer.layer_budget[layers.start:layers.stop]  # views: the kernels index them by local layer
    role = per_layer.role[layers.start:layers.stop]
    inv = inv_freq.to(device=device, dtype=work)

    cand = workspace.scratch((L, B, A, n), torch.int64, device)  # P + dense rank of every kept token, keep order
    rowmax = workspace.scratch((L * B * A,), torch.int64, device)  # largest position of every axis row (lazy trigger)
    dest = workspace.scratch((L, B, V), torch.int32, device)  # slot of every visual token among the kept, or -1
    delta = workspace.scratch((L, B, A, V), torch.int64, device)  # rotation delta of every token that is read
    flag = workspace.scratch((), torch.bool, device) if reindexed is None else reindexed
    trigger = cfg.reindex if reindexed is None else "given"
    summary_role = DEEP if cfg.summary else -1  # layers of this role fold their pruned tokens (Alg. 1)
    chunk = min(_CHUNK, triton.next_power_of_2(max(N, L * B * A)))
    rank_chunk = min(_RANK_CHUNK, chunk)
    sort = workspace.scratch((L * B * A, 2, n), torch.int64, device)  # the rank kernel's radix-sort buffers

    launch(_rank_kernel, (L * B * A,), pos, keep, cand, rowmax, budget, sort,
           *pos.stride(), *keep.stride(), B, N, P, V, n, max(1, (n - 1).bit_length()),
           A=A, LAZY=trigger == "lazy", CHUNK=rank_chunk, RADIX_BITS=_RADIX_BITS, num_warps=_RANK_WARPS)
    launch(_plan_kernel, (L * B,), pos, keep, cand, rowmax, budget, role, dest, delta,
           flag, *pos.stride(), *keep.stride(), B, P, V, n, L * B * A, cfg.max_positions - cfg.margin,
           summary_role, A=A, TRIGGER=trigger, CHUNK=chunk)
    block_pairs = min(32, triton.next_power_of_2(half))
    groups = triton.cdiv(layout.pairs, block_pairs) + triton.cdiv(half - layout.pairs, block_pairs)
    launch(_move_kernel, (L * B * Hkv, groups), keys, values, dest, delta, inv,
           layout.axis_tensor(device), budget, role, *keys.stride(), *values.stride(), B, Hkv, P, V, half,
           layout.pairs, summary_role, A=A, WORK=TRITON_WORK[work], BLOCK_T=_MOVE_TOKENS, BLOCK_PAIRS=block_pairs)
    return P + min(cfg.budget, V), flag
