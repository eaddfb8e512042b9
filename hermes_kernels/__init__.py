"""Fused KV-cache policies: tensors in, tensors out. HERMES compression (DESIGN.md §3) and the H2SVC frame
memories (H2SVC.md; `frame_features`, `stce_select`, `h2svc_step`) on one engine.

Every public op validates its inputs (via `hermes.validation` / `hermes.h2svc.validation`) before anything is
written, then dispatches to one of two backends that implement the same contract as `hermes.reference` /
`hermes.h2svc.reference`:
  "triton" — fused Triton kernels (CUDA tensors; CPU through TRITON_INTERPRET=1 for testing),
  "torch"  — vectorised PyTorch over layers and streams, no Python loop over layers, no host syncs; on CPU the
             compaction of an fp32 or bf16 cache moves its rows in one C pass (compact_cpu.c, see `compact.py`),
  "auto"   — triton for CUDA tensors, torch otherwise.
`compress_stacks` is the step for a cache whose layers are split into per-device stacks (`device_map` models): one
selection and one re-index decision for all layers, then `compact` of each stack's layer range on its own device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hermes.config import HermesConfig
from hermes.h2svc import H2SVCConfig
from hermes.h2svc.reference import H2SVCStepResult
from hermes.h2svc.validation import check_frame_features, check_h2svc_step, check_stce
from hermes.reference import CompressResult
from hermes.validation import (check_attn, check_cache, check_compacted_flag, check_compress, check_keep,
                               check_layers, check_pooled_attention, check_scores, check_stacks)

from . import compact as _compact
from . import frame_features as _frame_features
from . import frame_update as _frame_update
from . import pooled_attention as _pooled
from . import scoring as _scoring
from . import select as _select
from . import stce as _stce
from .launch import launch_count

BACKENDS = ("auto", "triton", "torch")

__all__ = ["pooled_attention", "hermes_scores", "select_keep", "compact", "compress_step", "compress_stacks",
           "CompressResult", "frame_features", "stce_select", "h2svc_step", "H2SVCStepResult", "resolve_backend",
           "launch_count", "BACKENDS"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The one dispatch point: "auto" is Triton on CUDA tensors and torch elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _pick(backend: str, device: torch.device, triton_impl, torch_impl):
    """The stage implementation `backend` resolves to on `device` (see `resolve_backend`)."""
    return triton_impl if resolve_backend(backend, device) == "triton" else torch_impl


def pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Mean over heads and query tokens of causal softmax probabilities per key (§2.3).

    q [B, H, Q, D] / k [B, Hkv, N, D] (or stacked [L, ...]) -> float32 [B, N] ([L, B, N]); never builds [H, Q, N].
    """
    check_pooled_attention(q, k, scale)
    impl = _pick(backend, q.device, _pooled.pooled_attention_triton, _pooled.pooled_attention_torch)
    return impl(q, k, scale)


def hermes_scores(attn: torch.Tensor, cfg: HermesConfig, backend: str = "auto") -> torch.Tensor:
    """Smoothed scores S~ float32 [L, B, V] from pooled attention [L, B, V] (§2.3–2.4)."""
    check_attn(attn, cfg)
    impl = _pick(backend, attn.device, _scoring.hermes_scores_triton, _scoring.hermes_scores_torch)
    return impl(attn, cfg)


def select_keep(scores: torch.Tensor, cfg: HermesConfig, backend: str = "auto") -> torch.Tensor:
    """Kept visual indices int64 [L, B, min(budget, V)], ascending, -1 padded (eq. 6, §2.5)."""
    check_scores(scores, cfg)
    impl = _pick(backend, scores.device, _select.select_keep_triton, _select.select_keep_torch)
    return impl(scores, cfg)


def compact(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
            cfg: HermesConfig, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
            backend: str = "auto", *, layers: range | None = None,
            compacted_flag: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """In-place gather + re-index + rotary delta + summary (Alg. 1, appendix E). Returns (length, compacted_flag).

    Same contract as `hermes.reference.compact`: `layers` (a range with step 1 inside [0, L)) names the config
    layers the tensors hold, default all; `compacted_flag` (0-dim bool on keys' device) is the caller's re-index
    decision for the whole model and wins over the config (§2.7), default: decided from these positions.
    """
    layers = check_layers(layers, cfg)
    check_cache(keys, values, positions, cfg, inv_freq, mrope_section, layers)
    check_keep(keep, keys, cfg)
    check_compacted_flag(compacted_flag, keys)
    impl = _pick(backend, keys.device, _compact.compact_triton, _compact.compact_torch)
    return impl(keys, values, positions, keep, cfg, inv_freq, mrope_section, layers, compacted_flag)


def compress_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor,
                  cfg: HermesConfig, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
                  backend: str = "auto") -> CompressResult:
    """One HERMES compression step in place; same contract as `hermes.reference.compress_step` (§3).

    keys/values [L, B, Hkv, N, D] fp16/bf16/fp32 (first `length` slots valid afterwards); positions int64
    [L, B, N] or [L, B, 3, N] (M-RoPE with `mrope_section`); attn float32 [L, B, N - prefix_len].
    """
    check_compress(keys, values, positions, attn, cfg, inv_freq, mrope_section)
    return _compress([(range(cfg.num_layers), keys, values, positions, inv_freq)], attn, cfg, mrope_section,
                     backend)


