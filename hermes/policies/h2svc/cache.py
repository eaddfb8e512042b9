"""The H2SVC KV cache: one stacked key and one value buffer per class and device (docs/h2svc.md §4–5).

Layout. The rows of class c (its (layer, KV head) pairs, `cfg.class_rows(c)` order) live in buffers
`[H_c, B, capacity_c, D]`; a model split over devices gets one block per class and run of consecutive layers on
one device (`hermes.cache.layer_runs`), so a layer's class-c heads are one contiguous slice of rows on that
layer's device (`cfg.layer_rows`). Token slots of every row: [0, P) the system prefix, then frame slot s at
[P + s·T_f, P + (s+1)·T_f): the held frames in home slots [0, held_c), a chunk's arriving frames right after them
(slots held_c .. held_c + F − 1, as `hk.h2svc_step` expects), or a question and its answer after the held frames.
    capacity_c = P + (W_c + F_max)·T_f + room       (F_max: frames of the largest chunk; room: question + answer)
Next to keys and values: positions per class row `[H_c, B, capacity_c]` (1D) or `[H_c, B, 3, capacity_c]`
(M-RoPE), `slot_frames [H_c, B, W_c]` (the stream frame of every home slot, −1 empty) and, for EPISODIC, the frame
features `[H_e, B, N_e, D]` fp32 STCE reads. Everything is allocated once: `data_ptrs()` never changes and memory
is flat for any stream length.

Lengths. All rows of a class hold the same number of tokens: prefix + held_c frames (+ the arrivals of a chunk
awaiting its step) + text (a question and its answer, the same count in every class, truncated away after
the answer). transformers sees one sequence whose length is the largest class's (`length`, a virtual slot count
the model's default positions run on); `room()` is what still fits in every class.

Positions (docs/h2svc.md §4). Incoming tokens get one position per token, shared by all heads of all layers: a chunk
starts at the stream's next position R (a host int: the largest position so far + 1, or the right-aligned end
after a re-index) plus the family's offsets; text after the video continues from R, then from its own largest
position. The model runs at the default positions `length + i`; `update` rotates the incoming keys by
(true − default) before storing them and the attention function rotates the queries the same way
(`incoming_delta`), as HERMES does (docs/hermes.md §2.8).

The step (`step`, after a chunk's prefill): `hk.h2svc_step` on every class block (all its rows in one call), with
held / num_frames / first_frame from the host counters, reindex = `cfg.needs_reindex(largest position)` and
next_position R = P + the largest retained visual token count over all heads (max_c min(W_c, held_c + F)·T_f),
all decided on the host: no device read. Afterwards the counters move.

Failures, as `hermes.cache`: forwards write only past each class's length and the counters move at the last
layer, so `atomic()` undoes any failed call by restoring the host counters. The step validates every block
(`check_h2svc_step`, the op's own checks) before the first block is written, so bad input (e.g. non-finite
values of the arriving frames on CPU) raises with the cache untouched; an exception after the first block's
writes began leaves the cache `undefined` until `reset()`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch

import hermes_kernels as hk
from hermes.cache import Forward, StreamCacheBase, layer_runs
from hermes_kernels.checks import check_positive_int
from hermes_kernels.dispatch import check_backend
from hermes_kernels.dtypes import CACHE_DTYPES
from hermes_kernels.policies.h2svc.checks import check_h2svc_step
from hermes_kernels.policies.h2svc.clock import StreamClock
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, H2SVCConfig, class_id
from hermes_kernels.results import H2SVCChunkResult
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta

from .attention import class_attention
from .blocks import CLASSES, LayerPart, allocate_blocks, class_capacity, layer_parts

@dataclasses.dataclass(kw_only=True)
class ClassForward(Forward):
    """A forward through the class blocks (`Forward`'s `start` is a virtual slot: the default positions):
    `starts[c]` the slot its tokens go to in class c; `frames` > 0 for a chunk of that many frames (with `extent`,
    the largest offset); `delta` true − default positions per device."""

    starts: tuple[int, ...]
    frames: int
    extent: int
    delta: dict


class H2SVCCache(StreamCacheBase):
    """Fixed-capacity per-class KV cache with per-row positions and in-place H2SVC steps (module docstring).

    Args:
        cfg:            the H2SVC policy (head map, windows, prefix_len P, tokens_per_frame T_f, re-index rule).
        batch_size:     B streams advanced in lockstep.
        num_heads:      query heads per layer H (a multiple of cfg.num_kv_heads: GQA groups of H / Hkv).
        head_dim:       D (even).
        chunk_frames:   F_max, frames of the largest chunk.
        room:           slots past the held frames for a question and its answer (and past a chunk: the
                        capacity formula adds both).
        dtype:          storage dtype of keys/values (the model's).
        inv_freq:       [D/2] rotary inverse frequencies taken from the model's rotary module.
        rotary:  which position axis turns each frequency pair: a `RotaryLayout` (Qwen2.5-VL's contiguous
                        sections, Qwen3-VL's interleaved ones), three contiguous pair counts (t, h, w), or None
                        for 1D RoPE; stored as the `RotaryLayout` (`self.rotary`, 1D included).
        layer_devices:  the device of every layer (default: inv_freq's); stack_bounds: extra block boundaries
                        between layers on one device (lays out a device split on one device; same results).
    """

    def __init__(self, cfg: H2SVCConfig, *, batch_size: int, num_heads: int, head_dim: int, chunk_frames: int,
                 room: int, dtype: torch.dtype, inv_freq: torch.Tensor,
                 rotary: Sequence[int] | RotaryLayout | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = ()):
        if not isinstance(cfg, H2SVCConfig):
            raise TypeError(f"cfg: expected an H2SVCConfig, got {type(cfg).__name__}")
        runs = layer_runs(cfg.num_layers, batch_size=batch_size, num_kv_heads=cfg.num_kv_heads, head_dim=head_dim,
                          inv_freq=inv_freq, rotary=rotary, layer_devices=layer_devices,
                          stack_bounds=stack_bounds)
        for name, value in (("num_heads", num_heads), ("chunk_frames", chunk_frames), ("room", room)):
            check_positive_int(name, value)
        if num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads: {num_heads} query heads do not form GQA groups over "
                             f"{cfg.num_kv_heads} KV heads")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype: expected a floating dtype for keys and values, got {dtype}")
        self.cfg = cfg
        self.num_heads = num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.chunk_frames = chunk_frames
        self.capacities = tuple(class_capacity(cfg, c, chunk_frames, room) for c in CLASSES)
        self._init_stream(cfg.num_layers, batch_size, rotary, head_dim)
        self.classes = tuple(c for c in CLASSES if cfg.num_rows(c))  # the non-empty classes
        self.blocks = allocate_blocks(cfg, runs, self.classes, self.capacities, batch_size=batch_size,
                                      head_dim=head_dim, dtype=dtype, mrope=self.mrope, inv_freq=inv_freq)
        self._parts = layer_parts(cfg, self.blocks, num_heads)
        self._devices = list(dict.fromkeys(block.device for block in self.blocks))
        self.reset()

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def class_length(self, cls) -> int:
        """Valid token slots in every row of class `cls`: prefix + (held + arrived)·T_f + text."""
        c = class_id(cls)
        return self._prefix + (self._held[c] + self._arrived) * self.cfg.tokens_per_frame + self._text

    @property
    def length(self) -> int:
        """The sequence length transformers sees: the largest class length (module docstring)."""
        frames = max(self._held[c] for c in self.classes) + self._arrived
        return self._prefix + frames * self.cfg.tokens_per_frame + self._text

    @property
    def capacity(self) -> int:
        """The largest class capacity (slots per row); `room()` says what still fits everywhere."""
        return max(self.capacities[c] for c in self.classes)

    def room(self) -> int:
        """Tokens that still fit past the length in every class."""
        return min(self.capacities[c] - self.class_length(c) for c in self.classes)

    @property
    def held(self) -> dict:
        """Frames held per class name (classes without heads included, at 0)."""
        return {CLASS_NAMES[c]: self._held[c] for c in CLASSES}

    @property
    def frames_seen(self) -> int:
        """Frames of the stream stepped so far (the next chunk's first frame index)."""
        return self._frames_seen

    @property
    def next_position(self) -> int:
        """R: the position the next chunk starts at (host int)."""
        return self._next_position

    @property
    def _home_device(self) -> torch.device:
        return self.blocks[0].device

    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (keys, values, positions, slot frames, features)."""
        return sum(self.class_nbytes().values())

    def class_nbytes(self) -> dict:
        """Bytes of every class's buffers over all devices, by class name."""
        return {CLASS_NAMES[c]: sum(t.numel() * t.element_size() for b in self.blocks if b.cls == c
                                    for t in b.buffers()) for c in CLASSES}

    def data_ptrs(self) -> list[int]:
        """Storage addresses of every buffer; they never change after construction."""
        return [t.data_ptr() for block in self.blocks for t in block.buffers()]

    # ---- views ----------------------------------------------------------------------------------------
    def layer_parts(self, layer: int) -> list[LayerPart]:
        """The class parts of `layer` (one per class with heads there)."""
        return self._parts[layer]

    def _part(self, cls, layer: int) -> LayerPart:
        c = class_id(cls)
        for part in self._parts[layer]:
            if part.cls == c:
                return part
        raise ValueError(f"cls: layer {layer} has no {CLASS_NAMES[c]} heads")

    def class_keys(self, cls, layer: int) -> torch.Tensor:
        """Valid keys of `layer`'s class-`cls` heads (`cfg.heads_of`), a view [B, n, N_c, D]."""
        part = self._part(cls, layer)
        return part.block.keys[part.rows, :, :self.class_length(cls)].transpose(0, 1)

    def class_values(self, cls, layer: int) -> torch.Tensor:
        """Valid values of `layer`'s class-`cls` heads, a view [B, n, N_c, D]."""
        part = self._part(cls, layer)
        return part.block.values[part.rows, :, :self.class_length(cls)].transpose(0, 1)

    def class_positions(self, cls, layer: int) -> torch.Tensor:
        """Valid positions of `layer`'s class-`cls` heads, a view int64 [B, n, N_c] or [B, n, 3, N_c]."""
        part = self._part(cls, layer)
        return part.block.positions[part.rows, ..., :self.class_length(cls)].transpose(0, 1)

    def class_slot_frames(self, cls, layer: int) -> torch.Tensor:
        """Stream frame index of every home slot of `layer`'s class-`cls` heads, a view int64 [B, n, W_c]."""
        part = self._part(cls, layer)
        return part.block.slot_frames[part.rows].transpose(0, 1)

    def class_features(self, layer: int) -> torch.Tensor:
        """Frame features of every home slot of `layer`'s episodic heads, a view float32 [B, n, N_e, D]."""
        part = self._part(EPISODIC, layer)
        return part.block.features[part.rows].transpose(0, 1)

    def layer_keys(self, layer: int) -> torch.Tensor:
        raise NotImplementedError("H2SVCCache: a layer's heads live in per-class blocks of different lengths; read "
                                  "them with class_keys(cls, layer)")

    def layer_values(self, layer: int) -> torch.Tensor:
        raise NotImplementedError("H2SVCCache: a layer's heads live in per-class blocks of different lengths; read "
                                  "them with class_values(cls, layer)")

    def position_range(self) -> tuple[int, int]:
        """(smallest, largest) valid position over all rows, streams and axes; (0, -1) when empty."""
        if self.length == 0:
            return 0, -1
        spans = [b.positions[..., :self.class_length(b.cls)] for b in self.blocks]
        return int(min(s.min().item() for s in spans)), int(max(s.max().item() for s in spans))

    # ---- writing ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, rel_positions: torch.Tensor | None = None, *, read_only: bool = False,
                        keep: int | None = None, left_padding: torch.Tensor | None = None, frames: int | None = None,
                        extent: int | None = None) -> Iterator["H2SVCCache"]:
        """`StreamCacheBase.forward_context`, plus: `frames` F (with `extent`, the largest offset of
        `rel_positions`, a host int) makes the first forward a chunk of F frames of T_f tokens each, stored after
        the held frames of every class and awaiting `step`. Without it, forwards are text (the first one on an
        empty cache is the P-token prefix)."""
        if frames is not None:
            if not isinstance(frames, int) or isinstance(frames, bool) or not 1 <= frames <= self.chunk_frames:
                raise ValueError(f"frames: expected an int in [1, chunk_frames={self.chunk_frames}], got {frames!r}")
            if not isinstance(extent, int) or isinstance(extent, bool) or extent < 0:
                raise ValueError(f"extent: a chunk needs the largest offset of its positions (int >= 0), got "
                                 f"{extent!r}")
            if read_only or keep is not None or left_padding is not None:
                raise ValueError("frames: a chunk is stored whole (no read_only, keep or left_padding)")
        with super().forward_context(rel_positions, read_only=read_only, keep=keep, left_padding=left_padding):
            self._chunk = (frames, extent) if frames is not None else None
            yield self

    def _end_context(self) -> None:
        self._chunk = None

    def _hidden_start(self) -> tuple[int, ...]:
        # the padding of a question batch starts at every class's own length
        return tuple(self.class_length(c) if c in self.classes else 0 for c in CLASSES)

    def _begin_forward(self, key_states: torch.Tensor) -> ClassForward:
        self._check_defined("step")
        count = self._incoming_count(key_states)
        chunk, self._chunk = self._chunk, None  # only the context's first forward is the chunk
        if self._arrived:
            raise RuntimeError("H2SVCCache: a chunk's frames await their step(); run it before the next forward")
        P, T_f = self.cfg.prefix_len, self.cfg.tokens_per_frame
        if chunk is not None:
            if self._prefix == 0 or self._text:
                raise ValueError("frames: a chunk goes right after the held frames: the prefix must be stored and "
                                 f"no text after the video (text tokens: {self._text})")
            if count != chunk[0] * T_f:
                raise ValueError(f"key_states: a chunk of {chunk[0]} frames has {chunk[0] * T_f} tokens "
                                 f"(tokens_per_frame={T_f}), got {count}")
        elif self.room() < count:
            raise ValueError(f"key_states: {count} incoming tokens do not fit: {self.room()} slots left in the "
                             f"fullest class (length {self.length})")
        elif self._prefix == 0 and count != P:
            raise ValueError(f"key_states: the first forward on an empty cache is the prefix of prefix_len={P} "
                             f"tokens, got {count}")
        rel, stored = self._take_context(count)
        if self._prefix == 0 and (rel is not None or stored not in (0, count)):
            raise ValueError("rel_positions: the prefix is stored whole at positions 0 .. P-1 (rel_positions=None)")
        starts = tuple(self.class_length(c) if c in self.classes else 0 for c in CLASSES)
        new = self._incoming_positions(count, rel)
        delta = new - (self.length + torch.arange(count, device=new.device))  # true - default
        forward = ClassForward(start=self.length, count=count, stored=stored, starts=starts,
                           frames=0 if chunk is None else chunk[0], extent=0 if chunk is None else chunk[1],
                           delta={device: delta.to(device) for device in self._devices})
        for block in self.blocks:
            start = starts[block.cls]
            block.positions[..., start:start + count] = new.to(block.device)  # [B, (3,) T] over every row
        return forward

    def _incoming_positions(self, count: int, rel: torch.Tensor | None) -> torch.Tensor:
        """True positions int64 [B, T] ([B, 3, T] M-RoPE) of the incoming tokens (docs/h2svc.md §4): from R for a chunk,
        the prefix or the first text after the video; after stored text, from its largest position + 1."""
        device = self._home_device
        B = self._batch_size
        if rel is None:
            rel = torch.arange(count, device=device)
            rel = rel.expand(3, count) if self.mrope else rel
        rel = rel.to(device)
        if self._text == 0:
            base = torch.full((B,), self._next_position, dtype=torch.int64, device=device)
        else:  # text after text (decode steps): every class holds the same text; read one row of the first block
            block = self.blocks[0]
            length = self.class_length(block.cls)
            base = block.positions[0, ..., length - self._text:length].reshape(B, -1).amax(dim=-1) + 1
        lead = (slice(None),) + ((None,) if self.mrope else ()) + (None,)
        return base[lead] + rel

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the incoming keys [B, Hkv, T, D] of layer `layer_idx` to their true positions and write keys and
        values into each class block's rows of that layer; return the incoming tensors themselves (the attention
        function claims them and attends over the class blocks)."""
        fwd = self._forward_at(layer_idx, key_states)
        count = fwd.count
        rotated = None
        for part in self._parts[layer_idx]:
            block = part.block
            if rotated is None:
                rotated = apply_rotary_delta(key_states, fwd.delta[block.device].unsqueeze(1), block.inv_freq,
                                             self.rotary)
            start = fwd.starts[part.cls]
            block.keys[part.rows, :, start:start + count] = rotated[:, part.kv_heads].transpose(0, 1)
            block.values[part.rows, :, start:start + count] = value_states[:, part.kv_heads].transpose(0, 1)
        self._hand_off(layer_idx, key_states)
        if layer_idx == self.cfg.num_layers - 1:
            self._commit(fwd)
        return key_states, value_states

    def _commit(self, fwd: ClassForward) -> None:
        """Move the host counters after a forward's last layer."""
        if fwd.frames:
            self._arrived, self._pending_extent = fwd.frames, fwd.extent
        elif self._prefix == 0:
            if fwd.stored:
                self._prefix, self._next_position = fwd.stored, fwd.stored
        else:
            self._text += fwd.stored

    @property
    def current_forward(self) -> ClassForward:
        """The running forward (its class start slots, chunk frames, masks); RuntimeError outside one."""
        if self._forward is None:
            raise RuntimeError("H2SVCCache: no forward is running")
        return self._forward

    def incoming_delta(self, layer: int) -> torch.Tensor:
        """int64 [B, T] (or [B, 3, T]) rotation of the running forward's tokens: true − default, the same in every
        layer (docs/h2svc.md §4), on `layer`'s device."""
        return self.current_forward.delta[self.layer_device(layer)]

    def layer_device(self, layer: int) -> torch.device:
        """The device of `layer`'s blocks."""
        return next(block.device for block in self.blocks if layer in block.layers)

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The model's rotary inverse frequencies [D/2] on `layer`'s device."""
        return next(block.inv_freq for block in self.blocks if layer in block.layers)

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention of `layer` over its class blocks (`hermes.policies.h2svc.attention.class_attention`); the
        incoming key/value are already in the blocks and the mask is the class's own."""
        return class_attention(module, self, layer, query, dropout=dropout, scaling=scaling, **kwargs)

    def truncate(self, length: int) -> None:
        """Forget text from `length` on (a question and its answer); the video (prefix and frames) stays."""
        video = self.length - self._text
        if not isinstance(length, int) or isinstance(length, bool) or not video <= length <= self.length:
            raise ValueError(f"length: expected an int in [{video}, {self.length}] (only the text after the video "
                             f"can be dropped), got {length!r}")
        self._text = length - video

    def reset(self) -> None:
        """Empty the cache (no prefix, no frames, counters 0, `undefined` cleared); the buffers stay allocated."""
        for block in self.blocks:
            block.slot_frames.fill_(-1)
        self._prefix = 0
        self._held = [0] * len(CLASSES)
        self._arrived = 0
        self._pending_extent = 0
        self._text = 0
        self._frames_seen = 0
        self._next_position = 0
        self._chunk = None
        self._reset_stream()

    def _counters(self) -> tuple:
        return (self._prefix, tuple(self._held), self._arrived, self._pending_extent, self._text,
                self._frames_seen, self._next_position, self._steps, self._reindexes)

    def _restore_counters(self, saved: tuple) -> None:
        (self._prefix, held, self._arrived, self._pending_extent, self._text, self._frames_seen,
         self._next_position, self._steps, self._reindexes) = saved
        self._held = list(held)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, backend: str = "auto") -> H2SVCChunkResult:
        """One H2SVC step after a chunk's prefill (docs/h2svc.md §3–4), every class block in place: FIFO / STCE keep
        sets, the slot plan, and the right-aligned re-index when `cfg.needs_reindex` says so (module docstring).

        Every block is checked before the first one is written (ValueError/TypeError, cache untouched); an
        exception after that leaves the cache `undefined`.
        """
        self._check_defined("step")
        if not self._arrived:
            raise ValueError("step: no chunk awaits a step (prefill one with forward_context(frames=...))")
        check_backend(backend)
        cfg, F, first = self.cfg, self._arrived, self._frames_seen
        largest = self._next_position + self._pending_extent  # the chunk's largest position (host)
        reindex = cfg.needs_reindex(largest)
        # a class without heads holds nothing (its count stays 0, as `held` reports it)
        held_after = [min(cfg.window(c), self._held[c] + F) if c in self.classes else 0 for c in CLASSES]
        # R (§4): every row's retained frames end at R - 1 after a re-index, R - 1 >= the largest one held
        next_position = cfg.prefix_len + max(held_after[c] for c in self.classes) * cfg.tokens_per_frame
        clock = StreamClock(held=0, num_frames=F, first_frame=first, reindexed=torch.tensor(reindex),
                            next_position=next_position)
        calls = []
        for block in self.blocks:
            args = (block.keys, block.values, block.positions, block.slot_frames, cfg, block.cls, block.inv_freq,
                    self.rotary)
            block_clock = clock.at(self._held[block.cls])
            check_h2svc_step(*args, block_clock, block.features)
            calls.append((args, block_clock, block.features))

        def step() -> tuple[H2SVCChunkResult, bool]:
            for args, block_clock, features in calls:
                hk.h2svc_step(*args, clock=block_clock, features=features, backend=backend)
            self._held = held_after
            self._arrived = self._pending_extent = 0
            self._frames_seen += F
            self._next_position = next_position if reindex else largest + 1
            return H2SVCChunkResult(first_frame=first, num_frames=F, held=self.held, reindexed=clock.reindexed,
                                    next_position=self._next_position), reindex

        return self._step_in_place(step)

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, reindexes, bytes_allocated (as HERMES), plus
        frames_seen, held (frames per class name), next_position and bytes_per_class."""
        return {"length": self.length, "capacity": self.capacity, "positions": self.position_range(),
                "steps": self._steps, "reindexes": self._reindexes, "bytes_allocated": self.nbytes(),
                "frames_seen": self._frames_seen, "held": self.held, "next_position": self._next_position,
                "bytes_per_class": self.class_nbytes()}
