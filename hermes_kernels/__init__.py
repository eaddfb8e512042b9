"""Fused HERMES compression: tensors in, tensors out (DESIGN.md §3).

Every public op validates its inputs (via `hermes.validation`) before anything is written, then dispatches to
one of two backends that implement the same contract as `hermes.reference`:
  "triton" — fused Triton kernels (CUDA tensors; CPU through TRITON_INTERPRET=1 for testing),
  "torch"  — vectorised PyTorch over layers and streams, no Python loop over layers, no host syncs,
  "auto"   — triton for CUDA tensors, torch otherwise.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hermes.config import HermesConfig
from hermes.reference import CompressResult
from hermes.validation import (check_attn, check_cache, check_compress, check_keep, check_pooled_attention,
                               check_scores)

from . import compact as _compact
from . import pooled_attention as _pooled
from . import scoring as _scoring
from . import select as _select
from .launch import launch_count

BACKENDS = ("auto", "triton", "torch")

__all__ = ["pooled_attention", "hermes_scores", "select_keep", "compact", "compress_step", "CompressResult",
           "resolve_backend", "launch_count", "BACKENDS"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The one dispatch point: "auto" is Triton on CUDA tensors and torch elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Mean over heads and query tokens of causal softmax probabilities per key (§2.3).

    q [B, H, Q, D] / k [B, Hkv, N, D] (or stacked [L, ...]) -> float32 [B, N] ([L, B, N]); never builds [H, Q, N].
    """
    check_pooled_attention(q, k, scale)
    impl = _pooled.pooled_attention_triton if resolve_backend(backend, q.device) == "triton" \
        else _pooled.pooled_attention_torch
    return impl(q, k, scale)


def hermes_scores(attn: torch.Tensor, cfg: HermesConfig, backend: str = "auto") -> torch.Tensor:
    """Smoothed scores S~ float32 [L, B, V] from pooled attention [L, B, V] (§2.3–2.4)."""
    check_attn(attn, cfg)
    impl = _scoring.hermes_scores_triton if resolve_backend(backend, attn.device) == "triton" \
        else _scoring.hermes_scores_torch
    return impl(attn, cfg)


def select_keep(scores: torch.Tensor, cfg: HermesConfig, backend: str = "auto") -> torch.Tensor:
    """Kept visual indices int64 [L, B, min(budget, V)], ascending, -1 padded (eq. 6, §2.5)."""
    check_scores(scores, cfg)
    impl = _select.select_keep_triton if resolve_backend(backend, scores.device) == "triton" \
        else _select.select_keep_torch
    return impl(scores, cfg)


def compact(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
            cfg: HermesConfig, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
            backend: str = "auto") -> tuple[int, torch.Tensor]:
    """In-place gather + re-index + rotary delta + summary (Alg. 1, appendix E). Returns (length, compacted_flag)."""
    check_cache(keys, values, positions, cfg, inv_freq, mrope_section)
    check_keep(keep, keys, cfg)
    impl = _compact.compact_triton if resolve_backend(backend, keys.device) == "triton" else _compact.compact_torch
    return impl(keys, values, positions, keep, cfg, inv_freq, mrope_section)


def compress_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor,
                  cfg: HermesConfig, inv_freq: torch.Tensor, mrope_section: Sequence[int] | None = None,
                  backend: str = "auto") -> CompressResult:
    """One HERMES compression step in place; same contract as `hermes.reference.compress_step` (§3).

    keys/values [L, B, Hkv, N, D] fp16/bf16/fp32 (first `length` slots valid afterwards); positions int64
    [L, B, N] or [L, B, 3, N] (M-RoPE with `mrope_section`); attn float32 [L, B, N - prefix_len].
    """
    check_compress(keys, values, positions, attn, cfg, inv_freq, mrope_section)
    chosen = resolve_backend(backend, keys.device)
    if chosen == "triton":
        scores = _scoring.hermes_scores_triton(attn, cfg)
        keep = _select.select_keep_triton(scores, cfg)
        length, flag = _compact.compact_triton(keys, values, positions, keep, cfg, inv_freq, mrope_section)
    else:
        scores = _scoring.hermes_scores_torch(attn, cfg)
        keep = _select.select_keep_torch(scores, cfg)
        length, flag = _compact.compact_torch(keys, values, positions, keep, cfg, inv_freq, mrope_section)
    return CompressResult(length=length, keep=keep, scores=scores.to(torch.float32), compacted_flag=flag)
