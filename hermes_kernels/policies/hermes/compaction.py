"""Stage 4: in-place compaction of the KV cache (docs/hermes.md §2.6–2.8; paper Alg. 1 and appendix E).

For every (layer, stream) the kept visual tokens move to slots P..P+n_l-1, their positions are re-ranked when the
step's decision `reindexed` says so, their keys turn by the position delta, and deep layers that pruned get a
summary token. This file holds the torch twin, `compact_torch` (planning in torch ops, the row work in
`rows_native` or `rows_torch`), and `decide_reindex`; the Triton kernels are in `compaction_triton.py`. How both
run (the branch-free decision, dense ranks, the launches, the two row movers): docs/hermes.md#s4-1.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...engine import ranks, rows_native, rows_torch
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
