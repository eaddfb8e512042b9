"""Stage 4: in-place compaction of the KV cache (docs/hermes.md §2.6–2.8; paper Alg. 1 and appendix E).

For every (layer, stream): the kept visual tokens (`keep`, ascending) move to slots P..P+n_l-1 (the prefix stays),
their positions become P + dense rank among the retained values of each axis when re-indexing, their keys are
rotated by (p_new - p_old)·inv_freq (the first R channels, inv_freq [R/2]; a partial-rotary head's channels [R, D)
move bit for bit), and deep layers that pruned something get a summary token at slot P+n_l
(mean of the pruned values; mean of the pruned keys each rotated to the target t = max retained position + 1).

The re-indexing decision (`reindexed`) stays a 0-dim bool tensor on the cache's device and is applied
branch-free: positions become where(flag, compacted, old), so an uncompacted step rotates by a zero delta, which is
an exact identity (cos 0 = 1, sin 0 = 0). By default it is decided from the given positions (eager: always; lazy:
past max_positions - margin). A caller that compacts a model split over devices stack by stack (`layers`, a range of
the config's layers held by the given tensors) decides it once for all stacks and passes it in; an explicit flag
wins over the config, eager included, because §2.7 allows only one decision per step.

Dense rank of the retained positions per axis. The 1D positions of a well-formed cache strictly increase in cache
order, and so does the M-RoPE t axis (non-decreasing), but the h and w axes cycle over the patch grid inside every
frame, so no method may assume monotone values. Both backends therefore compute the rank the general way — sort
the retained values of one (layer, stream, axis), mark where the sorted value changes, prefix-sum the marks,
scatter the ranks back — and the Triton rank kernel first checks on the device whether the row is already
non-decreasing in cache order and then takes the cheap path (prefix sum of "differs from the previous retained
value") without sorting. Both paths give the `torch.unique`-based dense rank of `hermes_kernels.rope.compact_positions`
for any input, so the result never depends on how the cache was built.

Two implementations of one contract: this file's torch twin and the Triton kernels of `compaction_triton.py`.
  compact_triton — three launches whatever L, B and Hkv are: a rank kernel (one program per layer, stream and
      axis), a plan kernel (one program per layer and stream: re-index flag, destination map, rotation deltas,
      positions updated in place), and the move kernel (one program per layer, stream, KV head and channel group)
      that walks the tokens left to right and moves/rotates K/V rows and accumulates the summary in registers.
  compact_torch  — the CPU path. The planning (new positions, deltas, pruned slots, summary targets) is torch ops
      over all layers and streams at once; the row work then takes one of two movers:
      rows_native.move_rows_native — fp32/bf16 caches on CPU: one call of a C kernel (compact_cpu.c, built on
          first use by `hermes_kernels.native`) that walks every (layer, stream, head) row left to right in place,
          like the Triton move kernel, reading each row once and writing each kept row once;
      rows_torch.move_rows_torch   — everything else (fp16, fp64, CUDA tensors, no C compiler,
          HERMES_KERNELS_NATIVE=0): torch ops over all rows at once, looping only over L2-sized token tiles left
          to right.
      Why two: any torch-ops mover stages the rows through a gather buffer and writes them out again; at the
      LLaVA-OV-7B shape on a 2-core CPU the tiled gather and write-back of K and V alone, without any rotation,
      took 49 ms, more than the whole C walk with rotation and summary (about 40 ms). Neither path has a Python
      loop over layers; the torch-ops path has no host sync (the C path reads the angle-table range, which on CPU
      tensors costs nothing).
The positions are rewritten by the plan kernel rather than by the move kernel's head-0 program: every head's
program needs the old positions (through the deltas), so rewriting them while other programs still read them
would race; the plan kernel owns the whole row and can order its reads before its writes with a barrier.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ... import ranks, rows_native, rows_torch
from ...rope import RotaryLayout
from .config import HermesConfig

__all__ = ["compact_torch", "decide_reindex"]

def _summary_layers(cfg: HermesConfig, V: int, layers: range) -> tuple[int, int, int]:
    """(first summary layer, kept count there, pruned count there), the layer counted from `layers.start`;
    first == len(layers) when no layer of `layers` summarises.

    Deep layers are the contiguous tail l >= deep_start and all keep n = min(b - 1, V); they summarise when
    summary is on and V > n (§2.6). Everything here comes from the config and shapes: no device data is read.
    """
    first = max(cfg.deep_start, layers.start)
    kept = min(cfg.budget - 1, V)
    if not cfg.summary or first >= layers.stop or V <= kept:
        return len(layers), kept, 0
    return first - layers.start, kept, V - kept


def decide_reindex(positions: Sequence[torch.Tensor], cfg: HermesConfig, device: torch.device) -> torch.Tensor:
    """0-dim bool on `device`: re-index in this step? Eager always; lazy once any position of any of the
    `positions` tensors (the stacks of one cache, on any devices) exceeds max_positions - margin (§2.7).

    Each stack reduces on its own device and only its 0-dim maximum moves to `device`; a copy between CUDA
    devices is ordered on the streams, so nothing waits on the host.
    """
    if cfg.reindex == "eager":
        return torch.ones((), dtype=torch.bool, device=device)
    top = torch.stack([p.amax().to(device) for p in positions]).amax()
    return top > cfg.max_positions - cfg.margin


# ----------------------------------------------------------------------------------------------------------------
# torch twin
# ----------------------------------------------------------------------------------------------------------------

def compact_torch(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                  cfg: HermesConfig, inv_freq: torch.Tensor,
                  rotary: Sequence[int] | RotaryLayout | None = None, layers: range | None = None,
                  reindexed: torch.Tensor | None = None, *,
                  native: bool | None = None) -> tuple[int, torch.Tensor]:
    """Vectorised PyTorch compaction, in place; same result as `reference.compact` (Alg. 1, appendix E).

    keys/values: [L, B, Hkv, N, D] fp16/bf16/fp32/fp64 (any strides); positions: int64 [L, B, N] (1D) or
    [L, B, 3, N] (M-RoPE); inv_freq [R/2], R <= D; rotary: what `RotaryLayout.of` takes for inv_freq's R/2 pairs
    (each pair's axis comes from it; the ops' checks take R < D, partial rotary, only from an explicit layout);
    keys turn in channels [0, R) and keep [R, D) bit for bit; keep: int64
    [L, B, n] from `select_keep` (ascending, -1 padded: only deep layers with summary on carry one -1, exactly in the
    column of their summary slot). Arithmetic in fp32 (fp64 caches: fp64).
    layers: the config's layers the tensors hold (L = len(layers); default all); reindexed: 0-dim bool on the
    cache's device that overrides the config's decision (default: `decide_reindex` of these positions).
    native: which mover does the row work: None (default) = the C kernel (`rows_native.move_rows_native`) whenever
    it applies (CPU fp32/bf16 cache with contiguous rows, library built, not switched off by
    HERMES_KERNELS_NATIVE=0), else the torch ops (`rows_torch.move_rows_torch`); False = the torch ops; True = the C
    kernel, or a RuntimeError saying why it cannot.
    Returns (P + min(budget, V), the flag used).

    Small work first, in torch ops over all layers and streams: new positions, deltas, the deep layers' pruned
    slots and summary targets. Then the row work (one of the two movers), then positions and summary slots.
    """
    L, B, Hkv, N, D = keys.shape
    P, V, n = cfg.prefix_len, N - cfg.prefix_len, keep.shape[-1]
    layers = range(L) if layers is None else layers
    in_c = rows_native.use_native(native, keys, values)  # the CPU C walk, with the counting dense rank of CPU tensors
    flag = decide_reindex([positions], cfg, keys.device) if reindexed is None else reindexed
    layout = RotaryLayout.of(rotary, inv_freq.numel())
    pos = positions if layout.num_axes == 3 else positions.unsqueeze(2)  # [L, B, A, N] view
    A = pos.shape[2]

    # §2.7: old and new positions of the kept tokens, per axis
    valid = (keep >= 0).unsqueeze(2)
    src = keep.clamp(min=0) + P
    old = pos.gather(3, src.unsqueeze(2).expand(L, B, A, n))
    rank = (ranks.dense_rank_counting if in_c else ranks.dense_rank)(old, valid)
    new = torch.where(flag & valid, P + rank, old)
    delta = new - old

    # Alg. 1 in deep layers: the pruned slots and their rotation to the target t
    first, kept_deep, pruned_deep = _summary_layers(cfg, V, layers)
    pruned = to_target = target = None
    if pruned_deep:
        Ld = L - first
        newest = new.masked_fill(~valid, -ranks.BIG).amax(dim=(2, 3))  # [L, B]
        if P:
            newest = torch.maximum(newest, pos[..., :P].amax(dim=(2, 3)))
        target = newest[first:] + 1  # t, the same on every axis
        is_kept = torch.zeros(Ld, B, V, dtype=torch.int8, device=keys.device)
        is_kept.scatter_(2, keep[first:, :, :kept_deep], 1)
        pruned = is_kept.argsort(dim=-1, stable=True)[..., :pruned_deep] + P  # [Ld, B, m] slots, ascending
        old_pruned = pos[first:].gather(3, pruned.unsqueeze(2).expand(Ld, B, A, pruned_deep))
        to_target = target.view(Ld, B, 1, 1) - old_pruned

    mover = rows_native.move_rows_native if in_c else rows_torch.move_rows_torch
    sums = mover(keys, values, P, torch.where(valid.squeeze(2), src, -1), delta, first, pruned, to_target,
                inv_freq, layout)
    pos[..., P:P + n] = new
    if pruned_deep:
        slot = P + kept_deep
        keys[first:, :, :, slot] = (sums[0] / pruned_deep).to(keys.dtype)
        values[first:, :, :, slot] = (sums[1] / pruned_deep).to(values.dtype)
        pos[first:, :, :, slot] = target.unsqueeze(2)
    return P + min(cfg.budget, V), flag
