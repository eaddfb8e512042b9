"""The HERMES KV cache: a `transformers.Cache` over one preallocated stacked buffer per device (DESIGN.md §2.6–2.7).

Every layer holds the same number of tokens (§2.6), so keys and values live in one stacked tensor
`[L, B, Hkv, capacity, D]` per device (a model split with `device_map` keeps one stack per device, each
holding its consecutive layers; `stack_bounds` can split further, e.g. to exercise the split layout on one
device). The buffers are allocated once and never reallocated: appending writes into free slots, compression
(`hermes_kernels.compress_stacks`: one score/selection pass and one re-index decision for all layers, then each
stack compacted on its own device) rewrites the first slots in place, and truncation only moves the length back.
Memory is flat for any stream length.

Positions: each (layer, stream) keeps its own position ids, int64 `[L, B, capacity]` (1D RoPE) or
`[L, B, 3, capacity]` (M-RoPE t/h/w), because compression leaves gaps and deep layers carry summary
positions (§2.7). Incoming tokens continue from that layer's largest position + 1, plus a relative offset
per token (text: 0, 1, 2, ...; video: the family's grid layout). The model itself runs with default
positions `length + i`; the attention function (`hermes.attention`) rotates the incoming q/k by
`incoming_delta(layer)` = true - default, which the cache computes once per forward.

Modes of a forward (set with `forward_context`): store (the default, also what `model.generate` gets:
tokens are appended and the length grows), read-only (tokens are written to the free slots past the
length so attention can read them, but the length does not move: guidance passes and scoring) and partly
stored (`keep`: the first tokens are appended, the rest read-only: a chunk carrying its guidance prompts,
DESIGN.md §4). A question batch of uneven lengths is left-padded; `left_padding` hides the padding slots
from every query (`hidden_keys`).

Failures. Everything a forward writes goes to the free slots past the length, and the length moves only at
the last layer, so `atomic()` undoes any failed call by restoring the length and the step counters. The one
write below the length is the in-place compression (`compress`): it validates everything first (a bad input
raises with the cache untouched); an exception escaping it after that (a device error, an out-of-memory, a
KeyboardInterrupt in the middle of the moves) may leave the slots half rewritten. The cache then marks itself
`undefined` and refuses every forward and step until `reset()`.

Shared with the other policy caches (`StreamCacheBase`): the forward contexts (modes, the first forward's
offsets and left padding, masks memoised per forward), the per-thread hand-off to the attention function
(`claim_update`), `atomic()`, the per-layer views transformers expects, the lockstep restrictions and the
geometry checks (`layer_runs`). A policy cache supplies its storage, positions, `update` and what `atomic()`
must restore (`hermes.h2svc.cache` is the second one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Iterator, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import hermes_kernels as hk
from hermes.config import HermesConfig
from hermes.reference import CompressResult
from hermes.validation import check_stacks

_HANDOFF = threading.local()


def claim_update(key: torch.Tensor) -> tuple["StreamCacheBase", int] | None:
    """The (cache, layer) whose `update` returned exactly `key`, consumed once; None for any other tensor.

    The model calls `cache.update` right before its attention function, on the same thread, and passes the
    returned keys on unchanged; identity of that tensor object ties the attention call to the cache without
    threading anything through the model's forward signature.
    """
    last = getattr(_HANDOFF, "last", None)
    if last is None or last[2] is not key:
        return None
    _HANDOFF.last = None
    cache = last[0]()
    return None if cache is None else (cache, last[1])


@dataclasses.dataclass
class _Stack:
    """The buffers of the consecutive layers [first, first + Ld) that live on one device."""

    device: torch.device
    first: int
    keys: torch.Tensor          # [Ld, B, Hkv, capacity, D]
    values: torch.Tensor        # [Ld, B, Hkv, capacity, D]
    positions: torch.Tensor     # int64 [Ld, B, capacity] or [Ld, B, 3, capacity]
    inv_freq: torch.Tensor      # [D/2] on this device
    delta: torch.Tensor | None = None   # int64 [Ld, b, T] / [Ld, b, 3, T] of the running forward


@dataclasses.dataclass
class _Forward:
    """What one forward through the model writes: tokens [start, start + count) of every stream, of which the
    first `stored` stay (the length moves to start + stored after the last layer)."""

    start: int
    count: int
    stored: int
    masks: dict = dataclasses.field(default_factory=dict)


class _LayerView(CacheLayerMixin):
    """Per-layer face of the stacked buffer, so transformers' generic `Cache` properties see L layers."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "StreamCacheBase", layer: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the stack is allocated up front."""

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer)

    def get_seq_length(self) -> int:
        return self._cache.length

    def get_max_length(self) -> int:
        return self._cache.capacity

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.layer_keys(self._layer)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError(f"{type(self._cache).__name__} layers are views of its buffers; write through "
                                 "update()")

    @property
    def values(self) -> torch.Tensor:
        return self._cache.layer_values(self._layer)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError(f"{type(self._cache).__name__} layers are views of its buffers; write through "
                                 "update()")


