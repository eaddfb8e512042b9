"""The HERMES case the GPU compile guard drives the kernels' launchers at (`hermes_kernels.engine.gpu_specs`): one
compression step's tensors, as meta tensors laid out as the streaming cache hands them over."""
from __future__ import annotations

import dataclasses

import torch

from ...engine.geometry import ModelGeometry
from ...engine.gpu_specs import meta
from ...rope import RotaryLayout
from .config import HermesConfig


@dataclasses.dataclass(frozen=True)
class HermesCase:
    """One compression step the launchers are driven at: model geometry (`hermes_kernels.engine.geometry`), cache dtype,
    budget and chunk.

    The tensors are laid out as `hermes.policies.hermes.cache.HermesCache` and `hermes.stream` hand them to the kernels:
    K/V and positions are views `[..., :N]` of buffers with `capacity` slots, the pooled attention a view of the cache's
    `guidance_attn` [L, B, capacity], the guidance queries a head-transposed view of a [B, Q, H, D] projection.
    reindex: "eager" / "lazy" (the config's trigger, decided on the device) or "given" (a caller-made flag, as
    `compress_stacks` passes for a cache split over devices).
    """

    label: str
    geometry: ModelGeometry
    dtype: torch.dtype
    cfg: HermesConfig
    chunk_tokens: int
    capacity: int
    guidance_tokens: tuple[int, ...]
    reindex: str
    batch: int = 1

    def __post_init__(self):
        if self.cfg.num_layers != self.geometry.num_layers:
            raise ValueError(f"cfg: {self.cfg.num_layers} layers, the geometry has {self.geometry.num_layers}")

    @property
    def rotary(self) -> RotaryLayout:
        """The geometry's rotary layout (1D included), as the ops take it."""
        return self.geometry.rotary

    @property
    def num_tokens(self) -> int:
        """N = prefix + budget + chunk: the cache length at the start of a step."""
        return self.cfg.prefix_len + self.cfg.budget + self.chunk_tokens

    @property
    def num_visual(self) -> int:
        """V = N - prefix."""
        return self.num_tokens - self.cfg.prefix_len

    empty = staticmethod(meta)

    def cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [L, B, Hkv, N, D] and int64 positions [L, B, N] / [L, B, 3, N], views of the buffers."""
        g = self.geometry
        L, B, Hkv, D, N = g.num_layers, self.batch, g.num_kv_heads, g.head_dim, self.num_tokens
        keys = self.empty(L, B, Hkv, self.capacity, D, dtype=self.dtype)[..., :N, :]
        values = self.empty(L, B, Hkv, self.capacity, D, dtype=self.dtype)[..., :N, :]
        axes = (3,) if self.rotary.num_axes == 3 else ()
        positions = self.empty(L, B, *axes, self.capacity, dtype=torch.int64)[..., :N]
        return keys, values, positions

    def guidance_attn(self) -> torch.Tensor:
        """float32 [L, B, V]: the view of the cache's pooled-attention buffer a step is given."""
        return self.empty(self.geometry.num_layers, self.batch, self.capacity)[..., :self.num_visual]

    def scores(self) -> torch.Tensor:
        """float32 [L, B, V] as the scoring stage returns it (contiguous)."""
        return self.empty(self.geometry.num_layers, self.batch, self.num_visual)

    def keep(self) -> torch.Tensor:
        """int64 [L, B, min(budget, V)] as the selection stage returns it (contiguous)."""
        kept = min(self.cfg.budget, self.num_visual)
        return self.empty(self.geometry.num_layers, self.batch, kept, dtype=torch.int64)

    def inv_freq(self) -> torch.Tensor:
        """float32 [R/2] rotary inverse frequencies (R = D but for partial rotary)."""
        return self.empty(self.rotary.pairs)

    def reindexed(self) -> torch.Tensor | None:
        """The caller's 0-dim bool re-index decision when `reindex` is "given", else None."""
        return self.empty(dtype=torch.bool) if self.reindex == "given" else None

    def guidance(self, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, Q, D] (transposed view of a [B, Q, H, D] projection) and k [B, Hkv, N + Q, D] (one layer of the
        cache buffer: the cache followed by the prompt's own keys), in the cache dtype."""
        g = self.geometry
        B, H, Hkv, D = self.batch, g.num_heads, g.num_kv_heads, g.head_dim
        q = self.empty(B, q_len, H, D, dtype=self.dtype).transpose(1, 2)
        k = self.empty(B, Hkv, self.capacity, D, dtype=self.dtype)[:, :, :self.num_tokens + q_len]
        return q, k
