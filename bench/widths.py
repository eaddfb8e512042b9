"""Random-weight models at the published widths of LLaVA-OV-0.5B and Qwen2.5-VL-3B, vision towers included
(`REAL_WIDTHS`, for `python -m bench.stream_cost real`).

The configs are written here from the checkpoints' published sizes (nothing downloads): every layer count, width,
head count and MLP size is the real one, so a chunk's prefill costs what it costs on the real model; only the
vocabulary is the tiny tokenizer's. A memory frame is 196 tokens for both (docs/benchmarks.md#stream-cost).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import (AutoModelForImageTextToText, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                          Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)

from scaffolding.tokenizer import tiny_tokenizer

_QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6)
_QWEN2_5_VL_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                      num_key_value_heads=2, max_position_embeddings=128000,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))


@dataclasses.dataclass(frozen=True)
class RealWidth:
    """A random-weight model at a real checkpoint's widths and the inputs of one chunk of its video frames.

    name:        the checkpoint it mirrors (and its shape in bench.shapes.SHAPES); model_class, config(): its
                 transformers class and config; frames(F, generator): the kwargs
                 of `HermesStream.append_video` for F family frames of one stream; frame_size: what the stream
                 needs to size a chunk (None when the family knows it from the config).
    """

    name: str
    model_class: type
    config: Callable[[], object]
    frames: Callable[[int, torch.Generator], dict]
    frame_size: tuple[int, int] | None

    def build(self) -> torch.nn.Module:
        """The model with seeded random weights, bfloat16, eval mode."""
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(self.config(), dtype=torch.bfloat16).eval()
        assert type(model) is self.model_class, type(model).__name__
        return model


def _text(**sizes) -> dict:
    """A decoder config at the given sizes with the tiny tokenizer's vocabulary: the embedding and LM head are a few
    thousand rows instead of ~152k, which changes nothing the cache or the guidance pass touches. Weights are drawn
    with the checkpoints' own initializer range (0.02)."""
    vocab = len(tiny_tokenizer())
    return dict(vocab_size=vocab, initializer_range=0.02, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                tie_word_embeddings=True, **sizes)


def llava_ov_0_5b_config() -> LlavaOnevisionConfig:
    """SigLIP-so400m (the 26 layers the checkpoint keeps, 1152 wide, 16 heads, MLP 4304, 384 px / 14) and
    Qwen2-0.5B (24 layers, 896 wide, 14 query / 2 KV heads of 64, MLP 4864)."""
    tok = tiny_tokenizer()
    return LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=26, num_attention_heads=16, image_size=384, patch_size=14,
                           vision_use_head=False),
        text_config=dict(model_type="qwen2", **_text(**_QWEN2_0_5B)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full")


def qwen2_5_vl_3b_config() -> Qwen2_5_VLConfig:
    """Qwen2.5-VL-3B: the 32-block vision tower (1280 wide, 16 heads, MLP 3420, windows of 112 px with full
    attention in blocks 7/15/23/31, merged to 2048) and the 36-layer decoder (2048 wide, 16 query / 2 KV heads of
    128, MLP 11008, M-RoPE sections 16/24/24)."""
    tok = tiny_tokenizer()
    return Qwen2_5_VLConfig(
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, tokens_per_second=2),
        text_config=_text(**_QWEN2_5_VL_3B),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"))


def _llava_frames(frames: int, g: torch.Generator) -> dict:
    """`frames` video frames of 384 x 384: SigLIP's 27 x 27 patch grid of each is pooled to 14 x 14, 196 tokens a
    frame."""
    return {"video": torch.randn(1, frames, 3, 384, 384, generator=g).to(torch.bfloat16)}


def _qwen_frames(frames: int, g: torch.Generator) -> dict:
    """`frames` video frames of 392 x 392 (an even count): frames / 2 temporal steps of 28 x 28 patches of
    3 x 2 x 14 x 14, 196 merged tokens per step."""
    grid = torch.tensor([[frames // 2, 28, 28]])
    patches = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g).to(torch.bfloat16)
    return {"video": patches, "grid_thw": grid}


REAL_WIDTHS: dict[str, RealWidth] = {w.name: w for w in (
    RealWidth("llava-ov-0.5b", LlavaOnevisionForConditionalGeneration, llava_ov_0_5b_config, _llava_frames, None),
    RealWidth("qwen2.5-vl-3b", Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_3b_config, _qwen_frames, (392, 392)),
)}