def layer_runs(num_layers: int, *, batch_size: int, num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor,
               mrope_section: Sequence[int] | None, layer_devices: Sequence[torch.device | str] | None,
               stack_bounds: Sequence[int]) -> list[tuple[torch.device, int, int]]:
    """Check a cache's geometry and split its layers into runs that share one buffer: (device, first, end) for
    consecutive layers on one device, cut again at every `stack_bounds` entry. ValueError naming the argument.

    layer_devices: the device of every layer (default: inv_freq's for all); stack_bounds: ascending layer indices
    inside (0, L) where a new run starts although the device does not change (lays out a `device_map` split on
    one device, e.g. for tests).
    """
    for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim: rotary embeddings need an even head dim, got {head_dim}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq: expected a tensor of shape [D/2={head_dim // 2}], got "
                         f"{getattr(inv_freq, 'shape', type(inv_freq).__name__)}")
    if mrope_section is not None and (len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2):
        raise ValueError(f"mrope_section: expected three pair counts summing to D/2={head_dim // 2}, "
                         f"got {list(mrope_section)}")
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
    """What every policy cache of the stream shares: a `transformers.Cache` the front drives the same way.

    Subclasses hold the storage and positions and implement `length`, `capacity`, `room()` (tokens that still fit
    past the length in every row), `_begin_forward` (checks and `_take_context`, run once at layer 0), `update`
    (taking its forward from `_forward_at`, calling `_hand_off` per layer),
    `truncate`, `reset`, `stats`, `layer_keys` / `layer_values` (what `_LayerView` shows transformers),
    `_hidden_start()` (where a left-padded forward's padding starts), `_counters()` / `_restore_counters()` (the
    host state `atomic()` puts back; it must include `_steps`), `_home_device` (where the default positions
    live) and, optionally, `_end_context()`.
    """

    def _init_stream(self, num_layers: int, batch_size: int, mrope_section: Sequence[int] | None) -> None:
        """The shared fields (call first: the layer views hold only a weak proxy of the cache)."""
        self.mrope_section = None if mrope_section is None else [int(s) for s in mrope_section]
        self._batch_size = batch_size
        self._steps = 0
        self._compactions = 0
        # set while an in-place step may have written below the length; only reset() clears it
        self._undefined = False
        self._context: dict | None = None
        self._forward: _Forward | None = None
        Cache.__init__(self, layers=[_LayerView(self, layer) for layer in range(num_layers)])

    # ---- what every forward and step checks first ---------------------------------------------------------
    def _check_defined(self, failed: str) -> None:
        """RuntimeError while a failed in-place write (`failed` names it) has left the cache undefined."""
        if self._undefined:
            raise RuntimeError(f"{type(self).__name__}: a failed {failed} left the cache undefined; call reset()")

    def _forward_at(self, layer_idx: int, key_states: torch.Tensor) -> _Forward:
        """The forward `update` of layer `layer_idx` belongs to: begun at layer 0 (`_begin_forward`), then the
        same one for every later layer with the same token count (RuntimeError otherwise)."""
        if layer_idx == 0:
            self._forward = self._begin_forward(key_states)
        fwd = self._forward
        if fwd is None or key_states.shape[-2] != fwd.count:
            raise RuntimeError(f"{type(self).__name__}.update: layer {layer_idx} updated outside a forward that "
                               f"began at layer 0 with the same token count")
        return fwd

    def _incoming_count(self, key_states: torch.Tensor) -> int:
        """T of a forward's key_states [B, Hkv, T, D]; ValueError unless B, Hkv and D are this cache's."""
        count = key_states.shape[-2]
        expected = (self._batch_size, self.num_kv_heads, count, self.head_dim)
        if tuple(key_states.shape) != expected:
            raise ValueError(f"key_states: expected [B={self._batch_size}, Hkv={self.num_kv_heads}, T, "
                             f"D={self.head_dim}] for this cache, got {tuple(key_states.shape)}")
        return count

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def mrope(self) -> bool:
        return self.mrope_section is not None

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

    # ---- forwards ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, rel_positions: torch.Tensor | None = None, *, read_only: bool = False,
                        keep: int | None = None,
                        left_padding: torch.Tensor | None = None) -> Iterator["StreamCacheBase"]:
        """Describe the next forward(s) through the model: one forward, or `model.generate`'s prefill and
        decode steps.

        rel_positions: int64 [T] / [3, T], or one row per stream [B, T] / [B, 3, T]: offsets of the FIRST
            forward's tokens from the next position (largest position + 1); None means text, 0, 1, ..., T-1
            on every axis. Later forwards (decode steps) are text after the largest position.
        read_only:     attend over the cache plus the incoming tokens without keeping any (length unchanged).
        keep:          keep only the first `keep` incoming tokens of each forward (a chunk carrying read-only
                       guidance prompts, DESIGN.md §4); default all.
        left_padding:  int64 [B]: padding tokens at the start of the FIRST forward, per stream (a question batch
                       of uneven lengths); those slots stay hidden from every query in the context.
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
        self._context = {"rel_positions": rel_positions, "keep": 0 if read_only else keep,
                         "left_padding": left_padding, "hidden": None}
        try:
            yield self
        finally:
            self._context = None
            self._forward = None
            self._end_context()

    def _end_context(self) -> None:
        """Drop per-forward state when a context closes (hook)."""

    def _take_context(self, count: int) -> tuple[torch.Tensor | None, int]:
        """At layer 0 of a forward of `count` tokens: (rel_positions of this forward, tokens it stores). The first
        forward of a context takes the context's offsets and padding (checked here; the padding slots are recorded
        for `hidden_keys`); later forwards are text after it."""
        context = self._context or {"rel_positions": None, "keep": None, "left_padding": None, "hidden": None}
        rel, pads = context["rel_positions"], context["left_padding"]
        context["rel_positions"] = context["left_padding"] = None
        if pads is not None:
            if int(pads.max()) >= count or int(pads.min()) < 0:
                raise ValueError(f"left_padding: expected counts in [0, T={count}) (every stream keeps a token), "
                                 f"got {pads.tolist()}")
            context["hidden"] = (self._hidden_start(), pads.to(self._home_device))
        keep = context["keep"]
        return rel, count if keep is None else min(keep, count)

    def _hand_off(self, layer: int, keys: torch.Tensor) -> None:
        """Tie the tensor `update` returns for `layer` to this cache, for the attention function (`claim_update`)."""
        _HANDOFF.last = (weakref.ref(self), layer, keys)

    def stored_count(self) -> int:
        """Tokens of the running forward that stay in the cache (its first ones); the rest are read-only."""
        return self._forward.stored

    def hidden_keys(self) -> tuple | None:
        """Padding slots of the running context hidden from every query: (start, counts int64 [B]), stream b
        hiding slots [start, start + counts[b]) (`start` as `_hidden_start` gives it); None when nothing is
        hidden."""
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

    # ---- failures ----------------------------------------------------------------------------------------
    @property
    def undefined(self) -> bool:
        """True after an exception escaped an in-place step that had begun writing: the slots may be half
        rewritten, so every forward and step raises until `reset()`."""
        return self._undefined

    @contextlib.contextmanager
    def atomic(self) -> Iterator["StreamCacheBase"]:
        """All or nothing: if the block raises (any BaseException, KeyboardInterrupt included) the cache is put
        back as it was at entry. Forwards write only past the length and move it at their last layer, so the
        host counters (`_counters()`) are the whole state to restore: the valid slots were never touched.

        Not undone: a step that completed inside the block (its in-place moves cannot be reversed; the cache
        then holds the stepped state and the exception propagates) or one that failed while writing
        (`undefined`).
        """
        steps, saved = self._steps, self._counters()
        try:
            yield self
        except BaseException:
            if not self._undefined and self._steps == steps:
                self._restore_counters(saved)
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
    positions; `context`: the policy cache's own `forward_context` arguments (H2SVC: frames, extent)."""
    with cache.forward_context(chunk.rel_positions, **context):
        language_model(inputs_embeds=chunk.embeds, position_ids=cache.default_position_ids(chunk.embeds.shape[1]),
                       cache=cache, use_cache=True)


