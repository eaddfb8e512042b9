"""Gemma 4 (`gemma4`): a decoder that mixes sliding-window layers (head dim 256, default RoPE) with full-attention
layers (their own head dim and KV heads, proportional RoPE over a quarter of the pairs), whose last layers read the
keys and values of an earlier layer (KV sharing), and whose every layer adds a per-layer input embedding (PLE). Which
layers the stream caches compress, and why: docs/gemma4.md.

A chunk is one run per video frame, laid out as `Gemma4Processor.replace_video_token` lays out a video: the frame's
"mm:ss" timestamp, <|image>, its soft tokens (<|video|> slots), <image|>, frames joined by a space. The space is
written in front of every frame, the stream's first included, so that every frame has one token count (the
processor writes none in front of a video's first frame). Positions are 1D.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
import torch
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

from .base import ModelFamily, PilVideoProcessor, VideoChunk, check_pixels, check_times, seconds_of

SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)  # the max_soft_tokens Gemma4VideoProcessor accepts
TIMESTAMP_LIMIT = 100 * 60  # seconds: "mm:ss" keeps two minute digits, so one token count, below 100 minutes


def frame_text(seconds: float) -> str:
    """The text in front of a frame's <|image>: the separator and Gemma4Processor's "mm:ss " timestamp (whole
    minutes and seconds, truncated). ValueError naming timestamps outside [0, TIMESTAMP_LIMIT): a negative time,
    or one of 100 minutes or more, would print another length."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) or \
            not 0 <= seconds < TIMESTAMP_LIMIT:
        raise ValueError(f"timestamps: expected seconds in [0, {TIMESTAMP_LIMIT}) (mm:ss with two minute digits), "
                         f"got {seconds!r}")
    return f" {int(seconds // 60):02d}:{int(seconds % 60):02d} "


def chunk_layout(stamp_ids: Sequence[Sequence[int]], soft_tokens: int, *, boi: int, eoi: int,
                 video_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [T], blocks int64 [T]) of a chunk of frames: frame f is its timestamp's ids
    `stamp_ids[f]`, <|image> (`boi`), `soft_tokens` slots holding `video_token`, <image|> (`eoi`). blocks: f at
    frame f's slots (the vision block transformers' get_block_sequence_ids_for_mask gives them, numbered from 0 in
    the chunk), -1 at text."""
    tokens, blocks = [], []
    for frame, stamp in enumerate(stamp_ids):
        text = list(stamp) + [boi]
        tokens += text + [video_token] * soft_tokens + [eoi]
        blocks += [-1] * len(text) + [frame] * soft_tokens + [-1]
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64)


def per_layer_kwargs(count: int, *, per_layer_inputs: torch.Tensor) -> dict:
    """The chunk's `extra`: {"per_layer_inputs": [B, T, layers, hidden_size_per_layer_input]} for a forward of the
    chunk's T tokens alone; any other `count` (a forward that carries text behind the chunk) is refused, the text's
    per-layer inputs being the model's to compute from its ids."""
    if count != per_layer_inputs.shape[1]:
        raise ValueError(f"count: Gemma 4 chunks carry the per-layer inputs of their own {per_layer_inputs.shape[1]} "
                         f"tokens only, got a forward of {count}")
    return {"per_layer_inputs": per_layer_inputs}


