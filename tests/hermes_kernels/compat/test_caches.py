"""The adapter on transformers' own DynamicCache (the container the released Qwen2.5-VL class holds between
shrinks): the cache stays a DynamicCache with the shrunk tensors, and a later update appends to them."""
import pytest
import torch

from hermes_kernels.compat import read_layers
from tests.hermes_kernels.compat.cases import BUDGET, KV_HEADS, PREFIX, Case, drive

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def dynamic_cache(pairs):
    cache = transformers.DynamicCache()
    for layer, (k, v) in enumerate(pairs):
        cache.update(k, v, layer)
    return cache


@pytest.mark.parametrize("kind", ["llava_ov", "qwen2_5_vl"])
def test_a_transformers_dynamic_cache_stays_one(kind):
    case = Case(kind, torch.float32, True, dynamic_cache, chunks=4)
    _, fast, handle, _, _ = drive(case)
    cache = fast.kv_cache
    assert isinstance(cache, transformers.DynamicCache) and handle.stats["shrinks"] == 3
    assert cache.get_seq_length() == PREFIX + BUDGET
    k = torch.randn(1, KV_HEADS, 3, 16)
    keys, _ = cache.update(k, k.clone(), 0)
    assert keys.shape[2] == PREFIX + BUDGET + 3 and torch.equal(keys[:, :, -3:], k)
    assert read_layers(cache)[0][0][0].shape[2] == PREFIX + BUDGET + 3
