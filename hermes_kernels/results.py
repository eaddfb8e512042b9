"""What the policies' steps return: one dataclass per step, for both policies.

`CompressResult` is one HERMES compression step (`compress_step`, `compress_stacks`, the reference's
`compress_step`, `HermesCache.compress`); `H2SVCStepResult` is one H2SVC step of one class block (`h2svc_step` and
its reference); `H2SVCChunkResult` is one H2SVC step of a whole cache after a chunk (`H2SVCCache.step`).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class CompressResult:
    """What one HERMES compression step did (docs/hermes.md §3).

    length:    int, valid slots per layer afterwards (P + min(budget, V)); every layer has the same length.
    keep:      int64 [L, B, n], kept visual indices (relative to P) ascending, -1 padded; n = min(budget, V).
    scores:    float32 [L, B, V], the smoothed scores S~ that selection used (§2.4).
    reindexed: 0-dim bool tensor on the cache's device (attn's for a split cache): whether positions were
               re-indexed (left-compacted) in this step (§2.7); `bool(result.reindexed)` reads it (one host sync).
    """

    length: int
    keep: torch.Tensor
    scores: torch.Tensor
    reindexed: torch.Tensor


@dataclasses.dataclass
class H2SVCStepResult:
    """What one `h2svc_step` did to a class block (docs/h2svc.md §7).

    held:      int, frames in the home slots afterwards (held' = min(W, held + F)), the same for every row.
    keep:      int64 [H_c, B, W], the stream frame index in each home slot afterwards, −1 beyond `held`
               (the step returns the updated `slot_frames` tensor itself).
    reindexed: 0-dim bool tensor on the CPU, whether positions were re-indexed (the clock's decision, which the
               step returns itself).
    """

    held: int
    keep: torch.Tensor
    reindexed: torch.Tensor


@dataclasses.dataclass(frozen=True)
class H2SVCChunkResult:
    """What one step of a whole H2SVC cache did after a chunk (`H2SVCCache.step`): the chunk's frames
    (`first_frame`, `num_frames`), frames now held per class name, whether positions were re-indexed (`reindexed`,
    a 0-dim bool tensor on the CPU) and the stream's next position afterwards."""

    first_frame: int
    num_frames: int
    held: dict
    reindexed: torch.Tensor
    next_position: int