class Gemma4PilVideoProcessor(PilVideoProcessor):
    """Torchvision-free twin of transformers' `Gemma4VideoProcessor`: every frame resized, aspect ratio kept, to
    the largest sides that are multiples of pooling_kernel_size · patch_size within max_soft_tokens ·
    pooling_kernel_size² patches (`get_aspect_ratio_preserving_size`; PIL copies a frame already that size),
    rescaled, normalised, cut into patches and padded to that many. Returns per clip pixel_values_videos float32
    [F, max_patches, patch_size² · 3] (a patch's pixels row by row, channels last), video_position_ids int64
    [F, max_patches, 2] (the patch's (column, row), -1 on padding), num_frames_per_video [1] (F) and
    num_soft_tokens_per_video [1] (soft tokens of one frame), the clips concatenated along the first axis."""

    defaults = dict(size={}, resample=PILImageResampling.BICUBIC, rescale_factor=1 / 255, image_mean=[0.0, 0.0, 0.0],
                    image_std=[1.0, 1.0, 1.0], do_resize=True, do_rescale=True, do_normalize=True,
                    do_convert_rgb=True, do_center_crop=None, patch_size=16, max_soft_tokens=70,
                    pooling_kernel_size=3)
    model_input_names = ("pixel_values_videos", "video_position_ids", "num_frames_per_video",
                         "num_soft_tokens_per_video")

    def __init__(self, image_processor, config: dict | None = None):
        super().__init__(image_processor, config)
        if self.max_soft_tokens not in SOFT_TOKEN_CHOICES:
            raise ValueError(f"max_soft_tokens: expected one of {SOFT_TOKEN_CHOICES}, got {self.max_soft_tokens!r}")

    @staticmethod
    def standardize(settings):
        return {**settings, "size": settings["size"] or {}}  # Gemma 4 sizes frames by patches; size stays unset

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def resize(self, image, num_frames):
        height, width = image.shape[-2:]
        target = get_aspect_ratio_preserving_size(height, width, self.patch_size, self.max_patches,
                                                  self.pooling_kernel_size)
        return PilBackend.resize(self.image_processor, image, SizeDict(height=target[0], width=target[1]),
                                 resample=self.resample)

    def layout(self, frames):
        count, channels, height, width = frames.shape
        patch = self.patch_size
        rows, cols = height // patch, width // patch
        if rows * patch != height or cols * patch != width:
            raise ValueError(f"video: frames of {height} x {width} pixels are not whole patches of {patch}")
        patches = frames.reshape(count, channels, rows, patch, cols, patch).transpose(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(count, rows * cols, patch * patch * channels)
        positions = np.stack([np.tile(np.arange(cols), rows), np.repeat(np.arange(rows), cols)], axis=-1)
        positions = np.broadcast_to(positions, (count, rows * cols, 2))
        pad = max(self.max_patches - rows * cols, 0)
        return {"pixel_values_videos": np.pad(patches, ((0, 0), (0, pad), (0, 0))),
                "video_position_ids": np.pad(positions, ((0, 0), (0, pad), (0, 0)), constant_values=-1),
                "num_frames_per_video": np.array([count]),
                "num_soft_tokens_per_video": np.array([rows * cols // self.pooling_kernel_size ** 2])}


class Gemma4(ModelFamily):
    """Gemma 4's family. `rotary` is the full-attention layers' (the layers the policies compress): the rotary
    module's `full_attention_inv_freq` [D/2] (D = global_head_dim), whose pairs past partial_rotary_factor · D/2 have
    frequency 0 (proportional RoPE), as one 1D `RotaryLayout` path: a zero frequency turns nothing, exactly.

    Chat text: Gemma 4's chat template, as the checkpoints' chat_template.jinja and tokenizer_config.json and
    Google's Gemma 4 prompt-formatting page give it: bos_token <bos> first, turns <|turn>{role}\\n ... <turn|>\\n
    (system, user, model), the system prompt and the question trimmed, a video item as <|video|> (which the processor
    expands into the frames) right before the question, the generation prompt <|turn>model\\n. That is the E2B and
    E4B checkpoints' prompt with thinking off; the larger checkpoints' templates add an empty thought channel,
    <|channel>thought\\n<channel|>, after it, which this text leaves out."""
    name = "Gemma 4"
    preset_name = "gemma4"
    # transformers 5.25's plan splits the embedding by vocabulary rows ("embedding_rowwise"), and Gemma4Model.forward
    # then reads the pad token's row of that weight and mixes it with plain tensors, which fails for any forward from
    # token ids; the embedding and the tied LM head stay whole on every rank, the heads split as transformers plans
    # (docs/multi-gpu.md#families)
    tp_plan = {"model.language_model.embed_tokens": "replicated_with_grad_allreduce",
               "lm_head": "replicated_with_grad_allreduce"}
    system_prompt = "You are a helpful assistant."
    pil_processor = Gemma4PilVideoProcessor

    def rotary(self, model: torch.nn.Module):
        return self.language_model(model).rotary_emb.full_attention_inv_freq, None

    def prefix_text(self, system_prompt: str | None) -> str:
        prompt = self.system_prompt if system_prompt is None else system_prompt
        return f"<bos><|turn>system\n{prompt.strip()}<turn|>\n<|turn>user\n{self.before_video}"

    def question_text(self, question: str) -> str:
        return f"{self.after_video}{question.strip()}<turn|>\n<|turn>model\n"

    # ---- frames --------------------------------------------------------------------------------------------
    @staticmethod
    def _stamp_ids(tokenizer, seconds: float) -> list[int]:
        return list(tokenizer(frame_text(seconds), add_special_tokens=False)["input_ids"])

    def tokens_per_frame(self, model, frame_size=None, tokenizer=None) -> int:
        """Tokens of one frame's run: its separator and timestamp (`frame_text`), <|image>, (height / patch) x
        (width / patch) / pooling_kernel_size² soft tokens for processed frames of `frame_size` = (height, width),
        <image|>."""
        if frame_size is None:
            raise ValueError(f"frame_size: {self.name}'s token count depends on the frame size; pass "
                             "frame_size=(height, width) of the processed frames or chunk_tokens")
        vision = model.config.vision_config
        patches = (frame_size[0] // vision.patch_size) * (frame_size[1] // vision.patch_size)
        stamp = self._stamp_ids(self.timestamp_tokenizer(tokenizer), 0.0)
        return len(stamp) + 2 + patches // vision.pooling_kernel_size ** 2

    def frame_size(self, model, inputs):
        """(height, width) of the processed frames: the first frame's patch grid (its largest column and row + 1)
        times the patch size."""
        positions = torch.as_tensor(inputs["video_position_ids"])[0]
        grid = positions[(positions != -1).all(dim=-1)].amax(dim=0) + 1
        patch = model.config.vision_config.patch_size
        return int(grid[1]) * patch, int(grid[0]) * patch

    def kept_size(self, processor, height, width):
        """The video processor's aspect-preserving size for a height x width frame (the frame whole when it does
        not resize)."""
        video_processor = processor.video_processor
        if not video_processor.do_resize:
            return None
        kernel = video_processor.pooling_kernel_size
        return get_aspect_ratio_preserving_size(height, width, video_processor.patch_size,
                                                video_processor.max_soft_tokens * kernel ** 2, kernel)

    def memory_frames(self, inputs):
        return len(inputs["timestamps"])

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": pixel values [F, max_patches, patch² · 3], "video_position_ids": [F, max_patches, 2],
        "timestamps": seconds of each frame} from frames uint8 [F, H, W, 3] sampled at `fps` from `start` seconds
        (frame i at start + i / fps), or at their own `times` (fps and start then play no part): the timestamps are
        the frames' true times, across a gap too."""
        times = check_times(times, len(frames))
        if times is None:
            if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
                raise ValueError(f"fps: expected a positive number of frames per second, got {fps!r}")
            times = [float(start) + i / float(fps) for i in range(len(frames))]
        out = processor.video_processor(videos=[np.asarray(frames)], return_tensors="pt", do_sample_frames=False)
        return {"video": out["pixel_values_videos"], "video_position_ids": out["video_position_ids"],
                "timestamps": times}

    # ---- the chunk -----------------------------------------------------------------------------------------
    def encode_video(self, model, processor, video, batch_size, video_position_ids=None, timestamps=None,
                     **kwargs) -> VideoChunk:
        """video: patches [B · F, max_patches, patch² · 3] with `video_position_ids` [B · F, max_patches, 2], the
        streams' F frames each one after another (as Gemma4VideoProcessor concatenates clips), every frame on one
        patch grid; or raw frames (one uint8 [F, H, W, 3] clip per stream) for `processor.video_processor`.
        timestamps: seconds of each of the F frames, shared by the streams. `processor` (or a tokenizer) writes
        them. Returns embeds [B, T, hidden] of the F runs (T = F · tokens_per_frame), with the vision block of each
        token and the per-layer inputs of the model's own forward (`extra`, when the model has PLE)."""
        self.reject_unexpected(kwargs)
        tokenizer = self.timestamp_tokenizer(processor)
        if not isinstance(video, torch.Tensor) and hasattr(processor, "video_processor"):
            clips = [video] if isinstance(video, np.ndarray) and video.ndim == 4 else list(video)
            if len(clips) != batch_size:
                raise ValueError(f"video: expected one clip of frames per stream (B={batch_size}), got {len(clips)}")
            processed = processor.video_processor(videos=clips, return_tensors="pt", do_sample_frames=False)
            video, video_position_ids = processed["pixel_values_videos"], processed["video_position_ids"]
        video, positions, soft = self._check_patches(model, video, video_position_ids, batch_size)
        frames = video.shape[0] // batch_size
        stamp_ids = [self._stamp_ids(tokenizer, seconds) for seconds in
                     seconds_of(timestamps, frames, "timestamps", "frames (shared by the streams)")]
        width = len(self._stamp_ids(tokenizer, 0.0))
        if any(len(ids) != width for ids in stamp_ids):
            raise ValueError(f"timestamps: the tokenizer gives {[len(ids) for ids in stamp_ids]} tokens for these "
                             f"timestamps and {width} for 00:00; every frame's run must have one length")
        config = model.config
        tokens, blocks = chunk_layout(stamp_ids, soft, boi=config.boi_token_id, eoi=config.eoi_token_id,
                                      video_token=config.video_token_id)
        tower = model.model.vision_tower
        features = model.model.get_video_features(
            video.to(device=tower.device, dtype=tower.dtype), positions.to(tower.device),
            num_frames_per_video=torch.full((batch_size,), frames)).pooler_output
        lm = self.language_model(model)
        device, dtype = lm.embed_tokens.weight.device, lm.embed_tokens.weight.dtype
        tokens, blocks = tokens.to(device), blocks.to(device)
        visual = blocks >= 0
        # as Gemma4Model.forward: the soft-token slots read as the pad token, then take the tower's features
        text_ids = torch.where(visual, config.text_config.pad_token_id, tokens)
        embeds = lm.embed_tokens(text_ids).expand(batch_size, -1, -1).masked_scatter(
            visual[None, :, None], torch.cat(features).to(device=device, dtype=dtype))
        extra = None
        if lm.hidden_size_per_layer_input:
            per_layer = lm.get_per_layer_inputs(text_ids[None]).expand(batch_size, -1, -1, -1)
            extra = functools.partial(per_layer_kwargs, per_layer_inputs=per_layer)
        return VideoChunk(embeds=embeds, rel_positions=None, frames=frames, extent=tokens.numel() - 1, extra=extra,
                          blocks=blocks)

    def _check_patches(self, model, video, positions, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(pixel values, positions, soft tokens per frame) of B streams' frames on one patch grid, else the error
        naming video or video_position_ids."""
        vision = model.config.vision_config
        kernel = vision.pooling_kernel_size ** 2
        patch_dim = 3 * vision.patch_size ** 2
        expected = f"[B·F, max_patches, {patch_dim}] (max_patches a multiple of pooling_kernel_size²={kernel})"
        video = check_pixels("video", video, f"{expected} with video_position_ids")
        if video.dim() != 3 or video.shape[0] == 0 or video.shape[0] % batch_size or video.shape[2] != patch_dim \
                or video.shape[1] == 0 or video.shape[1] % kernel:
            raise ValueError(f"video: expected patches {expected.replace('B·F', f'B·F, B={batch_size}')}, got "
                             f"{tuple(video.shape)}")
        if positions is None:
            raise ValueError(f"video_position_ids: {self.name} patches need their (column, row) positions, as the "
                             "video processor returns them")
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() or \
                tuple(positions.shape) != (*video.shape[:2], 2):
            raise ValueError(f"video_position_ids: expected integer positions [{video.shape[0]}, {video.shape[1]}, 2] "
                             f"for video of {tuple(video.shape)}, got {getattr(positions, 'shape', positions)!r}")
        if not bool((positions == positions[0]).all()):
            raise ValueError("video_position_ids: the frames of streams in lockstep need one patch grid")
        real = (positions[0] != -1).all(dim=-1)
        count, side = int(real.sum()), vision.pooling_kernel_size
        cols, rows = (int(x) + 1 for x in positions[0][real].amax(dim=0)) if count else (0, 0)
        if count == 0 or count != cols * rows or cols % side or rows % side or \
                max(cols, rows) > vision.position_embedding_size or int(positions[0][real].min()) < 0:
            raise ValueError(f"video_position_ids: expected a grid of columns x rows patches, both multiples of "
                             f"pooling_kernel_size={side}, at positions in [0, {vision.position_embedding_size}), got "
                             f"{count} patches up to {cols} x {rows}")
        return video, positions, count // kernel
