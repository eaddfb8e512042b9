"""Tiny random-weight LLaVA-OneVision (and 1.5), Qwen2.5-VL, Qwen3-VL and Qwen3.5 models built from configs
(docs/testing.md#scaffolding).

`tiny_llava_ov`, `tiny_llava_ov1_5`, `tiny_qwen2_5_vl`, `tiny_qwen3_vl`, `tiny_qwen3_5` and `tiny_qwen3_5_moe`
keep the real architectures at toy sizes, with nothing downloaded; `qwen3_5_layer_types` lays out a hybrid
model's layers. Why the larger initializer range, and the head counts tensor parallelism needs:
docs/testing.md#scaffolding, docs/multi-gpu.md#tested.
"""
from __future__ import annotations

import torch
from transformers import (Gemma4Config, Gemma4ForConditionalGeneration, LlavaOnevisionConfig,
                          LlavaOnevisionForConditionalGeneration, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen3_5Config, Qwen3_5ForConditionalGeneration,
                          Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)

from transformers import LlavaOnevision15Config, LlavaOnevision15ForConditionalGeneration

from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration

from scaffolding.tokenizer import tiny_minicpm_tokenizer, tiny_tokenizer


def _text_config(vocab_size: int, num_layers: int, max_positions: int, num_heads: int = 4, num_kv_heads: int = 2,
                 **extra) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


def tiny_llava_ov(seed: int = 0, num_layers: int = 4, max_positions: int = 4096, image_size: int = 16,
                  patch_size: int = 2, dtype: torch.dtype = torch.float32, num_heads: int = 4,
                  num_kv_heads: int = 2) -> LlavaOnevisionForConditionalGeneration:
    """LLaVA-OV with a 1-layer SigLIP tower: (image_size / patch_size / 2)^2 tokens per frame (16 by default).
    Head dim 16 whatever the head counts (Qwen2 decoders take an explicit head_dim), e.g. num_heads=8,
    num_kv_heads=4 for layers with more KV heads than two."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    heads = {} if (num_heads, num_kv_heads) == (4, 2) else dict(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                                 head_dim=16)
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=image_size, patch_size=patch_size),
        text_config=dict(model_type="qwen2", **_text_config(len(tok), num_layers, max_positions, **heads)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full")
    return LlavaOnevisionForConditionalGeneration(config).to(dtype).eval()


def tiny_llava_ov1_5(seed: int = 0, num_layers: int = 4, max_positions: int = 4096,
                     dtype: torch.dtype = torch.float32) -> LlavaOnevision15ForConditionalGeneration:
    """LLaVA-OneVision-1.5 with a 1-block RICE tower (patch 2, merge 2, no temporal patch: one frame per grid step)
    and a Qwen3 decoder (head dim 16, q/k norms, 1D RoPE). A 16 x 16 frame gives 4 x 4 merged tokens. The tower is
    drawn at the text's initializer range too, so its features are not negligible next to the text embeddings."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlavaOnevision15Config(
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, in_channels=3, initializer_range=0.2),
        text_config=dict(model_type="qwen3", **_text_config(len(tok), num_layers, max_positions, head_dim=16)),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    return LlavaOnevision15ForConditionalGeneration(config).to(dtype).eval()


def tiny_qwen2_5_vl(seed: int = 0, num_layers: int = 4, max_positions: int = 4096,
                    dtype: torch.dtype = torch.float32) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL with a 1-block vision tower (patch 2, merge 2, temporal patch 2); head dim 16 with
    mrope_section [2, 3, 3]. A 16 x 16 frame pair gives 4 x 4 merged tokens."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                           fullatt_block_indexes=[0], in_channels=3, tokens_per_second=2),
        text_config=_text_config(len(tok), num_layers, max_positions,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      mrope_section=[2, 3, 3])),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"))
    return Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()


