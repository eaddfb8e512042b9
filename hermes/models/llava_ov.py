"""LLaVA-OneVision (Qwen2 language model, 1D RoPE): a chunk is its frames' pooled vision features, without the
newline token a whole video would end with (docs/families.md#llava-onevision)."""
from __future__ import annotations

import math

import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from .base import ModelFamily, PilVideoProcessor, VideoChunk, check_pixels, check_times, size_of


class LlavaOneVisionPilVideoProcessor(PilVideoProcessor):
    """Torchvision-free twin of transformers' `LlavaOnevisionVideoProcessor`: every frame resized to `size`
    (height x width, aspect ratio not kept), rescaled, normalised. Returns pixel_values_videos float32
    [clips, F, C, height, width]."""

    defaults = dict(size={"height": 384, "width": 384}, resample=PILImageResampling.BICUBIC, rescale_factor=1 / 255,
                    image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, do_resize=True, do_rescale=True,
                    do_normalize=True, do_convert_rgb=True, do_center_crop=None)
    model_input_names = ("pixel_values_videos",)

    def layout(self, frames):
        return {"pixel_values_videos": frames[None]}


class LlavaOneVision(ModelFamily):
    name = "LLaVA-OneVision"
    preset_name = "llava_ov"
    pil_processor = LlavaOneVisionPilVideoProcessor
    after_video = "\n"

    def rotary(self, model):
        return self.language_model(model).rotary_emb.inv_freq, None

    def tokens_per_frame(self, model, frame_size=None, tokenizer=None) -> int:
        """ceil(side / 2)^2 for the tower's side x side patch grid (2 x 2 bilinear pooling); no frame size needed."""
        vision = model.config.vision_config
        side = vision.image_size // vision.patch_size
        return math.ceil(side / 2) ** 2

    def encode_video(self, model, processor, video, batch_size, **kwargs) -> VideoChunk:
        """video: pixel values [B, F, C, S, S] (or [F, C, S, S] for one stream), S = vision image_size; or raw
        frames (one clip per stream) for `processor.video_processor`. Returns [B, F * tokens_per_frame, hidden]."""
        self.reject_unexpected(kwargs)
        if not isinstance(video, torch.Tensor) and processor is not None:
            video = processor.video_processor(video, return_tensors="pt")["pixel_values_videos"]
        vision = model.config.vision_config
        side = vision.image_size
        expected = f"[B={batch_size}, F, C={vision.num_channels}, {side}, {side}]"
        video = check_pixels("video", video, expected)
        if video.dim() == 4 and batch_size == 1:
            video = video.unsqueeze(0)
        if video.dim() != 5 or video.shape[0] != batch_size or video.shape[1] < 1 or \
                tuple(video.shape[2:]) != (vision.num_channels, side, side):
            raise ValueError(f"video: expected pixel values {expected}, got {tuple(video.shape)}")
        tower = model.model.vision_tower
        features = model.model.get_video_features(
            video.to(device=tower.device, dtype=tower.dtype),
            vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy).pooler_output
        lm = self.language_model(model)
        embeds = features[:, :-1].to(device=lm.embed_tokens.weight.device, dtype=lm.embed_tokens.weight.dtype)
        return VideoChunk(embeds=embeds, rel_positions=None, frames=video.shape[1], extent=embeds.shape[1] - 1)

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": pixel values [1, F, C, S, S]} from frames uint8 [F, H, W, 3]. fps, start and times play no
        part: a chunk's 1D positions count its tokens, not seconds, so a gap between frames cannot show (times is
        still checked)."""
        check_times(times, len(frames))
        out = processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
        return {"video": out["pixel_values_videos"]}

    def kept_size(self, processor, height, width):
        """The tower's square, `size` (the aspect ratio is not kept)."""
        video_processor = processor.video_processor
        if not video_processor.do_resize:
            return None
        size = size_of(video_processor)
        return size.height, size.width

    def memory_frames(self, inputs):
        return int(inputs["video"].shape[-4])  # pixel values [1, F, C, S, S] or [F, C, S, S]
