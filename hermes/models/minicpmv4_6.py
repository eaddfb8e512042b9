"""MiniCPM-V 4.6 (`minicpmv4_6`): a SigLIP tower whose window-attention merger (after block `insert_layer_id`) and
MLP merger each fold 2 x 2 patches, so a frame of h x w patches gives (h / 4) x (w / 4) tokens ("4x" mode skips the
first fold), over Qwen3.5's hybrid decoder run with 1D positions on every axis. A frame is `<image>` its tokens
`</image>`, as MiniCPMV4_6Processor writes a video frame without slices; the video's `<image_id>0</image_id>` ends
the prefix. Layout, processing and what differs from the other families: docs/families.md#minicpm-v-4-6.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict

from hermes_kernels.rope import RotaryLayout

from .base import ModelFamily, PilVideoProcessor, VideoChunk, check_pixels, check_times


class MiniCPMV4_6PilVideoProcessor(PilVideoProcessor):
    """Torchvision-free twin of transformers' `MiniCPMV4_6VideoProcessor` with slice_mode=False: every frame resized
    by the image processor's `find_best_resize` (scale_resolution² pixels at the frame's aspect ratio, sides multiples
    of patch_size · 4, · 2 in "4x" mode), rescaled, normalised and packed as the processor packs a clip:
    pixel_values_videos float32 [1, C, patch, F · h · w · patch] (frame after frame, each as `reshape_by_patch`) and
    target_sizes_videos int32 [F, 2] ((h, w) patches of every frame)."""

    defaults = dict(size={}, resample=PILImageResampling.BICUBIC, rescale_factor=1 / 255,
                    image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD, do_resize=True, do_rescale=True,
                    do_normalize=True, do_convert_rgb=True, do_center_crop=None, scale_resolution=448, patch_size=14,
                    downsample_mode="16x")
    model_input_names = ("pixel_values_videos", "target_sizes_videos")
    off_flags = ("do_sample_frames", "slice_mode")

    @staticmethod
    def standardize(settings):
        return {**settings, "size": settings["size"] or {}}  # the processor sizes frames by scale_resolution

    def resize(self, image, num_frames):
        height, width = self.image_processor.find_best_resize(image.shape[-2:], self.scale_resolution, self.patch_size,
                                                              downsample_mode=self.downsample_mode, allow_upscale=True)
        return self.image_processor.resize(image, SizeDict(height=height, width=width), resample=self.resample)

    def layout(self, frames):
        count, channels, height, width = frames.shape
        p = self.patch_size
        rows = frames.reshape(count, channels, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4, 5)
        return {"pixel_values_videos": rows.reshape(1, channels, p, -1),
                "target_sizes_videos": np.array([[height // p, width // p]] * count, dtype=np.int32)}


class MiniCPMV4_6(ModelFamily):
    """Frames between `<image>` markers as MiniCPMV4_6Processor writes them without slices, 1D positions over the
    rotary part of each head, Qwen3.5's hybrid decoder as the language model (`model.model.language_model`); the
    base's ChatML, its prefix ending with the video's `<image_id>`."""
    name = "MiniCPM-V 4.6"
    preset_name = "minicpmv4_6"
    pil_processor = MiniCPMV4_6PilVideoProcessor
    before_video = "<image_id>0</image_id>"  # the processor's id of the video, once, in front of its first frame
    frame_markers = ("<image>", "</image>")

    def rotary(self, model):
        """The rotary module's inv_freq [R/2] (partial: R = partial_rotary_factor · head_dim) turned by one position:
        the model passes no position_ids, so Qwen3.5's text model puts the token index on all three M-RoPE axes."""
        inv_freq = self.language_model(model).rotary_emb.inv_freq
        return inv_freq, RotaryLayout.one_d(inv_freq.numel())

    @staticmethod
    def _fold(model) -> tuple[int, int]:
        """Patches per token along (height, width): the ViT window merger's kernel (not in "4x" mode) times the
        merger's kernel once per merger round."""
        config = model.config
        window = (1, 1) if config.downsample_mode == "4x" else tuple(config.vision_config.window_kernel_size)
        return tuple(w * k ** config.merger_times for w, k in zip(window, config.merge_kernel_size))

    def _marker_ids(self, tokenizer) -> tuple[list[int], list[int]]:
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if tokenizer is None or not callable(tokenizer):
            raise TypeError(f"processor: {self.name} frames carry <image> markers; pass the model's processor or "
                            f"tokenizer, got {type(tokenizer).__name__}")
        start, end = (list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in self.frame_markers)
        return start, end

    def tokens_per_frame(self, model, frame_size=None, tokenizer=None) -> int:
        """`<image>`, (height / (patch · fold)) x (width / (patch · fold)) tokens, `</image>`."""
        if frame_size is None:
            raise ValueError(f"frame_size: {self.name}'s token count depends on the frame size; pass "
                             "frame_size=(height, width) of the processed frames or chunk_tokens")
        patch = model.config.vision_config.patch_size
        fold = self._fold(model)
        start, end = self._marker_ids(tokenizer)
        return len(start) + (frame_size[0] // patch // fold[0]) * (frame_size[1] // patch // fold[1]) + len(end)

    def encode_video(self, model, processor, video, batch_size, target_sizes=None, **kwargs) -> VideoChunk:
        """video: pixel values [B, C, patch, F · h · w · patch] (one row per stream, each packed as the video
        processor packs a clip) with `target_sizes` int [F, 2] ((h, w) patches of every frame, shared by the
        streams); or raw frames (one uint8 [F, H, W, 3] clip per stream) for `processor.video_processor`. Returns
        embeds [B, F · (h · w / fold² + 2 markers), hidden] and no rel_positions (1D)."""
        self.reject_unexpected(kwargs)
        start, end = self._marker_ids(processor)
        if not isinstance(video, torch.Tensor) and hasattr(processor, "video_processor"):
            clips = [video] if isinstance(video, np.ndarray) and video.ndim == 4 else list(video)
            processed = [self._process(processor.video_processor, clip) for clip in clips]
            if len({tuple(out["target_sizes_videos"].flatten().tolist()) for out in processed}) > 1:
                raise ValueError("video: streams in lockstep need clips of one frame count and frame size")
            video = torch.cat([out["pixel_values_videos"] for out in processed])
            target_sizes = processed[0]["target_sizes_videos"]
        video, (frames, h, w) = self._check_frames(model, video, target_sizes, batch_size)
        fold = self._fold(model)
        tokens = torch.tensor((start + [model.config.video_token_id] * (h // fold[0]) * (w // fold[1]) + end) * frames)
        tower = model.model.vision_tower
        sizes = torch.tensor([[h, w]] * frames, dtype=torch.int32, device=tower.device)
        features = model.model.get_video_features(video.to(device=tower.device, dtype=tower.dtype), sizes)
        embed = self.language_model(model).embed_tokens
        tokens = tokens.to(embed.weight.device)
        # as MiniCPMV4_6Model.forward: token embeddings with the frames' features scattered over the pads, stream-major
        embeds = embed(tokens).expand(batch_size, -1, -1).masked_scatter(
            (tokens == model.config.video_token_id)[None, :, None],
            torch.cat(features.pooler_output).to(device=embed.weight.device, dtype=embed.weight.dtype))
        return VideoChunk(embeds=embeds, rel_positions=None, frames=frames, extent=tokens.numel() - 1)

    def _check_frames(self, model, video, target_sizes, batch_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel values, (F, h, w)), else the error naming video or target_sizes."""
        vision = model.config.vision_config
        channels, patch = vision.num_channels, vision.patch_size
        video = check_pixels("video", video, f"[B, {channels}, {patch}, F * h * w * {patch}] with target_sizes")
        if target_sizes is None:
            raise ValueError(f"target_sizes: {self.name} pixel values need the (h, w) patches of each frame")
        sizes = torch.as_tensor(target_sizes)
        if sizes.dim() != 2 or sizes.shape[0] < 1 or sizes.shape[1] != 2 or sizes.is_floating_point():
            raise ValueError(f"target_sizes: expected int [F, 2], got {tuple(sizes.shape)}")
        (h, w), fold = sizes[0].tolist(), self._fold(model)
        if not bool((sizes == sizes[0]).all()) or h < fold[0] or w < fold[1] or h % fold[0] or w % fold[1]:
            raise ValueError(f"target_sizes: expected F equal rows (h, w), positive multiples of {list(fold)} (the "
                             f"mergers' folds), got {sizes.tolist()}")
        expected = (batch_size, channels, patch, sizes.shape[0] * h * w * patch)
        if tuple(video.shape) != expected:
            raise ValueError(f"video: expected pixel values {list(expected)} for target_sizes {[h, w]} x "
                             f"{sizes.shape[0]} and B={batch_size}, got {tuple(video.shape)}")
        return video, (sizes.shape[0], h, w)

    @staticmethod
    def _process(video_processor, clip) -> dict:
        return video_processor(videos=[clip], return_tensors="pt", do_sample_frames=False, slice_mode=False)

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": pixel values [1, C, patch, F · h · w · patch], "target_sizes": [F, 2]} from frames uint8
        [F, H, W, 3]. fps, start and times play no part: the frames carry no time and 1D positions count tokens
        (times is still checked)."""
        check_times(times, len(frames))
        out = self._process(processor.video_processor, np.asarray(frames))
        return {"video": out["pixel_values_videos"], "target_sizes": out["target_sizes_videos"]}

    def memory_frames(self, inputs):
        return int(torch.as_tensor(inputs["target_sizes"]).shape[0])

    def frame_size(self, model, inputs):
        patch = model.config.vision_config.patch_size
        return tuple(int(x) * patch for x in torch.as_tensor(inputs["target_sizes"])[0])
