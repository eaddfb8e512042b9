"""The model families and their registry: `FAMILIES` maps a checkpoint's `config.model_type` to its family.

A family is one file over `hermes.models.base` (the interface, `VideoChunk`, the pixel check, the processor twins'
base), which never imports this package; adding a family is that file and a line in `FAMILIES`
(docs/families.md).
"""
from __future__ import annotations

import torch

from .base import ModelFamily, VideoChunk, check_pixels
from .gemma4 import Gemma4
from .llava_ov import LlavaOneVision
from .llava_ov1_5 import LlavaOneVision1_5
from .minicpmv4_6 import MiniCPMV4_6
from .qwen2_5_vl import Qwen2_5_VL
from .qwen3_5 import Qwen3_5
from .qwen3_vl import Qwen3_VL

FAMILIES: dict[str, type[ModelFamily]] = {
    "llava_onevision": LlavaOneVision,
    "llava_onevision1_5": LlavaOneVision1_5,
    "qwen2_5_vl": Qwen2_5_VL,
    "qwen3_vl": Qwen3_VL,
    "qwen3_5": Qwen3_5,
    "qwen3_5_moe": Qwen3_5,
    "minicpmv4_6": MiniCPMV4_6,
    "gemma4": Gemma4,
}


def family_of(model: torch.nn.Module) -> ModelFamily:
    """The family of a loaded model; ValueError for a model type that is not supported."""
    return family_of_type(getattr(getattr(model, "config", None), "model_type", None))


def family_of_type(model_type: str | None) -> ModelFamily:
    """The family of a `config.model_type` string; ValueError for a model type that is not in `FAMILIES`."""
    if model_type not in FAMILIES:
        raise ValueError(f"model: model type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]()


__all__ = ["FAMILIES", "ModelFamily", "VideoChunk", "check_pixels", "family_of", "family_of_type"]
