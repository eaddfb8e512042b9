"""The plain PyTorch oracle of one HERMES compression step (docs/hermes.md §2), written per layer and per stream.

This file is meant to be read next to the paper: every block names the equation it computes. It is slow on
purpose (Python loops, one small op at a time) and is the single oracle that every kernel test imports.
Arithmetic is float32, or float64 when the inputs are float64; keys/values keep their dtype and are updated
in place exactly like the fast path does.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ...engine.dtypes import work_dtype
from ...results import CompressResult
from ...rope import RotaryLayout, apply_rotary_delta, compact_positions
from .checks import (check_attn, check_cache, check_reindexed, check_compress, check_keep, check_layers,
                     check_pooled_attention, check_scores)
from .config import DEEP, HermesConfig


def pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Guidance attention pooled over heads and query tokens (§2.3, docs/hermes.md §5 item 7).

    q: [B, H, Q, D] post-RoPE guidance queries; k: [B, Hkv, N, D], whose last Q keys are the queries' own.
    Stacked [L, B, H, Q, D] / [L, B, Hkv, N, D] inputs give one row per layer.
    Query i sees keys j <= N - Q + i (causal, bottom-right aligned). Returns float32 [B, N] ([L, B, N]),
    float64 for float64 inputs: mean over heads and queries of softmax(q·k·scale) for every key.
    """
    check_pooled_attention(q, k, scale)
    if q.dim() == 5:
        return torch.stack([pooled_attention(q[layer], k[layer], scale) for layer in range(q.shape[0])])
    B, H, Q, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    work = work_dtype(q)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    visible = torch.arange(N, device=q.device)[None, :] <= (N - Q + torch.arange(Q, device=q.device))[:, None]
    out = torch.zeros(B, N, dtype=work, device=q.device)
    for b in range(B):
        for h in range(H):
            kv_head = h // (H // Hkv)  # GQA: consecutive query heads share one KV head
            logits = (q[b, h].to(work) @ k[b, kv_head].to(work).T) * scale
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            out[b] += probs.sum(dim=0)
    return out / (H * Q)


def hermes_scores(attn: torch.Tensor, cfg: HermesConfig) -> torch.Tensor:
    """Smoothed importance scores S~ [L, B, V] float32 from pooled attention attn [L, B, V] (§2.3–2.4)."""
    check_attn(attn, cfg)
    L, B, V = attn.shape
    work = work_dtype(attn)
    raw = torch.empty(L, B, V, dtype=work, device=attn.device)
    j = torch.arange(V, dtype=work, device=attn.device)
    for layer in range(L):
        omega = float(cfg.omega[layer])
        k_l = float(cfg.forget[layer])
        # eq. 1 (code form): exponential forgetting over the distance to the newest token, as a fraction of the span
        recency = torch.exp(-k_l * (V - 1 - j) / max(V - 1, 1))
        for b in range(B):
            a = attn[layer, b].to(work)
            # docs/hermes.md §5 item 6: min-max normalise attention and recency separately per layer and stream
            A = (a - a.min()) / (a.max() - a.min() + cfg.eps)
            R = (recency - recency.min()) / (recency.max() - recency.min() + cfg.eps)
            # eq. 4: blend with the layer's recency weight ω_l (shallow 1, deep 0, mid eq. 3)
            raw[layer, b] = (1 - omega) * A + omega * R
    # eq. 5, deepest layer first; the deepest layer keeps its raw score (docs/hermes.md §5 item 4)
    smooth = raw.clone()
    for layer in range(L - 2, -1, -1):
        lam = float(cfg.lam[layer])
        deeper = smooth[layer + 1] if cfg.cascade else raw[layer + 1]
        smooth[layer] = (1 - lam) * raw[layer] + lam * deeper
    return smooth


def select_keep(scores: torch.Tensor, cfg: HermesConfig) -> torch.Tensor:
    """Top-b_l visual tokens per (layer, stream), in cache order (eq. 6, §2.5).

    scores: [L, B, V] float. Returns int64 [L, B, n], n = min(budget, V): ascending kept indices relative to
    the prefix, padded with -1 where the layer keeps fewer (deep layers keep b-1 when summary is on).
    Ties go to the lower index (stable sort).
    """
    check_scores(scores, cfg)
    L, B, V = scores.shape
    keep = torch.full((L, B, min(cfg.budget, V)), -1, dtype=torch.int64, device=scores.device)
    for layer, budget in enumerate(cfg.layer_budget_list):
        n = min(budget, V)
        for b in range(B):
            order = torch.sort(scores[layer, b], descending=True, stable=True).indices[:n]
            keep[layer, b, :n] = order.sort().values
    return keep


