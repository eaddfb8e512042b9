"""Input checks of the H2SVC ops, shared by `hermes_kernels.policies.h2svc.reference` and the ops of
`hermes_kernels`, over the generic helpers of `hermes_kernels.engine.checks`. Each runs before anything is written and
raises ValueError or TypeError starting with the argument's name. Two kinds (ours): structure (types, shapes, dtypes,
devices, host ints, the memory a step writes, by strides alone) is always checked; contents (frame indices,
finiteness) are read only where `hermes_kernels.engine.checks.read_contents` allows, so a step on CUDA makes no host
sync. docs/h2svc.md §7.3, docs/api.md#input-checks.
"""
from __future__ import annotations

import torch

from ...engine.checks import (check_int, check_keys_values, check_positions, check_rotary, check_same_device,
                              check_tensor, check_written, read_contents)
from ...engine.dtypes import CACHE_DTYPES, SCORE_DTYPES
from .clock import StreamClock
from .config import EPISODIC, H2SVCConfig, class_counts, class_id

__all__ = ["check_config", "check_frame_features", "check_trajectory", "check_stce", "check_fifo",
           "check_h2svc_step", "check_arriving_features", "check_attention_profile", "check_tad_pair",
           "check_head_scores"]


def _check_held_frames(name: str, frames: torch.Tensor, first_frame: int, first_name: str) -> torch.Tensor:
    """Contents of a frame-index table [..., W] (−1 = empty): valid entries distinct per row and older than
    the chunk's first arriving frame. Returns the number of valid entries per row."""
    valid = frames >= 0
    if bool((frames < -1).any()):
        raise ValueError(f"{name}: frame indices must be >= 0, or -1 for an empty slot; found "
                         f"{int(frames.min())}")
    ordered = frames.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(repeated.any()):
        row = tuple(repeated.any(dim=-1).nonzero()[0].tolist())
        raise ValueError(f"{name}: row {row} holds the same frame index twice: {frames[row].tolist()}")
    if bool(valid.any()) and int(frames.max()) >= first_frame:
        raise ValueError(f"{first_name}: arriving frames must be newer than every held frame; {first_name}="
                         f"{first_frame} but {name} holds frame {int(frames.max())}")
    return valid.sum(dim=-1)


def _check_finite(name: str, x: torch.Tensor, what: str) -> None:
    # amin / amax propagate NaN and expose ±inf, one read each with no boolean temporaries (isfinite makes
    # several, a large cost on the arriving values of a step); reduced over the two innermost dims first,
    # because full reductions of strided views (a block's arriving slots) take a slow path on CPU
    inner = tuple(range(max(x.dim() - 2, 0), x.dim()))
    if x.numel() and not bool(torch.isfinite(x.amin(dim=inner)).all() & torch.isfinite(x.amax(dim=inner)).all()):
        raise ValueError(f"{name}: non-finite values in {what}")


def check_config(cfg) -> None:
    """cfg must be an H2SVCConfig."""
    if not isinstance(cfg, H2SVCConfig):
        raise TypeError(f"cfg: expected an H2SVCConfig, got {type(cfg).__name__}")


def check_frame_features(values, tokens_per_frame) -> int:
    """values [H, B, F·T_f, D] fp16/bf16/fp32/fp64 (the arriving frames' value slots), tokens_per_frame T_f >= 1.
    Returns F, the number of frames."""
    check_tensor("values", values, (4,), CACHE_DTYPES, "[H, B, F*T_f, D]")
    T_f = check_int("tokens_per_frame", tokens_per_frame, 1)
    H, B, N, D = values.shape
    if min(H, B, N, D) < 1:
        raise ValueError(f"values: expected [H, B, F*T_f, D] with every dimension >= 1, got {tuple(values.shape)}")
    if N % T_f:
        raise ValueError(f"values: {N} tokens are not a whole number of frames of tokens_per_frame={T_f}")
    return N // T_f


def check_trajectory(features, times) -> None:
    """Inputs of `stce_scores`: features float32/float64 [n, D] finite, times int64 [n] strictly increasing."""
    check_tensor("features", features, (2,), SCORE_DTYPES, "[n, D] float32")
    check_tensor("times", times, (1,), (torch.int64,), "[n] int64")
    check_same_device("times", times, "features", features)
    if features.shape[0] < 1 or features.shape[1] < 1:
        raise ValueError(f"features: expected [n, D] with n, D >= 1, got {tuple(features.shape)}")
    if times.numel() != features.shape[0]:
        raise ValueError(f"times: expected [n={features.shape[0]}] int64 like features, got {tuple(times.shape)}")
    if bool((times[1:] <= times[:-1]).any()):
        raise ValueError(f"times: stream frame indices must increase strictly, got {times.tolist()}")
    _check_finite("features", features, "the frame features")


