"""The one registry of model shapes the benchmarks run at, plus the streaming defaults (docs/hermes.md §4).

A shape is a name, what the compression step sees of a model (`hermes_kernels.engine.geometry.ModelGeometry`: layer
count, query/KV heads, head dim, RoPE base and position limit, the rotary layout: contiguous M-RoPE sections for
Qwen2.5-VL, interleaved for Qwen3-VL, interleaved over the first R of D channels for Qwen3.5, 1D over every pair
for Gemma 4), the rotary inverse frequencies the model's keys carry (`ModelShape.inv_freq`: default RoPE, or Gemma 4's
proportional RoPE) and its family's preset of both policies (HERMES `config`, H2SVC `h2svc_config`); a hybrid's
linear-attention state: `LINEAR_STATES`. Numbers are the models' published configs (Qwen3.5: transformers 5.24's
default config; Gemma 4: transformers 5.25's default Gemma4TextConfig).
"""
from __future__ import annotations

import dataclasses

import torch

from hermes_kernels import H2SVCConfig, HermesConfig, RotaryLayout
from hermes_kernels.engine.geometry import ModelGeometry
from scaffolding.rotary import proportional_inv_freq

TOKENS_PER_FRAME = 196      # 14 x 14 merged patches per frame (LLaVA-OV after pooling, Qwen2.5-VL merged grid)
GRID_WIDTH = 14             # merged-grid width; M-RoPE h/w coordinates come from it
MROPE_TIME_STEP = 2         # M-RoPE t advance per frame: Qwen2.5-VL's tokens_per_second=2 x 1 s per temporal patch
CHUNK_FRAMES = 16           # frames encoded per streaming chunk
PREFIX_LEN = 14             # system-prompt tokens kept in front of the video
BUDGETS = (4000, 6000)      # the paper's 4K / 6K per-layer budgets (the released script runs --kv_size 6000)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One benchmark shape: a name, the model's geometry (`hermes_kernels.engine.geometry.ModelGeometry`: keys/values
    are [L, B, Hkv, N, D], guidance queries have H heads) and its family's preset in both policies' configs."""

    name: str
    geometry: ModelGeometry
    preset_name: str  # the family's preset in both policies' configs (`HermesConfig.preset`, `H2SVCConfig.preset`)
    h2svc_windows: tuple[int, int, int] | None = None  # (W_s, W_w, N_e) frames; None: the paper's 4 / 16 / 64
    # proportional RoPE's partial_rotary_factor (transformers' rope type "proportional": Gemma 4's full-attention
    # layers, 0.25), or None for default RoPE; see `inv_freq`
    proportional: float | None = None

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [R/2]: the rotary inverse frequencies of the model's keys. Default RoPE: the geometry's
        (`ModelGeometry.inv_freq`); proportional RoPE: `scaffolding.rotary.proportional_inv_freq` over all D/2 pairs
        (most of them at frequency 0)."""
        if self.proportional is None:
            return self.geometry.inv_freq(device)
        return proportional_inv_freq(self.geometry.head_dim, self.proportional, self.geometry.rope_theta, device)

    def config(self, budget: int, prefix_len: int = PREFIX_LEN, reindex: str = "eager") -> HermesConfig:
        """The model family's HERMES preset at this shape."""
        return HermesConfig.preset(self.preset_name, self.geometry.num_layers, budget, prefix_len,
                                   max_positions=self.geometry.max_positions, reindex=reindex)

    def h2svc_config(self, prefix_len: int = PREFIX_LEN, tokens_per_frame: int = TOKENS_PER_FRAME,
                     reindex: str = "eager") -> H2SVCConfig:
        """The model family's H2SVC preset at this shape: default ratios and the default (depth-order) head map."""
        windows = {} if self.h2svc_windows is None else dict(zip(("instant_frames", "short_frames",
                                                                   "episodic_frames"), self.h2svc_windows))
        return H2SVCConfig.preset(self.preset_name, self.geometry.num_layers, self.geometry.num_kv_heads,
                                  prefix_len, max_positions=self.geometry.max_positions,
                                  tokens_per_frame=tokens_per_frame, reindex=reindex, **windows)