def decide_reindex(positions: torch.Tensor, cfg: HermesConfig) -> torch.Tensor:
    """0-dim bool: re-index in this step? eager always; lazy once a position exceeds max_positions - margin (§2.7)."""
    if cfg.reindex == "eager":
        return torch.ones((), dtype=torch.bool, device=positions.device)
    return positions.max() > cfg.max_positions - cfg.margin


def compact(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
            cfg: HermesConfig, inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None = None,
            *, layers: range | None = None,
            reindexed: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """Gather kept tokens, re-index, rotate keys and write summaries, in place (eq. 6, Alg. 1, appendix E).

    keys/values: [L, B, Hkv, N, D]; positions: int64 [L, B, N] or [L, B, 3, N]; keep: from `select_keep`;
    rotary: None, contiguous pair counts or a `RotaryLayout` (which axis turns each frequency pair).
    layers: the consecutive layers of cfg these tensors hold (a range with step 1, L = len(layers); default all
    cfg.num_layers): a model split over devices compacts each stack separately, with the roles of its own layers.
    reindexed: the step's re-index decision as a 0-dim bool tensor on keys' device, made by the caller for
    the whole model (§2.7: one decision for all layers); it wins over the config, eager included. Default:
    `decide_reindex(positions, cfg)` of the given positions.
    Returns (length, the flag used). Slots from `length` on are left as they were.
    """
    layers = check_layers(layers, cfg)
    layout = check_cache(keys, values, positions, cfg, inv_freq, rotary, layers)
    check_keep(keep, keys, values, positions, cfg, layers, contents=True)
    check_reindexed(reindexed, keys)
    L, B, _, N, _ = keys.shape
    P = cfg.prefix_len
    V = N - P
    work = work_dtype(keys)
    flag = decide_reindex(positions, cfg) if reindexed is None else reindexed
    reindex_now = bool(flag)
    for layer in range(L):
        is_deep = int(cfg.role[layers[layer]]) == DEEP
        for b in range(B):
            kept = keep[layer, b][keep[layer, b] >= 0]
            n = kept.numel()
            pruned = torch.ones(V, dtype=torch.bool, device=keys.device)
            pruned[kept] = False
            pruned = pruned.nonzero().flatten()
            pos = positions[layer, b]  # [N] or [3, N]
            old = pos[..., P + kept]
            new = compact_positions(old, P) if reindex_now else old
            # appendix E: move each kept key by the rotary delta of its own position shift
            k_kept = apply_rotary_delta(keys[layer, b][:, P + kept], new - old, inv_freq, layout)
            v_kept = values[layer, b][:, P + kept].clone()
            summary = None
            if cfg.summary and is_deep and pruned.numel() > 0:
                # Alg. 1: target t = last retained position (after re-indexing) + 1, on every M-RoPE axis
                t = torch.cat([pos[..., :P].flatten(), new.flatten()]).max() + 1
                old_pruned = pos[..., P + pruned]
                rotated = apply_rotary_delta(keys[layer, b][:, P + pruned].to(work), t - old_pruned,
                                             inv_freq, layout)
                summary = (rotated.mean(dim=1), values[layer, b][:, P + pruned].to(work).mean(dim=1), t)
            keys[layer, b, :, P:P + n] = k_kept
            values[layer, b, :, P:P + n] = v_kept
            pos[..., P:P + n] = new
            if summary is not None:
                k_sum, v_sum, t = summary
                keys[layer, b, :, P + n] = k_sum.to(keys.dtype)
                values[layer, b, :, P + n] = v_sum.to(values.dtype)
                pos[..., P + n] = t
    return P + min(cfg.budget, V), flag


def compress_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor,
                  cfg: HermesConfig, inv_freq: torch.Tensor,
                  rotary: Sequence[int] | RotaryLayout | None = None) -> CompressResult:
    """One HERMES compression step, in place (docs/hermes.md §2.3–2.8).

    keys/values: [L, B, Hkv, N, D] fp16/bf16/fp32/fp64; positions: int64 [L, B, N] or [L, B, 3, N] (M-RoPE:
    `rotary` three contiguous pair counts or a `RotaryLayout`); attn: float32 [L, B, N - P] pooled guidance
    attention; inv_freq: [R/2] from the model's rotary module (R = D, or fewer with an explicit `RotaryLayout`:
    partial rotary, channels [R, D) never turn). All inputs are checked before anything is written.
    """
    layout = check_compress(keys, values, positions, attn, cfg, inv_freq, rotary)
    scores = hermes_scores(attn, cfg)
    keep = select_keep(scores, cfg)
    length, flag = compact(keys, values, positions, keep, cfg, inv_freq, layout)
    return CompressResult(length=length, keep=keep, scores=scores.to(torch.float32), reindexed=flag)
