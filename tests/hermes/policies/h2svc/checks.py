"""Helpers of the H2SVC stream tests (tests/hermes/policies/h2svc/): streams with poisoned free slots, chunks of a
given number of H2SVC frames, snapshots of the class blocks, and the independent reference: a full-sequence
forward through a test-only eager attention with an explicit boolean mask per (layer, KV head); a step that
fails after its first class block (`h2svc_step_fails`)."""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

import hermes_kernels as hk
from hermes.attention import attention_implementation
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT
from hermes.policy import attention_layers
from hermes.stream import HermesStream
from tests.utils import poison_

# every layer but the last mixes two classes (one KV head each, GQA groups of two query heads); the last is
# all episodic (one dense call over all heads)
MIXED_MAP = [[EPISODIC, INSTANT], [SHORT, EPISODIC], [INSTANT, SHORT], [EPISODIC, EPISODIC]]
# four KV heads per layer (tiny_llava_ov(num_heads=8, num_kv_heads=4)): classes interleaved, so a class's heads in
# a layer are not contiguous and the query heads are gathered by index
INTERLEAVED_MAP = [[INSTANT, SHORT, INSTANT, EPISODIC], [EPISODIC, SHORT, EPISODIC, SHORT],
                   [SHORT, INSTANT, EPISODIC, INSTANT], [EPISODIC, EPISODIC, SHORT, EPISODIC]]




def video_frames(case, frames: int) -> int:
    """Video frames of a chunk of `frames` H2SVC frames (Qwen2.5-VL: a frame is a temporal grid step of 2)."""
    return 2 * frames if case.mrope else frames


def chunk(case, batch: int, g: torch.Generator, frames: int) -> dict:
    """append_video keyword arguments for one clip per stream of `frames` H2SVC frames (16 visual tokens each)."""
    return case.chunk(batch, g, video_frames(case, frames))


def h2svc_stream(case, model, frames: int, **kwargs) -> HermesStream:
    """An H2SVC stream for chunks of `frames` H2SVC frames, MIXED_MAP unless told otherwise, whose free slots are
    poisoned (NaN keys, values and features, sentinel positions): a read of a slot nobody wrote shows up. A hybrid
    model's map has a row per full-attention layer: MIXED_MAP's last rows (the all-episodic one last)."""
    rows = MIXED_MAP[len(MIXED_MAP) - len(attention_layers(model)):]
    args = dict(policy="h2svc", head_map=rows, chunk_frames=video_frames(case, frames), room=160)
    args.update(case.stream_kwargs)
    args.update(kwargs)
    stream = HermesStream(model, case.tokenizer(), **args)
    P = stream.cfg.prefix_len
    for block in stream.cache.blocks:
        for buffer in (block.keys, block.values):
            poison_(buffer[:, :, P:])
        poison_(block.positions[..., P:])
        if block.features is not None:
            poison_(block.features)
    return stream


def snapshot(stream) -> tuple:
    """Host counters, stats and the valid part of every block (keys, values, positions up to the class length;
    slot frames and features whole): what a failed call must leave as it was."""
    cache = stream.cache
    blocks = []
    for block in cache.blocks:
        n = cache.class_length(block.cls)
        blocks.append([block.keys[:, :, :n].clone(), block.values[:, :, :n].clone(),
                       block.positions[..., :n].clone(), block.slot_frames.clone()]
                      + ([block.features.clone()] if block.features is not None else []))
    return cache.counters, stream.stats(), list(stream.last_convs), stream.last_step, blocks


def whole_buffers(stream) -> list[torch.Tensor]:
    """Clones of every buffer of every block, free slots included."""
    return [t.clone() for block in stream.cache.blocks for t in block.buffers()]


