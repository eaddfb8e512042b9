"""HERMES attention of one layer (docs/hermes.md §2.3, §2.8): what `HermesCache.attend` runs for every layer.

`layer_attention` rotates the incoming q and k from the default positions to the layer's true ones, then either
runs the dense cache's attention (`hermes.dense.cached_attention`) or, during a guidance pass (`cache.guidance`
set, `hermes.policies.hermes.guidance`), computes `hermes_kernels.pooled_attention` of the guidance prompts over the
cache; `GuidanceDone` stops a pass run on its own after the last layer that scores. How a fused pass keeps a
chunk's rows as in a plain prefill: docs/stream.md#hermes-behind-the-front.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import hermes_kernels as hk
from hermes.attention import grouped_mask, grouped_sdpa
from hermes.dense import cached_attention, rotate_incoming

if TYPE_CHECKING:  # the cache imports this module for its `attend`, and guidance imports the cache
    from .cache import HermesCache
    from .guidance import GuidanceState


class GuidanceDone(Exception):
    """Raised after the last layer that needs a guidance score: the rest of the forward (and the LM head)
    would only be thrown away."""


def layer_attention(module: torch.nn.Module, cache: HermesCache, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`HermesCache.attend`: query [b, H, T, D] (post-RoPE at default positions), key/value [b, Hkv, N + T, D] as
    `cache.update` returned them. Rotates q and the incoming keys to their true positions (written back into the
    cache's slots: `hermes.dense.rotate_incoming`), then the guidance pass's attention or the dense cache's
    (docs/stream.md#hermes-behind-the-front). Returns (output [b, T, H, D], None)."""
    start = key.shape[2] - query.shape[2]
    query = rotate_incoming(cache, layer, query, key)
    if cache.guidance is not None:
        return _guidance_attention(module, cache, layer, query, key, value, start, attention_mask, dropout,
                                   scaling, **kwargs)
    return cached_attention(module, cache, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _guidance_attention(module, cache: HermesCache, layer: int, query, key, value, start: int, attention_mask,
                        dropout, scaling, **kwargs):
    """The guidance pass's attention: pooled attention of this layer's guidance prompt over the cache (§2.3), and
    the layer output: the stored chunk's rows exactly as a plain forward computes them, then the prompts' rows
    (each prompt sees the cache, the chunk and, causally, only itself)."""
    state: GuidanceState = cache.guidance
    stored = state.stored
    base = start + stored  # keys every prompt sees in full: the cache and the stored chunk
    outputs = []
    if stored:
        # the chunk's own call over the keys it would see without prompts: bit-identical to the unfused prefill
        outputs.append(cached_attention(module, cache, query[:, :, :stored], key[:, :, :base], value[:, :, :base],
                                         attention_mask, dropout, scaling, **kwargs)[0])
    prompts = query[:, :, stored:]
    b, heads, count, dim = prompts.shape
    read = state.read_rows(layer)
    if read is not None:
        # only the rows of prompts a deeper layer scores (a prompt's rows past its last scoring layer, e.g. the
        # mixed prompt's after the last mid layer, are never read again); they see no key past their own
        # (sdpa, as the model's own attention runs with a mask, in the grouped layout: no K/V copy per head)
        lo, hi = read
        groups = heads // key.shape[1]
        mask = cache.forward_mask(("guidance", base, lo, hi), query.device, lambda: grouped_mask(
            _segment_mask(state.segments, base, count, query.device)[..., lo:hi, :base + hi], groups))
        rows = grouped_sdpa(prompts[:, :, lo:hi], key[:, :, :base + hi], value[:, :, :base + hi], mask, scaling)
        # the other rows only have to have the right shape: zeros
        outputs.append(torch.nn.functional.pad(rows, (0, 0, 0, 0, lo, count - hi)) if hi - lo < count else rows)
    elif stored:
        # no deeper layer reads the prompts: their rows only have to have the right shape
        outputs.append(prompts.new_zeros(b, count, heads, dim))
    segment = state.segment_of_layer[layer]
    if segment is not None:
        prefix = cache.cfg.prefix_len
        for rows, lo, hi in state.runs(segment):
            keys = key[rows]
            if lo > 0:
                # the pooled-attention kernel wants the prompt's own keys right after the ones it sees in full:
                # move this prompt's keys in front of the earlier prompts (read-only slots past the stored ones)
                own = keys[:, :, base + lo:base + hi].clone()
                keys[:, :, base + hi - lo:base + hi] = keys[:, :, base:base + lo].clone()
                keys[:, :, base:base + hi - lo] = own
            pooled = hk.pooled_attention(prompts[rows, :, lo:hi], keys[:, :, :base + hi - lo], scale=scaling,
                                         backend=state.backend)
            cache.guidance_attn[layer, rows, :base - prefix] = pooled[:, prefix:base].to(cache.guidance_attn.device)
    if layer == state.last_layer and not stored:
        raise GuidanceDone
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _segment_mask(segments, base: int, count: int, device: torch.device) -> torch.Tensor:
    """bool [b or 1, 1, Q, base + Q] over Q prompt tokens after `base` keys: every prompt token sees the `base`
    keys and its own prompt causally (padding tokens, which no prompt sees, form one more segment)."""
    seg_id = torch.full((len(segments), count), -1, dtype=torch.int64)
    for b, bounds in enumerate(segments):
        for index, (lo, hi) in enumerate(bounds):
            seg_id[b, lo:hi] = index
    if all(bounds == segments[0] for bounds in segments):
        seg_id = seg_id[:1]
    seg_id = seg_id.to(device)
    pos = torch.arange(count, device=device)
    causal = pos[None, :] <= pos[:, None]
    own = (seg_id[:, :, None] == seg_id[:, None, :]) & causal
    seen = torch.ones(seg_id.shape[0], count, base, dtype=torch.bool, device=device)
    return torch.cat([seen, own], dim=2)[:, None]
