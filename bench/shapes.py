"""The one registry of model shapes the benchmarks run at, plus the streaming defaults (docs/hermes.md §4).

A shape is what the compression step sees of a model: layer count, query/KV heads, head dim, RoPE base and
position limit, and the M-RoPE sections (contiguous for Qwen2.5-VL, interleaved for Qwen3-VL; `rotary`). Numbers
are the models' published configs. Each shape names its family's preset of both policies: HERMES (`config`) and
H2SVC (`h2svc_config`).
"""
from __future__ import annotations

import dataclasses
import torch

from hermes_kernels import H2SVCConfig, HermesConfig, RotaryLayout

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
    preset_name: str  # the family's preset in both policies' configs (`HermesConfig.preset`, `H2SVCConfig.preset`)
    mrope_section: tuple[int, int, int] | None = None  # M-RoPE pairs per axis (t, h, w); None: 1D RoPE
    mrope_interleaved: bool = False  # the sections interleave pair by pair (Qwen3-VL), else contiguous blocks
    h2svc_windows: tuple[int, int, int] | None = None  # (W_s, W_w, N_e) frames; None: the paper's 4 / 16 / 64

    @property
    def rotary(self) -> RotaryLayout | None:
        """Which position axis turns each frequency pair, as the ops take it (`mrope_section`); None: 1D RoPE."""
        if self.mrope_section is None:
            return None
        build = RotaryLayout.interleaved if self.mrope_interleaved else RotaryLayout.sections
        return build(self.mrope_section)

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Default-RoPE inverse frequencies, float32 [D/2]: theta ** (-2i / D)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        return (1.0 / self.rope_theta ** exponent).to(device=device, dtype=torch.float32)

    def config(self, budget: int, prefix_len: int = PREFIX_LEN, reindex: str = "eager") -> HermesConfig:
        """The model family's HERMES preset at this shape."""
        return HermesConfig.preset(self.preset_name, self.num_layers, budget, prefix_len,
                                   max_positions=self.max_positions, reindex=reindex)

    def h2svc_config(self, prefix_len: int = PREFIX_LEN, tokens_per_frame: int = TOKENS_PER_FRAME,
                     reindex: str = "eager") -> H2SVCConfig:
        """The model family's H2SVC preset at this shape: default ratios and the default (depth-order) head map."""
        windows = {} if self.h2svc_windows is None else dict(zip(("instant_frames", "short_frames",
                                                                   "episodic_frames"), self.h2svc_windows))
        return H2SVCConfig.preset(self.preset_name, self.num_layers, self.num_kv_heads, prefix_len,
                                  max_positions=self.max_positions, tokens_per_frame=tokens_per_frame,
                                  reindex=reindex, **windows)


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llava-ov-7b", num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
               max_positions=32768, preset_name="llava_ov"),
    ModelShape("llava-ov-0.5b", num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
               max_positions=32768, preset_name="llava_ov"),
    ModelShape("qwen2.5-vl-7b", num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
               max_positions=128000, preset_name="qwen2_5_vl",
               mrope_section=(16, 24, 24)),
    ModelShape("qwen2.5-vl-3b", num_layers=36, num_heads=16, num_kv_heads=2, head_dim=128, rope_theta=1e6,
               max_positions=128000, preset_name="qwen2_5_vl",
               mrope_section=(16, 24, 24)),
    ModelShape("qwen3-vl-8b", num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e6,
               max_positions=262144, preset_name="qwen3_vl",
               mrope_section=(24, 20, 20), mrope_interleaved=True),
)}

# Tiny geometry for smoke runs (--quick, tests/bench/test_bench.py); not a real model, so not in SHAPES. Their H2SVC
# memories are 2 / 4 / 8 frames, so a re-indexed episodic memory of 196-token frames fits 4096 positions.
SMOKE_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("smoke-1d", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
               max_positions=4096, preset_name="llava_ov",
               h2svc_windows=(2, 4, 8)),
    ModelShape("smoke-mrope", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
               max_positions=4096, preset_name="qwen2_5_vl",
               mrope_section=(4, 6, 6), h2svc_windows=(2, 4, 8)),
    ModelShape("smoke-mrope-interleaved", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
               max_positions=4096, preset_name="qwen3_vl",
               mrope_section=(6, 5, 5), mrope_interleaved=True, h2svc_windows=(2, 4, 8)),
)}


def get_shape(name: str) -> ModelShape:
    """Look a shape up by name in SHAPES or SMOKE_SHAPES (ValueError listing the known names)."""
    found = SHAPES.get(name) or SMOKE_SHAPES.get(name)
    if found is None:
        raise ValueError(f"shape: unknown {name!r}; known: {sorted(SHAPES) + sorted(SMOKE_SHAPES)}")
    return found
