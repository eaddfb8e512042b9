"""Qwen2.5-VL (M-RoPE in contiguous (t, h, w) sections): a chunk is its temporal grid steps' merged patches, with
positions built here rather than by transformers' `get_rope_index` (docs/families.md#qwen25-vl). Qwen3-VL's family
subclasses this one."""
from __future__ import annotations

import numpy as np
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from hermes_kernels.rope import RotaryLayout

from .base import ModelFamily, PilVideoProcessor, VideoChunk, check_pixels, check_times, size_of


def patchify(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) \
        -> tuple[np.ndarray, tuple[int, int, int]]:
    """Flattened patches [t * h * w, C * T * p * p] and the grid (t, h, w) of one clip, laid out as
    transformers' `Qwen2VLVideoProcessor.patchify`.

    frames: [F, C, H, W] with H, W multiples of patch_size * merge_size. F is padded to a multiple of T =
    temporal_patch_size by repeating the last frame; t = F / T, h = H / p, w = W / p. Rows run t-major, then
    over 2D merge windows (row of windows, column of windows, row in window, column in window), so each window's
    merge_size^2 patches are adjacent; a row holds its patch's channels, each with T frames of p x p pixels.
    """
    count, channels, height, width = frames.shape
    if pad := -count % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    grid = ((count + pad) // temporal_patch_size, height // patch_size, width // patch_size)
    t, h, w = grid
    patches = frames.reshape(t, temporal_patch_size, channels, h // merge_size, merge_size, patch_size,
                             w // merge_size, merge_size, patch_size)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * temporal_patch_size * patch_size ** 2), grid


class Qwen2_5_VLPilVideoProcessor(PilVideoProcessor):
    """Torchvision-free twin of transformers' `Qwen2VLVideoProcessor`: every frame resized by the image
    processor's `smart_resize` (sides multiples of patch_size * merge_size, area within size's shortest_edge and
    longest_edge pixels; no per-video pixel cap, i.e. cap_pixels_per_frame=False), rescaled, normalised and cut
    by `patchify`. Returns pixel_values_videos float32 [t * h * w, C * T * p * p] and video_grid_thw int64
    [clips, 3]."""

    defaults = dict(size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
                    resample=PILImageResampling.BICUBIC, rescale_factor=1 / 255, image_mean=OPENAI_CLIP_MEAN,
                    image_std=OPENAI_CLIP_STD, do_resize=True, do_rescale=True, do_normalize=True,
                    do_convert_rgb=True, do_center_crop=None, patch_size=14, temporal_patch_size=2, merge_size=2,
                    min_pixels=None, max_pixels=None)
    model_input_names = ("pixel_values_videos", "video_grid_thw")
    off_flags = ("do_sample_frames", "cap_pixels_per_frame")

    @staticmethod
    def standardize(settings):
        # legacy min_pixels / max_pixels override size, as in Qwen2VLVideoProcessor.__init__
        size = dict(settings["size"])
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if (value := settings.pop(key, None)) is not None:
                size[edge] = value
        return {**settings, "size": size}

    def resize_kwargs(self):
        return {"factor": self.patch_size * self.merge_size}

    def layout(self, frames):
        rows, grid = patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size)
        return {"pixel_values_videos": rows, "video_grid_thw": np.array([grid], dtype=np.int64)}


def video_rel_positions(grid_thw: tuple[int, int, int], spatial_merge_size: int, time_interval: float,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [3, t * h' * w'] (t, h, w) offsets of a video's merged tokens from its start position.

    grid_thw: the patch grid (t, h, w) before spatial merging; h' = h / merge, w' = w / merge.
    time_interval: tokens_per_second * seconds per temporal grid step (the t axis follows the frame time).
    """
    grid_t, grid_h, grid_w = (int(x) for x in grid_thw)
    t = (torch.arange(grid_t, device=device) * time_interval).long()
    h = torch.arange(grid_h // spatial_merge_size, device=device)
    w = torch.arange(grid_w // spatial_merge_size, device=device)
    tt, hh, ww = torch.meshgrid(t, h, w, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


class Qwen2_5_VL(ModelFamily):
    name = "Qwen2.5-VL"
    preset_name = "qwen2_5_vl"
    pil_processor = Qwen2_5_VLPilVideoProcessor
    before_video = "<|vision_start|>"
    after_video = "<|vision_end|>"

    def rotary(self, model):
        rotary = self.language_model(model).rotary_emb
        return rotary.inv_freq, RotaryLayout.sections(rotary.mrope_section)  # contiguous t, h, w blocks

    def step_frames(self, model):
        return model.config.vision_config.temporal_patch_size

    def tokens_per_frame(self, model, frame_size=None, tokenizer=None) -> int:
        """Merged tokens of one temporal grid step: (height / (patch·merge)) x (width / (patch·merge))."""
        if frame_size is None:
            raise ValueError(f"frame_size: {self.name}'s token count depends on the frame size; pass "
                             "frame_size=(height, width) of the processed frames or chunk_tokens")
        vision = model.config.vision_config
        side = vision.patch_size * vision.spatial_merge_size
        return (frame_size[0] // side) * (frame_size[1] // side)

    def encode_video(self, model, processor, video, batch_size, grid_thw=None, seconds_per_grid: float = 1.0,
                     **kwargs) -> VideoChunk:
        """video: flattened patches [B * t * h * w, C * temporal_patch * patch^2] with `grid_thw` (t, h, w)
        (one row per stream, all equal, or one row for all), as Qwen's video processor returns them; or raw
        frames (one clip per stream) for `processor.video_processor`. seconds_per_grid: seconds covered by one
        temporal grid step (temporal_patch_size / fps)."""
        self.reject_unexpected(kwargs)
        video, grid = self._patches(model, processor, video, grid_thw, batch_size)
        if not (isinstance(seconds_per_grid, (int, float)) and seconds_per_grid > 0):
            raise ValueError(f"seconds_per_grid: expected a positive number, got {seconds_per_grid!r}")
        embeds = self._merged_tokens(model, video, grid, batch_size)
        vision = model.config.vision_config
        # in float32, as get_rope_index takes it (the processor hands second_per_grid_ts over as a float32 tensor):
        # a double product can truncate to another integer, e.g. 3 x 25 x (10/3) to 250 where transformers has 249
        interval = float(vision.tokens_per_second * torch.tensor(seconds_per_grid, dtype=torch.float32))
        rel = video_rel_positions(grid, vision.spatial_merge_size, interval, device=embeds.device)
        # the same integers built on the host (float32 arithmetic, bit for bit): the extent without a device read
        extent = int(video_rel_positions(grid, vision.spatial_merge_size, interval).max())
        return VideoChunk(embeds=embeds, rel_positions=rel, frames=grid[0], extent=extent)

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": patches, "grid_thw": [1, 3], "seconds_per_grid": T / fps} from frames uint8 [F, H, W, 3];
        seconds_per_grid is what Qwen2_5_VLProcessor passes as second_per_grid_ts (start plays no part: M-RoPE's t
        counts from the chunk).

        times: the frames' own seconds. M-RoPE's t axis steps by one interval per temporal step within a chunk and
        each chunk starts right after the last one's positions, so it can express a chunk's true span but neither a
        gap inside it (spread evenly over its steps) nor one between chunks. seconds_per_grid is then T times the
        frames' mean spacing, (times[-1] - times[0]) / (F - 1); frames spaced 1 / fps apart (to a microsecond) and
        a single frame keep T / fps exactly."""
        times = check_times(times, len(frames))
        video_processor = processor.video_processor
        out = video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False,
                              cap_pixels_per_frame=False)
        temporal = video_processor.temporal_patch_size
        seconds_per_grid = temporal / float(fps)
        # evenly sampled frames carry only rounding in their span: they keep the exact T / fps, whose float32
        # product get_rope_index truncates (a last-bit difference could move a position)
        if times is not None and len(times) > 1 and np.abs(np.diff(times) - 1 / float(fps)).max() > 1e-6:
            seconds_per_grid = temporal * (times[-1] - times[0]) / (len(times) - 1)
        return {"video": out["pixel_values_videos"], "grid_thw": out["video_grid_thw"],
                "seconds_per_grid": seconds_per_grid}

    def kept_size(self, processor, height, width):
        """Qwen2-VL's per-frame `smart_resize` within size's pixel bounds (`prepare_frames` asks for no cap)."""
        video_processor = processor.video_processor
        if not video_processor.do_resize:
            return None
        size = size_of(video_processor)
        return smart_resize(height, width, factor=video_processor.patch_size * video_processor.merge_size,
                            min_pixels=size.shortest_edge, max_pixels=size.longest_edge)

    def memory_frames(self, inputs):
        return int(torch.as_tensor(inputs["grid_thw"]).reshape(-1, 3)[0, 0])  # grid_t

    def frame_size(self, model, inputs):
        _, grid_h, grid_w = (int(x) for x in torch.as_tensor(inputs["grid_thw"]).reshape(-1, 3)[0])
        patch = model.config.vision_config.patch_size
        return grid_h * patch, grid_w * patch

    def text_kwargs(self, input_ids):
        # text only: without mm_token_type_ids the model silently drops to 1D positions
        return {"mm_token_type_ids": torch.zeros_like(input_ids, dtype=torch.int32)}

    def _patches(self, model, processor, video, grid_thw, batch_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """`_check_patches`' (pixel values, grid) of model-ready patches, or of raw frames (one clip per stream) run
        through `processor.video_processor`."""
        if not isinstance(video, torch.Tensor) and processor is not None:
            processed = processor.video_processor(video, return_tensors="pt")
            video, grid_thw = processed["pixel_values_videos"], processed["video_grid_thw"]
        return self._check_patches(model, video, grid_thw, batch_size)

    def _check_patches(self, model, video, grid_thw, batch_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel values [B * t * h * w, C * T * p * p], T = `step_frames`, the grid (t, h, w) every stream shares),
        else the error naming video or grid_thw."""
        vision = model.config.vision_config
        patch_dim = vision.in_channels * self.step_frames(model) * vision.patch_size ** 2
        video = check_pixels("video", video, f"[B * t * h * w, {patch_dim}] with grid_thw")
        grid = self._check_grid(grid_thw, batch_size, vision.spatial_merge_size)
        per_stream = grid[0] * grid[1] * grid[2]
        if video.dim() != 2 or tuple(video.shape) != (batch_size * per_stream, patch_dim):
            raise ValueError(f"video: expected flattened patches [B*t*h*w={batch_size * per_stream}, {patch_dim}] "
                             f"for grid_thw {list(grid)} and B={batch_size}, got {tuple(video.shape)}")
        return video, grid

    def _check_grid(self, grid_thw, batch_size: int, merge: int) -> tuple[int, int, int]:
        if grid_thw is None:
            raise ValueError(f"grid_thw: {self.name} pixel values need their (t, h, w) patch grid")
        grid = torch.as_tensor(grid_thw)
        if grid.dim() == 1:
            grid = grid.unsqueeze(0)
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] not in (1, batch_size) or grid.is_floating_point():
            raise ValueError(f"grid_thw: expected int [3] or [B={batch_size}, 3], got {tuple(grid.shape)}")
        if not bool((grid == grid[0]).all()):
            raise ValueError(f"grid_thw: streams in lockstep need the same grid, got {grid.tolist()}")
        t, h, w = (int(x) for x in grid[0])
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            raise ValueError(f"grid_thw: expected t >= 1 and h, w positive multiples of spatial_merge_size={merge}, "
                             f"got {[t, h, w]}")
        return t, h, w

    def _merged_tokens(self, model, video: torch.Tensor, grid: tuple[int, int, int], batch_size: int) -> torch.Tensor:
        """[B, t * h' * w', hidden]: the tower's merged tokens of each stream, in the language model's dtype and on
        its device."""
        weight = self.language_model(model).embed_tokens.weight
        features = self._video_features(model, video, grid, batch_size)
        return torch.stack(features.pooler_output).to(device=weight.device, dtype=weight.dtype)

    @staticmethod
    def _video_features(model, video: torch.Tensor, grid: tuple[int, int, int], batch_size: int):
        """The vision tower's output for B streams of one grid (pooler_output: one [t * h' * w', hidden] per
        stream; Qwen3-VL: deepstack_features too)."""
        visual = model.model.visual
        grids = torch.tensor([grid] * batch_size, device=visual.device)
        return model.model.get_video_features(video.to(device=visual.device, dtype=visual.dtype), grids)
