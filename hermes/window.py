"""A decoder's sliding-window layers and KV-shared layers inside a stream cache (Gemma 4): `WindowLayout` (which decoder
layer is which, which layer each KV-shared layer reads, the window's geometry, read from the model) and `Windows` (a
ring of slots per sliding-window layer that computes its own keys). The rules, and why: docs/gemma4.md.

A sliding-window layer is never compressed: a query sees at most the `window` - 1 tokens before it, so its cache is
bounded already. Its keys live at stream positions, the token's index in the uncompressed stream (`seen`), which
compression never re-numbers; the model runs at the default positions, and the incoming queries and keys are turned
by `seen - length` before they attend. A ring of `W - 1 + forward_tokens` slots (the most tokens one forward brings:
a chunk, or a question and its answer within the stream's room) holds every token a forward can see, and the window
before the last chunk's end while a question and its answer follow it, without moving a row: stream position s lives
in slot s mod slots.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hermes.linear_state import FULL, SLIDING, layer_kinds
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta


def kv_sources(kinds: Sequence[str], shared: int) -> tuple[int, ...]:
    """The decoder layer whose keys and values each decoder layer attends over: itself, or for the last `shared`
    layers (KV sharing) the last layer before them of the same kind. ValueError naming `num_kv_shared_layers` when a
    shared layer has no such layer."""
    kinds = tuple(kinds)
    first = len(kinds) - shared
    if not 0 <= shared < len(kinds):
        raise ValueError(f"num_kv_shared_layers: expected an int in [0, {len(kinds)}), got {shared!r}")
    sources = list(range(len(kinds)))
    for layer in range(first, len(kinds)):
        own = [i for i in range(first) if kinds[i] == kinds[layer]]
        if not own:
            raise ValueError(f"num_kv_shared_layers: layer {layer} ({kinds[layer]}) shares the keys of an earlier "
                             f"layer of its kind, and there is none before layer {first}")
        sources[layer] = own[-1]
    return tuple(sources)


def cache_layers(config) -> tuple[int, ...]:
    """Decoder indices of the layers whose keys the policy caches hold, read from a model config alone: the
    full-attention layers that compute their own keys (every layer of most models; not a hybrid model's
    linear-attention layers, nor Gemma 4's sliding-window and KV-shared layers). ValueError naming `layer_types` for
    a kind the caches do not hold."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = layer_kinds(config)
    sources = kv_sources(kinds, getattr(text, "num_kv_shared_layers", 0) or 0)
    return tuple(i for i, kind in enumerate(kinds) if kind == FULL and sources[i] == i)


def cache_kv_heads(config) -> int:
    """Hkv of the layers the policy caches hold (`cache_layers`), from a model config alone: the first one's own
    count where the config keeps one per layer (Gemma 4's full layers), else the config's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_layer = getattr(text, "per_layer_config", None)
    source = text if per_layer is None else per_layer[cache_layers(config)[0]]
    return int(getattr(source, "num_key_value_heads", None) or text.num_attention_heads)


@dataclasses.dataclass(frozen=True, eq=False)
class WindowLayout:
    """Which decoder layer is which, and the sliding-window layers' geometry.

    kinds:          per decoder layer, "full_attention" or "sliding_attention".
    sources:        per decoder layer, the layer whose keys and values it attends over (itself, or the layer a
                    KV-shared layer reads: `kv_sources`).
    window:         W: a query sees the keys of the W - 1 tokens before it and its own (transformers'
                    `sliding_window`).
    slots:          ring slots per sliding layer: W - 1 + the most tokens one forward brings.
    num_kv_heads:   Hkv of the sliding layers; head_dim: their D.
    inv_freq:       float32 [D/2]: the sliding layers' rotary inverse frequencies, from the model's rotary module.
    dtype:          storage dtype; devices: per sliding layer that computes its own keys, in depth order.
    """

    kinds: tuple[str, ...]
    sources: tuple[int, ...]
    window: int
    slots: int
    num_kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor
    dtype: torch.dtype
    devices: tuple[torch.device, ...]

    def __post_init__(self):
        if len(self.devices) != len(self.sliding_layers):
            raise ValueError(f"devices: expected one device per sliding layer ({len(self.sliding_layers)})")
        if self.slots < self.window:
            raise ValueError(f"slots: a ring of {self.slots} slots leaves no room past the window of {self.window}")

    @classmethod
    def of(cls, language_model: torch.nn.Module, kinds: Sequence[str], forward_tokens: int) -> "WindowLayout":
        """Read the layout from the decoder stack (`config.sliding_window`, `config.num_kv_shared_layers`, the
        sliding layers' attention modules and the rotary module's `sliding_attention_inv_freq`); `forward_tokens`:
        the most tokens one forward brings (a chunk and the room after it)."""
        config = language_model.config
        kinds = tuple(kinds)
        sources = kv_sources(kinds, getattr(config, "num_kv_shared_layers", 0) or 0)
        own = [i for i, kind in enumerate(kinds) if kind == SLIDING and sources[i] == i]
        attention = language_model.layers[own[0]].self_attn
        return cls(kinds=kinds, sources=sources, window=config.sliding_window,
                   slots=config.sliding_window - 1 + forward_tokens,
                   num_kv_heads=config.num_attention_heads // attention.num_key_value_groups,
                   head_dim=attention.head_dim, inv_freq=language_model.rotary_emb.sliding_attention_inv_freq,
                   dtype=attention.k_proj.weight.dtype,
                   devices=tuple(language_model.layers[i].self_attn.k_proj.weight.device for i in own))

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Decoder indices of the sliding layers that compute their own keys, in depth order."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind == SLIDING and self.sources[i] == i)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Decoder indices of the full-attention layers that compute their own keys (the policy cache's layers, in
        depth order)."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind != SLIDING and self.sources[i] == i)

    @property
    def readers(self) -> dict[int, int]:
        """KV-shared decoder layer -> the decoder layer it reads."""
        return {i: source for i, source in enumerate(self.sources) if source != i}


class Windows:
    """The rings of the sliding layers that compute their own keys: keys, values [B, Hkv, slots, D] per layer, at
    stream positions (slot s mod slots). What was written there is the caller's business (`StreamCacheBase`); this
    class moves rows and tracks how far back the rings are intact."""

    def __init__(self, layout: WindowLayout, batch_size: int, allocate):
        """layout: the model's `WindowLayout`; allocate: `(shape, dtype, device) -> tensor`, the owning cache's
        `allocate` (so its `buffers()` and `nbytes()` count the rings)."""
        self.layout = layout
        self.slot_of = {layer: i for i, layer in enumerate(layout.sliding_layers)}
        shape = (batch_size, layout.num_kv_heads, layout.slots, layout.head_dim)
        self.keys = [allocate(shape, layout.dtype, device) for device in layout.devices]
        self.values = [allocate(shape, layout.dtype, device) for device in layout.devices]
        self.inv_freq = [layout.inv_freq.detach().to(device) for device in layout.devices]
        self.rotary = RotaryLayout.of(None, layout.head_dim // 2)
        self.reset()

    def reset(self) -> None:
        """Every ring intact (nothing written yet)."""
        self.intact_from = 0  # the smallest stream position whose slot still holds its own token

    def check_count(self, count: int) -> None:
        """ValueError naming `key_states` when one forward brings more tokens than the rings hold past a window."""
        if count > self.layout.slots - (self.layout.window - 1):
            raise ValueError(f"key_states: {count} incoming tokens do not fit the sliding layers' rings of "
                             f"{self.layout.slots} slots past the window of {self.layout.window}")

    def can_return(self, seen: int) -> bool:
        """Whether a stream of `seen` tokens can go on: the window before its end is still in the rings."""
        return seen - (self.layout.window - 1) >= self.intact_from or seen <= 0 and self.intact_from <= 0

    def _slots(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        return torch.arange(start, end, device=device) % self.layout.slots

    def write(self, layer: int, start: int, delta: int, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store decoder layer `layer`'s incoming keys and values [B, Hkv, T, D] (keys rotated at the default
        positions, turned here by `delta` = stream - default to stream positions start...start+T-1); return the
        keys and values [B, Hkv, n + T, D] a query of this forward may see: the n = min(start, W - 1) tokens before
        `start` and the incoming ones, in stream order."""
        index = self.slot_of[layer]
        count = key_states.shape[2]
        if delta:
            turn = torch.full((1, 1, count), delta, dtype=torch.int64, device=key_states.device)
            key_states = apply_rotary_delta(key_states, turn, self.inv_freq[index], self.rotary)
        self.intact_from = max(self.intact_from, start + count - self.layout.slots)
        keys, values = self.keys[index], self.values[index]
        slots = self._slots(start, start + count, keys.device)
        keys[:, :, slots] = key_states
        values[:, :, slots] = value_states
        seen = self._slots(max(0, start - (self.layout.window - 1)), start + count, keys.device)
        return keys[:, :, seen], values[:, :, seen]

    def turn_query(self, layer: int, query: torch.Tensor, delta: int) -> torch.Tensor:
        """The queries [B, H, T, D] of a layer reading sliding layer `layer`, turned by `delta` (stream - default)."""
        if not delta:
            return query
        turn = torch.full((1, 1, query.shape[2]), delta, dtype=torch.int64, device=query.device)
        return apply_rotary_delta(query, turn, self.inv_freq[self.slot_of[layer]], self.rotary)

    def contents(self, seen: int) -> dict[str, torch.Tensor]:
        """By decoder layer i: "sliding layer {i} keys" / "values" [B, Hkv, n, D] and "positions" int64 [B, n], the
        n = min(seen, W - 1) tokens a next token would see before itself, in stream order (copies: the rings wrap)."""
        out = {}
        lo = max(0, seen - (self.layout.window - 1))
        for layer, index in self.slot_of.items():
            keys = self.keys[index]
            slots = self._slots(lo, seen, keys.device)
            out[f"sliding layer {layer} keys"] = keys[:, :, slots]
            out[f"sliding layer {layer} values"] = self.values[index][:, :, slots]
            positions = torch.arange(lo, seen, device=keys.device)
            out[f"sliding layer {layer} positions"] = positions.expand(keys.shape[0], seen - lo)
        return out


def window_mask(start: int, count: int, lo: int, window: int, blocks: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """bool [1, 1, T, n + T]: query i (stream position start + i) sees key j (stream position lo + j) when the key is
    less than `window` positions back and not after the query, or after it inside the query's vision block
    (`blocks`, int64 [T] over the incoming tokens, -1 for text), as transformers' Gemma 4 builds its sliding mask."""
    query = torch.arange(start, start + count, device=device)[:, None]
    key = torch.arange(lo, start + count, device=device)[None, :]
    visible = (key > query - window) & (key <= query)
    if blocks is not None:
        blocks = blocks.to(device)
        same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
        incoming = visible[:, start - lo:]
        visible[:, start - lo:] = incoming | (same & (key[:, start - lo:] > query - window))
    return visible[None, None]
