"""`DenseCache`: the storage a policy whose layers all hold the same token slots builds on (HERMES, and any policy
that decides which tokens stay: docs/policies.md#dense). One preallocated key and value stack `[Ld, B, Hkv,
capacity, D]` per run of consecutive layers on one device, per-(layer, stream) true positions `[Ld, B, capacity]`
(`[Ld, B, 3, capacity]` M-RoPE); the model runs at the default positions `length + i` and `attend` rotates the
incoming q and k by true − default before attending over the valid slots. A policy adds only its in-place step
(e.g. HERMES's `compress`), which rewrites the first slots of every stack through `_step_in_place`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hermes.attention import causal_mask, flash_usable, model_attention, padded_mask
from hermes.cache import Counters, Forward, StreamCacheBase, layer_runs
from hermes.linear_state import LinearLayout
from hermes.window import WindowLayout
from hermes_kernels.engine.checks import check_positive_int
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta


@dataclasses.dataclass
class Stack:
    """The buffers of the consecutive layers [first, first + Ld) that live on one device."""

    device: torch.device
    first: int
    keys: torch.Tensor          # [Ld, B, Hkv, capacity, D]
    values: torch.Tensor        # [Ld, B, Hkv, capacity, D]
    positions: torch.Tensor     # int64 [Ld, B, capacity] or [Ld, B, 3, capacity]
    inv_freq: torch.Tensor      # [D/2] on this device


@dataclasses.dataclass(kw_only=True)
class DenseForward(Forward):
    """A forward through the stacks: `delta[s]` int64 [Ld, B, T] ([Ld, B, 3, T] M-RoPE), true − default positions
    of its tokens in stack s's layers."""

    delta: list[torch.Tensor]


