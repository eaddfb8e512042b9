"""LLaVA-OneVision-1.5 (RICE-ViT tower, Qwen3 decoder, 1D RoPE): Qwen2.5-VL's video input — transformers gives it
Qwen2-VL's video processor, patch rows and (t, h, w) grid, and the markers around the whole video — with one frame
per grid step (the tower has no temporal patch) and 1D positions that count tokens, as LLaVA-OneVision's
(docs/families.md#llava-onevision-1-5)."""
from __future__ import annotations

from .base import VideoChunk
from .qwen2_5_vl import Qwen2_5_VL


class LlavaOneVision1_5(Qwen2_5_VL):
    """Qwen2.5-VL's processor twin, chat text, patch and grid checks, frame size and token counts; its own 1D rotary,
    one video frame per H2SVC frame, and chunks without positions or time."""
    name = "LLaVA-OneVision-1.5"
    preset_name = "llava_ov1_5"

    def rotary(self, model):
        return self.language_model(model).rotary_emb.inv_freq, None

    def step_frames(self, model):
        return 1  # the tower embeds each frame's patches on their own: a patch row is C x p x p pixels of one frame

    def encode_video(self, model, processor, video, batch_size, grid_thw=None, **kwargs) -> VideoChunk:
        """video: flattened patches [B * t * h * w, C * patch^2] with `grid_thw` (t frames, h, w) (one row per stream,
        all equal, or one row for all), as Qwen2-VL's video processor returns them at temporal_patch_size 1; or raw
        frames (one clip per stream) for `processor.video_processor`. Returns embeds [B, t * h' * w', hidden], the
        merged tokens frame by frame, at 1D positions."""
        self.reject_unexpected(kwargs)
        video, grid = self._patches(model, processor, video, grid_thw, batch_size)
        embeds = self._merged_tokens(model, video, grid, batch_size)
        return VideoChunk(embeds=embeds, rel_positions=None, frames=grid[0], extent=embeds.shape[1] - 1)

    def prepare_frames(self, processor, frames, fps, start=0.0, times=None):
        """{"video": patches, "grid_thw": [1, 3]} from frames uint8 [F, H, W, 3]; ValueError naming processor for a
        video processor whose temporal_patch_size is not 1 (its rows would not fit the tower). fps, start and times
        play no part: 1D positions count tokens, not seconds (times is still checked)."""
        inputs = super().prepare_frames(processor, frames, fps, start, times)
        if (temporal := processor.video_processor.temporal_patch_size) != 1:
            raise ValueError(f"processor: {self.name}'s tower takes one frame per patch row (temporal_patch_size 1); "
                             f"the video processor's temporal_patch_size is {temporal}")
        del inputs["seconds_per_grid"]
        return inputs

    def text_kwargs(self, input_ids):
        return {}  # 1D positions: no mm_token_type_ids (Qwen2.5-VL's, which keep its model on M-RoPE)
