"""Input checks of the HERMES ops, shared by the reference (`hermes_kernels.policies.hermes.reference`) and the
kernels (`hermes_kernels.policies.hermes.ops`) (docs/hermes.md §3).

Every check runs before anything is written, so a failed call leaves the cache untouched. Errors name the
argument and the expected shape. The only host synchronisation is the finiteness test of `attn`; the contents of
`keep` are checked where reading them is free (CPU tensors; CUDA with HERMES_KERNELS_DEBUG=1), the memory of the
tensors written in place by strides alone (docs/gpu.md#contracts). The generic checks both policies use are
`hermes_kernels.engine.checks`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...engine.checks import (check_disjoint, check_keys_values, check_positions, check_rotary, check_same_device,
                              check_tensor, check_written, read_contents)
from ...engine.dtypes import CACHE_DTYPES, SCORE_DTYPES
from ...rope import RotaryLayout
from .config import HermesConfig


def _config(cfg) -> None:
    if not isinstance(cfg, HermesConfig):
        raise TypeError(f"cfg: expected a HermesConfig, got {type(cfg).__name__}")


def check_pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> None:
    """q [B,H,Q,D] / k [B,Hkv,N,D], or stacked [L,B,H,Q,D] / [L,B,Hkv,N,D]; H % Hkv == 0, 1 <= Q <= N."""
    check_tensor("q", q, (4, 5), CACHE_DTYPES, "[B, H, Q, D] or [L, B, H, Q, D]")
    check_tensor("k", k, (q.dim(),), CACHE_DTYPES, "[B, Hkv, N, D]" if q.dim() == 4 else "[L, B, Hkv, N, D]")
    check_same_device("k", k, "q", q)
    if k.dtype != q.dtype:
        raise TypeError(f"k: dtype {k.dtype} differs from q's {q.dtype}")
    lead = q.shape[:-3]
    H, Q, D = q.shape[-3:]
    Hkv, N, Dk = k.shape[-3:]
    if k.shape[:-3] != lead or Dk != D:
        raise ValueError(f"k: expected shape {[*lead, 'Hkv', 'N', D]} to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"q, k: every dimension must be >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if H % Hkv != 0:
        raise ValueError(f"k: {Hkv} KV heads do not divide q's {H} heads (GQA needs H % Hkv == 0)")
    if not 1 <= Q <= N:
        raise ValueError(f"q: {Q} query tokens against {N} keys; need 1 <= Q <= N (the last Q keys are the queries')")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale: expected a positive float or None, got {scale!r}")


def check_attn(attn: torch.Tensor, cfg: HermesConfig, num_visual: int | None = None, finite: bool = True) -> None:
    """attn [L, B, V] float32/float64, finite (unless `finite=False`: a rank's share under tensor parallelism, whose
    values are checked once the ranks' shares are averaged, `check_attn_finite`); L = cfg.num_layers; V = num_visual
    when given."""
    _config(cfg)
    check_tensor("attn", attn, (3,), SCORE_DTYPES, "[L, B, V] float32")
    L, B, V = attn.shape
    if L != cfg.num_layers:
        raise ValueError(f"attn: expected [L={cfg.num_layers}, B, V], got {tuple(attn.shape)}")
    if V < 1 or B < 1:
        raise ValueError(f"attn: expected B >= 1 streams and V >= 1 visual tokens, got {tuple(attn.shape)}")
    if num_visual is not None and V != num_visual:
        raise ValueError(f"attn: expected [L, B, V={num_visual}] (V = N - prefix_len), got {tuple(attn.shape)}")
    if finite:
        check_attn_finite(attn)


def check_attn_finite(attn: torch.Tensor) -> None:
    """ValueError naming the layers of attn [L, B, V] that hold a non-finite value (one host read)."""
    finite = torch.isfinite(attn).flatten(1).all(dim=1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"attn: non-finite values in layer(s) {bad}")


def check_scores(scores: torch.Tensor, cfg: HermesConfig) -> None:
    """scores [L, B, V] float32/float64 with L = cfg.num_layers (finiteness is checked on attn upstream)."""
    _config(cfg)
    check_tensor("scores", scores, (3,), SCORE_DTYPES, "[L, B, V] float32")
    if scores.shape[0] != cfg.num_layers or scores.shape[1] < 1 or scores.shape[2] < 1:
        raise ValueError(f"scores: expected [L={cfg.num_layers}, B>=1, V>=1], got {tuple(scores.shape)}")


def check_layers(layers, cfg: HermesConfig) -> range:
    """layers: None (all of cfg's layers) or a non-empty `range` with step 1 inside [0, L). Returns the range."""
    _config(cfg)
    if layers is None:
        return range(cfg.num_layers)
    if not isinstance(layers, range):
        raise TypeError(f"layers: expected a range of consecutive layer indices, got {type(layers).__name__}")
    if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > cfg.num_layers:
        raise ValueError(f"layers: expected a non-empty range with step 1 inside [0, L={cfg.num_layers}), "
                         f"got {layers}")
    return layers


def check_reindexed(reindexed, keys: torch.Tensor) -> None:
    """reindexed: None, or a 0-dim bool tensor on keys' device (the caller's re-index decision, §2.7)."""
    if reindexed is None:
        return
    check_tensor("reindexed", reindexed, (0,), (torch.bool,), "[] (0-dim) bool")
    check_same_device("reindexed", reindexed, "keys", keys)


def check_cache(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, cfg: HermesConfig,
                inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None,
                layers: range | None = None) -> RotaryLayout:
    """keys/values [L,B,Hkv,N,D] one dtype and device, positions int64 [L,B,N] or [L,B,3,N] (M-RoPE),
    inv_freq [R/2] and rotary as `check_rotary` takes them (R = D, or fewer with an explicit `RotaryLayout`:
    partial rotary); N > prefix_len. L = len(layers),
    the layers of cfg the tensors hold (default all: cfg.num_layers); `layers` must have passed `check_layers`.
    Returns the rotary layout."""
    _config(cfg)
    check_keys_values(keys, values, 5, "[L, B, Hkv, N, D]")
    L, B, Hkv, N, D = keys.shape
    expected_layers = cfg.num_layers if layers is None else len(layers)
    if L != expected_layers:
        held = "" if layers is None else f" for layers {layers}"
        raise ValueError(f"keys: expected [L={expected_layers}, B, Hkv, N, D]{held}, got {tuple(keys.shape)}")
    if B < 1 or Hkv < 1:
        raise ValueError(f"keys: expected B >= 1 and Hkv >= 1, got {tuple(keys.shape)}")
    if N <= cfg.prefix_len:
        raise ValueError(f"keys: cache length N={N} holds no visual token after prefix_len={cfg.prefix_len}")
    if D % 2:
        raise ValueError(f"keys: head dim D={D} must be even for rotary embeddings")
    layout = check_rotary(inv_freq, rotary, D)
    check_positions(positions, [L, B], N, layout, keys)
    # the step rewrites all three in place while reading inv_freq: no element twice, no shared memory
    check_written([("keys", keys), ("values", values), ("positions", positions)], [("inv_freq", inv_freq)])
    return layout


def check_keep(keep: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               cfg: HermesConfig, layers: range | None = None, contents: bool | None = None) -> None:
    """keep int64 [L, B, min(budget, V)] on keys' device (as returned by `select_keep`), sharing no memory with the
    cache it compacts. Contents (`hermes_kernels.engine.checks.read_contents`: CPU tensors; CUDA with
    HERMES_KERNELS_DEBUG=1): row (l, b) holds n_l = min(layer_budget[l], V) visual indices in [0, V), strictly
    increasing, then -1. The in-place compaction relies on it: a repeated index has two tokens written to one slot,
    one out of range reads and writes outside the cache, one out of order overwrites a row before it is moved."""
    L, B, _, N, _ = keys.shape
    V = N - cfg.prefix_len
    n = min(cfg.budget, V)
    check_tensor("keep", keep, (3,), (torch.int64,), f"[L={L}, B={B}, n={n}] int64")
    if list(keep.shape) != [L, B, n]:
        raise ValueError(f"keep: expected [L={L}, B={B}, n={n}] int64, got {tuple(keep.shape)}")
    check_same_device("keep", keep, "keys", keys)
    for name, cache in (("keys", keys), ("values", values), ("positions", positions)):
        check_disjoint("keep", keep, name, cache)
    if not read_contents(contents, keep):
        return
    layers = range(L) if layers is None else layers
    counts = cfg.layer_budget[layers.start:layers.stop].clamp(max=V).to(keep.device).view(L, 1, 1)
    kept = torch.arange(n, device=keep.device) < counts  # [L, 1, n]: the columns that hold an index
    outside = torch.where(kept, (keep < 0) | (keep >= V), keep != -1)
    if bool(outside.any()):
        l, b, i = outside.nonzero()[0].tolist()
        raise ValueError(f"keep: row (layer {layers.start + l}, stream {b}) column {i} holds {int(keep[l, b, i])}; "
                         f"expected the first {int(counts[l])} columns to hold visual indices in [0, V={V}) and the "
                         f"rest -1")
    descents = kept[..., 1:] & (keep[..., 1:] <= keep[..., :-1])
    if bool(descents.any()):
        l, b, i = descents.nonzero()[0].tolist()
        raise ValueError(f"keep: row (layer {layers.start + l}, stream {b}) is not strictly increasing at column "
                         f"{i + 1} ({int(keep[l, b, i])} then {int(keep[l, b, i + 1])}); indices must be ascending "
                         f"and distinct")


def check_compress(keys, values, positions, attn, cfg, inv_freq, rotary, finite: bool = True) -> RotaryLayout:
    """All checks of one compression step (§3 `compress_step`), before anything is written; returns the rotary
    layout. `finite=False` leaves attn's values to `check_attn_finite` (tensor parallelism: after the average)."""
    layout = check_cache(keys, values, positions, cfg, inv_freq, rotary)
    check_attn(attn, cfg, num_visual=keys.shape[3] - cfg.prefix_len, finite=finite)
    if attn.shape[1] != keys.shape[1]:
        raise ValueError(f"attn: expected [L, B={keys.shape[1]}, V], got {tuple(attn.shape)}")
    check_same_device("attn", attn, "keys", keys)
    return layout


def check_stacks(stacks, attn: torch.Tensor, cfg: HermesConfig, rotary: Sequence[int] | RotaryLayout | None,
                 finite: bool = True) -> RotaryLayout:
    """All checks of one compression step over a cache split into per-device stacks (§2.6–2.7), before anything
    is written on any device.

    stacks: a non-empty sequence of (layers, keys, values, positions, inv_freq); `layers` is a range whose stack
    passes `check_cache`; the ranges follow each other in order and cover [0, L) exactly; every stack has the
    same [B, Hkv, N, D]. attn: [L, B, N - prefix_len] float32, finite (`finite=False`: left to
    `check_attn_finite`), on any device. Returns the rotary layout.
    """
    _config(cfg)
    if isinstance(stacks, (str, bytes)) or not isinstance(stacks, Sequence) or len(stacks) == 0:
        raise TypeError(f"stacks: expected a non-empty sequence of (layers, keys, values, positions, inv_freq), "
                        f"got {type(stacks).__name__}")
    next_layer = 0
    for index, stack in enumerate(stacks):
        if not isinstance(stack, Sequence) or len(stack) != 5:
            raise TypeError(f"stacks[{index}]: expected a (layers, keys, values, positions, inv_freq) tuple, got "
                            f"{type(stack).__name__}")
        layers, keys, values, positions, inv_freq = stack
        try:
            if layers is None:  # check_layers reads None as "all layers"; a stack must say which it holds
                raise TypeError("layers: expected a range of consecutive layer indices, got NoneType")
            check_layers(layers, cfg)
            layout = check_cache(keys, values, positions, cfg, inv_freq, rotary, layers)
        except (TypeError, ValueError) as error:
            raise type(error)(f"stacks[{index}]: {error}") from error
        if layers.start != next_layer:
            raise ValueError(f"stacks[{index}]: layers {layers} should start at layer {next_layer}; the stacks' "
                             f"ranges must cover layers 0..{cfg.num_layers - 1} in order, without gaps or overlaps")
        for earlier, (_, *tensors) in enumerate(stacks[:index]):  # each stack is written by its own launches
            for name, x in (("keys", keys), ("values", values), ("positions", positions)):
                for other_name, other in zip(("keys", "values", "positions"), tensors[:3]):
                    check_disjoint(f"stacks[{index}]: {name}", x, f"stacks[{earlier}]'s {other_name}", other)
        first_shape = stacks[0][1].shape[1:]
        if keys.shape[1:] != first_shape:
            raise ValueError(f"stacks[{index}]: keys [L, B, Hkv, N, D] = {tuple(keys.shape)} differ from stack 0's "
                             f"[B, Hkv, N, D] = {tuple(first_shape)}; every layer holds the same slots")
        next_layer = layers.stop
    if next_layer != cfg.num_layers:
        raise ValueError(f"stacks: the layer ranges end at layer {next_layer}, expected them to cover all "
                         f"L={cfg.num_layers} layers")
    _, B, _, N, _ = stacks[0][1].shape
    check_attn(attn, cfg, num_visual=N - cfg.prefix_len, finite=finite)
    if attn.shape[1] != B:
        raise ValueError(f"attn: expected [L, B={B}, V], got {tuple(attn.shape)}")
    return layout