def tiny_qwen3_vl(seed: int = 0, num_layers: int = 4, max_positions: int = 4096,
                  dtype: torch.dtype = torch.float32) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL with a 2-block vision tower (patch 2, merge 2, temporal patch 2) whose blocks 0 and 1 feed DeepStack
    (added after decoder layers 0 and 1); head dim 16 with interleaved mrope_section [4, 2, 2] (pairs 1, 4 turn with
    h, 2, 5 with w, the rest with t, like the released [24, 20, 20]). Its tokenizer is tiny_tokenizer(digits=True).
    A 16 x 16 frame pair gives 4 x 4 merged tokens. The tower is drawn at the text's initializer range too, so the
    DeepStack features are not negligible next to the hidden states."""
    tok = tiny_tokenizer(digits=True)
    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1], initializer_range=0.2),
        text_config=_text_config(len(tok), num_layers, max_positions, head_dim=16,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                                      mrope_interleaved=True)),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    return Qwen3VLForConditionalGeneration(config).to(dtype).eval()


def qwen3_5_layer_types(full_layers: int) -> list[str]:
    """Irregular hybrid layer types with `full_layers` full-attention layers: linear first and last, full layers in
    pairs with a linear layer after each pair (3: linear, full, full, linear, full, linear), so no code can get by
    with a fixed interval."""
    if isinstance(full_layers, bool) or not isinstance(full_layers, int) or full_layers < 1:
        raise ValueError(f"num_layers: expected a positive count of full-attention layers, got {full_layers!r}")
    types = ["linear_attention"]
    for index in range(full_layers):
        types.append("full_attention")
        if index % 2 or index == full_layers - 1:
            types.append("linear_attention")
    return types


def _tiny_qwen3_5(config_class, model_class, seed, num_layers, layer_types, max_positions, dtype, **text):
    tok = tiny_tokenizer(digits=True)
    if layer_types is None:
        layer_types = qwen3_5_layer_types(3 if num_layers is None else num_layers)
    elif num_layers is not None:
        raise ValueError("num_layers: pass either num_layers (full-attention layers) or layer_types")
    torch.manual_seed(seed)
    config = config_class(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16, initializer_range=0.2),
        text_config=_text_config(len(tok), len(layer_types), max_positions, head_dim=64, layer_types=list(layer_types),
                                 linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2],
                                                      mrope_interleaved=True, partial_rotary_factor=0.25), **text),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    return model_class(config).to(dtype).eval()


def tiny_qwen3_5(seed: int = 0, num_layers: int | None = None, max_positions: int = 4096,
                 dtype: torch.dtype = torch.float32, layer_types: list[str] | None = None) \
        -> Qwen3_5ForConditionalGeneration:
    """Qwen3.5 (hybrid decoder, Qwen3-VL's tower without DeepStack): `num_layers` full-attention layers (default 3)
    laid out by `qwen3_5_layer_types` (3: linear, full, full, linear, full, linear), or explicit `layer_types`.
    Full-attention layers: 4 heads, 2 KV heads, head dim 64 of which partial_rotary_factor 0.25 turns R = 16
    channels (8 frequency pairs, interleaved mrope_section [3, 3, 2], the released [11, 11, 10] scaled down);
    Gated DeltaNet layers: 2 key and 4 value heads of 16, conv kernel 4. A 2-block tower (patch 2, merge 2,
    temporal patch 2): a 16 x 16 frame pair gives 4 x 4 merged tokens. Its tokenizer is tiny_tokenizer(digits=True)."""
    return _tiny_qwen3_5(Qwen3_5Config, Qwen3_5ForConditionalGeneration, seed, num_layers, layer_types,
                         max_positions, dtype)


def tiny_qwen3_5_moe(seed: int = 0, num_layers: int | None = None, max_positions: int = 4096,
                     dtype: torch.dtype = torch.float32, layer_types: list[str] | None = None) \
        -> Qwen3_5MoeForConditionalGeneration:
    """`tiny_qwen3_5` with Qwen3.5-MoE's sparse MLPs: 4 experts of width 32, 2 per token, a shared expert of 32."""
    return _tiny_qwen3_5(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, seed, num_layers, layer_types,
                         max_positions, dtype, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32)


# A tiny Gemma 4's decoder: sliding, sliding, full, sliding, full, sliding (shared), full (shared): the last two layers
# read the keys and values of the last earlier layer of their kind; no fixed interval between the full layers
GEMMA4_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                      "full_attention", "sliding_attention", "full_attention"]


