"""The one attention function the engine registers with transformers, and the model's own attention it falls
back to.

`hermes_attention_forward` is registered as "hermes" and set on the language model only (`patch_model`). A call
whose keys come from a policy cache (`hermes.cache.claim_update`) goes to that cache's `attend` (its own layers) or
`attend_side` (sliding-window and KV-shared layers); any other call (no cache, a `DynamicCache`) to
`model_attention`. docs/policies.md#the-one-attention-function.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers import __version__ as transformers_version
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

from hermes.cache import claim_update

HERMES_ATTENTION = "hermes"


def hermes_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: query [b, H, T, D] (post-RoPE at default positions), key/value as
    returned by `cache.update`. Returns (output [b, T, H, D], None). Keys from a policy cache go to that cache's
    `attend`; anything else to the model's own attention."""
    claimed = claim_update(key)
    if claimed is None:
        return model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    cache, layer = claimed
    if isinstance(layer, int):
        return cache.attend(module, layer, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            **kwargs)
    return cache.attend_side(module, layer, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             **kwargs)


def flash_usable(query: torch.Tensor) -> bool:
    """flash-attn installed and the tensors are CUDA half precision."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available()


def model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """(c): the model's own attention. Without a mask: flash-attn when usable (its causal mask is
    bottom-right aligned), else sdpa with an explicit bottom-right causal mask whenever the queries follow
    cached keys (sdpa's own `is_causal` is top-left aligned). With a mask: sdpa."""
    if attention_mask is None and flash_usable(query):
        kwargs.pop("position_ids", None)  # default positions are not packed-sequence markers
        return flash_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                       **kwargs)
    if attention_mask is None and 1 < query.shape[2] < key.shape[2]:
        attention_mask = causal_mask(query.shape[2], key.shape[2], query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """sdpa with the G = H / Hkv query heads of each KV head stacked as rows, for a few query rows over many keys.

    query [b, H, Q, D]; key/value [b, Hkv, S, D]; mask bool [b or 1, 1, G·Q, S] (row g·Q + i: query i, the same
    for every head; `grouped_mask`). The same numbers as the model's sdpa path, without the per-query-head copy
    of K/V that `repeat_kv` makes (for tens of rows over thousands of keys that copy costs as much as the
    attention). Returns [b, Q, H, D], the layout of transformers' attention functions."""
    b, heads, count, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(b, kv_heads, heads // kv_heads * count, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, count, dim).transpose(1, 2).contiguous()


def grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """bool [m, 1, Q, S] -> [m, 1, groups·Q, S]: each query row's mask repeated for every query head of a group."""
    m, _, count, total = mask.shape
    return mask.unsqueeze(2).expand(m, 1, groups, count, total).reshape(m, 1, groups * count, total)


def causal_mask(count: int, total: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, T, S]: query i (the last T of S tokens) sees keys j <= S - T + i (bottom-right aligned)."""
    rows = torch.arange(count, device=device)[:, None] + (total - count)
    return (torch.arange(total, device=device)[None, :] <= rows)[None, None]


def padded_mask(hidden: tuple[int, torch.Tensor], count: int, total: int, device: torch.device) -> torch.Tensor:
    """bool [b, 1, T, S]: bottom-right causal, and stream b never sees its padding slots [start, start + pads[b])."""
    start, pads = hidden
    slots = torch.arange(total, device=device)
    visible = (slots[None, :] < start) | (slots[None, :] >= start + pads.to(device)[:, None])
    return causal_mask(count, total, device) & visible[:, None, None, :]


def register() -> None:
    """Register `hermes_attention_forward` under HERMES_ATTENTION (idempotent), in `AttentionInterface` only: it is
    deliberately absent from `AttentionMaskInterface`, so the model hands it `attention_mask=None` and causality is
    applied by the policy cache's attention or by `model_attention`."""
    AttentionInterface.register(HERMES_ATTENTION, hermes_attention_forward)


def patch_model(model: torch.nn.Module) -> None:
    """Route the language model's attention (only) through HERMES: `text_config` for VLMs."""
    register()
    if getattr(model.config, "text_config", None) is not None:
        model.set_attn_implementation({"text_config": HERMES_ATTENTION})
    else:
        model.set_attn_implementation(HERMES_ATTENTION)


def attention_name(config) -> str:
    """The attention implementation a model config records (e.g. "sdpa", or HERMES_ATTENTION once patched).
    transformers has no public getter: this reads its private `_attn_implementation`, here and nowhere else in the
    package, and names the installed release when that attribute is gone (docs/install.md#private-names)."""
    try:
        return config._attn_implementation
    except AttributeError:
        raise RuntimeError(f"transformers {transformers_version}: a {type(config).__name__} no longer records its "
                           "attention implementation as `_attn_implementation`; hermes supports the releases in "
                           "docs/install.md#ranges") from None


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str):
    """Run the language model with transformers' own `name` attention (e.g. "eager" for `output_attentions`)
    inside the block, then route it through HERMES again."""
    model.set_attn_implementation({"text_config": name})
    try:
        yield
    finally:
        patch_model(model)