# ---- the reference: explicit per-KV-head masks over the full sequence --------------------------------------
MASKED = "h2svc-test-masked"
_MASKS: dict[int, torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Eager attention with the boolean mask [Hkv, S, S] of this layer (from `_MASKS`), the same for every
    stream; query heads use their KV head's mask (GQA groups of consecutive heads). Ignores the model's mask."""
    group = query.shape[1] // key.shape[1]
    mask = _MASKS[module.layer_idx].repeat_interleave(group, dim=0)
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ keys.transpose(-1, -2)) * scaling
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ values).transpose(1, 2), None


AttentionInterface.register(MASKED, _masked_attention)


def window_masks(cfg, frames: int, question_len: int) -> dict[int, torch.Tensor]:
    """{layer: bool [Hkv, S, S]} over prefix + `frames` frames + question, written from docs/h2svc.md §3 on its own:
    every token sees itself and earlier tokens only; an episodic head (no eviction) sees all of them; an instant
    or short head with window W sees the prefix, and from frame i's tokens the frames i − W + 1 … i, from the
    question's tokens the W newest frames (n − W … n − 1) and the question."""
    P, T_f = cfg.prefix_len, cfg.tokens_per_frame
    S = P + frames * T_f + question_len
    frame = torch.full((S,), -1)
    frame[P:P + frames * T_f] = torch.arange(frames).repeat_interleave(T_f)
    is_question = torch.arange(S) >= P + frames * T_f
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    masks = {}
    for layer in range(cfg.num_layers):
        heads = []
        for cls in cfg.head_classes[layer].tolist():
            if cls == EPISODIC:
                heads.append(causal)
                continue
            W = cfg.window(cls)
            newest_seen = torch.where(is_question, frames - 1, frame)  # a question sees up to the newest frame
            oldest_seen = newest_seen - W + 1
            key_frame = frame[None, :]
            sees_frame = (key_frame >= oldest_seen[:, None]) & (key_frame <= newest_seen[:, None])
            not_a_frame = (frame < 0)[None, :]  # prefix and question keys
            heads.append(causal & (sees_frame | not_a_frame))
        masks[layer] = torch.stack(heads)
    return masks


def retention_masks(cfg, chunk_frames: int, episodic_held: list[dict[int, list[set[int]]]],
                    question_len: int) -> dict[int, torch.Tensor]:
    """`window_masks` of a stream whose episodic heads evict: `episodic_held[c][layer][j]` is the set of frames
    episodic head j of `layer` (j-th of `cfg.heads_of(EPISODIC, layer)`) held before chunk c, c = 0 … count (the
    last entry: before the question). Written from docs/h2svc.md §3 on its own: inside chunk c an episodic head's
    token sees the prefix, the frames held before the chunk and, causally, the chunk's own tokens; the question
    sees the frames held after the last chunk and, causally, itself. FIFO heads as in `window_masks`."""
    count = len(episodic_held) - 1
    P, T_f, frames = cfg.prefix_len, cfg.tokens_per_frame, chunk_frames * count
    masks = window_masks(cfg, frames, question_len)
    S = P + frames * T_f + question_len
    frame = torch.full((S,), -1)
    frame[P:P + frames * T_f] = torch.arange(frames).repeat_interleave(T_f)
    chunk_of = torch.where(frame >= 0, frame // chunk_frames, torch.where(torch.arange(S) < P, -1, count))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for layer in range(cfg.num_layers):
        for j, head in enumerate(cfg.heads_of(EPISODIC, layer)):
            held = torch.zeros(count + 1, frames + 1, dtype=torch.bool)  # column `frames`: "not a frame"
            for c in range(count + 1):
                held[c, sorted(episodic_held[c][layer][j])] = True
            key_frame = torch.where(frame >= 0, frame, frames)
            sees_held = held[chunk_of.clamp(min=0)][:, key_frame]                 # [S, S]
            same_chunk = (chunk_of[:, None] == chunk_of[None, :]) & (frame >= 0)[None, :]
            not_a_frame = (frame < 0)[None, :]
            masks[layer][head] = causal & (sees_held | same_chunk | not_a_frame)
    return masks


def masked_reference_logits(model, embeds: torch.Tensor, positions: torch.Tensor,
                            masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """Last-token logits [B, vocab] of one forward over the whole sequence with `masks` (the test attention)."""
    _MASKS.clear()
    _MASKS.update(masks)
    try:
        with attention_implementation(model, MASKED), torch.no_grad():
            hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
            return model.lm_head(hidden[:, -1])
    finally:
        _MASKS.clear()


@contextlib.contextmanager
def h2svc_step_fails(monkeypatch):
    """`hk.h2svc_step` raises on its second call inside the block: a step fails after its first class block was
    rewritten in place (the cache must then be `undefined`)."""
    step, calls = hk.h2svc_step, []

    def fails_after_the_first_block(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected after the first block moved")
        return step(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(hk, "h2svc_step", fails_after_the_first_block)
        yield
