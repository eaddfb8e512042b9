"""What every policy's KV cache shares: `StreamCacheBase`, a `transformers.Cache` the streaming front drives the
same way whatever the policy (docs/policies.md says what a policy cache must add).

Forwards (set with `forward_context`): store (the default, also what `model.generate` gets: tokens are appended
and the length grows), read-only (tokens are written past the length so attention can read them, but the length
does not move: guidance passes, scoring) and partly stored (`keep`: the first tokens are appended, the rest
read-only: a chunk carrying its guidance prompts, docs/hermes.md §4). A question batch of uneven lengths is
left-padded; `left_padding` hides the padding slots from every query (`hidden_keys`). The model runs at default
positions `length + i`; a policy cache knows every token's true position and the attention entry
(`hermes.attention`) hands each layer's call to the cache (`attend`), which rotates from one to the other.

The attention function finds its cache through a per-thread hand-off (`claim_update`): the model calls
`cache.update` right before attention, on the same thread, and passes the returned keys on unchanged.

Failures. A forward writes only past the length and the length moves at the last layer, so `atomic()` undoes any
failed call by restoring the host counters. The one write below the length is a policy's in-place step, run
through `_step_in_place`: it validates everything first (bad input raises with the cache untouched); an
exception escaping the writes themselves (a device error, an out-of-memory, a KeyboardInterrupt between row
moves) leaves the cache `undefined`, refusing every forward and step until `reset()`.

Also here: the per-layer views transformers expects (`_LayerView`), the lockstep restrictions, the geometry checks
and layer runs of a cache split over devices (`layer_runs`), and `prefill` of a video chunk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Callable, Iterator, Sequence, TypeVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hermes_kernels.checks import check_positive_int
from hermes_kernels.rope import RotaryLayout

_HANDOFF = threading.local()
T = TypeVar("T")


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
class Forward:
    """What one forward through the model writes: tokens [start, start + count) of every stream (default positions,
    the length transformers sees), of which the first `stored` stay; `masks` memoised for this forward. A policy
    cache may extend it with what its own forwards need (keyword-only fields)."""

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
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq: expected a tensor of shape [D/2={head_dim // 2}], got "
                         f"{getattr(inv_freq, 'shape', type(inv_freq).__name__)}")
    RotaryLayout.of(rotary, head_dim // 2)  # ValueError / TypeError naming rotary
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
    (taking its forward from `_forward_at`, calling `_hand_off` per layer), `attend` (the layer's attention, called
    by the one registered attention function), `truncate`, `reset` (calling `_reset_stream`), `stats`,
    `layer_keys` / `layer_values` (what `_LayerView` shows transformers), `_hidden_start()` (where a left-padded
    forward's padding starts), `_counters()` / `_restore_counters()` (the host state `atomic()` puts back; it
    must include `_steps`), `_home_device` (where the default positions live) and, optionally, `_end_context()`.
    Their in-place step runs through `_step_in_place`.
    """

    def _init_stream(self, num_layers: int, batch_size: int, rotary: Sequence[int] | RotaryLayout | None,
                     head_dim: int) -> None:
        """The shared fields (call first: the layer views hold only a weak proxy of the cache). `rotary`
        is stored as the `RotaryLayout` of D/2 pairs every rotation of the cache reads (1D RoPE included)."""
        self.rotary = RotaryLayout.of(rotary, head_dim // 2)
        self._batch_size = batch_size
        self._steps = 0
        self._reindexes = 0
        # set while an in-place step may have written below the length; only reset() clears it
        self._undefined = False
        self._context: dict | None = None
        self._forward: Forward | None = None
        Cache.__init__(self, layers=[_LayerView(self, layer) for layer in range(num_layers)])

    def _reset_stream(self) -> None:
        """The shared part of `reset()`: step counters 0, `undefined` cleared."""
        self._steps = 0
        self._reindexes = 0
        self._undefined = False

    # ---- what every forward and step checks first ---------------------------------------------------------
    def _check_defined(self, failed: str) -> None:
        """RuntimeError while a failed in-place write (`failed` names it) has left the cache undefined."""
        if self._undefined:
            raise RuntimeError(f"{type(self).__name__}: a failed {failed} left the cache undefined; call reset()")

    def _forward_at(self, layer_idx: int, key_states: torch.Tensor) -> Forward:
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
                       guidance prompts, docs/hermes.md §4); default all.
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

    def _step_in_place(self, step: Callable[[], tuple[T, bool]]) -> T:
        """Run a policy's in-place step (writes below the length), its inputs already validated: `step()` does the
        writes, moves the policy's own counters and returns (its result, whether positions were re-indexed).
        An exception escaping it leaves the cache `undefined` (the writes may be half done); on success the step
        counters move."""
        self._undefined = True
        result, reindexed = step()
        self._steps += 1
        self._reindexes += int(reindexed)
        self._undefined = False
        return result

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention of `layer` for the running forward: query [B, H, T, D] at the default positions, key/value
        as this cache's `update` returned them. Returns (output [B, T, H, D], None), as transformers' attention
        functions do."""
        raise NotImplementedError

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
    positions, with the family's extra arguments (`chunk.lm_kwargs()`: Qwen3-VL's DeepStack); `context`: the policy
    cache's own `forward_context` arguments (H2SVC: frames, extent)."""
    with cache.forward_context(chunk.rel_positions, **context):
        language_model(inputs_embeds=chunk.embeds, position_ids=cache.default_position_ids(chunk.embeds.shape[1]),
                       cache=cache, use_cache=True, **chunk.lm_kwargs())
