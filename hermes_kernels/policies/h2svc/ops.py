"""The H2SVC ops of the kernel library (docs/h2svc.md §7): input checks, then the backend the one dispatch point
(`hermes_kernels.engine.dispatch`) picks, each implementing the contract of `hermes_kernels.policies.h2svc.reference`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...engine.dispatch import pick
from ...results import H2SVCStepResult
from ...rope import RotaryLayout
from . import features as feature_kernels
from . import stce as stce_kernels
from . import step as step_kernels
from .checks import check_frame_features, check_h2svc_step, check_stce
from .clock import StreamClock
from .config import H2SVCConfig


def frame_features(values: torch.Tensor, tokens_per_frame: int, *, backend: str = "auto") -> torch.Tensor:
    """Mean value vector of every frame (docs/h2svc.md §3): values [H, B, F·T_f, D] fp16/bf16/fp32/fp64 (any strides,
    e.g. the arriving frames' slots of a class block) -> float32 [H, B, F, D] (float64 for float64 values)."""
    check_frame_features(values, tokens_per_frame)
    impl = pick(backend, values.device, feature_kernels.frame_features_triton,
                 feature_kernels.frame_features_torch)
    return impl(values, tokens_per_frame)


def stce_select(features: torch.Tensor, slot_frames: torch.Tensor, arriving: torch.Tensor, first_frame: int,
                capacity: int, *, backend: str = "auto") -> torch.Tensor:
    """Kept frame indices int64 [H, B, capacity] (ascending, -1 padded) after STCE over one chunk (docs/h2svc.md §3).

    features float32 [H, B, W, D] (the held frames' features, any slot order; float64 allowed), slot_frames int64
    [H, B, W] (their stream indices, -1 empty, valid ones distinct), arriving [H, B, F, D] of features' dtype in
    arrival order (arrival i is frame first_frame + i, newer than every held frame), capacity N_e >= 2.
    """
    check_stce(features, slot_frames, arriving, first_frame, capacity)
    impl = pick(backend, features.device, stce_kernels.stce_select_triton, stce_kernels.stce_select_torch)
    return impl(features, slot_frames, arriving, first_frame, capacity)


def h2svc_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_frames: torch.Tensor,
               cfg: H2SVCConfig, cls, inv_freq: torch.Tensor, rotary: Sequence[int] | RotaryLayout | None = None, *,
               clock: StreamClock, features: torch.Tensor | None = None, backend: str = "auto") -> H2SVCStepResult:
    """One H2SVC step of one class block, in place; same contract as
    `hermes_kernels.policies.h2svc.reference.h2svc_step`.

    keys/values [H_c, B, C, D] fp16/bf16/fp32/fp64 (any strides); positions int64 [H_c, B, C] or [H_c, B, 3, C]
    (M-RoPE); rotary None (1D), three contiguous pair counts or a `RotaryLayout`; slot_frames int64 [H_c, B, W]
    (W = cfg.window(cls)); cls INSTANT/SHORT/EPISODIC or its name; clock the caller's host values (`StreamClock`:
    held, num_frames, first_frame, the re-index decision, next_position; no host sync on CUDA: the contents checks
    run on CPU tensors only); features float32 [H_c, B, W, D] for EPISODIC blocks, None otherwise. Result:
    held' = min(W, held + F), keep = slot_frames (the same tensor, updated), reindexed = clock.reindexed.
    """
    # the arriving values' finiteness is checked on their features, inside the step before its first write
    cls = check_h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq, rotary, clock, features,
                           arriving_values=False)
    layout = RotaryLayout.of(rotary, keys.shape[-1] // 2)  # checked above
    impl = pick(backend, keys.device, step_kernels.h2svc_step_triton, step_kernels.h2svc_step_torch)
    held_after = impl(keys, values, positions, slot_frames, cfg, cls, inv_freq, layout, clock, features)
    return H2SVCStepResult(held=held_after, keep=slot_frames, reindexed=clock.reindexed)
