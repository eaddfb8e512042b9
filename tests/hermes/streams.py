"""Helpers of the stream tests: the model families under test (`CASES`: how to build the tiny model, make a chunk
of pixels, and encode it with the model's own vision path for reference runs; `QWEN3_VL` and `QWEN3_5`, whose
references are their own, below), HERMES streams with poisoned free slots, the references, and the two-thread
runner. References never go through the engine: they run the unpatched model (sdpa, or eager for attention maps)
over the full sequence or over a `DynamicCache` holding the same keys.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import pytest
import torch

from scaffolding.models import (tiny_gemma4, tiny_llava_ov, tiny_llava_ov1_5, tiny_minicpmv4_6, tiny_qwen2_5_vl,
                                tiny_qwen3_5, tiny_qwen3_vl)
from scaffolding.pixels import llava_pixels, qwen_pixels
from scaffolding.tokenizer import tiny_minicpm_tokenizer, tiny_tokenizer
import hermes.attention
from hermes.attention import attention_implementation
from hermes.models import family_of
from hermes.models.qwen2_5_vl import video_rel_positions
from hermes.stream import HermesStream
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, INSTANT, SHORT
from tests.utils import poison_

QUESTION = "what is the person holding ?"


@dataclasses.dataclass
class Case:
    """A model family under test.

    build:      (**overrides) -> tiny model.
    frames:     frames per chunk.
    chunk:      (batch, generator, frames=frames) -> append_video keyword arguments (video=..., grid_thw=...) of a
                chunk of `frames` video frames.
    encode:     (model, chunk kwargs) -> (embeds [B, T, hidden], rel positions [3, T] or None) via the model's
                own vision path.
    stream_kwargs: extra HermesStream arguments (frame_size for Qwen2.5-VL).
    bad_chunks: (batch, generator) -> {name: append_video kwargs that must be rejected}.
    linear:     the decoder has linear-attention layers (Qwen3.5): ragged question batches are refused.
    windows:    the decoder has sliding-window layers (Gemma 4): ragged question batches are refused.
    """

    name: str
    build: Callable
    frames: int
    chunk: Callable
    encode: Callable
    stream_kwargs: dict
    bad_chunks: Callable
    mrope: bool
    tokenizer: Callable = tiny_tokenizer  # () -> the tiny model's tokenizer
    linear: bool = False
    windows: bool = False


LLAVA_FRAMES = 2


def _llava_chunk(batch, g, frames=LLAVA_FRAMES):
    return {"video": llava_pixels(batch, frames, g)}


def _llava_encode(model, chunk):
    features = model.model.get_video_features(chunk["video"], vision_feature_layer=-1,
                                              vision_feature_select_strategy="full").pooler_output
    return features[:, :-1], None


def _llava_bad_chunks(batch, g):
    return {
        "wrong frame size": {"video": torch.randn(batch, LLAVA_FRAMES, 3, 8, 8, generator=g)},
        "wrong channels": {"video": torch.randn(batch, LLAVA_FRAMES, 1, 16, 16, generator=g)},
        "wrong batch": {"video": llava_pixels(batch + 1, LLAVA_FRAMES, g)},
        "integer pixels": {"video": torch.zeros(batch, LLAVA_FRAMES, 3, 16, 16, dtype=torch.uint8)},
        "non-finite": {"video": llava_pixels(batch, LLAVA_FRAMES, g).index_fill_(1, torch.tensor([0]),
                                                                                float("nan"))},
        "unknown argument": {"video": llava_pixels(batch, LLAVA_FRAMES, g), "grid_thw": torch.tensor([1, 8, 8])},
    }


QWEN_FRAMES = 4
SECONDS_PER_GRID = 4.0  # t advances 8 per temporal step: time, not the grid, drives the positions


def _qwen_chunk(batch, g, frames=QWEN_FRAMES):
    video, grid = qwen_pixels(batch, frames, g)
    return {"video": video, "grid_thw": grid, "seconds_per_grid": SECONDS_PER_GRID}


def _qwen_encode(model, chunk):
    grid = chunk["grid_thw"]
    embeds = torch.stack(model.model.get_video_features(chunk["video"], grid).pooler_output)
    vision = model.config.vision_config
    interval = vision.tokens_per_second * chunk["seconds_per_grid"]
    return embeds, video_rel_positions(grid[0].tolist(), vision.spatial_merge_size, interval)


def _qwen_bad_chunks(batch, g):
    video, grid = qwen_pixels(batch, QWEN_FRAMES, g)
    return {
        "missing grid": {"video": video},
        "grid does not match rows": {"video": video, "grid_thw": torch.tensor([2, 4, 4])},
        "odd grid": {"video": video[: batch * 2 * 3 * 8], "grid_thw": torch.tensor([2, 3, 8])},
        "streams with different grids": {"video": video, "grid_thw": torch.tensor([[2, 8, 8], [1, 16, 8]])},
        "wrong patch size": {"video": video[:, :12], "grid_thw": grid},
        "non-finite": {"video": video.clone().fill_(float("inf")), "grid_thw": grid},
        "bad seconds_per_grid": {"video": video, "grid_thw": grid, "seconds_per_grid": 0.0},
    }


CASES = {
    "llava_ov": Case(name="llava_ov", build=tiny_llava_ov, frames=LLAVA_FRAMES, chunk=_llava_chunk,
                     encode=_llava_encode, stream_kwargs={}, bad_chunks=_llava_bad_chunks, mrope=False),
    "qwen2_5_vl": Case(name="qwen2_5_vl", build=tiny_qwen2_5_vl, frames=QWEN_FRAMES, chunk=_qwen_chunk,
                       encode=_qwen_encode, stream_kwargs={"frame_size": (16, 16)}, bad_chunks=_qwen_bad_chunks,
                       mrope=True),
}


QWEN3_FRAME = (8, 8)  # 2 x 2 merged tokens: a step's run is 16 tokens with its timestamp, a chunk 32 (as Qwen2.5-VL's)


def _qwen3_chunk(batch, g, frames=QWEN_FRAMES):
    """Patches of 8 x 8 frames; the steps at 99.5 s, 100.5 s, ...: timestamps of 2 and 3 significant digits in one
    chunk (written with one token count). The same times in every chunk, as the lockstep checks stack clips and
    keep the first one's timing (the model's own tests stream advancing times)."""
    video, grid = qwen_pixels(batch, frames, g, *QWEN3_FRAME)
    return {"video": video, "grid_thw": grid, "timestamps": [99.5 + step for step in range(frames // 2)]}


def _qwen3_bad_chunks(batch, g):
    good = _qwen3_chunk(batch, g)
    video, grid, stamps = good["video"], good["grid_thw"], good["timestamps"]
    return {
        "missing grid": {"video": video, "timestamps": stamps},
        "grid does not match rows": {"video": video, "grid_thw": torch.tensor([2, 2, 4]), "timestamps": stamps},
        "streams with different grids": {"video": video, "grid_thw": torch.tensor([[2, 4, 4], [1, 8, 4]]),
                                         "timestamps": stamps},
        "non-finite": {"video": video.clone().fill_(float("nan")), "grid_thw": grid, "timestamps": stamps},
        "missing timestamps": {"video": video, "grid_thw": grid},
        "one timestamp short": {"video": video, "grid_thw": grid, "timestamps": stamps[:1]},
        "negative timestamp": {"video": video, "grid_thw": grid, "timestamps": [-1.0, 1.0]},
        "timestamp past the digits": {"video": video, "grid_thw": grid, "timestamps": [0.0, 1e6]},
        "Qwen2.5-VL's timing": {"video": video, "grid_thw": grid, "seconds_per_grid": 1.0},
    }


# Qwen3-VL (DeepStack, text timestamps): the shared stream checks run under it (tests/hermes/stream/policies.py
# FAMILIES); not in CASES, whose references feed embeddings alone: its references (the model's own forward) are in
# tests/hermes/models/test_qwen3_vl.py
QWEN3_VL = Case(name="qwen3_vl", build=tiny_qwen3_vl, frames=QWEN_FRAMES, chunk=_qwen3_chunk, encode=None,
                stream_kwargs={"frame_size": QWEN3_FRAME}, bad_chunks=_qwen3_bad_chunks, mrope=True,
                tokenizer=lambda: tiny_tokenizer(digits=True))

# Qwen3.5 (hybrid decoder, Qwen3-VL's chunk layout without DeepStack): Qwen3-VL's chunks and bad chunks (timestamps
# included); its references (the model's own forward) are in tests/hermes/models/test_qwen3_5.py. Not yet in the
# shared stream checks' FAMILIES: they need the hybrid cache (linear-attention states).
QWEN3_5 = Case(name="qwen3_5", build=tiny_qwen3_5, frames=QWEN_FRAMES, chunk=_qwen3_chunk, encode=None,
               stream_kwargs={"frame_size": QWEN3_FRAME}, bad_chunks=_qwen3_bad_chunks, mrope=True,
               tokenizer=lambda: tiny_tokenizer(digits=True), linear=True)


def _llava_ov1_5_chunk(batch, g, frames=LLAVA_FRAMES):
    video, grid = qwen_pixels(batch, frames, g, temporal_patch_size=1)
    return {"video": video, "grid_thw": grid}


def _llava_ov1_5_bad_chunks(batch, g):
    video, grid = qwen_pixels(batch, LLAVA_FRAMES, g, temporal_patch_size=1)
    return {
        "missing grid": {"video": video},
        "grid does not match rows": {"video": video, "grid_thw": torch.tensor([2, 4, 4])},
        "streams with different grids": {"video": video, "grid_thw": torch.tensor([[2, 8, 8], [1, 16, 8]])},
        "rows of two frames (Qwen2.5-VL's)": dict(zip(("video", "grid_thw"), qwen_pixels(batch, 2 * LLAVA_FRAMES, g))),
        "non-finite": {"video": video.clone().fill_(float("nan")), "grid_thw": grid},
        "Qwen2.5-VL's timing": {"video": video, "grid_thw": grid, "seconds_per_grid": 1.0},
    }


# LLaVA-OneVision-1.5 (Qwen2-VL's patch rows at one frame per row, Qwen3 decoder, 1D RoPE): chunks of 2 frames of
# 16 x 16 (4 x 4 merged tokens each); the shared stream checks run under it (tests/hermes/stream/policies.py FAMILIES);
# its references (the model's own forward of a whole video) are in tests/hermes/models/test_llava_ov1_5.py
LLAVA_OV1_5 = Case(name="llava_ov1_5", build=tiny_llava_ov1_5, frames=LLAVA_FRAMES, chunk=_llava_ov1_5_chunk,
                   encode=None, stream_kwargs={"frame_size": (16, 16)}, bad_chunks=_llava_ov1_5_bad_chunks, mrope=False)


MINICPM_FRAME = (24, 32)  # 12 x 16 patches, 3 x 4 tokens: a frame is 14 tokens with <image> and </image>, a chunk 28


def _minicpm_chunk(batch, g, frames=LLAVA_FRAMES):
    """Pixel values [B, 3, 2, F * 12 * 16 * 2] (one row per stream, packed as MiniCPMV4_6VideoProcessor packs a clip)
    and target_sizes [F, 2] of `frames` 24 x 32 frames."""
    h, w = MINICPM_FRAME[0] // 2, MINICPM_FRAME[1] // 2
    return {"video": torch.randn(batch, 3, 2, frames * h * w * 2, generator=g),
            "target_sizes": torch.tensor([[h, w]] * frames)}


def _minicpm_bad_chunks(batch, g):
    good = _minicpm_chunk(batch, g)
    video, sizes = good["video"], good["target_sizes"]
    return {
        "missing target_sizes": {"video": video},
        "sizes that do not match the pixels": {"video": video, "target_sizes": torch.tensor([[12, 8], [12, 8]])},
        "frames of two sizes": {"video": video, "target_sizes": torch.tensor([[12, 16], [16, 12]])},
        "a side the mergers cannot fold": {"video": video[..., :2 * 6 * 16 * 2],
                                           "target_sizes": torch.tensor([[6, 16], [6, 16]])},
        "float target_sizes": {"video": video, "target_sizes": sizes.float()},
        "one stream short": {"video": video[:-1], "target_sizes": sizes},
        "non-finite": {"video": video.clone().fill_(float("inf")), "target_sizes": sizes},
        "Qwen's grid": {"video": video, "target_sizes": sizes, "grid_thw": torch.tensor([2, 12, 16])},
    }


# MiniCPM-V 4.6 (Qwen3.5's hybrid decoder with 1D positions, frames between <image> markers): chunks of 2 frames of
# 24 x 32; the shared stream checks run under it (tests/hermes/stream/policies.py FAMILIES); its references (the
# model's own processing and forward of a whole video) are in tests/hermes/models/test_minicpmv4_6.py
MINICPM = Case(name="minicpmv4_6", build=tiny_minicpmv4_6, frames=LLAVA_FRAMES, chunk=_minicpm_chunk, encode=None,
               stream_kwargs={"frame_size": MINICPM_FRAME}, bad_chunks=_minicpm_bad_chunks, mrope=False,
               tokenizer=tiny_minicpm_tokenizer, linear=True)


# patch columns x rows of an 8 x 8 frame (patch 2): 4 soft tokens, 11 tokens with " mm:ss " and the markers
GEMMA4_GRID = (4, 4)


def _gemma4_chunk(batch, g, frames=LLAVA_FRAMES):
    """Patches [B·F, 16, 12] of `frames` 8 x 8 frames per stream with their (column, row) positions, and the frames'
    seconds (99 s and on: one minute digit changes inside the chunk, the token count does not)."""
    cols, rows = GEMMA4_GRID
    grid = torch.stack([torch.arange(cols).repeat(rows), torch.arange(rows).repeat_interleave(cols)], dim=-1)
    return {"video": torch.randn(batch * frames, cols * rows, 12, generator=g),
            "video_position_ids": grid.expand(batch * frames, -1, -1).clone(),
            "timestamps": [99.0 + frame for frame in range(frames)]}


def _gemma4_bad_chunks(batch, g):
    good = _gemma4_chunk(batch, g)
    video, grid, stamps = good["video"], good["video_position_ids"], good["timestamps"]
    return {
        "missing positions": {"video": video, "timestamps": stamps},
        "positions off the grid": {"video": video, "video_position_ids": grid + 1, "timestamps": stamps},
        "wrong patch width": {"video": video[..., :8], "video_position_ids": grid, "timestamps": stamps},
        "non-finite": {"video": video.clone().fill_(float("nan")), "video_position_ids": grid, "timestamps": stamps},
        "missing timestamps": {"video": video, "video_position_ids": grid},
        "timestamp past 100 minutes": {"video": video, "video_position_ids": grid, "timestamps": [0.0, 6000.0]},
        "Qwen's grid": {"video": video, "video_position_ids": grid, "timestamps": stamps, "grid_thw": grid},
    }


# Gemma 4 (sliding-window and KV-shared layers, 512-wide full heads scaled down, text timestamps); its references
# (transformers' own forward of the whole video) are in tests/hermes/models/test_gemma4_stream.py
GEMMA4 = Case(name="gemma4", build=tiny_gemma4, frames=LLAVA_FRAMES, chunk=_gemma4_chunk, encode=None,
              stream_kwargs={"frame_size": (8, 8)}, bad_chunks=_gemma4_bad_chunks, mrope=False,
              tokenizer=lambda: tiny_tokenizer(digits=True, gemma=True), windows=True)


def layer_parts(stream: HermesStream, layer: int) -> list[tuple]:
    """(KV heads, contents name prefix) of what a stream's cache holds of cache layer `layer`: the whole layer for
    HERMES ("layer {l}"), each class with heads there for H2SVC ("layer {l} {class}")."""
    if stream.policy.name != "h2svc":
        return [(slice(None), f"layer {layer}")]
    return [(stream.cfg.heads_of(cls, layer), f"layer {layer} {name}")
            for cls, name in zip((INSTANT, SHORT, EPISODIC), CLASS_NAMES) if stream.cfg.heads_of(cls, layer)]


def make_stream(case: Case, model, **kwargs) -> HermesStream:
    """A stream whose free slots (everything past the prefilled prefix) are poisoned: NaN keys/values and
    guidance scores, sentinel positions, so a read of a slot nobody wrote shows up in every check."""
    args = dict(chunk_frames=case.frames, room=160)
    args.update(case.stream_kwargs)
    args.update(kwargs)
    stream = HermesStream(model, case.tokenizer(), **args)
    length = stream.cache.length
    for stack in stream.cache._stacks:
        for buffer in (stack.keys, stack.values):
            poison_(buffer[..., length:, :])
        poison_(stack.positions[..., length:])
    poison_(stream.cache.guidance_attn)
    windows = stream.cache.windows
    for ring in () if windows is None else (*windows.keys, *windows.values):
        poison_(ring[:, :, length:])  # slots of the positions past the prefix
    return stream


def full_positions(case: Case, prefix_len: int, rels: list, lengths: list[int], question_len: int,
                   batch: int) -> torch.Tensor:
    """Positions of prefix + chunks + question as one sequence: every segment starts at the largest
    position so far + 1 (docs/hermes.md §2.7); [B, S] or [3, B, S]."""
    pieces = [torch.arange(prefix_len).expand(3, -1)]
    for rel, length in zip(rels, lengths):
        start = int(pieces[-1].max()) + 1
        pieces.append(start + (torch.arange(length).expand(3, -1) if rel is None else rel))
    pieces.append(int(pieces[-1].max()) + 1 + torch.arange(question_len).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    if not case.mrope:
        return positions[0].expand(batch, -1)
    return positions[:, None, :].expand(3, batch, -1)


def reference_sequence(case: Case, model, chunks: list[dict], batch: int):
    """(embeds [B, S, hidden], positions, question ids [B, Tq]) of the whole stream as one sequence."""
    tok = tiny_tokenizer()
    fam = family_of(model)
    prefix = torch.tensor([tok(fam.prefix_text(None), add_special_tokens=False)["input_ids"]] * batch)
    question = torch.tensor([tok(fam.question_text(QUESTION), add_special_tokens=False)["input_ids"]] * batch)
    embed = model.get_input_embeddings()
    encoded = [case.encode(model, chunk) for chunk in chunks]
    embeds = torch.cat([embed(prefix)] + [e for e, _ in encoded] + [embed(question)], dim=1)
    positions = full_positions(case, prefix.shape[1], [r for _, r in encoded], [e.shape[1] for e, _ in encoded],
                               question.shape[1], batch)
    return embeds, positions, question


def reference_logits(model, embeds, positions) -> torch.Tensor:
    with attention_implementation(model, "sdpa"), torch.no_grad():
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        return model.lm_head(hidden[:, -1])


def reference_greedy(model, embeds, positions, new_tokens: int, mrope: bool) -> torch.Tensor:
    tok = tiny_tokenizer()
    extra = {"mm_token_type_ids": torch.zeros(embeds.shape[:2], dtype=torch.int32)} if mrope else {}
    with attention_implementation(model, "sdpa"), torch.no_grad():
        return model.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                              position_ids=positions, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **extra)


def snapshot(stream: HermesStream) -> tuple:
    """Everything a failed call must leave untouched: length and the valid slots of every layer."""
    cache = stream.cache
    return (cache.length, [cache.layer_keys(l).clone() for l in range(cache.num_layers)],
            [cache.layer_values(l).clone() for l in range(cache.num_layers)],
            [cache.layer_positions(l).clone() for l in range(cache.num_layers)])


def refuse_bad_questions(stream: HermesStream) -> None:
    """Questions `ask` must refuse before anything runs, either policy: an answer past the room, a list for a
    one-stream batch, beam search."""
    with pytest.raises(ValueError, match="room"):
        stream.ask(QUESTION, max_new_tokens=10_000)
    with pytest.raises(TypeError, match="question"):
        stream.ask([QUESTION], max_new_tokens=2)
    with pytest.raises(ValueError, match="num_beams"):
        stream.ask(QUESTION, max_new_tokens=2, num_beams=2)


def rope_at(model, keys: torch.Tensor, positions: torch.Tensor, mrope: bool) -> torch.Tensor:
    """The model's own RoPE of pre-RoPE keys [Hkv, n, D] at positions [n] ([3, n] for M-RoPE)."""
    rotary = model.model.language_model.rotary_emb
    module = __import__(type(model.model.language_model.layers[0].self_attn).__module__, fromlist=["x"])
    pos = positions[:, None, :] if mrope else positions[None, :]
    cos, sin = rotary(keys, pos)  # [1, n, D] for both layouts
    rotated, _ = module.apply_rotary_pos_emb(keys[None], keys[None], cos, sin)
    return rotated[0]


def run_in_two_threads(monkeypatch, drive, streams: list, meetings: int) -> list:
    """`drive(streams[i], i)` for i = 0, 1 in two threads on one model; returns their results in order. For the
    first `meetings` attention calls of each thread (one per layer and forward) the threads meet at a barrier
    between the layer's cache write and its attention, so each reads the shared model while the other has just
    written its own cache. An exception in a thread is re-raised here; a hung thread fails the test."""
    barrier = threading.Barrier(2, timeout=60)
    local, claim = threading.local(), hermes.attention.claim_update

    def claim_after_both_wrote(key):
        local.met = getattr(local, "met", 0) + 1
        if local.met <= meetings:
            barrier.wait()
        return claim(key)

    monkeypatch.setattr(hermes.attention, "claim_update", claim_after_both_wrote)
    results, errors = [None, None], []

    def run(index):
        try:
            results[index] = drive(streams[index], index)
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results
