"""hermes.attention: the grouped sdpa the guidance prompts' rows run through equals transformers' own sdpa path
(which copies K/V per query head) on fresh random inputs, across GQA ratios, odd sizes, dtypes and masks that
differ per row and per stream. Its error against an fp32 computation is bounded by twice the model path's own."""
from __future__ import annotations

import re
import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hermes.attention import causal_mask, grouped_mask, grouped_sdpa

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, count, total, dim, streams_masked", [
    (4, 2, 5, 37, 16, False), (14, 2, 13, 301, 64, True), (7, 7, 3, 20, 8, False), (12, 1, 9, 65, 24, True)])
def test_grouped_sdpa_matches_the_model_sdpa(dtype, heads, kv_heads, count, total, dim, streams_masked):
    g = torch.Generator().manual_seed(heads * 1000 + count)
    b = 3
    query = torch.randn(b, heads, count, dim, generator=g).to(dtype)
    key = torch.randn(b, kv_heads, total, dim, generator=g).to(dtype)
    value = torch.randn(b, kv_heads, total, dim, generator=g).to(dtype)
    mask = causal_mask(count, total, "cpu")
    if streams_masked:  # stream-specific hidden keys on top of causality, as a ragged batch has
        hidden = torch.rand(b, 1, 1, total, generator=g) < 0.3
        hidden[..., -count:] = False
        mask = mask & ~hidden
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    exact, _ = sdpa_attention_forward(module, query.double(), key.double(), value.double(), mask, dropout=0.0,
                                      scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.3)
    got = grouped_sdpa(query, key, value, grouped_mask(mask, heads // kv_heads), 0.3)
    assert got.shape == expected.shape == (b, count, heads, dim) and got.dtype == dtype
    model_error = (expected.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * model_error + 1e-6


def test_the_recorded_attention_is_read_in_one_place():
    """`attention_name` reads what a config records (the one read of transformers' private `_attn_implementation`
    in the package), and a config without it is refused naming the installed transformers release."""
    from transformers import Qwen2Config, __version__

    from hermes.attention import attention_name
    config = Qwen2Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "eager"
    assert attention_name(config) == "eager"
    with pytest.raises(RuntimeError, match=rf"^transformers {re.escape(__version__)}: a object no longer records"):
        attention_name(object())