class DenseCache(StreamCacheBase):
    """Fixed-capacity KV cache whose layers hold the same slots, with per-(layer, stream) positions (module
    docstring).

    Args:
        num_layers:     L.
        batch_size:     B streams advanced in lockstep.
        num_kv_heads:   Hkv; head_dim: D (even).
        capacity:       slots per layer (what is kept + the largest chunk + room for prompts or a question).
        dtype:          storage dtype of keys/values (the model's).
        inv_freq:       [D/2] rotary inverse frequencies taken from the model's rotary module.
        rotary:         which position axis turns each frequency pair: a `RotaryLayout`, three contiguous pair counts
                        (t, h, w), or None for 1D RoPE; stored as the `RotaryLayout` (`self.rotary`, 1D included).
        layer_devices:  the device of every layer (default: inv_freq's device for all); consecutive layers on
                        one device share a stack.
        stack_bounds:   layers at which a new stack starts even though the device does not change (ascending,
                        inside (0, L)): the results are the same as with one stack; this lays out a `device_map`
                        split on one device.
        counters:       the empty cache's host state (a `Counters` subclass for a policy's own counters).
        linear:         a hybrid model's `hermes.linear_state.LinearLayout` (this cache's layers are its full-attention
                        layers; the linear-attention layers' states are held too), None without linear layers.
        windows:        a decoder's `hermes.window.WindowLayout` (this cache's layers are its full-attention layers
                        that compute their own keys; the sliding-window layers' rings are held too), None without
                        sliding-window or KV-shared layers.
    """

    def __init__(self, num_layers: int, *, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = (),
                 counters: Counters = Counters(), linear: LinearLayout | None = None,
                 windows: WindowLayout | None = None):
        runs = layer_runs(num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          inv_freq=inv_freq, rotary=rotary, layer_devices=layer_devices, stack_bounds=stack_bounds)
        check_positive_int("capacity", capacity)
        super().__init__(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, rotary=rotary, home_device=runs[0][0], counters=counters,
                         linear=linear, windows=windows)
        self.capacity = capacity
        self.dtype = dtype
        self._stacks = [self._allocate(device, first, end - first, inv_freq) for device, first, end in runs]
        self._stack_of_layer: list[tuple[int, int]] = []
        for index, stack in enumerate(self._stacks):
            self._stack_of_layer.extend((index, local) for local in range(stack.keys.shape[0]))

    def _allocate(self, device: torch.device, first: int, count: int, inv_freq: torch.Tensor) -> Stack:
        kv_shape = (count, self._batch_size, self.num_kv_heads, self.capacity, self.head_dim)
        pos_shape = (count, self._batch_size) + ((3,) if self.mrope else ()) + (self.capacity,)
        return Stack(device=device, first=first, keys=self.allocate(kv_shape, self.dtype, device),
                     values=self.allocate(kv_shape, self.dtype, device),
                     positions=self.allocate(pos_shape, torch.int64, device), inv_freq=inv_freq.detach().to(device))

    # ---- views ---------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> tuple[Stack, int]:
        index, local = self._stack_of_layer[layer]
        return self._stacks[index], local

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer, a view [B, Hkv, N, D] of its stack."""
        stack, local = self._layer(layer)
        return stack.keys[local, :, :, :self.length]

    def layer_values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer, a view [B, Hkv, N, D] of its stack."""
        stack, local = self._layer(layer)
        return stack.values[local, :, :, :self.length]

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Valid position ids of one layer, a view int64 [B, N] or [B, 3, N] (M-RoPE)."""
        stack, local = self._layer(layer)
        return stack.positions[local, ..., :self.length]

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The model's rotary inverse frequencies [D/2] on `layer`'s device."""
        return self._layer(layer)[0].inv_freq

    def contents(self) -> dict[str, torch.Tensor]:
        """Every layer's valid keys, values [B, Hkv, N, D] and positions [B, N] / [B, 3, N]."""
        views = {}
        for layer in range(self.num_layers):
            views[f"layer {layer} keys"] = self.layer_keys(layer)
            views[f"layer {layer} values"] = self.layer_values(layer)
            views[f"layer {layer} positions"] = self.layer_positions(layer)
        return {**views, **self.side_contents()}

    # ---- forwards ------------------------------------------------------------------------------------------
    def begin_forward(self, count: int, rel_positions: torch.Tensor | None, stored: int) -> DenseForward:
        """Write the incoming tokens' true positions into every stack: each (layer, stream) continues from its
        largest position + 1, plus the relative offsets (docs/hermes.md §2.7)."""
        start = self.length
        if start + count > self.capacity:
            raise ValueError(f"key_states: {count} incoming tokens do not fit: length {start} of capacity "
                             f"{self.capacity}")
        delta = [self._write_positions(stack, start, count, rel_positions) for stack in self._stacks]
        return DenseForward(start=start, count=count, stored=stored, delta=delta,
                            after=dataclasses.replace(self.counters, length=start + stored))

    def _write_positions(self, stack: Stack, start: int, count: int, rel: torch.Tensor | None) -> torch.Tensor:
        """Write `count` incoming tokens' true positions into `stack` at slot `start`; return true − default."""
        device = stack.device
        text = torch.arange(count, device=device)
        if rel is None:
            rel = text.expand(3, count) if self.mrope else text
        rel = rel.to(device)
        positions = stack.positions
        if start == 0:
            next_pos = torch.zeros(positions.shape[:2], dtype=torch.int64, device=device)
        else:
            next_pos = positions[..., :start].flatten(2).amax(dim=-1) + 1  # over axes and tokens, + 1
        lead = (slice(None), slice(None)) + ((None,) if self.mrope else ()) + (None,)
        new = next_pos[lead] + rel
        positions[..., start:start + count] = new
        return new - (start + text)

    def write(self, forward: DenseForward, layer: int, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the incoming keys/values [B, Hkv, T, D] of `layer` in place; return views [B, Hkv, N + T, D] of
        the stack (what `attend` reads)."""
        stack, local = self._layer(layer)
        end = forward.start + forward.count
        stack.keys[local, :, :, forward.start:end] = key_states
        stack.values[local, :, :, forward.start:end] = value_states
        return stack.keys[local, :, :, :end], stack.values[local, :, :, :end]

    def incoming_delta(self, layer: int) -> torch.Tensor:
        """int64 [B, T] (or [B, 3, T]) rotation of the running forward's tokens in `layer`: true − default."""
        index, local = self._stack_of_layer[layer]
        return self.current_forward.delta[index][local]

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`layer`'s attention over its valid slots and the incoming tokens (`rotate_incoming`, then
        `cached_attention`)."""
        query = rotate_incoming(self, layer, query, key)
        return cached_attention(module, self, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def attend_shared(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """A KV-shared layer's attention over `layer`'s slots, which `layer`'s own attention already turned to
        their true positions: only the queries [b, H, T', D] (the forward's last T') are turned, then
        `cached_attention`."""
        delta = self.incoming_delta(layer)[..., -query.shape[2]:].unsqueeze(1)
        query = apply_rotary_delta(query, delta, self.layer_inv_freq(layer), self.rotary)
        return cached_attention(module, self, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (e.g. a question and its answer); storage is untouched."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.length:
            raise ValueError(f"length: expected an int in [0, {self.length}], got {length!r}")
        self.truncate_states(length)
        self.counters = dataclasses.replace(self.counters, length=length)


def rotate_incoming(cache: DenseCache, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Rotate query [b, H, T, D] and the incoming keys (the last T of key [b, Hkv, N + T, D], a view of the stack:
    rotated in place) from the default positions the model ran with to the layer's true ones (docs/hermes.md
    §2.8); returns the rotated query."""
    start = key.shape[2] - query.shape[2]
    delta = cache.incoming_delta(layer).unsqueeze(1)  # [b, 1, T] or [b, 1, 3, T]: broadcast over heads
    inv_freq = cache.layer_inv_freq(layer)
    key[:, :, start:] = apply_rotary_delta(key[:, :, start:], delta, inv_freq, cache.rotary)
    return apply_rotary_delta(query, delta, inv_freq, cache.rotary)


def cached_attention(module, cache: StreamCacheBase, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """The model's own attention (`hermes.attention.model_attention`) for queries that are the last T of the keys:
    the causal mask, built once per forward, whenever the chosen kernel cannot apply it itself, combined with the
    padding slots the cache hides."""
    count, total = query.shape[2], key.shape[2]
    hidden = cache.hidden_keys()
    if attention_mask is None and hidden is not None:
        attention_mask = cache.forward_mask(("padded", count, total), query.device,
                                            lambda: padded_mask(hidden, count, total, query.device))
    elif attention_mask is None and not flash_usable(query) and 1 < count < total:
        attention_mask = cache.forward_mask(("causal", count, total), query.device,
                                            lambda: causal_mask(count, total, query.device))
    return model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
