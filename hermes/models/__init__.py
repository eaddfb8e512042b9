"""What differs per model family: token layout of a video chunk, positions, prompts, presets (docs/hermes.md §3).

A family turns a chunk of video into language-model input embeddings plus the positions of those tokens
relative to where the chunk starts (and any extra arguments the language model's forward over them needs:
`VideoChunk.lm_kwargs`), names the language model and its rotary module, wraps questions in the model's chat
format and names its preset in every policy's config (`preset_name`); it also turns decoded frames into that
chunk's inputs through the checkpoint's processor (`prepare_frames`, `hermes.models.processing`).
`family_of(model)` finds the family from `model.config.model_type`, `family_of_type` from the string.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hermes_kernels.rope import RotaryLayout


@dataclasses.dataclass
class VideoChunk:
    """One encoded chunk for B streams.

    embeds:        [B, T, hidden] language-model input embeddings (the model's dtype and device).
    rel_positions: int64 [3, T] M-RoPE offsets (t, h, w) from the chunk's start position, or None for 1D
                   RoPE (0, 1, ..., T-1).
    frames:        H2SVC frames in the chunk (the unit of memory, docs/h2svc.md §1): LLaVA-OV video frames,
                   Qwen2.5-VL and Qwen3-VL temporal grid steps; the T tokens are `frames` runs of T / frames tokens
                   (Qwen3-VL: a run holds the step's timestamp text too).
    extent:        the largest offset of `rel_positions` over axes and tokens (T - 1 for 1D RoPE), a host int: the
                   chunk's next position is start + extent + 1, known without reading a device tensor.
    extra:         count -> extra keyword arguments of the language model's forward (see `lm_kwargs`), or None.
    """

    embeds: torch.Tensor
    rel_positions: torch.Tensor | None
    frames: int
    extent: int
    extra: Callable[[int], dict] | None = None

    def lm_kwargs(self, count: int | None = None) -> dict:
        """Keyword arguments the language model's forward over this chunk needs besides embeddings and positions,
        for a forward of `count` tokens (default T) whose first T are the chunk's and the rest text (HERMES's fused
        guidance prompts): Qwen3-VL's DeepStack features and their mask; {} for the other families. Every forward
        that carries a chunk passes them, so the chunk's hidden states are the model's own."""
        if self.extra is None:
            return {}
        return self.extra(self.embeds.shape[1] if count is None else count)


class ModelFamily:
    """Interface of a supported family (one subclass per file in this package)."""

    model_types: tuple[str, ...] = ()
    system_prompt = "You are a helpful assistant."
    # the name of the family's preset in every policy's config (`HermesConfig.preset`, `H2SVCConfig.preset`)
    preset_name: str = ""

    def language_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The decoder stack the cache and attention patch apply to."""
        return model.model.language_model

    def rotary(self, model: torch.nn.Module) -> tuple[torch.Tensor, RotaryLayout | None]:
        """(inv_freq [D/2] taken from the model's rotary module — never recomputed, §2.8 — and the axis of each
        frequency pair: a `RotaryLayout` for M-RoPE, None for 1D RoPE)."""
        raise NotImplementedError

    def tokens_per_frame(self, model: torch.nn.Module, frame_size: tuple[int, int] | None = None,
                         tokenizer=None) -> int:
        """Tokens of one H2SVC frame (`VideoChunk.frames`); ValueError when it depends on a frame size that is not
        given. `tokenizer`: the stream's, for families whose frames carry text (Qwen3-VL's timestamps)."""
        raise NotImplementedError

    def tokens_per_chunk(self, model: torch.nn.Module, frames: int, frame_size: tuple[int, int] | None,
                         tokenizer=None) -> int:
        """Tokens a chunk of `frames` video frames yields (sizes the cache)."""
        raise NotImplementedError

    def encode_video(self, model, processor, video, batch_size: int, **kwargs) -> VideoChunk:
        """Validate and encode one chunk (frames through `processor`, or model-ready pixel values)."""
        raise NotImplementedError

    def pil_video_processor(self, image_processor, config: dict):
        """The torchvision-free twin of the family's video processor (`hermes.models.processing`) over the
        checkpoint's PIL image processor, with the video processor's settings `config`."""
        raise NotImplementedError

    def prepare_frames(self, processor, frames, fps: float, start: float = 0.0) -> dict:
        """`append_video` keyword arguments for one clip: frames uint8 [F, H, W, 3] RGB sampled at `fps`
        frames per second, the first at `start` seconds of the video (Qwen3-VL writes the time into the chunk),
        through `processor.video_processor` (the real one or the twin)."""
        raise NotImplementedError

    def kept_size(self, processor, height: int, width: int) -> tuple[int, int] | None:
        """(height, width) `prepare_frames` resizes a height x width frame to (the largest, where it depends on
        the chunk), or None when frames go through whole: how far the video reader may shrink frames while
        decoding them (`hermes.video.VideoReader.output_size`, docs/security.md#video)."""
        return None

    def memory_frames(self, inputs: dict) -> int:
        """H2SVC frames (the unit of memory, docs/h2svc.md §1) in one chunk's `prepare_frames` output: LLaVA-OV one per
        video frame; Qwen2.5-VL and Qwen3-VL one per temporal grid step (temporal_patch_size video frames)."""
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
    from .qwen3_vl import Qwen3_VL

    families = (LlavaOneVision(), Qwen2_5_VL(), Qwen3_VL())
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
