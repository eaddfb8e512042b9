"""What every policy's KV cache shares: `StreamCacheBase`, a `transformers.Cache` the streaming front drives the
same way whatever the policy. It owns the host counters (one frozen value, moved at a forward's last layer and by
in-place steps), reset, the forward contexts (stored, read-only, partly stored, left-padded), the per-thread
hand-off to the attention function (`claim_update`), failure bookkeeping (`atomic()`, `undefined`), the buffers'
bookkeeping (`allocate`: `data_ptrs`, `nbytes`) and stats; a policy's cache adds its storage through five methods
(`begin_forward`, `write`, `attend`, `truncate`, `contents`). Also here: `layer_runs` (the layers of a cache split
over devices) and `prefill` of a video chunk. The contract, with shapes: docs/policies.md#cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, ClassVar, Iterator, Sequence, TypeVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from hermes.linear_state import RECURRENT, LinearLayout, LinearStates
from hermes.window import WindowLayout, Windows, window_mask
from hermes_kernels.engine.checks import check_positive_int
from hermes_kernels.rope import RotaryLayout

_HANDOFF = threading.local()
T = TypeVar("T")


def claim_update(key: torch.Tensor) -> tuple["StreamCacheBase", Any] | None:
    """The (cache, layer) whose `update` returned exactly `key`, consumed once; None for any other tensor. `layer`
    is the cache's layer (an int) for a policy layer, else a `SideLayer` (a sliding-window layer, or a KV-shared
    layer reading a layer's keys).

    The model calls `cache.update` right before its attention function, on the same thread, and passes the
    returned keys on unchanged; identity of that tensor object ties the attention call to the cache without
    threading anything through the model's forward signature. A KV-shared layer (Gemma 4) calls no `update`: it
    attends over the keys an earlier layer's `update` returned, which stay claimable as that layer's, read as
    shared, for the rest of the forward.
    """
    last = getattr(_HANDOFF, "last", None)
    if last is not None and last[2] is key:
        _HANDOFF.last = None
        cache = last[0]()
        return None if cache is None else (cache, last[1])
    for cache_ref, layer, keys in getattr(_HANDOFF, "shared", ()):
        if keys is key:
            cache = cache_ref()
            return None if cache is None else (cache, SideLayer(layer.decoder if isinstance(layer, SideLayer)
                                                                else layer, shared=True,
                                                                sliding=isinstance(layer, SideLayer)))
    return None


@dataclasses.dataclass(frozen=True)
class SideLayer:
    """What an attention call outside the policy's own layers reads: `decoder`, a sliding-window decoder layer that
    computes its keys (`sliding`), or the cache layer a KV-shared layer reads (`shared`, not `sliding`)."""

    decoder: int
    shared: bool = False
    sliding: bool = True


@dataclasses.dataclass(frozen=True)
class Counters:
    """The host state of a cache, one frozen value: `length`, the slots transformers sees (prefix, video, text). A
    policy's cache extends it with its own fields (`dataclasses.replace` moves them); `atomic()` restores it
    whole and `reset()` puts back the value the cache was built with."""

    length: int = 0


@dataclasses.dataclass
class Forward:
    """What one forward through the model writes: tokens [start, start + count) of every stream (default positions,
    the length transformers sees), of which the first `stored` stay; `after`: the cache's counters once its last
    layer has stored them; `masks` memoised for this forward. A policy cache may extend it with what its own
    forwards need (keyword-only fields)."""

    start: int
    count: int
    stored: int
    after: Any = None
    masks: dict = dataclasses.field(default_factory=dict)
    # the sliding-window layers' side of the forward (`StreamCacheBase` sets them): the stream position of its
    # first token, stream - default positions, the incoming tokens' vision blocks
    seen: int = 0
    turn: int = 0
    blocks: torch.Tensor | None = None

    @property
    def hidden_start(self):
        """Where the padding of a left-padded forward starts (`hidden_keys`): the slot of its first token."""
        return self.start


class _LayerView(CacheLayerMixin):
    """Per-layer face of the stacked buffer, so transformers' generic `Cache` properties see the cache's layers:
    `layer` is the cache's index (None for a sliding-window layer, `_WindowView`), `decoder_layer` the model's (they
    differ in a hybrid model)."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "StreamCacheBase", layer: int | None, decoder_layer: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self._layer = layer
        self._decoder_layer = decoder_layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the stack is allocated up front."""

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._decoder_layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer)

    def get_seq_length(self) -> int:
        return self._cache.length

    def get_max_length(self) -> int:
        return self._cache.capacity

    def _window_check(self) -> int:
        if self._layer is None:
            raise NotImplementedError(f"{type(self._cache).__name__}: a sliding-window layer's keys live in a ring; "
                                      "read contents()")
        return self._layer

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.layer_keys(self._window_check())

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError(f"{type(self._cache).__name__} layers are views of its buffers; write through "
                                 "update()")

    @property
    def values(self) -> torch.Tensor:
        return self._cache.layer_values(self._window_check())

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError(f"{type(self._cache).__name__} layers are views of its buffers; write through "
                                 "update()")


class _LinearView(LinearAttentionCacheLayerMixin):
    """A linear-attention layer's face for transformers (`Cache.is_linear`, `len(cache)`); its states live in the
    cache's `LinearStates` and are reached through the cache's own `get_conv_state` / `update_*` methods."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "StreamCacheBase", decoder_layer: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self._decoder_layer = decoder_layer

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to do: the states are allocated up front."""

    def update_conv_state(self, conv_states, state_idx=0, **kwargs):
        return self._cache.update_conv_state(conv_states, self._decoder_layer, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        return self._cache.update_recurrent_state(recurrent_states, self._decoder_layer, state_idx, **kwargs)

    def get_seq_length(self) -> int:
        return self._cache.length


class _WindowView(_LayerView):
    """A sliding-window layer's face for transformers (`Cache.is_sliding`, `len(cache)`); its ring lives in the
    cache's `Windows` (read through `contents()`) and is written through the cache's `update`."""

    is_sliding = True
    is_croppable = False

    def __init__(self, cache: "StreamCacheBase", decoder_layer: int):
        super().__init__(cache, None, decoder_layer)


def layer_runs(num_layers: int, *, batch_size: int, num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor,
               rotary: Sequence[int] | RotaryLayout | None,
               layer_devices: Sequence[torch.device | str] | None,
               stack_bounds: Sequence[int]) -> list[tuple[torch.device, int, int]]:
    """Check a cache's geometry and split its layers into runs that share one buffer: (device, first, end) for
    consecutive layers on one device, cut again at every `stack_bounds` entry. ValueError naming the argument.

    layer_devices: the device of every layer (default: inv_freq's for all); stack_bounds: ascending layer indices
    inside (0, L) where a new run starts although the device does not change (lays out a `device_map` split on
    one device, e.g. for tests).
    """
    for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_positive_int(name, value)
    if head_dim % 2:
        raise ValueError(f"head_dim: rotary embeddings need an even head dim, got {head_dim}")
    layout = RotaryLayout.of(rotary, head_dim // 2)  # ValueError / TypeError naming rotary
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (layout.pairs,):
        raise ValueError(f"inv_freq: expected a tensor of shape [R/2={layout.pairs}] for {layout.describe()}, got "
                         f"{getattr(inv_freq, 'shape', type(inv_freq).__name__)}")
    devices = [torch.device(d) for d in (layer_devices or [inv_freq.device] * num_layers)]
    if len(devices) != num_layers:
        raise ValueError(f"layer_devices: expected one device per layer ({num_layers}), got {len(devices)}")
    bounds = list(stack_bounds)
    if any(not isinstance(b, int) or isinstance(b, bool) for b in bounds) or bounds != sorted(set(bounds)) or \
            any(not 0 < b < num_layers for b in bounds):
        raise ValueError(f"stack_bounds: expected ascending distinct layer indices inside (0, L={num_layers}), "
                         f"got {bounds}")
    runs, first = [], 0
    while first < num_layers:
        end = first + 1
        while end < num_layers and devices[end] == devices[first] and end not in bounds:
            end += 1
        runs.append((devices[first], first, end))
        first = end
    return runs


class StreamCacheBase(Cache):
    """What every policy cache of the stream shares: a `transformers.Cache` the front drives the same way
    (docs/policies.md#cache).

    A subclass calls `super().__init__` first (the layer views hold only a weak proxy of the cache), allocates its
    buffers with `allocate`, sets `capacity` and implements `begin_forward`, `write`, `attend`, `truncate` and
    `contents`; `room()`, `length` (the counters' `length`) and `position_range()` have defaults it may override.
    Its in-place step runs through `_step_in_place` after `_check_defined()` and its own validation.
    `step_name` names that step in the message of a cache a failed step left undefined.

    Step timing (a live session's compression_ms, docs/policies.md#cache): while `step_clock` is a clock (a callable
    returning seconds), every in-place step is read on it before and after, the CUDA devices of the buffers
    synchronised at both ends (the step's kernels finish inside its time, the prefill's before it), and
    `step_seconds` grows by the step's duration; None (the default) times and synchronises nothing.
    """

    step_name: ClassVar[str] = "step"

    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 rotary: Sequence[int] | RotaryLayout | None, home_device: torch.device | str,
                 counters: Counters = Counters(), linear: LinearLayout | None = None,
                 windows: WindowLayout | None = None):
        """num_layers L, batch_size B, num_kv_heads Hkv, head_dim D: the cache's geometry (incoming key_states are
        [B, Hkv, T, D]); rotary: stored as the `RotaryLayout` of D/2 pairs every rotation of the cache reads (1D
        RoPE included); home_device: where default positions and padding counts live (layer 0's device);
        counters: the empty cache's host state (`reset()` puts it back); linear: a hybrid model's
        `LinearLayout` (its L full-attention layers are the cache's layers 0..L-1 in depth order, its
        linear-attention layers' states live in `linear_states`), None when every decoder layer is full
        attention (docs/qwen3_5.md#hybrid-cache); windows: a decoder's `WindowLayout` (its L full-attention layers
        that compute their own keys are the cache's layers, its sliding-window layers' rings live in `windows`,
        its KV-shared layers read their source's), None without sliding-window or KV-shared layers
        (docs/gemma4.md)."""
        if linear is not None and windows is not None:
            raise ValueError("windows: a decoder with both linear-attention and sliding-window layers is not supported")
        layout = linear if linear is not None else windows
        if layout is not None and len(layout.full_layers) != num_layers:
            raise ValueError(f"{'linear' if linear is not None else 'windows'}: the layout has "
                             f"{len(layout.full_layers)} full-attention layers, the cache {num_layers}")
        self.rotary = RotaryLayout.of(rotary, head_dim // 2)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._batch_size = batch_size
        self._home_device = torch.device(home_device)
        self._empty = counters
        self.counters = counters
        self._steps = 0
        self._reindexes = 0
        self.step_clock: Callable[[], float] | None = None
        self.step_seconds = 0.0  # seconds of the in-place steps timed by step_clock, in all
        # set while an in-place step may have written below the length; only reset() clears it
        self._undefined = False
        self._context: dict | None = None
        self._forward: Forward | None = None
        self._length_before_commit = 0  # the length when the linear states' last committing context began
        self._buffers: list[torch.Tensor] = []
        # the model's decoder index -> the cache's layer, for the full-attention layers
        full = range(num_layers) if layout is None else layout.full_layers
        self._cache_layer = {decoder: layer for layer, decoder in enumerate(full)}
        self.linear_states = None if linear is None else LinearStates(linear, batch_size, self.allocate)
        self.windows = None if windows is None else Windows(windows, batch_size, self.allocate)
        self._seen = 0  # tokens of the uncompressed stream: the next token's stream position (sliding layers)
        self._step_length = 0  # the length right after the last in-place step
        # the decoder layer whose `update` begins a forward: the first that computes keys
        self._first_writer = min((*full, *(() if windows is None else windows.sliding_layers)))
        self._readers = {} if windows is None else windows.readers
        views = [_LayerView(self, layer, decoder) for decoder, layer in self._cache_layer.items()]
        if linear is not None:
            views = [views[self._cache_layer[i]] if kind != "linear_attention" else _LinearView(self, i)
                     for i, kind in enumerate(linear.kinds)]
        if windows is not None:
            own = {decoder: views[layer] for decoder, layer in self._cache_layer.items()}
            own.update({i: _WindowView(self, i) for i in windows.sliding_layers})
            views = [own[source] for source in windows.sources]
        Cache.__init__(self, layers=views)

    # ---- what a policy cache implements (docs/policies.md#cache) -------------------------------------------
    def begin_forward(self, count: int, rel_positions: torch.Tensor | None, stored: int) -> Forward:
        """At layer 0 of every forward of `count` tokens, `stored` of which stay: check that they fit, write their
        true positions (`rel_positions` as `forward_context` describes them, None for text) and return the
        `Forward` every layer's `write` gets, with `after`, the counters once the forward's last layer stored."""
        raise NotImplementedError

    def write(self, forward: Forward, layer: int, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s incoming keys and values [B, Hkv, T, D] (post-RoPE at the default positions) past
        the length; return the (keys, values) the model hands to its attention, which hands them to `attend`."""
        raise NotImplementedError

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention of `layer` for the running forward: query [B, H, T, D] at the default positions, key/value
        as `write` returned them. Rotates the queries to the true positions and attends over the cache's storage.
        Returns (output [B, T, H, D], None), as transformers' attention functions do."""
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (a question and its answer): ValueError naming `length` for a length
        that is not an int in the range the cache can drop to; storage is untouched."""
        raise NotImplementedError

    def attend_shared(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention of a KV-shared decoder layer that reads cache layer `layer`'s keys, after that layer
        attended: query [B, H, T', D] at the default positions (the last T' of the forward's tokens), key/value as
        `layer`'s `write` returned them. A policy cache of a model with KV-shared layers implements it."""
        raise NotImplementedError(f"{type(self).__name__}: KV-shared layers are not supported by this policy")

    def contents(self) -> dict[str, torch.Tensor]:
        """What the cache holds now, by name: views of the valid slots with the stream axis first ([B, ...]); names
        ending in "positions" are int64 position ids (`position_range`), in "keys" / "values" keys and values."""
        raise NotImplementedError

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """N: the sequence length transformers sees (the counters' `length`)."""
        return self.counters.length

    def room(self) -> int:
        """Tokens the next forwards may still bring past the length (default: capacity - length)."""
        return self.capacity - self.length

    def check_room(self, count: int) -> None:
        """ValueError naming `room` unless `count` more tokens fit past the length."""
        if count > self.room():
            raise ValueError(f"room: {count} more tokens do not fit (length {self.length}, capacity "
                             f"{self.capacity}); raise room")

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def mrope(self) -> bool:
        """Positions carry three axes (t, h, w): [..., 3, N] instead of [..., N]."""
        return self.rotary.num_axes == 3

    @property
    def is_compileable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def default_position_ids(self, count: int, start: int | None = None) -> torch.Tensor:
        """Positions the model is run with for `count` tokens from slot `start` (default: the length):
        `start + i` on every axis, int64 [B, count] (1D) or [3, B, count] (M-RoPE). The attention function
        rotates from these to the true positions."""
        start = self.length if start is None else start
        ids = torch.arange(start, start + count, device=self._home_device)
        ids = ids.expand(self._batch_size, count)
        return ids.expand(3, self._batch_size, count) if self.mrope else ids

    # ---- buffers and stats ---------------------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 fill: float = 0) -> torch.Tensor:
        """A buffer of the cache, allocated once (`data_ptrs`, `nbytes` and `buffers` count it)."""
        buffer = torch.full(tuple(shape), fill, dtype=dtype, device=device)
        self._buffers.append(buffer)
        return buffer

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer `allocate` gave, whole (free slots included)."""
        return list(self._buffers)

    def data_ptrs(self) -> list[int]:
        """Storage addresses of every buffer; they never change after construction."""
        return [t.data_ptr() for t in self._buffers]

    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers."""
        return sum(t.numel() * t.element_size() for t in self._buffers)

    def position_range(self) -> tuple[int, int]:
        """(smallest, largest) valid position over every layer, row, stream and axis; (0, -1) when empty."""
        if self.length == 0:
            return 0, -1
        spans = [view for name, view in self.contents().items() if name.endswith("positions") and view.numel()]
        lows = torch.stack([span.amin().to(self._home_device) for span in spans])
        highs = torch.stack([span.amax().to(self._home_device) for span in spans])
        return int(lows.min().item()), int(highs.max().item())

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, reindexes, bytes_allocated."""
        return {"length": self.length, "capacity": self.capacity, "positions": self.position_range(),
                "steps": self._steps, "reindexes": self._reindexes, "bytes_allocated": self.nbytes()}

    def reset(self) -> None:
        """Empty the cache (the counters it was built with, step counters 0, `undefined` cleared); the buffers
        stay allocated."""
        self.counters = self._empty
        self._steps = 0
        self._reindexes = 0
        self._undefined = False
        self._seen = self._step_length = 0
        if self.linear_states is not None:
            self.linear_states.reset()
        if self.windows is not None:
            self.windows.reset()

    # ---- forwards ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, rel_positions: torch.Tensor | None = None, *, read_only: bool = False,
                        keep: int | None = None, left_padding: torch.Tensor | None = None,
                        blocks: torch.Tensor | None = None) -> Iterator["StreamCacheBase"]:
        """Describe the next forward(s) through the model: one forward, or `model.generate`'s prefill and
        decode steps.

        rel_positions: int64 [T] / [3, T], or one row per stream [B, T] / [B, 3, T]: offsets of the FIRST
            forward's tokens from the next position (largest position + 1); None means text, 0, 1, ..., T-1
            on every axis. Later forwards (decode steps) are text after the largest position.
        read_only:     attend over the cache plus the incoming tokens without keeping any (length unchanged).
        keep:          keep only the first `keep` incoming tokens of each forward (a chunk carrying read-only
                       guidance prompts, docs/hermes.md §4); default all.
        left_padding:  int64 [B]: padding tokens at the start of the FIRST forward, per stream (a question batch
                       of uneven lengths); those slots stay hidden from every query in the context.
        blocks:        int64 [T]: the vision block of each of the FIRST forward's tokens (-1: text), whose tokens
                       see each other both ways on sliding-window layers (`VideoChunk.blocks`, docs/gemma4.md#masks).
        """
        if read_only and keep is not None:
            raise ValueError("keep: a read-only forward keeps nothing; pass read_only or keep, not both")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 0):
            raise ValueError(f"keep: expected a non-negative int, got {keep!r}")
        if left_padding is not None and (not isinstance(left_padding, torch.Tensor) or left_padding.dtype !=
                                         torch.int64 or tuple(left_padding.shape) != (self._batch_size,)):
            raise ValueError(f"left_padding: expected int64 [B={self._batch_size}], got "
                             f"{getattr(left_padding, 'shape', type(left_padding).__name__)}")
        if self._context is not None:
            raise RuntimeError(f"{type(self).__name__}.forward_context: contexts do not nest")
        states = self.linear_states
        if states is not None and keep is not None and not read_only:
            raise ValueError("keep: the linear-attention layers' states would take in the tokens left out; a hybrid "
                             "model stores all of a forward's tokens or none (docs/qwen3_5.md#hybrid-cache)")
        if states is not None and left_padding is not None:
            raise ValueError("left_padding: padding would pass through the linear-attention layers' states; a "
                             "hybrid model takes no left-padded forward (docs/qwen3_5.md#hybrid-cache)")
        if self.windows is not None and left_padding is not None:
            raise ValueError("left_padding: a sliding-window layer's window counts tokens, padding included; a model "
                             "with sliding-window layers takes no left-padded forward (docs/gemma4.md#limits)")
        if self.windows is not None and keep is not None and not read_only:
            raise ValueError("keep: the sliding-window layers' rings would hold the tokens left out; a model with "
                             "sliding-window layers stores all of a forward's tokens or none (docs/gemma4.md#limits)")
        if blocks is not None and (not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.int64 or
                                   blocks.dim() != 1):
            raise ValueError(f"blocks: expected int64 [T], got {getattr(blocks, 'shape', type(blocks).__name__)}")
        self._context = {"rel_positions": rel_positions, "keep": 0 if read_only else keep,
                         "left_padding": left_padding, "hidden": None, "blocks": blocks}
        if states is not None:
            states.begin(store=not read_only)
            start, epoch = self.length, states.epoch
        success = False
        try:
            yield self
            success = True
        finally:
            self._context = None
            self._forward = None
            if states is not None:
                states.end(success)
                if states.epoch != epoch:
                    self._length_before_commit = start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' write of one layer: the forward begun at layer 0 (`begin_forward`), the policy's `write`,
        the hand-off to the attention function; the counters move once the last layer has stored."""
        windows = self.windows
        if windows is not None and layer_idx in windows.slot_of:
            return self._update_window(layer_idx, key_states, value_states)
        layer = self._cache_layer.get(layer_idx)
        if layer is None:
            raise RuntimeError(f"{type(self).__name__}.update: decoder layer {layer_idx} holds no keys in this cache")
        states = self.linear_states
        if states is not None:
            states.arrive(layer_idx, RECURRENT)
        forward = self._forward_at(layer_idx, key_states, self.num_kv_heads, self.head_dim)
        keys, values = self.write(forward, layer, key_states, value_states)
        self._hand_off(layer_idx, layer, keys)
        if layer == self.num_layers - 1:
            self.counters = forward.after
            self._seen = forward.seen + forward.stored
        if states is not None:
            states.leave(layer_idx)
        return keys, values

    def _update_window(self, layer_idx: int, key_states: torch.Tensor,
                       value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding-window layer's write: its ring takes the incoming tokens at their stream positions; returns the
        keys and values its queries see (`Windows.write`)."""
        layout = self.windows.layout
        forward = self._forward_at(layer_idx, key_states, layout.num_kv_heads, layout.head_dim)
        keys, values = self.windows.write(layer_idx, forward.seen, forward.turn, key_states, value_states)
        self._hand_off(layer_idx, SideLayer(layer_idx), keys)
        return keys, values

    def _hand_off(self, layer_idx: int, layer, keys: torch.Tensor) -> None:
        """Tie the attention call that follows `update` to this cache (`claim_update`); keys a KV-shared layer
        reads later in the forward stay claimable."""
        _HANDOFF.last = (weakref.ref(self), layer, keys)
        if layer_idx in self._readers.values():
            _HANDOFF.shared = getattr(_HANDOFF, "shared", []) + [(weakref.ref(self), layer, keys)]

    def _forward_at(self, layer_idx: int, key_states: torch.Tensor, heads: int, dim: int) -> Forward:
        """The forward decoder layer `layer_idx`'s `update` belongs to: begun at the first decoder layer that
        computes keys, then the same one for every later layer with the same token count (RuntimeError
        otherwise). heads, dim: Hkv and D of that layer's keys."""
        if layer_idx == self._first_writer:
            self._check_defined()
            count = self._incoming_count(key_states, heads, dim)
            if self.windows is not None:
                self.windows.check_count(count)
            rel, stored, pads, blocks = self._take_context(count)
            _HANDOFF.shared = []
            forward = self.begin_forward(count, rel, stored)
            forward.seen, forward.turn, forward.blocks = self._seen, self._seen - self.length, blocks
            self._forward = forward
            if pads is not None:
                self._context["hidden"] = (self._forward.hidden_start, pads.to(self._home_device))
        fwd = self._forward
        if fwd is None or key_states.shape[-2] != fwd.count:
            raise RuntimeError(f"{type(self).__name__}.update: layer {layer_idx} updated outside a forward that "
                               f"began at layer {self._first_writer} with the same token count")
        return fwd

    def _incoming_count(self, key_states: torch.Tensor, heads: int, dim: int) -> int:
        """T of a forward's key_states [B, Hkv, T, D]; ValueError unless B, Hkv and D are this cache's."""
        count = key_states.shape[-2]
        expected = (self._batch_size, heads, count, dim)
        if tuple(key_states.shape) != expected:
            raise ValueError(f"key_states: expected [B={self._batch_size}, Hkv={heads}, T, D={dim}] for this "
                             f"cache, got {tuple(key_states.shape)}")
        return count

    def _take_context(self, count: int) -> tuple[torch.Tensor | None, int, torch.Tensor | None, torch.Tensor | None]:
        """At the first layer of a forward of `count` tokens: (rel_positions of this forward, tokens it stores, its
        left padding, its vision blocks). The first forward of a context takes the context's offsets, padding and
        blocks (checked here); later forwards are text after it."""
        context = self._context or {"rel_positions": None, "keep": None, "left_padding": None, "hidden": None,
                                    "blocks": None}
        rel, pads, blocks = context["rel_positions"], context["left_padding"], context["blocks"]
        context["rel_positions"] = context["left_padding"] = context["blocks"] = None
        if blocks is not None and blocks.shape[0] != count:
            raise ValueError(f"blocks: expected one block per incoming token ({count}), got {blocks.shape[0]}")
        if pads is not None and (int(pads.max()) >= count or int(pads.min()) < 0):
            raise ValueError(f"left_padding: expected counts in [0, T={count}) (every stream keeps a token), "
                             f"got {pads.tolist()}")
        keep = context["keep"]
        return rel, count if keep is None else min(keep, count), pads, blocks

    # ---- sliding-window and KV-shared layers (hermes.window) --------------------------------------------------
    def attend_side(self, module: torch.nn.Module, side: SideLayer, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention of a layer outside the policy's own: a sliding-window layer, or a KV-shared layer reading one
        (the queries turned to stream positions, over the window `update` returned, masked by `window_mask`), or a
        KV-shared layer reading a policy layer (`attend_shared`). query [B, H, T', D]: the last T' of the
        forward's tokens (transformers drops the others before the KV-shared layers when it keeps one logit)."""
        if not side.sliding:
            return self.attend_shared(module, side.decoder, query, key, value, attention_mask, dropout, scaling,
                                      **kwargs)
        from hermes.attention import model_attention  # hermes.attention imports this module for claim_update
        fwd, layout = self.current_forward, self.windows.layout
        query = self.windows.turn_query(self.windows_source(side.decoder), query, fwd.turn)
        lo = max(0, fwd.seen - (layout.window - 1))
        rows = query.shape[2]
        mask = self.forward_mask(("window", rows), query.device, lambda: window_mask(
            fwd.seen, fwd.count, lo, layout.window, fwd.blocks, query.device)[:, :, fwd.count - rows:])
        return model_attention(module, query, key, value, mask, dropout, scaling, **kwargs)

    def windows_source(self, layer_idx: int) -> int:
        """The sliding decoder layer whose ring decoder layer `layer_idx` reads (itself or its KV source)."""
        return self.windows.layout.sources[layer_idx]

    def truncate_states(self, length: int) -> None:
        """Called by a policy cache's `truncate` once `length` is valid, before its counters move: the
        linear-attention states (`truncate_linear`) and the sliding-window layers' stream go back with the
        length. The rings hold the tokens stored since the last in-place step, so on a model with sliding-window
        layers only a length at or past the length that step left is accepted, and only while the window before
        it is still in the rings; ValueError naming `length` for any other."""
        self.truncate_linear(length)
        if self.windows is None or length == self.length:
            return
        seen = self._seen - (self.length - length)
        if length < self._step_length or not self.windows.can_return(seen):
            raise ValueError(f"length: the sliding-window layers hold the tokens stored since the last step only; this "
                             f"cache can go back to {max(self._step_length, self.length - self._seen)} at the "
                             f"least, got {length} (docs/gemma4.md#limits)")
        self._seen = seen

    def side_contents(self) -> dict[str, torch.Tensor]:
        """The layers outside the policy's own, for `contents()`: the linear-attention layers' committed states
        (`LinearStates.contents`) and the sliding-window layers' windows (`Windows.contents`); empty without them."""
        out = self.linear_contents()
        if self.windows is not None:
            out.update(self.windows.contents(self._seen))
        return out

    # ---- a hybrid model's linear-attention layers (hermes.linear_state) ---------------------------------------
    def _linear(self, layer_idx: int) -> LinearStates:
        """The linear states, for decoder layer `layer_idx` (ValueError unless it is a linear-attention layer)."""
        states = self.linear_states
        if states is None or layer_idx not in states.slot_of:
            raise ValueError(f"{type(self).__name__}: decoder layer {layer_idx} is not a linear-attention layer")
        self._check_defined()
        return states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """transformers' read of a linear-attention layer's convolution state [B, C, K] (None: no state yet)."""
        return self._linear(layer_idx).get_conv_state(layer_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs) -> torch.Tensor:
        """transformers' write of a linear-attention layer's convolution input [B, C, T]; returns [state, input]."""
        return self._linear(layer_idx).update_conv_state(conv_states, layer_idx, kwargs.get("conv_kernel_size"))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """transformers' read of a linear-attention layer's recurrent state [B, Hv, Dk, Dv] (None: no state yet)."""
        return self._linear(layer_idx).get_recurrent_state(layer_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """transformers' write of a linear-attention layer's recurrent state (its last call in a forward)."""
        return self._linear(layer_idx).update_recurrent_state(recurrent_states, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the linear-attention layers hold a state (the committed one)."""
        return self.linear_states is not None and self.linear_states.has_state

    def is_recording_past(self, layer_idx: int) -> bool:
        """Never: the states are two fixed copies (`LinearStates`), not a growing record."""
        return False

    def linear_contents(self) -> dict[str, torch.Tensor]:
        """The linear-attention layers' committed states by name (`LinearStates.contents`), for `contents()`;
        empty for a model without them."""
        return {} if self.linear_states is None else self.linear_states.contents()

    def truncate_linear(self, length: int) -> None:
        """Called by a policy cache's `truncate` once `length` is valid, before its counters move: the
        linear-attention states cannot be cropped, so on a hybrid model only the current length and the length
        before the last storing forward context (a question and its answer: the states' last commit is undone)
        are accepted; ValueError naming `length` for any other."""
        states = self.linear_states
        if states is None or length == self.length:
            return
        if states.can_undo and length == self._length_before_commit:
            states.undo()
            return
        back = f" or {self._length_before_commit}" if states.can_undo else ""
        raise ValueError(f"length: the linear-attention layers' states cannot be cropped; this cache can go back to "
                         f"{self.length}{back} only, got {length} (docs/qwen3_5.md#hybrid-cache)")

    def stored_count(self) -> int:
        """Tokens of the running forward that stay in the cache (its first ones); the rest are read-only."""
        return self._forward.stored

    @property
    def current_forward(self) -> Forward:
        """The running forward (what `begin_forward` returned); RuntimeError outside one."""
        if self._forward is None:
            raise RuntimeError(f"{type(self).__name__}: no forward is running")
        return self._forward

    def hidden_keys(self) -> tuple | None:
        """Padding slots of the running context hidden from every query: (start, counts int64 [B]), stream b
        hiding slots [start, start + counts[b]) (`start` as the forward's `hidden_start` gives it); None when
        nothing is hidden."""
        return None if self._context is None else self._context["hidden"]

    def forward_mask(self, key, device: torch.device, build) -> torch.Tensor:
        """A mask memoised for the running forward (`build()` is called once per key and device)."""
        slot = (key, str(device))
        if slot not in self._forward.masks:
            self._forward.masks[slot] = build()
        return self._forward.masks[slot]

    def crop(self, max_length: int) -> None:
        """transformers' crop: keep `max_length` slots (negative: drop that many from the end)."""
        self.truncate(self.length + max_length if max_length < 0 else min(max_length, self.length))

    # ---- the layer views transformers reads --------------------------------------------------------------
    def layer_keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer [B, Hkv, N, D], for caches whose layers hold one sequence."""
        raise NotImplementedError(f"{type(self).__name__}: a layer's heads do not hold one sequence; read "
                                  "contents()")

    def layer_values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer [B, Hkv, N, D], for caches whose layers hold one sequence."""
        raise NotImplementedError(f"{type(self).__name__}: a layer's heads do not hold one sequence; read "
                                  "contents()")

    # ---- failures ----------------------------------------------------------------------------------------
    @property
    def undefined(self) -> bool:
        """True after an exception escaped an in-place step that had begun writing: the slots may be half
        rewritten, so every forward and step raises until `reset()`."""
        return self._undefined

    def _check_defined(self) -> None:
        """RuntimeError while a failed in-place step (named by `step_name`) has left the cache undefined: every
        forward checks it first, and a policy's step before anything else."""
        if self._undefined:
            raise RuntimeError(f"{type(self).__name__}: a failed {self.step_name} left the cache undefined; call "
                               "reset()")

    def _step_in_place(self, step: Callable[[], tuple[T, bool]]) -> T:
        """Run a policy's in-place step (writes below the length), its inputs already validated: `step()` does the
        writes, moves the counters and returns (its result, whether positions were re-indexed). An exception
        escaping it leaves the cache `undefined` (the writes may be half done); on success the step counters
        move; timed by `step_clock` when set."""
        clock = self.step_clock
        if clock is not None:
            self._synchronize()
            began = clock()
        self._undefined = True
        result, reindexed = step()
        self._step_length = self.length
        if clock is not None:
            self._synchronize()
            self.step_seconds += clock() - began
        self._steps += 1
        self._reindexes += int(reindexed)
        self._undefined = False
        if self.linear_states is not None:
            self.linear_states.forget_undo()  # the keys moved: the states' last commit is part of the stream now
        return result

    def _synchronize(self) -> None:
        # CUDA runs ahead of the host: a step's time is its own only once the devices of its buffers are idle
        for device in {buffer.device for buffer in self._buffers if buffer.is_cuda}:
            torch.cuda.synchronize(device)

    @contextlib.contextmanager
    def atomic(self) -> Iterator["StreamCacheBase"]:
        """All or nothing: if the block raises (any BaseException, KeyboardInterrupt included) the cache is put
        back as it was at entry. Forwards write only past the length and move the counters at their last layer,
        so the counters are the whole state to restore: the valid slots were never touched.

        Not undone: a step that completed inside the block (its in-place moves cannot be reversed; the cache
        then holds the stepped state and the exception propagates) or one that failed while writing
        (`undefined`). A hybrid model's linear-attention states are put back with the counters (the last commit
        undone); where more than one storing context committed inside the block they cannot be, and the cache is
        left `undefined`.
        """
        saved = self.counters, self._steps, self._reindexes
        seen = self._seen
        states = self.linear_states
        epoch = None if states is None else states.epoch
        try:
            yield self
        except BaseException:
            if not self._undefined and self._steps == saved[1]:
                self.counters, self._steps, self._reindexes = saved
                self._seen = seen
                if states is not None and states.epoch != epoch:
                    # one storing context committed inside the block: its commit is undone with the counters
                    if states.epoch == epoch + 1 and states.can_undo:
                        states.undo()
                    else:
                        self._undefined = True
            raise

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{type(self).__name__}: streams are fixed in lockstep; beam search is not "
                                  "supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}: the batch of streams is fixed at construction")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__}: the batch of streams is fixed at construction")


def prefill(language_model: torch.nn.Module, cache: StreamCacheBase, chunk, **context) -> None:
    """Store a chunk (`hermes.models.VideoChunk`): one forward of its embeddings [B, T, hidden] at its relative
    positions, with the family's extra arguments (`chunk.lm_kwargs()`: Qwen3-VL's DeepStack) and vision blocks
    (`chunk.blocks`, Gemma 4); `context`: the policy cache's own `forward_context` arguments (H2SVC: frames,
    extent)."""
    if chunk.blocks is not None:
        context["blocks"] = chunk.blocks
    with cache.forward_context(chunk.rel_positions, **context):
        language_model(inputs_embeds=chunk.embeds, position_ids=cache.default_position_ids(chunk.embeds.shape[1]),
                       cache=cache, use_cache=True, **chunk.lm_kwargs())
