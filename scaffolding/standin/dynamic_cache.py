"""Look-alikes of transformers' `DynamicCache`, the containers the released classes hold, without transformers:
4.x (`key_cache` / `value_cache`) and 5.x (`layers[i].keys` / `.values`); and the stand-in's own reading and writing
of every container (`layer_pairs`, `with_layers`), written apart from `hermes_kernels.compat.caches` so that the
adapter's helper is checked against an independent one, not against itself."""
from __future__ import annotations

from types import SimpleNamespace


class LegacyDynamicCache:
    """A transformers 4.x DynamicCache look-alike: `key_cache` / `value_cache` lists, indexing gives pairs."""

    def __init__(self, pairs):
        self.key_cache = [k for k, _ in pairs]
        self.value_cache = [v for _, v in pairs]

    def __getitem__(self, index):
        return self.key_cache[index], self.value_cache[index]

    def __len__(self):
        return len(self.key_cache)

    def __iter__(self):
        return iter(zip(self.key_cache, self.value_cache))


class LayeredDynamicCache:
    """A transformers 5.x DynamicCache look-alike: `layers[i].keys` / `.values`, no indexing."""

    def __init__(self, pairs):
        self.layers = [SimpleNamespace(keys=k, values=v) for k, v in pairs]



def layer_pairs(cache) -> list:
    """The per-layer (keys, values) of a container: a 5.x cache (`layers`), a 4.x one (`key_cache`), or a list or
    tuple of pairs."""
    if hasattr(cache, "layers") and not isinstance(cache, (list, tuple)):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(pair[0], pair[1]) for pair in cache]


def with_layers(cache, pairs: list):
    """`cache` holding `pairs` instead, as a forward leaves it: a DynamicCache (either generation) updated in place
    and returned; a list or tuple of pairs rebuilt as the same type."""
    if hasattr(cache, "layers") and not isinstance(cache, (list, tuple)):
        for layer, (k, v) in zip(cache.layers, pairs):
            layer.keys, layer.values = k, v
        return cache
    if hasattr(cache, "key_cache"):
        cache.key_cache[:] = [k for k, _ in pairs]
        cache.value_cache[:] = [v for _, v in pairs]
        return cache
    return type(cache)((k, v) for k, v in pairs)
