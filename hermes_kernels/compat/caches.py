"""Per-layer key/value access to the cache containers the released HERMES classes hold, by duck typing only (no
transformers import): a sequence of `(keys, values)` pairs, one per layer (the legacy tuple cache; LLaVA-OV's
`kv_cache` after every chunk, Qwen2.5-VL's after a shrink), a transformers 4.x `DynamicCache` (`key_cache` /
`value_cache`) or a 5.x one (`layers[i].keys` / `.values`). `read_layers` returns the pairs and the container's
kind; `write_layers` puts new per-layer tensors back in a container of that kind.
docs/integrations.md#what-it-changes.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

SEQUENCE, KEY_CACHE, LAYERS = "sequence", "key_cache", "layers"


class IncompatibleInstance(ValueError):
    """An instance (or its state at this call) lacks what the released HERMES classes have; the message names
    every missing or malformed attribute. Raised before anything on the instance is changed."""


def container_kind(cache: Any) -> str:
    """"layers" (transformers 5.x DynamicCache), "key_cache" (4.x DynamicCache) or "sequence" (pairs); else
    IncompatibleInstance."""
    if cache is None:
        raise IncompatibleInstance("kv_cache: is None; encode the system prompt (encode_init_prompt) first")
    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (list, tuple)):
        return LAYERS
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return KEY_CACHE
    if isinstance(cache, Sequence) and not isinstance(cache, (str, bytes)):
        return SEQUENCE
    raise IncompatibleInstance(f"kv_cache: a {type(cache).__name__} is none of the containers the released code "
                               f"holds: a list of (keys, values) pairs, a DynamicCache with key_cache/value_cache "
                               f"(transformers 4.x) or with layers[i].keys/values (5.x)")


def read_layers(cache: Any) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """The per-layer (keys, values) of `cache` and its container kind; IncompatibleInstance when an entry is not a
    pair of tensors."""
    kind = container_kind(cache)
    if kind == LAYERS:
        pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
        where = "kv_cache.layers[{}].keys/.values"
    elif kind == KEY_CACHE:
        if len(cache.key_cache) != len(cache.value_cache):
            raise IncompatibleInstance(f"kv_cache: key_cache holds {len(cache.key_cache)} layers, value_cache "
                                       f"{len(cache.value_cache)}")
        pairs = list(zip(cache.key_cache, cache.value_cache))
        where = "kv_cache.key_cache[{0}]/value_cache[{0}]"
    else:
        pairs = []
        for index, entry in enumerate(cache):
            if not isinstance(entry, Sequence) or len(entry) < 2:
                raise IncompatibleInstance(f"kv_cache[{index}]: expected a (keys, values) pair, got "
                                           f"{type(entry).__name__}")
            pairs.append((entry[0], entry[1]))
        where = "kv_cache[{}]"
    for index, (k, v) in enumerate(pairs):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise IncompatibleInstance(f"{where.format(index)}: expected two tensors [1, Hkv, L, D], got "
                                       f"{type(k).__name__} and {type(v).__name__}")
    return pairs, kind


def write_layers(cache: Any, kind: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`cache` with every layer's tensors replaced by `pairs`, in the container kind `kind`; returns what the
    instance's `kv_cache` should be afterwards: the same object, updated entry by entry, for a DynamicCache; a new
    list or tuple for a sequence."""
    if kind == LAYERS:
        for layer, (k, v) in zip(cache.layers, pairs):
            layer.keys, layer.values = k, v
        return cache
    if kind == KEY_CACHE:
        for index, (k, v) in enumerate(pairs):
            cache.key_cache[index], cache.value_cache[index] = k, v
        return cache
    entries = [(k, v) for k, v in pairs]
    return tuple(entries) if isinstance(cache, tuple) else entries
