"""The attention function HERMES registers with transformers (DESIGN.md §2.3, §2.8, §3 "Model level").

`hermes_attention_forward` is registered as "hermes" in transformers' `AttentionInterface` and set on the
language model only (`patch_model`). It is deliberately absent from `AttentionMaskInterface`, so the model
hands it `attention_mask=None` and it applies causality itself. For every layer it:

(a) rotates the incoming tokens' q and k from the default positions the model ran with (`length + i`) to the
    layer's true positions, one rotary delta per (layer, stream, token) taken from the cache (§2.7–2.8);
    the rotated keys are written back into the cache's slots;
(b) during a guidance pass (`cache.guidance` set, see `hermes.guidance`) computes
    `hermes_kernels.pooled_attention` of the layer's guidance prompt over the cache and stores the visual
    part in `cache.guidance_attn`, then stops the forward after the last layer that needs a score;
(c) otherwise calls the model's own attention: flash-attn when installed and running on CUDA half
    precision, sdpa elsewhere, with a bottom-right causal mask when queries follow cached keys.

Calls whose keys do not come from a `HermesCache` (no cache, a `DynamicCache`) go straight to (c).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

import hermes_kernels as hk
from hermes.cache import HermesCache, claim_update
from hermes.rope import apply_rotary_delta

HERMES_ATTENTION = "hermes"


class GuidanceDone(Exception):
    """Raised after the last layer that needs a guidance score: the rest of the forward (and the LM head)
    would only be thrown away."""


@dataclasses.dataclass(frozen=True)
class GuidanceState:
    """What the attention function needs during a guidance pass (set on `cache.guidance`).

    segments:         (start, end) token ranges of the packed guidance prompts within the forward's tokens;
                      each prompt attends to the cache and causally to itself, never to another prompt.
    segment_of_layer: per layer, the index of the prompt whose pooled attention it needs, or None.
    last_layer:       the deepest layer that needs a score; the forward stops after it.
    backend:          `hermes_kernels` backend of the pooled attention ("auto" | "triton" | "torch").
    """

    segments: tuple[tuple[int, int], ...]
    segment_of_layer: tuple[int | None, ...]
    last_layer: int
    backend: str = "auto"


def hermes_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: query [b, H, T, D] (post-RoPE at default positions), key/value
    [b, Hkv, N + T, D] as returned by `cache.update`. Returns (output [b, T, H, D], None)."""
    claimed = claim_update(key)
    if claimed is None:
        return _model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    cache, layer = claimed
    start = key.shape[2] - query.shape[2]
    delta = cache.incoming_delta(layer).unsqueeze(1)  # [b, 1, T] or [b, 1, 3, T]: broadcast over heads
    inv_freq = cache.layer_inv_freq(layer)
    query = apply_rotary_delta(query, delta, inv_freq, cache.mrope_section)
    key[:, :, start:] = apply_rotary_delta(key[:, :, start:], delta, inv_freq, cache.mrope_section)
    if cache.guidance is not None:
        return _guidance_attention(module, cache, layer, query, key, value, start, dropout, scaling, **kwargs)
    count, total = query.shape[2], key.shape[2]
    if attention_mask is None and not _flash_usable(query) and 1 < count < total:
        attention_mask = cache.forward_mask("causal", query.device, lambda: _causal_mask(count, total, query.device))
    return _model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _flash_usable(query: torch.Tensor) -> bool:
    """flash-attn installed and the tensors are CUDA half precision."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available()


def _model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """(c): the model's own attention. Without a mask: flash-attn when usable (its causal mask is
    bottom-right aligned), else sdpa with an explicit bottom-right causal mask whenever the queries follow
    cached keys (sdpa's own `is_causal` is top-left aligned). With a mask: sdpa."""
    if attention_mask is None and _flash_usable(query):
        kwargs.pop("position_ids", None)  # default positions are not packed-sequence markers
        return flash_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                       **kwargs)
    if attention_mask is None and 1 < query.shape[2] < key.shape[2]:
        attention_mask = _causal_mask(query.shape[2], key.shape[2], query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _causal_mask(count: int, total: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, T, S]: query i (the last T of S tokens) sees keys j <= S - T + i (bottom-right aligned)."""
    rows = torch.arange(count, device=device)[:, None] + (total - count)
    return (torch.arange(total, device=device)[None, :] <= rows)[None, None]


def _guidance_attention(module, cache: HermesCache, layer: int, query, key, value, start: int, dropout, scaling,
                        **kwargs):
    """(b): pooled attention of this layer's guidance prompt over the cache (§2.3), then the layer output
    of all packed prompts (each sees the cache and, causally, only itself)."""
    state: GuidanceState = cache.guidance
    segment = state.segment_of_layer[layer]
    output = None
    if layer < state.last_layer:
        mask = cache.forward_mask("guidance", query.device,
                                  lambda: _segment_mask(state.segments, start, query.device))
        output = _model_attention(module, query, key, value, mask, dropout, scaling, **kwargs)[0]
    if segment is not None:
        lo, hi = state.segments[segment]
        if lo > 0:
            # the pooled-attention kernel wants the prompt's own keys right after the cache: move this
            # prompt's keys in front of the earlier prompts (scratch slots past the length only)
            own = key[:, :, start + lo:start + hi].clone()
            key[:, :, start + hi - lo:start + hi] = key[:, :, start:start + lo].clone()
            key[:, :, start:start + hi - lo] = own
        pooled = hk.pooled_attention(query[:, :, lo:hi], key[:, :, :start + hi - lo], scale=scaling,
                                     backend=state.backend)
        prefix = cache.cfg.prefix_len
        rows = cache.forward_rows()
        cache.guidance_attn[layer, rows, :start - prefix] = pooled[:, prefix:start].to(cache.guidance_attn.device)
    if layer == state.last_layer:
        raise GuidanceDone
    return output, None


def _segment_mask(segments, start: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, Q, N + Q]: every prompt token sees the N cached keys and its own prompt causally."""
    total = segments[-1][1]
    seg_id = torch.empty(total, dtype=torch.int64, device=device)
    for index, (lo, hi) in enumerate(segments):
        seg_id[lo:hi] = index
    pos = torch.arange(total, device=device)
    own = (seg_id[:, None] == seg_id[None, :]) & (pos[None, :] <= pos[:, None])
    cached = torch.ones(total, start, dtype=torch.bool, device=device)
    return torch.cat([cached, own], dim=1)[None, None]


def register() -> None:
    """Register `hermes_attention_forward` under HERMES_ATTENTION (idempotent)."""
    AttentionInterface.register(HERMES_ATTENTION, hermes_attention_forward)


def patch_model(model: torch.nn.Module) -> None:
    """Route the language model's attention (only) through HERMES: `text_config` for VLMs."""
    register()
    if getattr(model.config, "text_config", None) is not None:
        model.set_attn_implementation({"text_config": HERMES_ATTENTION})
    else:
        model.set_attn_implementation(HERMES_ATTENTION)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str):
    """Run the language model with transformers' own `name` attention (e.g. "eager" for `output_attentions`)
    inside the block, then route it through HERMES again."""
    model.set_attn_implementation({"text_config": name})
    try:
        yield
    finally:
        patch_model(model)
