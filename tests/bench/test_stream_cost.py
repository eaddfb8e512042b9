"""bench.stream_cost and the real-width models it times (bench.widths): the configs match the shape registry,
and a timing pass on a tiny model prints its row."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForImageTextToText

from hermes.models import family_of
from bench import stream_cost
from bench.shapes import SHAPES
from bench.widths import REAL_WIDTHS


@pytest.mark.parametrize("name", sorted(REAL_WIDTHS))
def test_real_widths_match_the_shape_registry(name):
    """The decoder the stream benchmark builds is the one the kernel benchmarks' shape describes, and frames are
    196 tokens; the model is built on the meta device (no weights)."""
    width, shape = REAL_WIDTHS[name], SHAPES[name]
    config = width.config()
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert type(model) is width.model_class
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    geometry = shape.geometry
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, head_dim) == \
        (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim)
    assert text.max_position_embeddings == geometry.max_positions
    rope = text.rope_parameters
    assert rope["rope_theta"] == geometry.rope_theta
    assert (tuple(rope["mrope_section"]) if "mrope_section" in rope else None) == _sections(shape)
    family = family_of(model)
    assert family.tokens_per_frame(model, width.frame_size) == 196
    inputs = width.frames(4, torch.Generator().manual_seed(0))
    assert all(t.dtype in (torch.bfloat16, torch.int64) for t in inputs.values())
    # the chunk's visual tokens are what the stream sizes a 4-frame chunk for (Qwen: 2 x 2 patches merge to one)
    tokens = int(inputs["grid_thw"].prod()) // 4 if "grid_thw" in inputs else inputs["video"].shape[1] * 196
    assert tokens == family.tokens_per_chunk(model, 4, width.frame_size)


def _sections(shape):
    return tuple(shape.geometry.rotary.counts) if shape.geometry.mrope else None


@pytest.mark.parametrize("family", ["llava_ov", "qwen2_5_vl"])
def test_time_split_prints_a_row_per_model(family, capsys):
    stream_cost.time_split(family, budget=40, frames=2, steps=2, room=64)
    line = capsys.readouterr().out.strip()
    assert line.startswith(family)
    ratios = [float(r) for r in re.findall(r"x(\d+\.\d+)", line)]
    assert len(ratios) == 3 and all(r > 0 for r in ratios[:2])  # separate, fused, target