def tiny_gemma4(seed: int = 0, max_positions: int = 4096, dtype: torch.dtype = torch.float32,
                layer_types: list[str] | None = None, num_kv_shared_layers: int | None = None,
                sliding_window: int = 24, moe: bool = False, attention_k_eq_v: bool = False,
                num_layers: int | None = None) -> Gemma4ForConditionalGeneration:
    """Gemma 4 at toy sizes: GEMMA4_LAYER_TYPES with the last 2 layers reading an earlier layer's keys and values;
    or `num_layers` full-attention layers, each after two sliding ones, none shared; or `layer_types` (with
    `num_kv_shared_layers`, default 0); sliding layers: 4 heads, 2 KV heads of 16, default RoPE, a window of
    `sliding_window` tokens, vision tokens of one frame attending to each other both ways; full layers: KV heads of 32
    (global_head_dim; 1 of them with `attention_k_eq_v`, whose values are the keys' projection), proportional RoPE
    turning 4 of the 16 pairs; per-layer input embeddings of 8; `moe`: 4 experts of 32, 2 per token, beside the
    dense MLP. Its tokenizer is tiny_tokenizer(digits=True, gemma=True)."""
    tok = tiny_tokenizer(digits=True, gemma=True)
    torch.manual_seed(seed)
    if num_layers is not None and layer_types is not None:
        raise ValueError("num_layers: pass either num_layers (full-attention layers) or layer_types")
    if num_layers is not None:
        layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * num_layers
    shared = (2 if layer_types is None else 0) if num_kv_shared_layers is None else num_kv_shared_layers
    types = list(GEMMA4_LAYER_TYPES if layer_types is None else layer_types)
    moe_args = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32) if moe else {}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=len(types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1 if attention_k_eq_v else None, attention_k_eq_v=attention_k_eq_v,
                max_position_embeddings=max_positions, initializer_range=0.2, layer_types=types,
                sliding_window=sliding_window, num_kv_shared_layers=shared,
                use_bidirectional_attention="vision", vocab_size_per_layer_input=len(tok),
                hidden_size_per_layer_input=8, pad_token_id=tok.pad_token_id, bos_token_id=None,
                eos_token_id=None, final_logit_softcapping=None, **moe_args)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=2, pooling_kernel_size=2,
                  position_embedding_size=64, initializer_range=0.2)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          boi_token_id=tok.convert_tokens_to_ids("<|image>"),
                          eoi_token_id=tok.convert_tokens_to_ids("<image|>"),
                          image_token_id=tok.convert_tokens_to_ids("<|image|>"),
                          video_token_id=tok.convert_tokens_to_ids("<|video|>"))
    return Gemma4ForConditionalGeneration(config).to(dtype).eval()


def tiny_minicpmv4_6(seed: int = 0, num_layers: int | None = None, max_positions: int = 4096,
                     dtype: torch.dtype = torch.float32, layer_types: list[str] | None = None) \
        -> MiniCPMV4_6ForConditionalGeneration:
    """MiniCPM-V 4.6: `tiny_qwen3_5`'s hybrid decoder (`num_layers` full-attention layers, default 3, laid out by
    `qwen3_5_layer_types`, or explicit `layer_types`; head dim 64 of which 16 channels turn) under a 2-block SigLIP
    tower (patch 2, a 32 x 32 position grid) whose window-attention merger runs after block 0 and whose MLP merger
    follows: 4 x 4 patches fold into one token, so a 24 x 32 frame (12 x 16 patches) gives 3 x 4 tokens. Its
    tokenizer is tiny_minicpm_tokenizer()."""
    tok = tiny_minicpm_tokenizer()
    if layer_types is None:
        layer_types = qwen3_5_layer_types(3 if num_layers is None else num_layers)
    elif num_layers is not None:
        raise ValueError("num_layers: pass either num_layers (full-attention layers) or layer_types")
    torch.manual_seed(seed)
    text = _text_config(len(tok), len(layer_types), max_positions, head_dim=64, layer_types=list(layer_types),
                        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2],
                                             partial_rotary_factor=0.25))
    config = MiniCPMV4_6Config(
        text_config=dict(model_type="qwen3_5_text", **text),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=2),
        insert_layer_id=0, image_size=32, image_token_id=tok.image_token_id, video_token_id=tok.video_token_id)
    return MiniCPMV4_6ForConditionalGeneration(config).to(dtype).eval()
