"""Qwen3-VL (interleaved M-RoPE, a text timestamp in front of every temporal step, DeepStack): a Qwen2.5-VL whose
chunk is a run per temporal step, `<t seconds> <|vision_start|> visual tokens <|vision_end|>`, with positions as
transformers' `get_rope_index` lays them out and the DeepStack features carried by the chunk. The layout, the
zero-padded timestamps and the per-frame pixel cap: docs/qwen3_vl.md.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
import torch
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

from hermes_kernels.rope import RotaryLayout

from .base import VideoChunk, check_times, seconds_of, size_of
from .qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLPilVideoProcessor

TIMESTAMP_DIGITS = 5  # integer digits of a frame's timestamp: runs keep one length up to 99999.9 s (27.7 h)


def timestamp_text(seconds: float) -> str:
    """The text in front of a temporal step's tokens: Qwen3VLProcessor's "<{t:.1f} seconds>" with the integer part
    zero-padded to TIMESTAMP_DIGITS digits, so every run has one length (docs/qwen3_vl.md#decisions). ValueError
    for a negative time and for one that rounds (to one decimal) to 10^TIMESTAMP_DIGITS s or more: either would
    print another length ("-0000.0", "100000.0")."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) or \
            seconds < 0 or round(seconds, 1) >= 10 ** TIMESTAMP_DIGITS:
        raise ValueError(f"timestamps: expected seconds in [0, {10 ** TIMESTAMP_DIGITS}), got {seconds!r}")
    return f"<{seconds + 0.0:0{TIMESTAMP_DIGITS + 2}.1f} seconds>"  # + 0.0: -0.0 prints as 0


def step_times(count: int, fps: float, start: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal step of `count` frames sampled at `fps` from `start`, as Qwen3VLProcessor computes
    them (`_calculate_timestamps`): `step_times_from` the frame times start + i / fps."""
    return step_times_from([start + i / fps for i in range(count)], temporal_patch_size)


def step_times_from(frame_times: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal step of frames at `frame_times` (any spacing: a live session's chunk may have
    gaps, docs/live.md#gaps): the times padded with the last one to a multiple of temporal_patch_size, then the
    mean of each step's first and last frame."""
    times = list(frame_times)
    times += times[-1:] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def chunk_layout(timestamp_ids: Sequence[Sequence[int]], merged: tuple[int, int], *, vision_start: int,
                 vision_end: int, video_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [T], offsets int64 [3, T]) of a chunk of temporal steps, from its start position.

    timestamp_ids: the token ids of each step's timestamp; merged: (h', w') visual tokens of a step. Visual slots
    hold `video_token`. Offsets as get_rope_index lays them out (docs/qwen3_vl.md#differences): text counts on from
    a cursor on every axis; a step's visual tokens sit at (c, c + row, c + column) and move the cursor by
    max(h', w').
    """
    rows, cols = merged
    grid = torch.stack(torch.meshgrid(torch.zeros(1, dtype=torch.int64), torch.arange(rows), torch.arange(cols),
                                      indexing="ij")).reshape(3, -1)
    tokens, pieces, cursor = [], [], 0
    for stamp in timestamp_ids:
        text = list(stamp) + [vision_start]
        tokens += text + [video_token] * (rows * cols) + [vision_end]
        pieces.append(cursor + torch.arange(len(text)).expand(3, -1))
        cursor += len(text)
        pieces.append(cursor + grid)
        cursor += max(rows, cols)
        pieces.append(torch.full((3, 1), cursor))
        cursor += 1
    return torch.tensor(tokens, dtype=torch.int64), torch.cat(pieces, dim=1)


def deepstack_kwargs(count: int, *, visual: torch.Tensor, batch_size: int, features: list[torch.Tensor]) -> dict:
    """The language model's DeepStack arguments for a forward of `count` tokens whose first T are the chunk's:
    visual_pos_masks bool [B, count] (the chunk's visual slots; whatever follows is text) and
    deepstack_visual_embeds (one [B * visual tokens, hidden] per DeepStack layer, stream-major)."""
    mask = torch.zeros(batch_size, count, dtype=torch.bool, device=visual.device)
    mask[:, :visual.numel()] = visual
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": features}


class Qwen3VLPilVideoProcessor(Qwen2_5_VLPilVideoProcessor):
    """Torchvision-free twin of transformers' `Qwen3VLVideoProcessor`: a clip's frames resized together by its
    `smart_resize` (sides multiples of patch_size * merge_size; the clip's t x h x w pixels within size's
    shortest_edge and longest_edge, or with cap_pixels_per_frame each frame within max(min(max_video_tokens *
    factor^2, longest_edge / frames), 1.05 * shortest_edge)), then as Qwen2.5-VL's twin: rescaled, normalised and
    cut by `patchify` into the same two tensors."""

    defaults = dict(size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                    resample=PILImageResampling.BICUBIC, rescale_factor=1 / 255, image_mean=IMAGENET_STANDARD_MEAN,
                    image_std=IMAGENET_STANDARD_STD, do_resize=True, do_rescale=True, do_normalize=True,
                    do_convert_rgb=True, do_center_crop=None, patch_size=16, temporal_patch_size=2, merge_size=2,
                    cap_pixels_per_frame=None, max_video_tokens=768)
    off_flags = ("do_sample_frames",)
    options = ("cap_pixels_per_frame",)

    def resize(self, image, num_frames, cap_pixels_per_frame=None):
        cap = self.cap_pixels_per_frame if cap_pixels_per_frame is None else cap_pixels_per_frame
        factor = self.patch_size * self.merge_size
        max_pixels = self.size.longest_edge
        if cap:
            per_frame = max(min(self.max_video_tokens * factor ** 2, self.size.longest_edge // num_frames),
                            int(self.size.shortest_edge * 1.05))
            max_pixels = per_frame * num_frames
        height, width = smart_resize(num_frames, *image.shape[-2:], temporal_factor=self.temporal_patch_size,
                                     factor=factor, min_pixels=self.size.shortest_edge, max_pixels=max_pixels)
        # the image processor's own resize applies Qwen2-VL's per-image rule; the clip's size is decided here
        return PilBackend.resize(self.image_processor, image, SizeDict(height=height, width=width),
                                 resample=self.resample)


class Qwen3_VL(Qwen2_5_VL):
    """Qwen2.5-VL's patch and grid checks, frame counts and text-only position arguments; its own rotary layout,
    chunk layout (timestamps, DeepStack), processing and chat text (no outer video markers)."""
    name = "Qwen3-VL"
    preset_name = "qwen3_vl"
    pil_processor = Qwen3VLPilVideoProcessor
    before_video = after_video = ""
    # ours: transformers 5.24's plan for Qwen3-VL's text model shards embed_tokens only. Qwen3.5's rules for the
    # attention and the MLP: heads split by q/k/v's rows, o_proj's columns all-reduced (the hidden states, so the
    # DeepStack additions, are whole on every rank); the per-head norms replicated (docs/multi-gpu.md#families)
    tp_plan = {f"model.language_model.layers.*.{name}": style for name, style in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("self_attn.q_norm", "replicated_with_grad_allreduce"),
        ("self_attn.k_norm", "replicated_with_grad_allreduce"), ("mlp.gate_proj", "colwise"),
        ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))}

    def rotary(self, model):
        rotary = self.language_model(model).rotary_emb
        return rotary.inv_freq, RotaryLayout.interleaved(rotary.mrope_section)  # h, w, t cycling over pairs

    def _timestamp_ids(self, tokenizer, seconds: float) -> list[int]:
        return list(tokenizer(timestamp_text(seconds), add_special_tokens=False)["input_ids"])

    def tokens_per_frame(self, model, frame_size=None, tokenizer=None) -> int:
        """Tokens of one temporal step's run: its timestamp, <|vision_start|>, (height / (patch·merge)) x
        (width / (patch·merge)) visual tokens, <|vision_end|>."""
        visual = super().tokens_per_frame(model, frame_size)
        return len(self._timestamp_ids(self.timestamp_tokenizer(tokenizer), 0.0)) + 2 + visual

    def encode_video(self, model, processor, video, batch_size, grid_thw=None, timestamps=None,
                     **kwargs) -> VideoChunk:
        """video: flattened patches [B * t * h * w, C * temporal_patch * patch^2] with `grid_thw` (t, h, w) (one row
        per stream, all equal, or one row for all), as Qwen's video processor returns them; or raw frames (one
        uint8 [F, H, W, 3] clip per stream) for `processor.video_processor`. timestamps: seconds of each of the t
        temporal steps (`step_times`), shared by the streams. `processor` (or a tokenizer) writes the timestamps.
        Returns embeds [B, T, hidden] of the t runs (docs/qwen3_vl.md), their offsets and DeepStack arguments."""
        self.reject_unexpected(kwargs)
        tokenizer = self.timestamp_tokenizer(processor)
        if not isinstance(video, torch.Tensor) and hasattr(processor, "video_processor"):
            clips = [video] if isinstance(video, np.ndarray) and video.ndim == 4 else list(video)
            processed = self._process(processor.video_processor, clips)
            video, grid_thw = processed["pixel_values_videos"], processed["video_grid_thw"]
        video, grid = self._check_patches(model, video, grid_thw, batch_size)
        stamps = self._check_timestamps(timestamps, grid[0])
        stamp_ids = [self._timestamp_ids(tokenizer, seconds) for seconds in stamps]
        if len({len(ids) for ids in stamp_ids}) > 1:
            raise ValueError(f"timestamps: the tokenizer gives the timestamps {stamps} different token counts; every "
                             "temporal step's run must have one length (docs/qwen3_vl.md)")
        config = model.config
        merge = config.vision_config.spatial_merge_size
        tokens, rel = chunk_layout(stamp_ids, (grid[1] // merge, grid[2] // merge),
                                   vision_start=config.vision_start_token_id, vision_end=config.vision_end_token_id,
                                   video_token=config.video_token_id)
        extent = int(rel.max())  # built on the host: known without a device read
        features = self._video_features(model, video, grid, batch_size)
        embed = self.language_model(model).embed_tokens
        device, dtype = embed.weight.device, embed.weight.dtype
        tokens = tokens.to(device)
        visual = tokens == config.video_token_id
        # as Qwen3VLModel.forward: token embeddings with the visual slots scattered over, stream-major
        embeds = embed(tokens).expand(batch_size, -1, -1).masked_scatter(
            visual[None, :, None], torch.cat(features.pooler_output).to(device=device, dtype=dtype))
        return VideoChunk(embeds=embeds, rel_positions=rel.to(device), frames=grid[0], extent=extent,
                          extra=self._extra(features, visual, batch_size, dtype))

    @staticmethod
    def _extra(features, visual: torch.Tensor, batch_size: int, dtype: torch.dtype):
        """The chunk's `extra`: DeepStack's arguments (`deepstack_kwargs`) from the tower's output; visual: bool [T],
        the chunk's visual slots, on the language model's device."""
        deepstack = [torch.cat(feature).to(device=visual.device, dtype=dtype)
                     for feature in features.deepstack_features]
        return functools.partial(deepstack_kwargs, visual=visual, batch_size=batch_size, features=deepstack)

    @staticmethod
    def _check_timestamps(timestamps, count: int) -> list[float]:
        seconds = seconds_of(timestamps, count, "timestamps", "temporal steps (shared by the streams)")
        for value in seconds:
            timestamp_text(value)  # raises, naming timestamps
        return seconds

    @staticmethod
    def _process(video_processor, clips: list) -> dict:
        """The video processor over clips uint8 [F, H, W, 3], each padded with its last frame to a multiple of
        temporal_patch_size first (the processor refuses fewer frames than that), the per-frame cap on."""
        size = video_processor.temporal_patch_size
        clips = [np.concatenate([clip, np.repeat(clip[-1:], -len(clip) % size, axis=0)]) for clip in clips]
        return video_processor(videos=clips, return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=True)

    def kept_size(self, processor, height, width):
        """Qwen3-VL's clip-wide `smart_resize` with the per-frame cap (as `_process` asks), for the shortest clip,
        temporal_patch_size frames: a longer clip's frames are no larger."""
        video_processor = processor.video_processor
        if not video_processor.do_resize:
            return None
        size, frames = size_of(video_processor), video_processor.temporal_patch_size
        factor = video_processor.patch_size * video_processor.merge_size
        per_frame = max(min(video_processor.max_video_tokens * factor ** 2, size.longest_edge // frames),
                        int(size.shortest_edge * 1.05))
        return smart_resize(frames, height, width, temporal_factor=frames, factor=factor,
                            min_pixels=size.shortest_edge, max_pixels=per_frame * frames)

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": patches, "grid_thw": [1, 3], "timestamps": seconds of each temporal step} from frames uint8
        [F, H, W, 3] sampled at `fps` from `start` seconds (`step_times`), or at their own `times` (seconds, one per
        frame; fps and start then play no part, `step_times_from`): each step's timestamp is then its frames' true
        time, so the model reads the true time across a gap."""
        times = check_times(times, len(frames))
        video_processor = processor.video_processor
        temporal = video_processor.temporal_patch_size
        stamps = step_times(len(frames), float(fps), float(start), temporal) if times is None else \
            step_times_from(times, temporal)
        out = self._process(video_processor, [np.asarray(frames)])
        return {"video": out["pixel_values_videos"], "grid_thw": out["video_grid_thw"], "timestamps": stamps}