def check_stce(features, slot_frames, arriving, first_frame, capacity, contents: bool | None = None) -> int:
    """Inputs of `stce_select` (docs/h2svc.md §3). Returns F, the number of arrivals.

    features float32/float64 [H, B, W, D]: features of the held frames, any slot order; slot_frames int64 [H, B, W]:
    their stream indices, −1 for an empty slot (valid ones distinct per row); arriving [H, B, F, D], features'
    dtype, in arrival order; first_frame int >= 0, stream index of arrival 0, newer than every held frame;
    capacity N_e int >= 2. Contents: at most `capacity` frames held per row, held and arriving features finite.
    """
    check_tensor("features", features, (4,), SCORE_DTYPES, "[H, B, W, D] float32")
    check_tensor("slot_frames", slot_frames, (3,), (torch.int64,), "[H, B, W] int64")
    check_tensor("arriving", arriving, (4,), SCORE_DTYPES, "[H, B, F, D] float32")
    check_same_device("slot_frames", slot_frames, "features", features)
    check_same_device("arriving", arriving, "features", features)
    H, B, W, D = features.shape
    if min(H, B, W, D) < 1:
        raise ValueError(f"features: expected [H, B, W, D] with every dimension >= 1, got {tuple(features.shape)}")
    if tuple(slot_frames.shape) != (H, B, W):
        raise ValueError(f"slot_frames: expected [H={H}, B={B}, W={W}] int64 like features, got "
                         f"{tuple(slot_frames.shape)}")
    if arriving.dtype != features.dtype:
        raise TypeError(f"arriving: dtype {arriving.dtype} differs from features' {features.dtype}")
    if arriving.shape[:2] != (H, B) or arriving.shape[3] != D or arriving.shape[2] < 1:
        raise ValueError(f"arriving: expected [H={H}, B={B}, F>=1, D={D}], got {tuple(arriving.shape)}")
    check_int("first_frame", first_frame, 0)
    check_int("capacity", capacity, 2)
    if read_contents(contents, features):
        held = _check_held_frames("slot_frames", slot_frames, first_frame, "first_frame")
        if bool((held > capacity).any()):
            raise ValueError(f"slot_frames: a row holds {int(held.max())} frames, more than capacity={capacity}")
        _check_finite("features", torch.where((slot_frames >= 0)[..., None], features, 0), "held frames' features")
        _check_finite("arriving", arriving, "the arriving features")
    return arriving.shape[2]


def check_fifo(slot_frames, first_frame, num_frames, window, contents: bool | None = None) -> None:
    """Inputs of `fifo_keep`: slot_frames int64 [H, B, W'] held frame indices (−1 empty, valid ones distinct and
    older than first_frame), first_frame int >= 0, num_frames F >= 1, window W >= 1."""
    check_tensor("slot_frames", slot_frames, (3,), (torch.int64,), "[H, B, W] int64")
    if min(slot_frames.shape) < 1:
        raise ValueError(f"slot_frames: expected [H, B, W] with every dimension >= 1, got {tuple(slot_frames.shape)}")
    check_int("first_frame", first_frame, 0)
    check_int("num_frames", num_frames, 1)
    check_int("window", window, 1)
    if read_contents(contents, slot_frames):
        _check_held_frames("slot_frames", slot_frames, first_frame, "first_frame")


