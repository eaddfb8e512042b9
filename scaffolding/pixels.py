"""Random pixel inputs for the tiny models of scaffolding/models.py, in the layouts their vision towers take
(docs/testing.md#scaffolding)."""
from __future__ import annotations

import torch


def llava_pixels(batch: int, frames: int, generator: torch.Generator, image_size: int = 16,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random pixel values [B, F, 3, S, S] for `tiny_llava_ov`."""
    return torch.randn(batch, frames, 3, image_size, image_size, generator=generator).to(dtype)


def qwen_pixels(batch: int, frames: int, generator: torch.Generator, height: int = 16, width: int = 16,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random flattened patches [B * t * h * w, 3 * 2 * 2 * 2] and grid_thw [B, 3] for `tiny_qwen2_5_vl` and
    `tiny_qwen3_vl`."""
    grid = torch.tensor([frames // 2, height // 2, width // 2])
    rows = batch * int(grid.prod())
    return torch.randn(rows, 3 * 2 * 2 * 2, generator=generator).to(dtype), grid.expand(batch, 3).clone()
