"""The H2SVC KV cache: one stacked key and one value buffer per class and device (docs/h2svc.md §4–5).

`H2SVCCache` holds, per class block (`hermes.policies.h2svc.blocks`), keys, values and true positions of the prefix,
the held frames in home slots and a chunk's arrivals right after them, plus `slot_frames` and the episodic frame
features; everything is allocated once. After a chunk's prefill `step` runs `hk.h2svc_step` on every class block with
the stream clock taken from host counters: no device read, every block validated before the first is written. Layout,
positions and failures: docs/stream.md#h2svc-behind-the-front; lengths and R: docs/decisions.md#h2svc-model.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch

import hermes_kernels as hk
from hermes.cache import Forward, StreamCacheBase, layer_runs
from hermes.linear_state import LinearLayout
from hermes.window import WindowLayout
from hermes.parallel import refusing_ranks
from hermes_kernels.engine.checks import check_group, check_positive_int, read_contents
from hermes_kernels.engine.dispatch import check_backend
from hermes_kernels.engine.dtypes import CACHE_DTYPES
from hermes_kernels.policies.h2svc.checks import check_h2svc_step
from hermes_kernels.policies.h2svc.clock import StreamClock
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, H2SVCConfig, class_id
from hermes_kernels.results import H2SVCChunkResult
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta

from .attention import class_attention
from .blocks import CLASSES, LayerPart, allocate_blocks, class_capacity, layer_parts


@dataclasses.dataclass(frozen=True)
class ClassCounters:
    """The host state of an `H2SVCCache` (what `atomic()` restores): `prefix` tokens stored, frames `held` per class
    (INSTANT, SHORT, EPISODIC), the `arrived` frames of a chunk awaiting its step and that chunk's largest offset
    (`pending_extent`), `text` tokens after the video, frames stepped so far (`frames_seen`) and R, the position
    the next chunk starts at (`next_position`)."""

    prefix: int = 0
    held: tuple[int, ...] = (0,) * len(CLASSES)
    arrived: int = 0
    pending_extent: int = 0
    text: int = 0
    frames_seen: int = 0
    next_position: int = 0


@dataclasses.dataclass(kw_only=True)
class ClassForward(Forward):
    """A forward through the class blocks (`Forward`'s `start` is a virtual slot: the default positions):
    `starts[c]` the slot its tokens go to in class c; `frames` > 0 for a chunk of that many frames (with `extent`,
    the largest offset); `delta` true − default positions per device."""

    starts: tuple[int, ...]
    frames: int
    extent: int
    delta: dict

    @property
    def hidden_start(self) -> tuple[int, ...]:
        # the padding of a question batch starts at every class's own length
        return self.starts


class H2SVCCache(StreamCacheBase):
    """Fixed-capacity per-class KV cache with per-row positions and in-place H2SVC steps
    (docs/stream.md#h2svc-behind-the-front).

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
        rotary:         which position axis turns each frequency pair: a `RotaryLayout` (Qwen2.5-VL's contiguous
                        sections, Qwen3-VL's interleaved ones), three contiguous pair counts (t, h, w), or None
                        for 1D RoPE; stored as the `RotaryLayout` (`self.rotary`, 1D included).
        layer_devices:  the device of every layer (default: inv_freq's); stack_bounds: extra block boundaries
                        between layers on one device (lays out a device split on one device; same results).
        classes:        the classes whose host counters run (default: those with heads in cfg). Under tensor
                        parallelism, those of the whole model's map: a rank whose columns hold no head of a class
                        still counts its frames, so the lengths, room and positions of every rank agree.
        group:          under tensor parallelism, the `torch.distributed` process group of the ranks holding the
                        model's other heads (cfg's map is this rank's columns); None in one process.
        linear:         a hybrid model's `hermes.linear_state.LinearLayout` (this cache's layers are its full-attention
                        layers; the linear-attention layers' states are held too), None without linear layers.
        windows:        a decoder's `hermes.window.WindowLayout` (sliding-window and KV-shared layers, Gemma 4) or
                        None.
    """

    def __init__(self, cfg: H2SVCConfig, *, batch_size: int, num_heads: int, head_dim: int, chunk_frames: int,
                 room: int, dtype: torch.dtype, inv_freq: torch.Tensor,
                 rotary: Sequence[int] | RotaryLayout | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = (),
                 classes: Sequence[int] | None = None, group=None, linear: LinearLayout | None = None,
                 windows: WindowLayout | None = None):
        if not isinstance(cfg, H2SVCConfig):
            raise TypeError(f"cfg: expected an H2SVCConfig, got {type(cfg).__name__}")
        runs = layer_runs(cfg.num_layers, batch_size=batch_size, num_kv_heads=cfg.num_kv_heads, head_dim=head_dim,
                          inv_freq=inv_freq, rotary=rotary, layer_devices=layer_devices,
                          stack_bounds=stack_bounds)
        for name, value in (("num_heads", num_heads), ("chunk_frames", chunk_frames), ("room", room)):
            check_positive_int(name, value)
        check_group(group)
        if num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads: {num_heads} query heads do not form GQA groups over "
                             f"{cfg.num_kv_heads} KV heads")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype: expected a floating dtype for keys and values, got {dtype}")
        super().__init__(num_layers=cfg.num_layers, batch_size=batch_size, num_kv_heads=cfg.num_kv_heads,
                         head_dim=head_dim, rotary=rotary, home_device=runs[0][0], counters=ClassCounters(),
                         linear=linear, windows=windows)
        self.cfg = cfg
        self.group = group
        self.num_heads = num_heads
        self.dtype = dtype
        self.chunk_frames = chunk_frames
        self.capacities = tuple(class_capacity(cfg, c, chunk_frames, room) for c in CLASSES)
        present = tuple(c for c in CLASSES if cfg.num_rows(c))
        if classes is not None and not set(present) <= set(classes) <= set(CLASSES):
            raise ValueError(f"classes: expected classes of {CLASSES} including those with heads here {present}, got "
                             f"{classes!r}")
        self.classes = present if classes is None else tuple(c for c in CLASSES if c in set(classes))
        self.blocks = allocate_blocks(cfg, runs, self.classes, self.capacities, batch_size=batch_size,
                                      head_dim=head_dim, dtype=dtype, mrope=self.mrope, inv_freq=inv_freq,
                                      allocate=self.allocate)
        self._parts = layer_parts(cfg, self.blocks, num_heads)
        self._devices = list(dict.fromkeys(block.device for block in self.blocks))
        self._chunk: tuple[int, int] | None = None  # (frames, extent) of the context's first forward, a chunk

    # ---- sizes -------------------------------------------------------------------------------------------
    def class_length(self, cls) -> int:
        """Valid token slots in every row of class `cls`: prefix + (held + arrived)·T_f + text."""
        c, n = class_id(cls), self.counters
        return n.prefix + (n.held[c] + n.arrived) * self.cfg.tokens_per_frame + n.text

    @property
    def length(self) -> int:
        """The sequence length transformers sees: the largest class length
        (docs/decisions.md#h2svc-model)."""
        n = self.counters
        frames = max(n.held[c] for c in self.classes) + n.arrived
        return n.prefix + frames * self.cfg.tokens_per_frame + n.text

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
        return {CLASS_NAMES[c]: self.counters.held[c] for c in CLASSES}

    @property
    def frames_seen(self) -> int:
        """Frames of the stream stepped so far (the next chunk's first frame index)."""
        return self.counters.frames_seen

    @property
    def next_position(self) -> int:
        """R: the position the next chunk starts at (host int)."""
        return self.counters.next_position

    def class_nbytes(self) -> dict:
        """Bytes of every class's buffers over all devices, by class name."""
        return {CLASS_NAMES[c]: sum(t.numel() * t.element_size() for b in self.blocks if b.cls == c
                                    for t in b.buffers()) for c in CLASSES}

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

    def contents(self) -> dict[str, torch.Tensor]:
        """Per layer and class with heads there: valid keys, values [B, n, N_c, D], positions [B, n, N_c] /
        [B, n, 3, N_c], the slot frames [B, n, W_c] and (EPISODIC) the held slots' features [B, n, held, D]."""
        views = {}
        for layer in range(self.num_layers):
            for part in self._parts[layer]:
                name = f"layer {layer} {CLASS_NAMES[part.cls]}"
                views[f"{name} keys"] = self.class_keys(part.cls, layer)
                views[f"{name} values"] = self.class_values(part.cls, layer)
                views[f"{name} positions"] = self.class_positions(part.cls, layer)
                views[f"{name} slot_frames"] = self.class_slot_frames(part.cls, layer)
                if part.cls == EPISODIC:
                    views[f"{name} features"] = self.class_features(layer)[:, :, :self.counters.held[EPISODIC]]
        return {**views, **self.side_contents()}

    # ---- writing ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, rel_positions: torch.Tensor | None = None, *, read_only: bool = False,
                        keep: int | None = None, left_padding: torch.Tensor | None = None,
                        blocks: torch.Tensor | None = None, frames: int | None = None,
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
        with super().forward_context(rel_positions, read_only=read_only, keep=keep, left_padding=left_padding,
                                     blocks=blocks):
            self._chunk = (frames, extent) if frames is not None else None
            try:
                yield self
            finally:
                self._chunk = None

    def begin_forward(self, count: int, rel_positions: torch.Tensor | None, stored: int) -> ClassForward:
        """Check the forward (a chunk of whole frames after the held ones, the prefix on an empty cache, or text
        that fits every class) and write its true positions into every block (docs/h2svc.md §4)."""
        n = self.counters
        chunk, self._chunk = self._chunk, None  # only the context's first forward is the chunk
        if n.arrived:
            raise RuntimeError("H2SVCCache: a chunk's frames await their step(); run it before the next forward")
        P, T_f = self.cfg.prefix_len, self.cfg.tokens_per_frame
        if chunk is not None:
            if n.prefix == 0 or n.text:
                raise ValueError("frames: a chunk goes right after the held frames: the prefix must be stored and "
                                 f"no text after the video (text tokens: {n.text})")
            if count != chunk[0] * T_f:
                raise ValueError(f"key_states: a chunk of {chunk[0]} frames has {chunk[0] * T_f} tokens "
                                 f"(tokens_per_frame={T_f}), got {count}")
        elif self.room() < count:
            raise ValueError(f"key_states: {count} incoming tokens do not fit: {self.room()} slots left in the "
                             f"fullest class (length {self.length})")
        elif n.prefix == 0 and count != P:
            raise ValueError(f"key_states: the first forward on an empty cache is the prefix of prefix_len={P} "
                             f"tokens, got {count}")
        if n.prefix == 0 and (rel_positions is not None or stored not in (0, count)):
            raise ValueError("rel_positions: the prefix is stored whole at positions 0 .. P-1 (rel_positions=None)")
        starts = tuple(self.class_length(c) if c in self.classes else 0 for c in CLASSES)
        new = self._incoming_positions(count, rel_positions)
        delta = new - (self.length + torch.arange(count, device=new.device))  # true - default
        frames, extent = (0, 0) if chunk is None else chunk
        for block in self.blocks:
            start = starts[block.cls]
            block.positions[..., start:start + count] = new.to(block.device)  # [B, (3,) T] over every row
        return ClassForward(start=self.length, count=count, stored=stored, starts=starts, frames=frames,
                            extent=extent, delta={device: delta.to(device) for device in self._devices},
                            after=self._after(frames, extent, stored))

    def _after(self, frames: int, extent: int, stored: int) -> ClassCounters:
        """The counters once a forward's last layer has stored it: a chunk awaits its step, the prefix sets R,
        text adds to the text."""
        n = self.counters
        if frames:
            return dataclasses.replace(n, arrived=frames, pending_extent=extent)
        if n.prefix == 0:
            return dataclasses.replace(n, prefix=stored, next_position=stored) if stored else n
        return dataclasses.replace(n, text=n.text + stored)

    def _incoming_positions(self, count: int, rel: torch.Tensor | None) -> torch.Tensor:
        """True positions int64 [B, T] ([B, 3, T] M-RoPE) of the incoming tokens (docs/h2svc.md §4): from R for a chunk,
        the prefix or the first text after the video; after stored text, from its largest position + 1."""
        device = self._home_device
        B = self._batch_size
        if rel is None:
            rel = torch.arange(count, device=device)
            rel = rel.expand(3, count) if self.mrope else rel
        rel = rel.to(device)
        text = self.counters.text
        if text == 0:
            base = torch.full((B,), self.counters.next_position, dtype=torch.int64, device=device)
        else:  # text after text (decode steps): every class holds the same text; read one row of the first block
            block = self.blocks[0]
            length = self.class_length(block.cls)
            base = block.positions[0, ..., length - text:length].reshape(B, -1).amax(dim=-1) + 1
        lead = (slice(None),) + ((None,) if self.mrope else ()) + (None,)
        return base[lead] + rel

    def write(self, forward: ClassForward, layer: int, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the incoming keys [B, Hkv, T, D] of `layer` to their true positions and write keys and values into
        each class block's rows of that layer; return the incoming tensors themselves (the attention function
        claims them and attends over the class blocks)."""
        count = forward.count
        rotated = None
        for part in self._parts[layer]:
            block = part.block
            if rotated is None:
                rotated = apply_rotary_delta(key_states, forward.delta[block.device].unsqueeze(1), block.inv_freq,
                                             self.rotary)
            start = forward.starts[part.cls]
            block.keys[part.rows, :, start:start + count] = rotated[:, part.kv_heads].transpose(0, 1)
            block.values[part.rows, :, start:start + count] = value_states[:, part.kv_heads].transpose(0, 1)
        return key_states, value_states

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

    def attend_shared(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """A KV-shared layer's attention over `layer`'s class blocks (`attend`: the blocks hold the keys already)."""
        return class_attention(module, self, layer, query, dropout=dropout, scaling=scaling, **kwargs)

    def truncate(self, length: int) -> None:
        """Forget text from `length` on (a question and its answer); the video (prefix and frames) stays."""
        video = self.length - self.counters.text
        if not isinstance(length, int) or isinstance(length, bool) or not video <= length <= self.length:
            raise ValueError(f"length: expected an int in [{video}, {self.length}] (only the text after the video "
                             f"can be dropped), got {length!r}")
        self.truncate_states(length)
        self.counters = dataclasses.replace(self.counters, text=length - video)

    def reset(self) -> None:
        """Empty the cache (no prefix, no frames, counters 0, `undefined` cleared, every slot frame −1); the buffers
        stay allocated."""
        for block in self.blocks:
            block.slot_frames.fill_(-1)
        super().reset()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, backend: str = "auto") -> H2SVCChunkResult:
        """One H2SVC step after a chunk's prefill (docs/h2svc.md §3–4), every class block in place: FIFO / STCE keep
        sets, the slot plan, and the right-aligned re-index when `cfg.needs_reindex` says so (docs/h2svc.md §7.2).

        Every block is checked before the first one is written (ValueError/TypeError, cache untouched); an
        exception after that leaves the cache `undefined`. Under tensor parallelism (`group`), where the checks read
        the blocks' contents (CPU tensors; `read_contents`), a rank's verdict may differ from the others' (a
        non-finite value in its heads only), so the ranks agree first (`hermes.parallel.refusing_ranks`, one
        all-reduce of a flag per rank): one refusal, and every rank refuses with its cache untouched
        (docs/multi-gpu.md#failures).
        """
        self._check_defined()
        n = self.counters
        if not n.arrived:
            raise ValueError("step: no chunk awaits a step (prefill one with forward_context(frames=...))")
        check_backend(backend)
        cfg, F, first = self.cfg, n.arrived, n.frames_seen
        largest = n.next_position + n.pending_extent  # the chunk's largest position (host)
        reindex = cfg.needs_reindex(largest)
        # a class without heads holds nothing (its count stays 0, as `held` reports it)
        held_after = tuple(min(cfg.window(c), n.held[c] + F) if c in self.classes else 0 for c in CLASSES)
        # R (§4): every row's retained frames end at R - 1 after a re-index, R - 1 >= the largest one held
        next_position = cfg.prefix_len + max(held_after[c] for c in self.classes) * cfg.tokens_per_frame
        clock = StreamClock(held=0, num_frames=F, first_frame=first, reindexed=torch.tensor(reindex),
                            next_position=next_position)
        calls, refusal = [], None
        try:
            for block in self.blocks:
                args = (block.keys, block.values, block.positions, block.slot_frames, cfg, block.cls,
                        block.inv_freq, self.rotary)
                block_clock = clock.at(n.held[block.cls])
                check_h2svc_step(*args, block_clock, block.features)
                calls.append((args, block_clock, block.features))
        except (ValueError, TypeError) as error:
            refusal = error
        if self.group is not None and read_contents(None, self.blocks[0].values):
            refused = refusing_ranks(self.group, refusal is not None, self.blocks[0].device)
            if refused and refusal is None:
                refusal = ValueError(f"step: rank(s) {refused} refused the arriving frames of their heads; every "
                                     f"rank refuses the step (its cache as before the chunk)")
        if refusal is not None:
            raise refusal
        after = dataclasses.replace(n, held=held_after, arrived=0, pending_extent=0, frames_seen=first + F,
                                    next_position=next_position if reindex else largest + 1)

        def step() -> tuple[H2SVCChunkResult, bool]:
            for args, block_clock, features in calls:
                hk.h2svc_step(*args, clock=block_clock, features=features, backend=backend)
            self.counters = after
            return H2SVCChunkResult(first_frame=first, num_frames=F, held=self.held, reindexed=clock.reindexed,
                                    next_position=after.next_position), reindex

        return self._step_in_place(step)

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, reindexes, bytes_allocated (as HERMES), plus
        frames_seen, held (frames per class name), next_position and bytes_per_class."""
        return {**super().stats(), "frames_seen": self.frames_seen, "held": self.held,
                "next_position": self.next_position, "bytes_per_class": self.class_nbytes()}