def check_h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq, rotary, clock, features,
                     contents: bool | None = None, arriving_values: bool = True) -> int:
    """All checks of one `h2svc_step` on a class block (docs/h2svc.md §7), before anything is written.
    Returns the class as an int.

    keys/values [H_c, B, C, D] one dtype (fp16/bf16/fp32/fp64) and device, D even; positions int64 [H_c, B, C]
    or [H_c, B, 3, C] (M-RoPE with rotary); slot_frames int64 [H_c, B, W], W = cfg.window(cls); inv_freq [R/2]
    (`check_rotary`: R = D, or fewer with an explicit `RotaryLayout`);
    clock a `StreamClock` (its fields checked by itself) with held <= W, C >= P + (held + F)·T_f and, when
    it re-indexes, next_position >= P + min(W, held + F)·T_f.
    features: for EPISODIC a float32 [H_c, B, W, D] tensor (float64 for a float64 cache); None otherwise (ours:
    FIFO classes carry no features, so passing some is a caller bug).
    Contents: slot_frames[..., :held] distinct frame indices older than first_frame, slot_frames[..., held:]
    all −1; EPISODIC: held features and the arriving values finite. `arriving_values=False` leaves the last one
    to the caller, who checks the arriving frames' features instead (`check_arriving_features`): a non-finite
    value makes its frame's mean non-finite, and the features are T_f times smaller than the values.
    """
    check_config(cfg)
    cls = class_id(cls, "cls")
    W = cfg.window(cls)
    check_keys_values(keys, values, 4, "[H_c, B, C, D]")
    H_c, B, C, D = keys.shape
    if H_c < 1 or B < 1:
        raise ValueError(f"keys: expected H_c >= 1 rows and B >= 1 streams, got {tuple(keys.shape)}")
    if D < 2 or D % 2:
        raise ValueError(f"keys: head dim D={D} must be even for rotary embeddings")
    check_positions(positions, [H_c, B], C, check_rotary(inv_freq, rotary, D), keys)
    check_tensor("slot_frames", slot_frames, (3,), (torch.int64,), f"[H_c, B, W={W}] int64")
    if tuple(slot_frames.shape) != (H_c, B, W):
        raise ValueError(f"slot_frames: expected [H_c={H_c}, B={B}, W={W}] int64 ({W} home slots of class "
                         f"{cls}), got {tuple(slot_frames.shape)}")
    check_same_device("slot_frames", slot_frames, "keys", keys)
    if not isinstance(clock, StreamClock):
        raise TypeError(f"clock: expected a StreamClock (held, num_frames, first_frame, reindexed, next_position), "
                        f"got {type(clock).__name__}")
    held, F, first_frame = clock.held, clock.num_frames, clock.first_frame
    if held > W:
        raise ValueError(f"clock.held: at most W={W} frames sit in the home slots, got {held}")
    P, T_f = cfg.prefix_len, cfg.tokens_per_frame
    if C < P + (held + F) * T_f:
        raise ValueError(f"keys: cache length C={C} cannot hold prefix_len={P} + (held={held} + num_frames={F}) "
                         f"frames of {T_f} tokens = {P + (held + F) * T_f}")
    held_after = min(W, held + F)
    if bool(clock.reindexed) and clock.next_position < P + held_after * T_f:
        raise ValueError(f"clock.next_position: re-indexing needs next_position >= prefix_len + {held_after} retained "
                         f"frames of {T_f} tokens = {P + held_after * T_f}, got {clock.next_position}")
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    if cls == EPISODIC:
        check_tensor("features", features, (4,), (work,), f"[H_c, B, W={W}, D] {work}")
        if tuple(features.shape) != (H_c, B, W, D):
            raise ValueError(f"features: expected [H_c={H_c}, B={B}, W={W}, D={D}] {work}, got "
                             f"{tuple(features.shape)}")
        check_same_device("features", features, "keys", keys)
    elif features is not None:
        raise ValueError(f"features: only EPISODIC blocks carry frame features; class {cls} takes None")
    # the step rewrites these in place while reading inv_freq: no element twice, no shared memory
    written = [("keys", keys), ("values", values), ("positions", positions), ("slot_frames", slot_frames)]
    check_written(written + ([("features", features)] if cls == EPISODIC else []), [("inv_freq", inv_freq)])
    if read_contents(contents, keys):
        if bool((slot_frames[..., :held] < 0).any()):
            raise ValueError(f"slot_frames: the first held={held} home slots must all hold a frame (>= 0)")
        if bool((slot_frames[..., held:] != -1).any()):
            raise ValueError(f"slot_frames: home slots from held={held} on must be empty (-1)")
        _check_held_frames("slot_frames", slot_frames[..., :held], first_frame, "clock.first_frame")
        if cls == EPISODIC:
            _check_finite("features", features[..., :held, :], "the held frames' features")
            if arriving_values:
                _check_finite("values", values[:, :, P + held * T_f:P + (held + F) * T_f], "the arriving frames")
    return cls


def check_arriving_features(arriving: torch.Tensor, contents: bool | None = None) -> None:
    """The arriving frames' features [H_c, B, F, D] finite (contents check, CPU tensors by default), before the
    step writes anything: what `check_h2svc_step(..., arriving_values=False)` leaves to its caller."""
    if read_contents(contents, arriving):
        _check_finite("values", arriving, "the arriving frames (their mean is not finite)")


