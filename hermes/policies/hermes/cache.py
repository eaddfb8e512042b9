"""The HERMES KV cache: a `hermes.dense.DenseCache` (one preallocated stacked buffer per device, per-(layer, stream)
positions; docs/hermes.md §2.6–2.7) plus the pooled guidance attention of the running step and the in-place
compression step (`compress`: `hermes_kernels.compress_stacks`, one score/selection pass and one re-index decision
for all layers, then each stack compacted on its own device). Every layer holds the same number of tokens (§2.6),
so the dense storage is HERMES's own; the buffers are never reallocated and memory is flat for any stream length.
Failures: `compress` validates everything before its first write (docs/policies.md#failures).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

import hermes_kernels as hk
from hermes.dense import DenseCache
from hermes.linear_state import LinearLayout
from hermes.window import WindowLayout
from hermes_kernels.engine.checks import check_group, check_positive_int
from hermes_kernels.engine.dispatch import check_backend
from hermes_kernels.policies.hermes.checks import check_attn_finite, check_stacks
from hermes_kernels.policies.hermes.config import HermesConfig
from hermes_kernels.policies.hermes.tensor_parallel import group_mean
from hermes_kernels.results import CompressResult
from hermes_kernels.rope import RotaryLayout

from .attention import layer_attention


class HermesCache(DenseCache):
    """Fixed-capacity KV cache with per-(layer, stream) positions and in-place HERMES compression.

    Args:
        cfg:            the HERMES policy (`cfg.num_layers` = L, `cfg.prefix_len`, `cfg.budget`, ...).
        batch_size:     B streams advanced in lockstep.
        num_kv_heads:   Hkv; head_dim: D (even).
        capacity:       slots per layer: prefix + budget + the largest chunk + room for guidance prompts or a
                        question and its answer. Must exceed prefix_len + budget.
        dtype:          storage dtype of keys/values (the model's).
        inv_freq:       [D/2] rotary inverse frequencies taken from the model's rotary module (§2.8).
        rotary:         which position axis turns each frequency pair: a `RotaryLayout` (Qwen2.5-VL's contiguous
                        sections, Qwen3-VL's interleaved ones), three contiguous pair counts (t, h, w), or None
                        for 1D RoPE; stored as the `RotaryLayout` (`self.rotary`, 1D included).
        layer_devices:  the device of every layer (default: inv_freq's device for all); consecutive layers on
                        one device share a stack.
        stack_bounds:   layers at which a new stack starts even though the device does not change (ascending,
                        inside (0, L)); e.g. [2] with 4 layers on one device gives stacks [0, 2) and [2, 4). The
                        results are the same as with one stack; this lays out a `device_map` split on one device.
        group:          under tensor parallelism, the `torch.distributed` process group of the ranks holding the
                        model's other heads (this cache holds num_kv_heads of them); None in one process.
        linear:         a hybrid model's `hermes.linear_state.LinearLayout` (this cache's layers are its full-attention
                        layers; the linear-attention layers' states are held too), None without linear layers.
        windows:        a decoder's `hermes.window.WindowLayout` (sliding-window and KV-shared layers, Gemma 4) or
                        None.
    """

    step_name = "compression step"

    def __init__(self, cfg: HermesConfig, *, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, inv_freq: torch.Tensor,
                 rotary: Sequence[int] | RotaryLayout | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = (),
                 group=None, linear: LinearLayout | None = None, windows: WindowLayout | None = None):
        if not isinstance(cfg, HermesConfig):
            raise TypeError(f"cfg: expected a HermesConfig, got {type(cfg).__name__}")
        check_positive_int("capacity", capacity)
        check_group(group)
        if capacity <= cfg.prefix_len + cfg.budget:
            raise ValueError(f"capacity: {capacity} slots leave no room past prefix_len + budget = "
                             f"{cfg.prefix_len + cfg.budget} for a chunk or a question")
        super().__init__(cfg.num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         capacity=capacity, dtype=dtype, inv_freq=inv_freq, rotary=rotary,
                         layer_devices=layer_devices, stack_bounds=stack_bounds, linear=linear, windows=windows)
        self.cfg = cfg
        self.group = group
        # pooled guidance attention of the running step, written by the attention function (§2.3)
        self.guidance_attn = self.allocate((cfg.num_layers, batch_size, capacity), torch.float32,
                                           self._home_device)
        # a hermes.policies.hermes.guidance.GuidanceState while `hermes.policies.hermes.guidance` runs a guidance
        # pass, else None
        self.guidance = None

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`layer`'s attention over the stack (`hermes.policies.hermes.attention.layer_attention`)."""
        return layer_attention(module, self, layer, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def attend_shared(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`DenseCache.attend_shared`, outside a guidance pass: a KV-shared layer scores nothing, and the passes
        over a model with KV-shared layers end at the last layer that scores, before them (docs/gemma4.md#roles)."""
        if self.guidance is not None:
            raise RuntimeError("HermesCache: a guidance pass reached a KV-shared layer; it ends at the last layer "
                               "that scores")
        return super().attend_shared(module, layer, query, key, value, attention_mask, dropout, scaling, **kwargs)

    # ---- compression ------------------------------------------------------------------------------------
    def compress(self, attn: torch.Tensor, backend: str = "auto") -> CompressResult:
        """One HERMES step over the valid slots of every stack, in place (`hermes_kernels.compress_stacks`,
        docs/hermes.md §2; one stack takes the same fused path as `compress_step`).

        attn: float32 [L, B, V], V = length - prefix_len, pooled guidance attention (e.g. `guidance_attn`), on any
        device. Afterwards the length is prefix_len + min(budget, V) in every layer.
        Under tensor parallelism (`group`) attn is this rank's share (the mean over its heads), averaged over the
        group (`hermes_kernels`' `group_mean`, the step's one collective) after the shapes are checked and before
        its values are, so every rank refuses or steps alike and keeps the same tokens (docs/multi-gpu.md).

        Failures: bad input (shape, dtype, backend, non-finite attn) raises ValueError/TypeError before anything is
        written; every stack is unchanged. Inputs are checked here first (`compress_stacks` checks them again) so
        that anything raised past that point is known to come from the step itself: a device error or an
        interrupt while rows are being moved may leave some layers compacted and others not. The cache is then
        `undefined` and refuses forwards and steps until `reset()`: the video memory is lost, start again.
        """
        self._check_defined()
        n = self.length
        if n <= self.cfg.prefix_len:
            raise ValueError(f"attn: the cache holds no visual token (length {n}, prefix_len "
                             f"{self.cfg.prefix_len})")
        check_backend(backend)
        stacks = [(range(s.first, s.first + s.keys.shape[0]), s.keys[:, :, :, :n], s.values[:, :, :, :n],
                   s.positions[..., :n], s.inv_freq) for s in self._stacks]
        check_stacks(stacks, attn, self.cfg, self.rotary, finite=self.group is None)
        if self.group is not None:
            attn = group_mean(attn, self.group)
            check_attn_finite(attn)

        def step() -> tuple[CompressResult, bool]:
            result = hk.compress_stacks(stacks, attn, self.cfg, self.rotary, backend=backend)
            self.counters = dataclasses.replace(self.counters, length=result.length)
            return result, bool(result.reindexed)

        return self._step_in_place(step)
