"""The class blocks of an H2SVC cache (docs/h2svc.md §5): which rows of which class live in which buffer, and how a
layer's heads map onto them.

Class c's rows, its (layer, KV head) pairs in `cfg.class_rows(c)` order, are stacked in buffers `[H_c, B,
capacity_c, D]`, one block per class and run of consecutive layers on one device (`hermes.cache.layer_runs`), so
a layer's class-c heads are one contiguous slice of rows of one block (`cfg.layer_rows`). A `LayerPart` is that
slice together with the layer's KV heads and query heads it serves (GQA groups of consecutive query heads).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, H2SVCConfig

CLASSES = tuple(range(len(CLASS_NAMES)))


def class_capacity(cfg: H2SVCConfig, cls, chunk_frames: int, room: int) -> int:
    """Token slots per row of class `cls`: P + (W_c + chunk_frames)·T_f + room
    (docs/stream.md#h2svc-behind-the-front)."""
    return cfg.prefix_len + (cfg.window(cls) + chunk_frames) * cfg.tokens_per_frame + room


@dataclasses.dataclass
class Block:
    """The rows of one class whose layers `layers` live on one device (`rows`: their range in the class stack)."""

    cls: int
    device: torch.device
    layers: range
    rows: range
    keys: torch.Tensor              # [n, B, capacity_c, D]
    values: torch.Tensor            # [n, B, capacity_c, D]
    positions: torch.Tensor         # int64 [n, B, capacity_c] or [n, B, 3, capacity_c]
    slot_frames: torch.Tensor       # int64 [n, B, W_c]
    features: torch.Tensor | None   # float32 [n, B, W_c, D] (EPISODIC), else None
    inv_freq: torch.Tensor          # [D/2] on this device

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.positions, self.slot_frames, self.features) if t is not None]


@dataclasses.dataclass(frozen=True)
class LayerPart:
    """The heads of one class in one layer: `rows` of `block` (a slice), the layer's KV heads they are
    (`kv_heads`) and the query heads that read them (`query_heads`, GQA groups of consecutive heads); each a
    slice when contiguous, else an int64 index tensor on the block's device."""

    cls: int
    block: Block
    rows: slice
    kv_heads: slice | torch.Tensor
    query_heads: slice | torch.Tensor


def head_index(heads: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice for consecutive ascending indices, else an int64 index tensor."""
    if heads == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, dtype=torch.int64, device=device)


def allocate_blocks(cfg: H2SVCConfig, runs: Sequence[tuple[torch.device, int, int]], classes: Sequence[int],
                    capacities: Sequence[int], *, batch_size: int, head_dim: int, dtype: torch.dtype, mrope: bool,
                    inv_freq: torch.Tensor, allocate: Callable) -> list[Block]:
    """One zeroed block per non-empty class (`classes`) and layer run (device, first, end) with rows there, in run
    order: keys and values [n, B, capacity_c, D] in `dtype`, positions int64 [n, B, (3,) capacity_c], slot frames
    int64 [n, B, W_c] (all -1) and, for EPISODIC, features [n, B, W_c, D] (float32; float64 for a float64 cache).
    `allocate(shape, dtype, device, fill)` makes each buffer (the cache's `allocate`, which counts them)."""
    blocks = []
    for device, first, end in runs:
        for cls in classes:
            lo, hi = cfg.layer_rows(cls, first).start, cfg.layer_rows(cls, end - 1).stop
            if hi == lo:
                continue
            n, B, D, W, C = hi - lo, batch_size, head_dim, cfg.window(cls), capacities[cls]
            features = None
            if cls == EPISODIC:
                work = torch.float64 if dtype == torch.float64 else torch.float32
                features = allocate((n, B, W, D), dtype=work, device=device, fill=0)
            blocks.append(Block(cls=cls, device=device, layers=range(first, end), rows=range(lo, hi),
                                keys=allocate((n, B, C, D), dtype=dtype, device=device, fill=0),
                                values=allocate((n, B, C, D), dtype=dtype, device=device, fill=0),
                                positions=allocate((n, B) + ((3,) if mrope else ()) + (C,), dtype=torch.int64,
                                                   device=device, fill=0),
                                slot_frames=allocate((n, B, W), dtype=torch.int64, device=device, fill=-1),
                                features=features, inv_freq=inv_freq.detach().to(device)))
    return blocks


def layer_parts(cfg: H2SVCConfig, blocks: Sequence[Block], num_heads: int) -> list[list[LayerPart]]:
    """Per layer, one `LayerPart` per block holding heads of that layer, in block order."""
    group = num_heads // cfg.num_kv_heads
    parts: list[list[LayerPart]] = []
    for layer in range(cfg.num_layers):
        here = []
        for block in blocks:
            heads = cfg.heads_of(block.cls, layer) if layer in block.layers else []
            if heads:
                rows = cfg.layer_rows(block.cls, layer)
                here.append(LayerPart(
                    cls=block.cls, block=block, rows=slice(rows.start - block.rows.start, rows.stop - block.rows.start),
                    kv_heads=head_index(heads, block.device),
                    query_heads=head_index([h * group + j for h in heads for j in range(group)], block.device)))
        parts.append(here)
    return parts
