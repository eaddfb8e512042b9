"""The one registry of model shapes the benchmarks run at, plus the streaming defaults (DESIGN.md §4).

A shape is what the compression step sees of a model: layer count, query/KV heads, head dim, RoPE base and
position limit, and the M-RoPE section for Qwen2.5-VL. Numbers are the models' published configs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hermes import HermesConfig

TOKENS_PER_FRAME = 196      # 14 x 14 merged patches per frame (LLaVA-OV after pooling, Qwen2.5-VL merged grid)
GRID_WIDTH = 14             # merged-grid width; M-RoPE h/w coordinates come from it
MROPE_TIME_STEP = 2         # M-RoPE t advance per frame: Qwen2.5-VL's tokens_per_second=2 x 1 s per temporal patch
CHUNK_FRAMES = 16           # frames encoded per streaming chunk
PREFIX_LEN = 14             # system-prompt tokens kept in front of the video
BUDGETS = (4000, 6000)      # the paper's 4K / 6K per-layer budgets (the released script runs --kv_size 6000)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Cache geometry of one model: keys/values are [L, B, Hkv, N, D]; guidance queries have H heads."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_positions: int
    preset: Callable[..., HermesConfig]
    mrope_section: tuple[int, int, int] | None = None

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Default-RoPE inverse frequencies, float32 [D/2]: theta ** (-2i / D)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        return (1.0 / self.rope_theta ** exponent).to(device=device, dtype=torch.float32)

    def config(self, budget: int, prefix_len: int = PREFIX_LEN, reindex: str = "eager") -> HermesConfig:
        """The model family's HERMES preset at this shape."""
        return self.preset(self.num_layers, budget, prefix_len, max_positions=self.max_positions,
                           reindex=reindex)


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llava-ov-7b", num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
               max_positions=32768, preset=HermesConfig.llava_ov),
    ModelShape("llava-ov-0.5b", num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
               max_positions=32768, preset=HermesConfig.llava_ov),
    ModelShape("qwen2.5-vl-7b", num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
               max_positions=128000, preset=HermesConfig.qwen2_5_vl, mrope_section=(16, 24, 24)),
    ModelShape("qwen2.5-vl-3b", num_layers=36, num_heads=16, num_kv_heads=2, head_dim=128, rope_theta=1e6,
               max_positions=128000, preset=HermesConfig.qwen2_5_vl, mrope_section=(16, 24, 24)),
)}

# Tiny geometry for smoke runs (--quick, bench/test_bench.py); not a real model, so not in SHAPES.
SMOKE_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("smoke-1d", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
               max_positions=4096, preset=HermesConfig.llava_ov),
    ModelShape("smoke-mrope", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
               max_positions=4096, preset=HermesConfig.qwen2_5_vl, mrope_section=(4, 6, 6)),
)}


def get_shape(name: str) -> ModelShape:
    """Look a shape up by name in SHAPES or SMOKE_SHAPES (ValueError listing the known names)."""
    found = SHAPES.get(name) or SMOKE_SHAPES.get(name)
    if found is None:
        raise ValueError(f"shape: unknown {name!r}; known: {sorted(SHAPES) + sorted(SMOKE_SHAPES)}")
    return found
