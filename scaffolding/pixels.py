"""Random pixel inputs for the tiny models of scaffolding/models.py, in the layouts their vision towers take
(docs/testing.md#scaffolding)."""
from __future__ import annotations

import torch


def llava_pixels(batch: int, frames: int, generator: torch.Generator, image_size: int = 16,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random pixel values [B, F, 3, S, S] for `tiny_llava_ov`."""
    return torch.randn(batch, frames, 3, image_size, image_size, generator=generator).to(dtype)


def qwen_pixels(batch: int, frames: int, generator: torch.Generator, height: int = 16, width: int = 16,
                dtype: torch.dtype = torch.float32, temporal_patch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random flattened patches [B * t * h * w, 3 * T * 2 * 2] and grid_thw [B, 3] (t = frames / T) for
    `tiny_qwen2_5_vl` and `tiny_qwen3_vl` (T = temporal_patch_size 2), `tiny_llava_ov1_5` (T = 1)."""
    grid = torch.tensor([frames // temporal_patch_size, height // 2, width // 2])
    rows = batch * int(grid.prod())
    return torch.randn(rows, 3 * temporal_patch_size * 2 * 2, generator=generator).to(dtype), \
        grid.expand(batch, 3).clone()
