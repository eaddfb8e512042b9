"""What differs per model family: token layout of a video chunk, positions, prompts, presets (docs/hermes.md §3).

A family turns a chunk of video into language-model input embeddings plus the positions of those tokens
relative to where the chunk starts, names the language model and its rotary module, wraps questions in the
model's chat format and names its preset in every policy's config (`preset_name`); it also turns decoded frames
into that chunk's inputs through the checkpoint's processor (`prepare_frames`, `hermes.models.processing`).
`family_of(model)` finds the family from `model.config.model_type`, `family_of_type` from the string.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class VideoChunk:
    """One encoded chunk for B streams.

    embeds:        [B, T, hidden] language-model input embeddings (the model's dtype and device).
    rel_positions: int64 [3, T] M-RoPE offsets (t, h, w) from the chunk's start position, or None for 1D
                   RoPE (0, 1, ..., T-1).
    frames:        H2SVC frames in the chunk (the unit of memory, docs/h2svc.md §1): LLaVA-OV video frames,
                   Qwen2.5-VL temporal grid steps; the T tokens are `frames` runs of T / frames tokens.
    extent:        the largest offset of `rel_positions` over axes and tokens (T - 1 for 1D RoPE), a host int: the
                   chunk's next position is start + extent + 1, known without reading a device tensor.
    """

    embeds: torch.Tensor
    rel_positions: torch.Tensor | None
    frames: int
    extent: int


class ModelFamily:
    """Interface of a supported family (one subclass per file in this package)."""

    model_types: tuple[str, ...] = ()
    system_prompt = "You are a helpful assistant."
    # the name of the family's preset in every policy's config (`HermesConfig.preset`, `H2SVCConfig.preset`)
    preset_name: str = ""

    def language_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The decoder stack the cache and attention patch apply to."""
        return model.model.language_model

    def rotary(self, model: torch.nn.Module) -> tuple[torch.Tensor, list[int] | None]:
        """(inv_freq [D/2] taken from the model's rotary module — never recomputed, §2.8, mrope_section)."""
        raise NotImplementedError

    def tokens_per_frame(self, model: torch.nn.Module, frame_size: tuple[int, int] | None = None) -> int:
        """Visual tokens of one H2SVC frame (`VideoChunk.frames`); ValueError when it depends on a frame size
        that is not given."""
        raise NotImplementedError

    def tokens_per_chunk(self, model: torch.nn.Module, frames: int, frame_size: tuple[int, int] | None) -> int:
        """Visual tokens a chunk of `frames` frames yields (sizes the cache)."""
        raise NotImplementedError

    def encode_video(self, model, processor, video, batch_size: int, **kwargs) -> VideoChunk:
        """Validate and encode one chunk (frames through `processor`, or model-ready pixel values)."""
        raise NotImplementedError

    def pil_video_processor(self, image_processor, config: dict):
        """The torchvision-free twin of the family's video processor (`hermes.models.processing`) over the
        checkpoint's PIL image processor, with the video processor's settings `config`."""
        raise NotImplementedError

    def prepare_frames(self, processor, frames, fps: float) -> dict:
        """`append_video` keyword arguments for one clip: frames uint8 [F, H, W, 3] RGB sampled at `fps`
        frames per second, through `processor.video_processor` (the real one or the twin)."""
        raise NotImplementedError

    def memory_frames(self, inputs: dict) -> int:
        """H2SVC frames (the unit of memory, docs/h2svc.md §1) in one chunk's `prepare_frames` output: LLaVA-OV one per
        video frame; Qwen2.5-VL one per temporal grid step (temporal_patch_size video frames)."""
        raise NotImplementedError

    def frame_size(self, model: torch.nn.Module, inputs: dict) -> tuple[int, int] | None:
        """(height, width) of the processed frames in `inputs` where the token count depends on it, else None."""
        return None

    def prefix_text(self, system_prompt: str | None) -> str:
        """Chat-format text in front of the video (the never-evicted prefix)."""
        raise NotImplementedError

    def question_text(self, question: str) -> str:
        """Chat-format text after the video, ending where the answer starts."""
        raise NotImplementedError

    def text_kwargs(self, input_ids: torch.Tensor) -> dict:
        """Extra keyword arguments a text-only forward/generate of the full model needs."""
        return {}


def family_of(model: torch.nn.Module) -> ModelFamily:
    """The family of a loaded model; ValueError for a model type that is not supported."""
    return family_of_type(getattr(getattr(model, "config", None), "model_type", None))


def family_of_type(model_type: str | None) -> ModelFamily:
    """The family of a `config.model_type` string; ValueError for a model type that is not supported."""
    from .llava_ov import LlavaOneVision  # the family modules import ModelFamily from here
    from .qwen2_5_vl import Qwen2_5_VL

    families = (LlavaOneVision(), Qwen2_5_VL())
    for family in families:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for family in families for t in family.model_types)
    raise ValueError(f"model: model type {model_type!r} is not supported; supported: {supported}")


def check_pixels(name: str, video, expected: str) -> torch.Tensor:
    """A floating tensor of model-ready pixel values, else TypeError naming the argument."""
    if not isinstance(video, torch.Tensor) or not video.is_floating_point():
        raise TypeError(f"{name}: expected floating pixel values {expected} (or raw frames with a processor), "
                        f"got {type(video).__name__}")
    if not bool(torch.isfinite(video).all()):
        raise ValueError(f"{name}: pixel values contain non-finite entries")
    return video


__all__ = ["ModelFamily", "VideoChunk", "family_of", "family_of_type", "check_pixels"]
