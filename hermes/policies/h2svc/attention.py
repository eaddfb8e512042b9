"""H2SVC attention of one layer: one dense call per class over that class's block (docs/h2svc.md §5).

The one registered "hermes" attention function reaches `class_attention` through `H2SVCCache.attend`. For every
class with heads in the layer it gathers the query heads of that class's KV heads, rotates them to the true
positions (`incoming_delta`), runs the model's own attention over the class block and puts the outputs back in head
order. `frame_window_mask` is the instant / short heads' window while a chunk is prefilled. The masks and why a
chunk then matches frame-by-frame streaming: docs/stream.md#h2svc-behind-the-front, docs/decisions.md#h2svc-model.
"""
from __future__ import annotations

import torch

from hermes.attention import causal_mask, flash_usable, model_attention, padded_mask
from hermes_kernels.policies.h2svc.config import EPISODIC
from hermes_kernels.rope import apply_rotary_delta


def frame_window_mask(held_frames: torch.Tensor, prefix_len: int, tokens_per_frame: int, first_frame: int,
                      num_frames: int, window: int) -> torch.Tensor:
    """bool [1, 1, T, N] of a FIFO class block during a chunk's prefill (docs/decisions.md#h2svc-model).

    held_frames: int64 [held], the stream frame of each home slot in slot order (any order: a FIFO ring);
    keys are [0, P) the prefix, then the held frames' T_f slots each, then the chunk's T = F·T_f tokens
    (frames first_frame … first_frame + F − 1), N = P + held·T_f + T. Query t (chunk frame t // T_f) sees key k
    iff k < P, or k is at or before it (slot order) and k's frame >= its frame − window + 1.
    """
    device = held_frames.device
    T_f, F, P = tokens_per_frame, num_frames, prefix_len
    held = held_frames.numel()
    chunk = first_frame + torch.arange(F, device=device)
    key_frame = torch.cat([held_frames, chunk])[:, None].expand(-1, T_f).reshape(-1)  # [N - P], T_f per frame
    query_frame = key_frame[held * T_f:]                                               # [T]
    key_slot = torch.arange(key_frame.numel(), device=device)
    query_slot = held * T_f + torch.arange(F * T_f, device=device)
    visual = (key_frame[None, :] > (query_frame - window)[:, None]) & (key_slot[None, :] <= query_slot[:, None])
    prefix = torch.ones(F * T_f, P, dtype=torch.bool, device=device)
    return torch.cat([prefix, visual], dim=1)[None, None]


def _class_mask(cache, part, count: int, total: int, device: torch.device) -> torch.Tensor | None:
    """The mask of `part`'s class for this forward, or None when it is plain causal
    (docs/stream.md#h2svc-behind-the-front)."""
    hidden = cache.hidden_keys()
    cls = part.cls
    if hidden is not None:
        starts, pads = hidden
        return cache.forward_mask(("padded", cls, count, total), device,
                                  lambda: padded_mask((starts[cls], pads), count, total, device))
    fwd, cfg = cache.current_forward, cache.cfg
    window = cfg.window(cls)
    held = (fwd.starts[cls] - cfg.prefix_len) // cfg.tokens_per_frame  # a chunk goes right after the held frames
    if fwd.frames and cls != EPISODIC and held + fwd.frames > window:
        # FIFO: every row and stream of the class holds the same frames in the same slots; read row 0, stream 0
        held_frames = part.block.slot_frames[0, 0, :held]
        return cache.forward_mask(("window", cls), device, lambda: frame_window_mask(
            held_frames, cfg.prefix_len, cfg.tokens_per_frame, cache.frames_seen, fwd.frames, window))
    return None


def class_attention(module: torch.nn.Module, cache, layer: int, query: torch.Tensor, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of `layer` over the class blocks of an `H2SVCCache` (docs/h2svc.md §5).

    query: [B, H, T, D] at the default positions the model ran with (rotated here to the true ones), the last T of
    the forward's tokens (all of them, but for a KV-shared layer when transformers keeps one logit). The keys
    and values of the incoming tokens are already in the blocks (`H2SVCCache.write`). Returns (output
    [B, T, H, D], None), as transformers' attention functions do.
    """
    # [B, 1, T] or [B, 1, 3, T]: the same for every head; a KV-shared layer may run the forward's last rows only
    delta = cache.incoming_delta(layer)[..., -query.shape[2]:].unsqueeze(1)
    query = apply_rotary_delta(query, delta, cache.layer_inv_freq(layer), cache.rotary)
    B, H, T, D = query.shape
    fwd = cache.current_forward
    parts = cache.layer_parts(layer)
    out = None if len(parts) == 1 else query.new_empty(B, T, H, D)
    for part in parts:
        block = part.block
        total = fwd.starts[part.cls] + fwd.count
        keys = block.keys[part.rows, :, :total].transpose(0, 1)      # [B, n, N_c, D]
        values = block.values[part.rows, :, :total].transpose(0, 1)
        q = query if len(parts) == 1 else query[:, part.query_heads]
        mask = _class_mask(cache, part, fwd.count, total, query.device)
        if mask is not None:
            mask = mask[..., fwd.count - T:, :]  # the rows of the queries that run
        elif not flash_usable(q) and 1 < T < total:
            mask = cache.forward_mask(("causal", T, total), query.device, lambda: causal_mask(T, total, query.device))
        output, _ = model_attention(module, q, keys, values, mask, dropout, scaling, **kwargs)  # [B, T, n·g, D]
        if out is None:
            return output, None
        out[:, :, part.query_heads] = output
    return out, None