def compress_stacks(stacks: Sequence[tuple[range, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                    attn: torch.Tensor, cfg: HermesConfig, mrope_section: Sequence[int] | None = None,
                    backend: str = "auto") -> CompressResult:
    """One HERMES compression step, in place, over a cache whose layers are split into per-device stacks (§2.6).

    stacks: (layers, keys, values, positions, inv_freq) per stack, in layer order: `layers` a range of the config's
        layers that the stack holds (the ranges cover [0, L) without gaps), keys/values [len(layers), B, Hkv, N, D],
        positions int64 [len(layers), B, N] or [len(layers), B, 3, N], inv_freq [D/2]; each stack on its own
        device (several stacks may share one).
    attn: float32 [L, B, N - prefix_len] pooled guidance attention, on any device.
    Every stack and attn are checked before anything is written on any device. Scores and keep are computed once
    on attn's device; one re-index decision for all stacks (§2.7) is combined there from every stack's largest
    position without a host sync; then each stack is compacted on its own device with its rows of keep and the
    flag. The result's keep, scores and compacted_flag live on attn's device. `backend` is resolved per device.
    """
    check_stacks(stacks, attn, cfg, mrope_section)
    return _compress(stacks, attn, cfg, mrope_section, backend)


def _compress(stacks, attn: torch.Tensor, cfg: HermesConfig, mrope_section: Sequence[int] | None,
              backend: str) -> CompressResult:
    """The step behind `compress_step` and `compress_stacks`, on inputs already checked (§2.3–2.8); an unknown
    backend raises at the first dispatch, before anything is written.

    A single stack next to attn keeps the fused path: its compaction decides the re-index flag itself, in the
    same launches. Otherwise the flag is decided once here from all stacks and handed to every compaction.
    """
    if resolve_backend(backend, attn.device) == "triton":
        scores = _scoring.hermes_scores_triton(attn, cfg)
        keep = _select.select_keep_triton(scores, cfg)
    else:
        scores = _scoring.hermes_scores_torch(attn, cfg)
        keep = _select.select_keep_torch(scores, cfg)
    fused = len(stacks) == 1 and stacks[0][1].device == attn.device
    flag = None if fused else _compact.reindex_flag([stack[3] for stack in stacks], cfg, attn.device)
    for layers, keys, values, positions, inv_freq in stacks:
        device = keys.device
        impl = _pick(backend, device, _compact.compact_triton, _compact.compact_torch)
        length, decided = impl(keys, values, positions, keep[layers.start:layers.stop].to(device), cfg, inv_freq,
                               mrope_section, layers, None if fused else flag.to(device))
        flag = decided if fused else flag
    return CompressResult(length=length, keep=keep, scores=scores.to(torch.float32), compacted_flag=flag)


# ----------------------------------------------------------------------------------------------------------------
# H2SVC (H2SVC.md): per-class frame memories; the same dispatch, checks from hermes.h2svc.validation
# ----------------------------------------------------------------------------------------------------------------

def frame_features(values: torch.Tensor, tokens_per_frame: int, backend: str = "auto") -> torch.Tensor:
    """Mean value vector of every frame (H2SVC.md §3): values [H, B, F·T_f, D] fp16/bf16/fp32/fp64 (any strides,
    e.g. the arriving frames' slots of a class block) -> float32 [H, B, F, D] (float64 for float64 values)."""
    check_frame_features(values, tokens_per_frame)
    impl = _pick(backend, values.device, _frame_features.frame_features_triton,
                 _frame_features.frame_features_torch)
    return impl(values, tokens_per_frame)


def stce_select(features: torch.Tensor, frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
                capacity: int, backend: str = "auto") -> torch.Tensor:
    """Kept frame indices int64 [H, B, capacity] (ascending, -1 padded) after STCE over one chunk (H2SVC.md §3).

    features float32 [H, B, W, D] (the held frames' features, any slot order; float64 allowed), frames int64
    [H, B, W] (their stream indices, -1 empty, valid ones distinct), arriving [H, B, F, D] of features' dtype in
    arrival order (arrival i is frame first_frame + i, newer than every held frame), capacity N_e >= 2.
    """
    check_stce(features, frames, arriving, first_frame, capacity)
    impl = _pick(backend, features.device, _stce.stce_select_triton, _stce.stce_select_torch)
    return impl(features, frames, arriving, first_frame, capacity)


def h2svc_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_frames: torch.Tensor,
               cfg: H2SVCConfig, cls, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None, *,
               held: int, num_frames: int, first_frame: int, reindex: bool, next_position: int,
               features: torch.Tensor | None = None, backend: str = "auto") -> H2SVCStepResult:
    """One H2SVC step of one class block, in place; same contract as `hermes.h2svc.reference.h2svc_step`.

    keys/values [H_c, B, C, D] fp16/bf16/fp32/fp64 (any strides); positions int64 [H_c, B, C] or [H_c, B, 3, C]
    (M-RoPE with mrope_section); slot_frames int64 [H_c, B, W] (W = cfg.window(cls)); features float32
    [H_c, B, W, D] for EPISODIC blocks, None otherwise; cls INSTANT/SHORT/EPISODIC or its name; held, num_frames,
    first_frame, reindex and next_position are the caller's host values (no host sync on CUDA: the contents checks
    run on CPU tensors only). Result: held' = min(W, held + F), kept = slot_frames (the same tensor, updated),
    compacted = reindex.
    """
    # the arriving values' finiteness is checked on their features, inside the step before its first write
    cls = check_h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq, mrope_section, held,
                           num_frames, first_frame, reindex, next_position, features, arriving_values=False)
    impl = _pick(backend, keys.device, _frame_update.h2svc_step_triton, _frame_update.h2svc_step_torch)
    held_after = impl(keys, values, positions, slot_frames, cfg, cls, inv_freq, mrope_section, held, num_frames,
                      first_frame, reindex, next_position, features)
    return H2SVCStepResult(held=held_after, kept=slot_frames, compacted=reindex)
