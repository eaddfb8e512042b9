"""`ModelGeometry`: the attention geometry of a decoder, recorded once — the benchmark shapes (`bench/shapes.py`),
the compile guard's cases (`policies/*/gpu_case.py`) and the streaming glue (`hermes.policy.StreamSetup`, read off
a loaded model) all hold one. What a stream adds (cache dtype, prefix, the model's own `inv_freq`, layer devices)
lives with the stream, not here (docs/policies.md#setup).
"""
from __future__ import annotations

import dataclasses

import torch

from .checks import check_positive_int
from ..rope import RotaryLayout


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """Keys and values of one stream are [L, Hkv, N, D]; queries have H heads (GQA groups of H / Hkv).

    num_layers:    L decoder layers.
    num_heads:     H query heads per layer; num_kv_heads: Hkv key/value heads (H a multiple of Hkv).
    head_dim:      D, even.
    max_positions: the model's max_position_embeddings.
    rope_theta:    the RoPE base; `inv_freq()` gives the default inverse frequencies it implies.
    rotary:        which position axis turns each frequency pair: a `RotaryLayout` (of R/2 <= D/2 pairs: partial
                   rotary when fewer, e.g. Qwen3.5's R = D/4), three contiguous pair counts (t, h, w) or None for
                   1D RoPE over the whole head; stored as the `RotaryLayout` (1D included).
    Bad values raise ValueError/TypeError naming the field.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rope_theta: float
    rotary: RotaryLayout | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_positions"):
            check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: {self.num_heads} query heads do not form GQA groups over "
                             f"{self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: rotary embeddings need an even head dim, got {self.head_dim}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or \
                not self.rope_theta > 1:
            raise ValueError(f"rope_theta: expected a RoPE base > 1, got {self.rope_theta!r}")
        object.__setattr__(self, "rotary", RotaryLayout.of(self.rotary, self.head_dim // 2))

    @property
    def mrope(self) -> bool:
        """Positions carry three axes (t, h, w): [..., 3, N] instead of [..., N]."""
        return self.rotary.num_axes == 3

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Default-RoPE inverse frequencies, float32 [R/2]: rope_theta ** (-2i / R), R = `rotary.rotary_dim` (D for
        full rotary; computed in fp64)."""
        width = self.rotary.rotary_dim
        exponent = torch.arange(0, width, 2, dtype=torch.float64) / width
        return (1.0 / self.rope_theta ** exponent).to(device=device, dtype=torch.float32)

    def with_head_dim(self, head_dim: int) -> "ModelGeometry":
        """The same geometry at another head dim, M-RoPE pair counts (contiguous or interleaved, as they are) and a
        partial 1D width scaled with it, rounded down: the compile guard's D = 64 / 256 variants."""
        rotary = None
        if self.mrope:
            counts = tuple(count * head_dim // self.head_dim for count in self.rotary.counts)
            build = RotaryLayout.interleaved if self.rotary.kind == "interleaved" else RotaryLayout.sections
            rotary = build(counts)
        elif self.rotary.pairs < self.head_dim // 2:
            rotary = RotaryLayout.one_d(self.rotary.pairs * head_dim // self.head_dim)
        return dataclasses.replace(self, head_dim=head_dim, rotary=rotary)
