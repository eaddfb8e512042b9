"""The HERMES ops of the kernel library (docs/hermes.md §3): input checks, then the backend the one dispatch point
(`hermes_kernels.engine.dispatch`) picks, each implementing the contract of `hermes_kernels.policies.hermes.reference`.

`compress_stacks` is the step of a cache split into per-device stacks; the scoring ops take `group=` (tensor
parallelism): the ranks' pooled attention is averaged by one all-reduce (`tensor_parallel.group_mean`) and checked
before it is scored (docs/api.md#hermes-ops, docs/multi-gpu.md#what-crosses).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...engine.checks import check_group
from ...engine.dispatch import pick, resolve_backend
from ...results import CompressResult
from ...rope import RotaryLayout
from . import compaction, compaction_triton, pooling, scoring, select
from .checks import (check_attn, check_attn_finite, check_cache, check_reindexed, check_compress, check_keep,
                     check_layers, check_pooled_attention, check_scores, check_stacks)
from .config import HermesConfig
from .tensor_parallel import group_mean


def pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *,
                     backend: str = "auto") -> torch.Tensor:
    """Mean over heads and query tokens of causal softmax probabilities per key (§2.3).

    q [B, H, Q, D] / k [B, Hkv, N, D] (or stacked [L, ...]) -> float32 [B, N] ([L, B, N]); never builds [H, Q, N].
    """
    check_pooled_attention(q, k, scale)
    impl = pick(backend, q.device, pooling.pooled_attention_triton, pooling.pooled_attention_torch)
    return impl(q, k, scale)


def hermes_scores(attn: torch.Tensor, cfg: HermesConfig, *, backend: str = "auto", group=None) -> torch.Tensor:
    """Smoothed scores S~ float32 [L, B, V] from pooled attention [L, B, V] (§2.3–2.4); with `group`, from the
    group's mean of every rank's attn (docs/multi-gpu.md#what-crosses)."""
    check_attn(attn, cfg, finite=group is None)
    check_group(group)
    attn = _mean_over(attn, group)
    impl = pick(backend, attn.device, scoring.hermes_scores_triton, scoring.hermes_scores_torch)
    return impl(attn, cfg)


def select_keep(scores: torch.Tensor, cfg: HermesConfig, *, backend: str = "auto") -> torch.Tensor:
    """Kept visual indices int64 [L, B, min(budget, V)], ascending, -1 padded (eq. 6, §2.5)."""
    check_scores(scores, cfg)
    impl = pick(backend, scores.device, select.select_keep_triton, select.select_keep_torch)
    return impl(scores, cfg)


def compact(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
            cfg: HermesConfig, inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None = None, *,
            backend: str = "auto", layers: range | None = None,
            reindexed: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """In-place gather + re-index + rotary delta + summary (Alg. 1, appendix E). Returns (length, reindexed).

    Same contract as `reference.compact`: `layers` (a range with step 1 inside [0, L)) names the config
    layers the tensors hold, default all; `reindexed` (0-dim bool on keys' device) is the caller's re-index
    decision for the whole model and wins over the config (§2.7), default: decided from these positions.
    """
    layers = check_layers(layers, cfg)
    layout = check_cache(keys, values, positions, cfg, inv_freq, rotary, layers)
    check_keep(keep, keys, values, positions, cfg, layers)
    check_reindexed(reindexed, keys)
    impl = pick(backend, keys.device, compaction_triton.compact_triton, compaction.compact_torch)
    return impl(keys, values, positions, keep, cfg, inv_freq, layout, layers, reindexed)


def compress_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor,
                  cfg: HermesConfig, inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None = None, *,
                  backend: str = "auto", group=None) -> CompressResult:
    """One HERMES compression step in place; same contract as `reference.compress_step` (§3).

    keys/values [L, B, Hkv, N, D] fp16/bf16/fp32 (first `length` slots valid afterwards); positions int64
    [L, B, N] or [L, B, 3, N] (M-RoPE); attn float32 [L, B, N - prefix_len]. rotary: None (1D RoPE),
    three contiguous pair counts (t, h, w) or a `RotaryLayout` (interleaved M-RoPE included).
    group: None, or the `torch.distributed` group whose ranks hold the other heads (tensor parallelism): keys and
    values are this rank's heads, attn its pooled attention over them; every rank keeps the same tokens.
    """
    layout = check_compress(keys, values, positions, attn, cfg, inv_freq, rotary, finite=group is None)
    check_group(group)
    attn = _mean_over(attn, group)
    return _compress([(range(cfg.num_layers), keys, values, positions, inv_freq)], attn, cfg, layout, backend)


def compress_stacks(stacks: Sequence[tuple[range, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                    attn: torch.Tensor, cfg: HermesConfig, rotary: Sequence[int] | RotaryLayout | None = None, *,
                    backend: str = "auto", group=None) -> CompressResult:
    """One HERMES compression step, in place, over a cache whose layers are split into per-device stacks (§2.6).

    stacks: (layers, keys, values, positions, inv_freq) per stack, in layer order: `layers` a range of the config's
        layers that the stack holds (the ranges cover [0, L) without gaps), keys/values [len(layers), B, Hkv, N, D],
        positions int64 [len(layers), B, N] or [len(layers), B, 3, N], inv_freq [R/2]; each stack on its own
        device (several stacks may share one).
    attn: float32 [L, B, N - prefix_len] pooled guidance attention, on any device.
    Every stack and attn are checked before anything is written on any device. Scores and keep are computed once
    on attn's device; one re-index decision for all stacks (§2.7) is combined there from every stack's largest
    position without a host sync; then each stack is compacted on its own device with its rows of keep and the
    flag. The result's keep, scores and reindexed live on attn's device. `backend` is resolved per device.
    group: as for `compress_step` (the stacks hold this rank's heads).
    """
    layout = check_stacks(stacks, attn, cfg, rotary, finite=group is None)
    check_group(group)
    attn = _mean_over(attn, group)
    return _compress(stacks, attn, cfg, layout, backend)


def _mean_over(attn: torch.Tensor, group) -> torch.Tensor:
    """attn as it is without a group; else the group's mean of it (the one collective of a step), checked finite
    (the same values, so the same verdict, on every rank)."""
    if group is None:
        return attn
    attn = group_mean(attn, group)
    check_attn_finite(attn)
    return attn


def _compress(stacks, attn: torch.Tensor, cfg: HermesConfig, layout: RotaryLayout, backend: str) -> CompressResult:
    """The step behind `compress_step` and `compress_stacks`, on inputs already checked (§2.3–2.8); an unknown
    backend raises at the first dispatch, before anything is written.

    A single stack next to attn keeps the fused path: its compaction decides the re-index flag itself, in the
    same launches. Otherwise the flag is decided once here from all stacks and handed to every compaction.
    """
    if resolve_backend(backend, attn.device) == "triton":
        scores = scoring.hermes_scores_triton(attn, cfg)
        keep = select.select_keep_triton(scores, cfg)
    else:
        scores = scoring.hermes_scores_torch(attn, cfg)
        keep = select.select_keep_torch(scores, cfg)
    fused = len(stacks) == 1 and stacks[0][1].device == attn.device
    flag = None if fused else compaction.decide_reindex([stack[3] for stack in stacks], cfg, attn.device)
    for layers, keys, values, positions, inv_freq in stacks:
        device = keys.device
        impl = pick(backend, device, compaction_triton.compact_triton, compaction.compact_torch)
        length, decided = impl(keys, values, positions, keep[layers.start:layers.stop].to(device), cfg, inv_freq,
                               layout, layers, None if fused else flag.to(device))
        flag = decided if fused else flag
    return CompressResult(length=length, keep=keep, scores=scores.to(torch.float32), reindexed=flag)
