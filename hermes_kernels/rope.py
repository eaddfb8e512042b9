"""Rotary positions: delta rotations (1D and M-RoPE) and the left-compaction of positions (docs/hermes.md §2.7–2.8).

Convention: rotate-half, as transformers' `apply_rotary_pos_emb`: frequency pair i couples channels i and
i + D/2, and a rotation by angle θ_i maps (x_i, x_{i+D/2}) to
(x_i cos θ_i − x_{i+D/2} sin θ_i, x_{i+D/2} cos θ_i + x_i sin θ_i).
Angles come from the integer delta times `inv_freq` in fp32 (fp64 for fp64 tensors), never from products of
low-precision cos/sin tables, so rotating by p then by d is rotating by p + d up to fp32 rounding.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch


def mrope_axis_of_freq(mrope_section: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Axis (0 = t, 1 = h, 2 = w) of each rotary frequency pair, int64 [D/2].

    `mrope_section` counts frequency pairs per axis (Qwen2.5-VL: [16, 24, 24] for D = 128): the first 16 pairs
    follow t, the next 24 h, the last 24 w; both halves of the head dim share the map (rotate-half).
    """
    section = tuple(int(s) for s in mrope_section)
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"mrope_section: expected three non-negative pair counts (t, h, w), got {mrope_section!r}")
    return _axis_map(section, str(torch.device("cpu" if device is None else device)))


@functools.lru_cache(maxsize=32)
def _axis_map(section: tuple[int, int, int], device: str) -> torch.Tensor:
    # memoised: rotations call this per token tile, and building it on a GPU is a host-to-device copy each time
    return torch.repeat_interleave(torch.arange(3), torch.tensor(section)).to(device)


def rotary_angles(delta: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotation angles [..., T, D/2] for integer position deltas.

    delta: int64 [..., T] (1D RoPE) or [..., 3, T] (M-RoPE: t, h, w deltas); inv_freq: [D/2].
    Each frequency pair takes the delta of its own M-RoPE axis (`mrope_axis_of_freq`).
    """
    freq = inv_freq.to(device=delta.device, dtype=dtype)
    if mrope_section is None:
        return delta.to(dtype).unsqueeze(-1) * freq
    axis = mrope_axis_of_freq(mrope_section, device=delta.device)
    if axis.numel() != freq.numel():
        raise ValueError(f"mrope_section: {list(mrope_section)} covers {axis.numel()} frequency pairs, "
                         f"inv_freq has {freq.numel()}")
    # [..., 3, T] -> [..., T, 3] -> pick each pair's axis -> [..., T, D/2]
    per_axis = delta.to(dtype).transpose(-1, -2)
    return per_axis.index_select(-1, axis) * freq


def rotary_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, D/2] of `rotary_angles` (fp32 unless `dtype` says otherwise)."""
    angle = rotary_angles(delta, inv_freq, mrope_section, dtype)
    return angle.cos(), angle.sin()


def apply_rotary_delta(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor,
                       mrope_section: Sequence[int] | None = None) -> torch.Tensor:
    """Rotate x [..., T, D] by delta·inv_freq (§2.8); returns a new tensor in x's dtype.

    delta: int64 [..., T] or, for M-RoPE, [..., 3, T], broadcastable against x's leading dims.
    Arithmetic in fp32 (fp64 when x is fp64).
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rotary_cos_sin(delta, inv_freq, mrope_section, work)
    half = x.shape[-1] // 2
    xf = x.to(work)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def compact_positions(kept: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Left-compacted positions for retained visual tokens (appendix E, §2.7).

    kept: int64 [n] (1D) or [3, n] (M-RoPE), the old positions of the retained visual tokens of one layer
    and stream. Each axis separately: new = prefix_len + rank of the value among the distinct retained
    values of that axis (dense rank, so equal coordinates stay equal and order is preserved).
    """
    rows = kept.unsqueeze(0) if kept.dim() == 1 else kept
    ranks = torch.stack([torch.unique(axis_values, sorted=True, return_inverse=True)[1] for axis_values in rows])
    return prefix_len + (ranks[0] if kept.dim() == 1 else ranks)
