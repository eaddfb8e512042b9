"""Look-alikes of transformers' `DynamicCache`, the containers the released classes hold, without transformers:
4.x (`key_cache` / `value_cache`) and 5.x (`layers[i].keys` / `.values`); `hermes_kernels.compat.caches` reads
and writes both."""
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