def _shape(name: str, preset_name: str, *, layers: int, heads: int, kv_heads: int, head_dim: int, theta: float,
           max_positions: int, rotary: RotaryLayout | None = None,
           h2svc_windows: tuple[int, int, int] | None = None, proportional: float | None = None) -> ModelShape:
    geometry = ModelGeometry(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             max_positions=max_positions, rope_theta=theta, rotary=rotary)
    return ModelShape(name, geometry, preset_name, h2svc_windows, proportional)


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llava-ov-7b", "llava_ov", layers=28, heads=28, kv_heads=4, head_dim=128, theta=1e6,
           max_positions=32768),
    _shape("llava-ov-0.5b", "llava_ov", layers=24, heads=14, kv_heads=2, head_dim=64, theta=1e6,
           max_positions=32768),
    _shape("qwen2.5-vl-7b", "qwen2_5_vl", layers=28, heads=28, kv_heads=4, head_dim=128, theta=1e6,
           max_positions=128000, rotary=RotaryLayout.sections((16, 24, 24))),
    _shape("qwen2.5-vl-3b", "qwen2_5_vl", layers=36, heads=16, kv_heads=2, head_dim=128, theta=1e6,
           max_positions=128000, rotary=RotaryLayout.sections((16, 24, 24))),
    _shape("qwen3-vl-8b", "qwen3_vl", layers=36, heads=32, kv_heads=8, head_dim=128, theta=5e6,
           max_positions=262144, rotary=RotaryLayout.interleaved((24, 20, 20))),
    # Qwen3.5, the full-attention part of transformers 5.24's default Qwen3_5Config: 8 of its 32 layers hold a
    # growing K/V cache (the other 24 are linear attention with a fixed state, nothing to compress), 16 heads over
    # 4 KV heads of D 256, partial rotary (partial_rotary_factor 0.25: R = 64, inv_freq over R) with interleaved
    # M-RoPE [11, 11, 10] over the 32 pairs. Preset: its own, `qwen3_5` (Qwen3-VL's constants at 32768 positions),
    # over the 8 full-attention layers.
    _shape("qwen3.5", "qwen3_5", layers=8, heads=16, kv_heads=4, head_dim=256, theta=1e4, max_positions=32768,
           rotary=RotaryLayout.interleaved((11, 11, 10))),
    # Gemma 4, the layers the policies compress in transformers 5.25's default Gemma4TextConfig: the 5 of its 30
    # layers that `layer_types` marks full_attention (every sixth; the 25 sliding-window layers keep a 512-token
    # window, head dim 256, nothing to compress), 8 heads over 4 KV heads (attention_k_eq_v is off, so the full layers
    # keep num_key_value_heads) of global_head_dim 512, 131072 positions. RoPE: proportional, partial_rotary_factor
    # 0.25, theta 1e6: a plain 1D layout over the 256 pairs whose first 64 turn and whose other 192 have frequency 0
    # (`inv_freq`; the rotary module's `full_attention_inv_freq`). Preset: `gemma4`.
    _shape("gemma4", "gemma4", layers=5, heads=8, kv_heads=4, head_dim=512, theta=1e6, max_positions=131072,
           proportional=0.25),
)}

# Tiny geometry for smoke runs (--quick, tests/bench/test_bench.py); not a real model, so not in SHAPES. Their H2SVC
# memories are 2 / 4 / 8 frames, so a re-indexed episodic memory of 196-token frames fits 4096 positions.
SMOKE_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _shape("smoke-1d", "llava_ov", layers=4, heads=4, kv_heads=2, head_dim=32, theta=1e4, max_positions=4096,
           h2svc_windows=(2, 4, 8)),
    _shape("smoke-mrope", "qwen2_5_vl", layers=4, heads=4, kv_heads=2, head_dim=32, theta=1e4, max_positions=4096,
           rotary=RotaryLayout.sections((4, 6, 6)), h2svc_windows=(2, 4, 8)),
    _shape("smoke-mrope-interleaved", "qwen3_vl", layers=4, heads=4, kv_heads=2, head_dim=32, theta=1e4,
           max_positions=4096, rotary=RotaryLayout.interleaved((6, 5, 5)), h2svc_windows=(2, 4, 8)),
    _shape("smoke-proportional", "gemma4", layers=4, heads=4, kv_heads=2, head_dim=32, theta=1e4,
           max_positions=4096, h2svc_windows=(2, 4, 8), proportional=0.25),
)}


def get_shape(name: str) -> ModelShape:
    """Look a shape up by name in SHAPES or SMOKE_SHAPES (ValueError listing the known names)."""
    found = SHAPES.get(name) or SMOKE_SHAPES.get(name)
    if found is None:
        raise ValueError(f"shape: unknown {name!r}; known: {sorted(SHAPES) + sorted(SMOKE_SHAPES)}")
    return found


@dataclasses.dataclass(frozen=True)
class LinearStateShape:
    """What a hybrid model's linear-attention (Gated DeltaNet) layers keep per stream instead of a token cache, as
    transformers' `LinearAttentionLayer` allocates it (one per linear layer): the conv state [B, conv_dim,
    conv_kernel] in the model dtype (conv_dim = 2·key_heads·key_dim + value_heads·value_dim, the q/k/v channels of
    the short convolution) and the recurrent state [B, value_heads, key_dim, value_dim] in float32 (the chunked
    delta rule works, and returns its final state, in float32). Fixed in the stream length."""

    num_layers: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, text_config) -> "LinearStateShape":
        """From a transformers Qwen3.5 text config (`linear_*` fields; the layer count from `layer_types`)."""
        return cls(num_layers=text_config.layer_types.count("linear_attention"),
                   num_key_heads=text_config.linear_num_key_heads,
                   num_value_heads=text_config.linear_num_value_heads,
                   key_head_dim=text_config.linear_key_head_dim, value_head_dim=text_config.linear_value_head_dim,
                   conv_kernel=text_config.linear_conv_kernel_dim)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def layer_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one layer's conv + recurrent state for one stream, the conv state in `dtype`."""
        return (self.conv_dim * self.conv_kernel * dtype.itemsize
                + self.num_value_heads * self.key_head_dim * self.value_head_dim * torch.float32.itemsize)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of every linear layer's state for one stream (one copy)."""
        return self.num_layers * self.layer_bytes(dtype)


# The linear-attention part of the hybrid shapes, by shape name. Qwen3.5: transformers 5.24's default
# Qwen3_5TextConfig, 24 of its 32 layers (layer_types), 16 key heads and 32 value heads of 128, kernel 4.
LINEAR_STATES: dict[str, LinearStateShape] = {
    "qwen3.5": LinearStateShape(num_layers=24, num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                value_head_dim=128, conv_kernel=4),
}
