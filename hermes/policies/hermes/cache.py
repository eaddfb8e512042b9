"""The HERMES KV cache: a `StreamCacheBase` over one preallocated stacked buffer per device (docs/hermes.md
§2.6–2.7).

Every layer holds the same number of tokens (§2.6), so keys and values live in one stacked tensor
`[L, B, Hkv, capacity, D]` per device (a model split with `device_map` keeps one stack per device, each
holding its consecutive layers; `stack_bounds` can split further, e.g. to exercise the split layout on one
device). The buffers are allocated once and never reallocated: appending writes into free slots, compression
(`hermes_kernels.compress_stacks`: one score/selection pass and one re-index decision for all layers, then each
stack compacted on its own device) rewrites the first slots in place, and truncation only moves the length back.
Memory is flat for any stream length.

Positions: each (layer, stream) keeps its own position ids, int64 `[L, B, capacity]` (1D RoPE) or
`[L, B, 3, capacity]` (M-RoPE t/h/w), because compression leaves gaps and deep layers carry summary
positions (§2.7). Incoming tokens continue from that layer's largest position + 1, plus a relative offset
per token (text: 0, 1, 2, ...; video: the family's grid layout). The model itself runs with default
positions `length + i`; the layer's attention (`hermes.policies.hermes.attention`) rotates the incoming q/k by
`incoming_delta(layer)` = true - default, which the cache computes once per forward.

Failures: the in-place compression (`compress`) validates everything before its first write; see
`hermes.cache` for what a failure leaves.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

import hermes_kernels as hk
from hermes.cache import Forward, StreamCacheBase, layer_runs
from hermes_kernels.checks import check_positive_int
from hermes_kernels.dispatch import check_backend
from hermes_kernels.policies.hermes.checks import check_stacks
from hermes_kernels.policies.hermes.config import HermesConfig
from hermes_kernels.results import CompressResult
from hermes_kernels.rope import RotaryLayout

from .attention import layer_attention


@dataclasses.dataclass
class _Stack:
    """The buffers of the consecutive layers [first, first + Ld) that live on one device."""

    device: torch.device
    first: int
    keys: torch.Tensor          # [Ld, B, Hkv, capacity, D]
    values: torch.Tensor        # [Ld, B, Hkv, capacity, D]
    positions: torch.Tensor     # int64 [Ld, B, capacity] or [Ld, B, 3, capacity]
    inv_freq: torch.Tensor      # [D/2] on this device
    delta: torch.Tensor | None = None   # int64 [Ld, b, T] / [Ld, b, 3, T] of the running forward




class HermesCache(StreamCacheBase):
    """Fixed-capacity KV cache with per-(layer, stream) positions and in-place HERMES compression.

    Args:
        cfg:            the HERMES policy (`cfg.num_layers` = L, `cfg.prefix_len`, `cfg.budget`, ...).
        batch_size:     B streams advanced in lockstep.
        num_kv_heads:   Hkv; head_dim: D (even).
        capacity:       slots per layer: prefix + budget + the largest chunk + room for guidance prompts or a
                        question and its answer. Must exceed prefix_len + budget.
        dtype:          storage dtype of keys/values (the model's).
        inv_freq:       [D/2] rotary inverse frequencies taken from the model's rotary module (§2.8).
        rotary:  which position axis turns each frequency pair: a `RotaryLayout` (Qwen2.5-VL's contiguous
                        sections, Qwen3-VL's interleaved ones), three contiguous pair counts (t, h, w), or None
                        for 1D RoPE; stored as the `RotaryLayout` (`self.rotary`, 1D included).
        layer_devices:  the device of every layer (default: inv_freq's device for all); consecutive layers on
                        one device share a stack.
        stack_bounds:   layers at which a new stack starts even though the device does not change (ascending,
                        inside (0, L)); e.g. [2] with 4 layers on one device gives stacks [0, 2) and [2, 4). The
                        results are the same as with one stack; this lays out a `device_map` split on one device.
    """

    def __init__(self, cfg: HermesConfig, *, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, inv_freq: torch.Tensor,
                 rotary: Sequence[int] | RotaryLayout | None = None,
                 layer_devices: Sequence[torch.device | str] | None = None, stack_bounds: Sequence[int] = ()):
        if not isinstance(cfg, HermesConfig):
            raise TypeError(f"cfg: expected a HermesConfig, got {type(cfg).__name__}")
        runs = layer_runs(cfg.num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          inv_freq=inv_freq, rotary=rotary, layer_devices=layer_devices,
                          stack_bounds=stack_bounds)
        check_positive_int("capacity", capacity)
        if capacity <= cfg.prefix_len + cfg.budget:
            raise ValueError(f"capacity: {capacity} slots leave no room past prefix_len + budget = "
                             f"{cfg.prefix_len + cfg.budget} for a chunk or a question")

        self.cfg = cfg
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._init_stream(cfg.num_layers, batch_size, rotary, head_dim)
        self._stacks: list[_Stack] = [self._allocate(device, first, end - first, inv_freq)
                                      for device, first, end in runs]
        self._stack_of_layer: list[tuple[_Stack, int]] = []
        for stack in self._stacks:
            self._stack_of_layer.extend((stack, local) for local in range(stack.keys.shape[0]))
        # pooled guidance attention of the running step, written by the attention function (§2.3)
        self.guidance_attn = torch.zeros(cfg.num_layers, batch_size, capacity, dtype=torch.float32,
                                         device=self._stacks[0].device)
        # a hermes.policies.hermes.guidance.GuidanceState while `hermes.policies.hermes.guidance` runs a guidance pass,
        # else None
        self.guidance = None
        self._length = 0

    def _allocate(self, device: torch.device, first: int, count: int, inv_freq: torch.Tensor) -> _Stack:
        kv_shape = (count, self._batch_size, self.num_kv_heads, self.capacity, self.head_dim)
        pos_shape = (count, self._batch_size) + ((3,) if self.mrope else ()) + (self.capacity,)
        return _Stack(device=device, first=first,
                      keys=torch.zeros(kv_shape, dtype=self.dtype, device=device),
                      values=torch.zeros(kv_shape, dtype=self.dtype, device=device),
                      positions=torch.zeros(pos_shape, dtype=torch.int64, device=device),
                      inv_freq=inv_freq.detach().to(device))

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """N: valid slots in every layer (prefix + visual tokens [+ question/answer while one is asked])."""
        return self._length

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def room(self) -> int:
        """Slots past the length: how many more tokens the next forwards may bring."""
        return self.capacity - self._length

    @property
    def _home_device(self) -> torch.device:
        return self._stacks[0].device

    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (keys, values, positions, guidance attention)."""
        held = sum(t.numel() * t.element_size() for s in self._stacks for t in (s.keys, s.values, s.positions))
        return held + self.guidance_attn.numel() * self.guidance_attn.element_size()

    def data_ptrs(self) -> list[int]:
        """Storage addresses of every buffer; they never change after construction."""
        return [t.data_ptr() for s in self._stacks for t in (s.keys, s.values, s.positions)] + \
            [self.guidance_attn.data_ptr()]

    # ---- views ----------------------------------------------------------------------------------------
    def layer_keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer, a view [B, Hkv, N, D] of the stack."""
        stack, local = self._stack_of_layer[layer]
        return stack.keys[local, :, :, :self._length]

    def layer_values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer, a view [B, Hkv, N, D] of the stack."""
        stack, local = self._stack_of_layer[layer]
        return stack.values[local, :, :, :self._length]

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Valid position ids of one layer, a view int64 [B, N] or [B, 3, N] (M-RoPE)."""
        stack, local = self._stack_of_layer[layer]
        return stack.positions[local, ..., :self._length]

    def position_range(self) -> tuple[int, int]:
        """(smallest, largest) valid position over all layers, streams and axes; (0, -1) when empty."""
        if self._length == 0:
            return 0, -1
        lows = [s.positions[..., :self._length].min().item() for s in self._stacks]
        highs = [s.positions[..., :self._length].max().item() for s in self._stacks]
        return int(min(lows)), int(max(highs))

    # ---- writing ----------------------------------------------------------------------------------------
    def _end_context(self) -> None:
        for stack in self._stacks:
            stack.delta = None

    def _hidden_start(self) -> int:
        return self._length

    def _begin_forward(self, key_states: torch.Tensor) -> Forward:
        self._check_defined("compression step")
        count = self._incoming_count(key_states)
        if self._length + count > self.capacity:
            raise ValueError(f"key_states: {count} incoming tokens do not fit: length {self._length} of capacity "
                             f"{self.capacity}")
        rel, stored = self._take_context(count)
        forward = Forward(start=self._length, count=count, stored=stored)
        for stack in self._stacks:
            stack.delta = self._write_positions(stack, forward, rel)
        return forward

    def _write_positions(self, stack: _Stack, fwd: Forward, rel: torch.Tensor | None) -> torch.Tensor:
        """Write the incoming tokens' true positions into the stack; return true - default (§2.7)."""
        device = stack.device
        text = torch.arange(fwd.count, device=device)
        if rel is None:
            rel = text.expand(3, fwd.count) if self.mrope else text
        rel = rel.to(device)
        positions = stack.positions
        if fwd.start == 0:
            next_pos = torch.zeros(positions.shape[:2], dtype=torch.int64, device=device)
        else:
            used = positions[..., :fwd.start]
            next_pos = (used.flatten(2).amax(dim=-1)) + 1  # largest position over axes and tokens, + 1
        lead = (slice(None), slice(None)) + ((None,) if self.mrope else ()) + (None,)
        new = next_pos[lead] + rel
        positions[..., fwd.start:fwd.start + fwd.count] = new
        return new - (fwd.start + text)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the incoming keys/values [B, Hkv, T, D] of layer `layer_idx` in place; return views
        [B, Hkv, N + T, D] of the cache plus the new tokens (what the attention function attends over)."""
        fwd = self._forward_at(layer_idx, key_states)
        stack, local = self._stack_of_layer[layer_idx]
        end = fwd.start + fwd.count
        stack.keys[local, :, :, fwd.start:end] = key_states
        stack.values[local, :, :, fwd.start:end] = value_states
        keys = stack.keys[local, :, :, :end]
        values = stack.values[local, :, :, :end]
        self._hand_off(layer_idx, keys)
        if layer_idx == self.cfg.num_layers - 1:
            self._length = fwd.start + fwd.stored
        return keys, values

    def incoming_delta(self, layer: int) -> torch.Tensor:
        """int64 [b, T] (or [b, 3, T]) rotation of the running forward's tokens in `layer`: true - default."""
        stack, local = self._stack_of_layer[layer]
        if stack.delta is None:
            raise RuntimeError("HermesCache.incoming_delta: no forward is running")
        return stack.delta[local]

    def attend(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`layer`'s attention over the stack (`hermes.policies.hermes.attention.layer_attention`)."""
        return layer_attention(module, self, layer, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The model's rotary inverse frequencies [D/2] on `layer`'s device (§2.8)."""
        return self._stack_of_layer[layer][0].inv_freq

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (e.g. a question and its answer); storage is untouched."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self._length:
            raise ValueError(f"length: expected an int in [0, {self._length}], got {length!r}")
        self._length = length

    def reset(self) -> None:
        """Empty the cache (length 0, step counters 0, `undefined` cleared); the buffers stay allocated."""
        self._length = 0
        self._reset_stream()

    def _counters(self) -> tuple:
        return self._length, self._steps, self._reindexes

    def _restore_counters(self, saved: tuple) -> None:
        self._length, self._steps, self._reindexes = saved

    # ---- compression ------------------------------------------------------------------------------------
    def compress(self, attn: torch.Tensor, backend: str = "auto") -> CompressResult:
        """One HERMES step over the valid slots of every stack, in place (`hermes_kernels.compress_stacks`,
        docs/hermes.md §2; one stack takes the same fused path as `compress_step`).

        attn: float32 [L, B, V], V = length - prefix_len, pooled guidance attention (e.g. `guidance_attn`), on any
        device. Afterwards the length is prefix_len + min(budget, V) in every layer.

        Failures: bad input (shape, dtype, backend, non-finite attn) raises ValueError/TypeError before anything is
        written; every stack is unchanged. Inputs are checked here first (`compress_stacks` checks them again) so
        that anything raised past that point is known to come from the step itself: a device error or an
        interrupt while rows are being moved may leave some layers compacted and others not. The cache is then
        `undefined` and refuses forwards and steps until `reset()`: the video memory is lost, start again.
        """
        self._check_defined("compression step")
        if self._length <= self.cfg.prefix_len:
            raise ValueError(f"attn: the cache holds no visual token (length {self._length}, prefix_len "
                             f"{self.cfg.prefix_len})")
        check_backend(backend)
        n = self._length
        stacks = [(range(s.first, s.first + s.keys.shape[0]), s.keys[:, :, :, :n], s.values[:, :, :, :n],
                   s.positions[..., :n], s.inv_freq) for s in self._stacks]
        check_stacks(stacks, attn, self.cfg, self.rotary)

        def step() -> tuple[CompressResult, bool]:
            result = hk.compress_stacks(stacks, attn, self.cfg, self.rotary, backend=backend)
            self._length = result.length
            return result, bool(result.reindexed)

        return self._step_in_place(step)

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, reindexes, bytes_allocated."""
        return {"length": self._length, "capacity": self.capacity, "positions": self.position_range(),
                "steps": self._steps, "reindexes": self._reindexes, "bytes_allocated": self.nbytes()}
