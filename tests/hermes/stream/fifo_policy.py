"""A deliberately small third policy, "fifo": the newest `frames` frames of video stay (docs/policies.md#example).
It runs through every shared stream check (tests/hermes/stream/policies.py) to show that a policy is its config,
its prefill and its in-place step over the engine's dense storage (`hermes.dense.DenseCache`)."""
from __future__ import annotations

import dataclasses

import torch

from hermes.cache import Counters, prefill
from hermes.dense import DenseCache
from hermes.policy import StreamPolicy, StreamSetup, register_policy
from hermes_kernels.engine.checks import check_positive_int


@dataclasses.dataclass(frozen=True)
class FifoConfig:
    frames: int            # frames of video kept
    num_layers: int
    prefix_len: int        # P: the prefix is never evicted
    tokens_per_frame: int  # T_f


@dataclasses.dataclass(frozen=True)
class FifoCounters(Counters):
    held: int = 0          # frames in the cache (after a chunk's prefill: the chunk's included)


@dataclasses.dataclass(frozen=True)
class FifoStep:
    dropped: int           # frames this step evicted
    held: int              # frames held after it


def shift_down(buffer: torch.Tensor, dim: int, start: int, end: int, by: int) -> None:
    """Move slots [start + by, end) along `dim` to [start, end - by) (the ranges overlap: through a copy)."""
    buffer.narrow(dim, start, end - start - by).copy_(buffer.narrow(dim, start + by, end - start - by).clone())


class FifoCache(DenseCache):
    step_name = "eviction"

    def __init__(self, cfg: FifoConfig, setup: StreamSetup):
        g = setup.geometry
        super().__init__(g.num_layers, batch_size=setup.batch_size, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                         capacity=cfg.prefix_len + cfg.frames * cfg.tokens_per_frame + setup.chunk_tokens + setup.room,
                         dtype=setup.dtype, inv_freq=setup.inv_freq, rotary=g.rotary,
                         layer_devices=setup.layer_devices, counters=FifoCounters(), linear=setup.linear,
                         windows=setup.windows)
        self.cfg = cfg

    def evict(self, arrived: int) -> FifoStep:
        """After a chunk of `arrived` frames: drop the oldest frames past `cfg.frames`, keys, values and true
        positions moving down together (the next tokens continue from the largest position, as ever)."""
        self._check_defined()
        cfg, length, held = self.cfg, self.length, self.counters.held + arrived
        if length != cfg.prefix_len + held * cfg.tokens_per_frame:
            raise ValueError(f"arrived: {held} frames do not make the cache's {length} slots")
        drop = max(0, held - cfg.frames)

        def step() -> tuple[FifoStep, bool]:
            for stack in self._stacks if drop else ():  # keys, values and true positions move down together
                for buffer, dim in ((stack.keys, 3), (stack.values, 3), (stack.positions, -1)):
                    shift_down(buffer, dim, cfg.prefix_len, length, drop * cfg.tokens_per_frame)
            self.counters = FifoCounters(length=length - drop * cfg.tokens_per_frame, held=held - drop)
            return FifoStep(dropped=drop, held=held - drop), False

        return self._step_in_place(step)


@register_policy
class FifoPolicy(StreamPolicy):
    name = "fifo"

    def __init__(self, setup: StreamSetup, *, frames: int = 3):
        super().__init__(setup)
        T_f = setup.family.tokens_per_frame(setup.model, setup.frame_size, tokenizer=setup.tokenizer)
        if setup.chunk_tokens < T_f:
            raise ValueError(f"chunk_tokens: {setup.chunk_tokens} tokens hold no frame of {T_f}")
        self.cfg = FifoConfig(check_positive_int("frames", frames), setup.geometry.num_layers, setup.prefix_len, T_f)
        self.cache = FifoCache(self.cfg, setup)

    def append_chunk(self, chunk, history) -> FifoStep:
        if chunk.embeds.shape[1] != chunk.frames * self.cfg.tokens_per_frame:
            raise ValueError(f"video: {chunk.frames} frames of {self.cfg.tokens_per_frame} tokens expected")
        prefill(self.setup.language_model, self.cache, chunk)
        return self.cache.evict(chunk.frames)
