"""Qwen3.5 and Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe`): Qwen3-VL's chunk layout (a zero-padded timestamp and the
vision markers around every temporal step, positions as `get_rope_index` lays them out) and processor, without
DeepStack; the decoder's full-attention layers rotate only the first R = partial_rotary_factor · head_dim channels
of a head, with interleaved M-RoPE sections. What differs from Qwen3-VL and the hybrid decoder: docs/qwen3_5.md.
"""
from __future__ import annotations

import torch

from .qwen3_vl import Qwen3_VL


class Qwen3_5(Qwen3_VL):
    """Qwen3-VL's family with no chunk `extra` (Qwen3.5's tower has no DeepStack mergers, its language model no
    DeepStack arguments) and no tensor-parallel plan of ours (transformers' plan splits every full-attention
    layer's heads). `rotary` is Qwen3-VL's: the rotary module's inv_freq [R/2] (32 pairs for 64 of 256 channels in the
    default config) and `RotaryLayout.interleaved(mrope_section)` over those R/2 pairs, a partial-rotary layout."""
    name = "Qwen3.5"
    preset_name = "qwen3_5"
    tp_plan = None  # transformers' own plan splits the full-attention heads (and Qwen3.5-MoE has no mlp.*_proj)

    @staticmethod
    def _extra(features, visual: torch.Tensor, batch_size: int, dtype: torch.dtype):
        return None  # the tower returns its merged features only (get_video_features: no deepstack_features)
