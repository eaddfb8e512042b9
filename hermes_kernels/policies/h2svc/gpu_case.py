"""The H2SVC case the GPU compile guard drives the kernels' launchers at (`hermes_kernels.engine.gpu_specs`): every
class block of one step, as meta tensors laid out as the cache hands them over."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ...engine.geometry import ModelGeometry
from ...engine.gpu_specs import meta
from ...rope import RotaryLayout
from .clock import StreamClock
from .config import EPISODIC, INSTANT, SHORT, H2SVCConfig


class H2SVCBlock(NamedTuple):
    """One class block as `hk.h2svc_step` takes it (meta tensors); features is None for a FIFO class."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot_frames: torch.Tensor
    features: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class H2SVCCase:
    """One H2SVC streaming step the launchers are driven at: every class block of a model (the config's head map)
    with a full memory (held = W frames in the home slots) and a just-prefilled chunk of F frames behind it, in one
    cache dtype, re-indexing on or off (the caller's decision for the step).

    Blocks are laid out as the engine interface, docs/h2svc.md §7 and bench/inputs.py's `ClassBlock` lay them out: keys
    / values [H_c, B, C, D] with C = P + (W + F)·T_f, positions int64 [H_c, B, C] (1D) or [H_c, B, 3, C] (M-RoPE),
    slot_frames int64 [H_c, B, W], features float32 [H_c, B, W, D] (EPISODIC only). The stream has seen 2·N_e
    frames before the chunk, and a re-indexing step aligns to next_position = P + (largest window)·T_f, as the
    benchmark's step does.
    """

    label: str
    geometry: ModelGeometry  # hermes_kernels.engine.geometry; its layers and KV heads are the config's
    dtype: torch.dtype
    cfg: H2SVCConfig
    chunk_frames: int
    reindexing: bool
    batch: int = 1

    def __post_init__(self):
        g, cfg = self.geometry, self.cfg
        if (cfg.num_layers, cfg.num_kv_heads) != (g.num_layers, g.num_kv_heads):
            raise ValueError(f"cfg: (layers, KV heads) = {(cfg.num_layers, cfg.num_kv_heads)}, the geometry has "
                             f"{(g.num_layers, g.num_kv_heads)}")

    @property
    def rotary(self) -> RotaryLayout:
        """The geometry's rotary layout (1D included), as the ops take it."""
        return self.geometry.rotary

    @property
    def classes(self) -> tuple[int, ...]:
        """The classes that have rows in the head map, in INSTANT, SHORT, EPISODIC order."""
        return tuple(c for c in (INSTANT, SHORT, EPISODIC) if self.cfg.num_rows(c))

    @property
    def first_frame(self) -> int:
        """Stream index of the chunk's first frame (newer than every held frame)."""
        return 2 * self.cfg.window(EPISODIC)

    @property
    def next_position(self) -> int:
        """The re-index target R: P + the largest retained visual token count over the classes."""
        return self.cfg.prefix_len + max(self.cfg.window(c) for c in self.classes) * self.cfg.tokens_per_frame

    def clock(self, cls: int) -> StreamClock:
        """The step's clock for class `cls`'s block: a full memory (held = W) and the chunk's frames."""
        return StreamClock(held=self.cfg.window(cls), num_frames=self.chunk_frames, first_frame=self.first_frame,
                           reindexed=torch.tensor(self.reindexing), next_position=self.next_position)

    def block(self, cls: int) -> H2SVCBlock:
        """The state of class `cls`'s block at the start of the step (after the chunk's prefill)."""
        H, B, D, W = self.cfg.num_rows(cls), self.batch, self.geometry.head_dim, self.cfg.window(cls)
        C = self.cfg.prefix_len + (W + self.chunk_frames) * self.cfg.tokens_per_frame
        axes = (3,) if self.rotary.num_axes == 3 else ()
        features = meta(H, B, W, D) if cls == EPISODIC else None
        return H2SVCBlock(meta(H, B, C, D, dtype=self.dtype), meta(H, B, C, D, dtype=self.dtype),
                          meta(H, B, *axes, C, dtype=torch.int64), meta(H, B, W, dtype=torch.int64), features)

    def inv_freq(self) -> torch.Tensor:
        """float32 [R/2] rotary inverse frequencies (R = D but for partial rotary)."""
        return meta(self.rotary.pairs)
