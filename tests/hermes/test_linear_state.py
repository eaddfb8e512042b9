"""`hermes.linear_state` on its own: the layer kinds read from a config (defaults and refusals, from the config alone)
and the layout's own checks. The states' behaviour inside a stream is tested on Qwen3.5
(tests/hermes/models/test_qwen3_5_stream.py, the shared stream checks)."""
import pytest
import torch
from transformers import Qwen2Config

from hermes.linear_state import FULL, LINEAR, LinearLayout, layer_kinds
from scaffolding.models import tiny_qwen3_5


def test_a_config_without_layer_types_is_all_full_attention():
    config = Qwen2Config(num_hidden_layers=3, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config.layer_types = None
    assert layer_kinds(config) == (FULL,) * 3


def test_the_text_config_of_a_vlm_says_which_layer_is_which():
    model = tiny_qwen3_5()
    kinds = layer_kinds(model.config)
    assert kinds == (LINEAR, FULL, FULL, LINEAR, FULL, LINEAR)
    layout = LinearLayout.of(model.model.language_model, kinds)
    assert layout.full_layers == (1, 2, 4) and layout.linear_layers == (0, 3, 5)
    gdn = model.model.language_model.layers[0].linear_attn
    assert layout.conv == ((gdn.conv_dim, gdn.conv_kernel_size),) * 3
    assert layout.recurrent == ((gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim),) * 3


@pytest.mark.parametrize("kinds,match", [
    (["full_attention", "sliding_attention", "chunked_attention"], r"'chunked_attention', 'sliding_attention'"),
    (["linear_attention", "linear_attention"], "no full-attention layer"),
])
def test_kinds_the_caches_do_not_hold_are_refused_naming_them(kinds, match):
    config = Qwen2Config(num_hidden_layers=len(kinds), hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config.layer_types = kinds
    with pytest.raises(ValueError, match=f"layer_types: .*{match}"):
        layer_kinds(config)


def test_a_layout_needs_the_state_of_every_linear_layer():
    kinds = (LINEAR, FULL, LINEAR)
    one = dict(conv=((8, 4),), recurrent=((2, 4, 4),), dtypes=(torch.float32,), devices=(torch.device("cpu"),))
    with pytest.raises(ValueError, match="linear: expected the state of each of the 2 linear-attention layers"):
        LinearLayout(kinds=kinds, **one)
    two = {name: value * 2 for name, value in one.items()}
    assert LinearLayout(kinds=kinds, **two).linear_layers == (0, 2)
