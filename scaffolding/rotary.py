"""Proportional RoPE's inverse frequencies (docs/testing.md#scaffolding), for the kernel tests and the Gemma 4 shape of
the benchmarks: the rotary values a Gemma 4 full-attention layer's keys carry, without transformers."""
from __future__ import annotations

import torch


def proportional_inv_freq(head_dim: int, factor: float = 0.25, theta: float = 1e6,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [D/2] of transformers' rope type "proportional" (Gemma 4's full-attention layers: D = 512, factor
    0.25, theta 1e6): pair i < int(factor·D/2) turns at theta^(-2i/D) (float32 exponents, as the rotary module
    computes them), the other pairs at frequency exactly 0. The kernels take it as plain 1D RoPE over all D/2 pairs
    (rotary=None): a zero frequency turns by cos 0 = 1 and sin 0 = 0, so those channels come through a re-indexing
    as they were. tests/hermes_kernels/test_rope.py holds it equal to Gemma 4's own rotary module."""
    turning = int(factor * head_dim // 2)
    exponent = torch.arange(0, 2 * turning, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return torch.cat([1.0 / theta ** exponent, torch.zeros(head_dim // 2 - turning)]).to(device)