def check_attention_profile(probs, frame_of_token, num_kv_heads, text_queries=None) -> int:
    """Inputs of `tad_v2v` / `tad_t2v` (docs/h2svc.md §2). Returns n, the number of frames.

    probs float [L, H, S, S] finite (attention probabilities of one video, rows = queries); frame_of_token
    int64 [S]: 0-based frame of each token, −1 for other tokens, every frame 0..n−1 present; num_kv_heads
    dividing H; text_queries (T2V only) int64 [Q >= 1]: distinct token indices after the last frame token.
    """
    check_tensor("probs", probs, (4,), SCORE_DTYPES, "[L, H, S, S] float32")
    L, H, S, S2 = probs.shape
    if min(L, H, S) < 1 or S2 != S:
        raise ValueError(f"probs: expected [L, H, S, S] with L, H, S >= 1, got {tuple(probs.shape)}")
    Hkv = check_int("num_kv_heads", num_kv_heads, 1)
    if H % Hkv:
        raise ValueError(f"num_kv_heads: {Hkv} KV heads do not divide probs' {H} query heads")
    check_tensor("frame_of_token", frame_of_token, (1,), (torch.int64,), f"[S={S}] int64")
    if frame_of_token.numel() != S:
        raise ValueError(f"frame_of_token: expected [S={S}] int64, got {tuple(frame_of_token.shape)}")
    check_same_device("frame_of_token", frame_of_token, "probs", probs)
    _check_finite("probs", probs, "the attention probabilities")
    if bool((frame_of_token < -1).any()):
        raise ValueError(f"frame_of_token: expected frame indices >= 0 or -1 for other tokens, found "
                         f"{int(frame_of_token.min())}")
    n = int(frame_of_token.max()) + 1
    if n < 1:
        raise ValueError("frame_of_token: no frame tokens (every entry is -1)")
    present = torch.zeros(n, dtype=torch.bool, device=frame_of_token.device)
    present[frame_of_token[frame_of_token >= 0]] = True
    if not bool(present.all()):
        raise ValueError(f"frame_of_token: frames {(~present).nonzero().flatten().tolist()} have no tokens; "
                         f"frames must be numbered 0..n-1")
    if text_queries is not None:
        check_tensor("text_queries", text_queries, (1,), (torch.int64,), "[Q] int64")
        check_same_device("text_queries", text_queries, "probs", probs)
        last_frame_token = int((frame_of_token >= 0).nonzero().max())
        if text_queries.numel() < 1 or bool(((text_queries <= last_frame_token) | (text_queries >= S)).any()):
            raise ValueError(f"text_queries: expected >= 1 token indices in ({last_frame_token}, {S}) (text after "
                             f"all frames), got {text_queries.tolist()}")
        if text_queries.unique().numel() != text_queries.numel():
            raise ValueError(f"text_queries: repeated token indices {text_queries.tolist()}")
    return n


def check_tad_pair(v2v, t2v) -> None:
    """v2v, t2v float [L, Hkv] of one shape, finite (inputs of `head_scores`)."""
    check_tensor("v2v", v2v, (2,), SCORE_DTYPES, "[L, Hkv] float")
    check_tensor("t2v", t2v, (2,), SCORE_DTYPES, "[L, Hkv] float")
    if min(v2v.shape) < 1:
        raise ValueError(f"v2v: expected [L, Hkv] with L, Hkv >= 1, got {tuple(v2v.shape)}")
    if t2v.shape != v2v.shape:
        raise ValueError(f"t2v: expected the shape of v2v {tuple(v2v.shape)}, got {tuple(t2v.shape)}")
    check_same_device("t2v", t2v, "v2v", v2v)
    _check_finite("v2v", v2v, "TAD_V2V")
    _check_finite("t2v", t2v, "TAD_T2V")


def check_head_scores(scores, instant_ratio, short_ratio) -> tuple[int, int, int]:
    """scores float [L, Hkv] finite; ratios as `class_counts`. Returns (n_i, n_s, n_e)."""
    check_tensor("scores", scores, (2,), SCORE_DTYPES, "[L, Hkv] float")
    if min(scores.shape) < 1:
        raise ValueError(f"scores: expected [L, Hkv] with L, Hkv >= 1, got {tuple(scores.shape)}")
    _check_finite("scores", scores, "the head scores")
    return class_counts(scores.numel(), instant_ratio, short_ratio)