class HermesCache(StreamCacheBase):
    """Fixed-capacity KV cache with per-(layer, stream) positions and in-place HERMES compression.

    Args:
        cfg:            the HERMES policy (`cfg.num_layers` = L, `cfg.prefix_len`, `cfg.budget`, ...).
        batch_size:     B streams advanced in lockstep.
        num_kv_heads:   Hkv; head_dim: D (even).
        capacity:       slots per layer: prefix + budget + the largest chunk + room for guidance prompts or a
                        question and its answer. Must exceed prefix_len + budget.
        dtype:          storage dtype of keys/values (the model's).
        inv_freq:       [D/2] rotary inverse frequencies taken from the model's rotary module (§2.8).
        mrope_section:  frequency pairs per M-RoPE axis (t, h, w) for Qwen2.5-VL; None for 1D RoPE.
        layer_devices:  the device of every layer (default: inv_freq's device for all); consecutive layers on
                        one device share a stack.
        stack_bounds:   layers at which a new stack starts even though the device does not change (ascending,
                        inside (0, L)); e.g. [2] with 4 layers on one device gives stacks [0, 2) and [2, 4). The
                        results are the same as with one stack; this lays out a `device_map` split on one device.
    """

    def __init__(self, cfg: HermesConfig, *, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = ()):
        if not isinstance(cfg, HermesConfig):
            raise TypeError(f"cfg: expected a HermesConfig, got {type(cfg).__name__}")
        runs = layer_runs(cfg.num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          inv_freq=inv_freq, mrope_section=mrope_section, layer_devices=layer_devices,
                          stack_bounds=stack_bounds)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        if capacity <= cfg.prefix_len + cfg.budget:
            raise ValueError(f"capacity: {capacity} slots leave no room past prefix_len + budget = "
                             f"{cfg.prefix_len + cfg.budget} for a chunk or a question")

        self.cfg = cfg
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._init_stream(cfg.num_layers, batch_size, mrope_section)
        self._stacks: list[_Stack] = [self._allocate(device, first, end - first, inv_freq)
                                      for device, first, end in runs]
        self._stack_of_layer: list[tuple[_Stack, int]] = []
        for stack in self._stacks:
            self._stack_of_layer.extend((stack, local) for local in range(stack.keys.shape[0]))
        # pooled guidance attention of the running step, written by the attention function (§2.3)
        self.guidance_attn = torch.zeros(cfg.num_layers, batch_size, capacity, dtype=torch.float32,
                                         device=self._stacks[0].device)
        # a hermes.attention.GuidanceState while `hermes.guidance` runs a guidance pass, else None
        self.guidance = None
        self._length = 0

    def _allocate(self, device: torch.device, first: int, count: int, inv_freq: torch.Tensor) -> _Stack:
        kv_shape = (count, self._batch_size, self.num_kv_heads, self.capacity, self.head_dim)
        pos_shape = (count, self._batch_size) + ((3,) if self.mrope_section else ()) + (self.capacity,)
        return _Stack(device=device, first=first,
                      keys=torch.zeros(kv_shape, dtype=self.dtype, device=device),
                      values=torch.zeros(kv_shape, dtype=self.dtype, device=device),
                      positions=torch.zeros(pos_shape, dtype=torch.int64, device=device),
                      inv_freq=inv_freq.detach().to(device))

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """N: valid slots in every layer (prefix + visual tokens [+ question/answer while one is asked])."""
        return self._length

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def room(self) -> int:
        """Slots past the length: how many more tokens the next forwards may bring."""
        return self.capacity - self._length

    @property
    def _home_device(self) -> torch.device:
        return self._stacks[0].device

    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (keys, values, positions, guidance attention)."""
        held = sum(t.numel() * t.element_size() for s in self._stacks for t in (s.keys, s.values, s.positions))
        return held + self.guidance_attn.numel() * self.guidance_attn.element_size()

    def data_ptrs(self) -> list[int]:
        """Storage addresses of every buffer; they never change after construction."""
        return [t.data_ptr() for s in self._stacks for t in (s.keys, s.values, s.positions)] + \
            [self.guidance_attn.data_ptr()]

    # ---- views ----------------------------------------------------------------------------------------
    def layer_keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer, a view [B, Hkv, N, D] of the stack."""
        stack, local = self._stack_of_layer[layer]
        return stack.keys[local, :, :, :self._length]

    def layer_values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer, a view [B, Hkv, N, D] of the stack."""
        stack, local = self._stack_of_layer[layer]
        return stack.values[local, :, :, :self._length]

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Valid position ids of one layer, a view int64 [B, N] or [B, 3, N] (M-RoPE)."""
        stack, local = self._stack_of_layer[layer]
        return stack.positions[local, ..., :self._length]

    def position_range(self) -> tuple[int, int]:
        """(smallest, largest) valid position over all layers, streams and axes; (0, -1) when empty."""
        if self._length == 0:
            return 0, -1
        lows = [s.positions[..., :self._length].min().item() for s in self._stacks]
        highs = [s.positions[..., :self._length].max().item() for s in self._stacks]
        return int(min(lows)), int(max(highs))

    # ---- writing ----------------------------------------------------------------------------------------
    def _end_context(self) -> None:
        for stack in self._stacks:
            stack.delta = None

    def _hidden_start(self) -> int:
        return self._length

    def _begin_forward(self, key_states: torch.Tensor) -> _Forward:
        self._check_defined("compression step")
        count = self._incoming_count(key_states)
        if self._length + count > self.capacity:
            raise ValueError(f"key_states: {count} incoming tokens do not fit: length {self._length} of capacity "
                             f"{self.capacity}")
        rel, stored = self._take_context(count)
        forward = _Forward(start=self._length, count=count, stored=stored)
        for stack in self._stacks:
            stack.delta = self._write_positions(stack, forward, rel)
        return forward

    def _write_positions(self, stack: _Stack, fwd: _Forward, rel: torch.Tensor | None) -> torch.Tensor:
        """Write the incoming tokens' true positions into the stack; return true - default (§2.7)."""
        device = stack.device
        text = torch.arange(fwd.count, device=device)
        if rel is None:
            rel = text.expand(3, fwd.count) if self.mrope else text
        rel = rel.to(device)
        positions = stack.positions
        if fwd.start == 0:
            next_pos = torch.zeros(positions.shape[:2], dtype=torch.int64, device=device)
        else:
            used = positions[..., :fwd.start]
            next_pos = (used.flatten(2).amax(dim=-1)) + 1  # largest position over axes and tokens, + 1
        lead = (slice(None), slice(None)) + ((None,) if self.mrope else ()) + (None,)
        new = next_pos[lead] + rel
        positions[..., fwd.start:fwd.start + fwd.count] = new
        return new - (fwd.start + text)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the incoming keys/values [B, Hkv, T, D] of layer `layer_idx` in place; return views
        [B, Hkv, N + T, D] of the cache plus the new tokens (what the attention function attends over)."""
        fwd = self._forward_at(layer_idx, key_states)
        stack, local = self._stack_of_layer[layer_idx]
        end = fwd.start + fwd.count
        stack.keys[local, :, :, fwd.start:end] = key_states
        stack.values[local, :, :, fwd.start:end] = value_states
        keys = stack.keys[local, :, :, :end]
        values = stack.values[local, :, :, :end]
        self._hand_off(layer_idx, keys)
        if layer_idx == self.cfg.num_layers - 1:
            self._length = fwd.start + fwd.stored
        return keys, values

    def incoming_delta(self, layer: int) -> torch.Tensor:
        """int64 [b, T] (or [b, 3, T]) rotation of the running forward's tokens in `layer`: true - default."""
        stack, local = self._stack_of_layer[layer]
        if stack.delta is None:
            raise RuntimeError("HermesCache.incoming_delta: no forward is running")
        return stack.delta[local]

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The model's rotary inverse frequencies [D/2] on `layer`'s device (§2.8)."""
        return self._stack_of_layer[layer][0].inv_freq

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (e.g. a question and its answer); storage is untouched."""
        if not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"length: expected an int in [0, {self._length}], got {length!r}")
        self._length = length

    def reset(self) -> None:
        """Empty the cache (length 0, step counters 0, `undefined` cleared); the buffers stay allocated."""
        self._length = 0
        self._steps = 0
        self._compactions = 0
        self._undefined = False

    def _counters(self) -> tuple:
        return self._length, self._steps, self._compactions

    def _restore_counters(self, saved: tuple) -> None:
        self._length, self._steps, self._compactions = saved

    # ---- compression ------------------------------------------------------------------------------------
    def compress(self, attn: torch.Tensor, backend: str = "auto") -> CompressResult:
        """One HERMES step over the valid slots of every stack, in place (`hermes_kernels.compress_stacks`,
        DESIGN.md §2; one stack takes the same fused path as `compress_step`).

        attn: float32 [L, B, V], V = length - prefix_len, pooled guidance attention (e.g. `guidance_attn`), on any
        device. Afterwards the length is prefix_len + min(budget, V) in every layer.

        Failures: bad input (shape, dtype, backend, non-finite attn) raises ValueError/TypeError before anything is
        written; every stack is unchanged. Inputs are checked here first (`compress_stacks` checks them again) so
        that anything raised past that point is known to come from the step itself: a device error or an
        interrupt while rows are being moved may leave some layers compacted and others not. The cache is then
        `undefined` and refuses forwards and steps until `reset()`: the video memory is lost, start again.
        """
        self._check_defined("compression step")
        if self._length <= self.cfg.prefix_len:
            raise ValueError(f"attn: the cache holds no visual token (length {self._length}, prefix_len "
                             f"{self.cfg.prefix_len})")
        if backend not in hk.BACKENDS:
            raise ValueError(f"backend: expected one of {hk.BACKENDS}, got {backend!r}")
        n = self._length
        stacks = [(range(s.first, s.first + s.keys.shape[0]), s.keys[:, :, :, :n], s.values[:, :, :, :n],
                   s.positions[..., :n], s.inv_freq) for s in self._stacks]
        check_stacks(stacks, attn, self.cfg, self.mrope_section)
        self._undefined = True  # until the bookkeeping below is done, a failure may leave half-moved rows
        result = hk.compress_stacks(stacks, attn, self.cfg, self.mrope_section, backend=backend)
        self._length = result.length
        self._steps += 1
        self._compactions += int(result.compacted)
        self._undefined = False
        return result

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, compactions, bytes_allocated."""
        return {"length": self._length, "capacity": self.capacity, "positions": self.position_range(),
                "steps": self._steps, "compactions": self._compactions, "bytes_allocated": self.nbytes()}
