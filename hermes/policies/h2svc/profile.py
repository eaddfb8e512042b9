"""Offline routing of H2SVC heads (docs/h2svc.md §2): `profile_heads` runs sample clips through the model with a full
cache and returns the `HeadProfile` whose head map `save_head_map` writes (`hermes.policies.h2svc.head_map`).

A clip runs as the stream lays it out: the system prefix, the frames chunk by chunk, then each question alone
after the whole clip. The attention and its reduction to TAD sums are `hermes.policies.h2svc.tad`; the command line,
`hermes-profile`, is `hermes.profile_cli`. Usage, the clip layout and the text queries of T2V:
docs/cli.md#profiling-heads-for-h2svc.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Iterator, Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

from hermes.window import cache_kv_heads, cache_layers
from hermes.models import family_of
from hermes_kernels.engine.checks import check_positive_int
from hermes_kernels.policies.h2svc.config import class_counts
from hermes_kernels.policies.h2svc.reference import classify_heads, head_scores

from .head_map import HeadProfile
from .tad import Queries, TADSums, profiling_attention

DEFAULT_QUESTIONS = ("What is happening in the video?",)
TEXT_QUERIES = ("the tokens of family.question_text(question) after the whole clip, plus up to answer_tokens greedy "
                "answer tokens fed back; T2V is the mean over questions")


# ---------------------------------------------------------------------------------------------------------------
# clips
# ---------------------------------------------------------------------------------------------------------------

class _Clip:
    """One sample clip: frames already sampled, uint8 [F, H, W, 3] RGB, or a clip object that samples its own (a
    `name`, `duration` in seconds or None, and `chunks(fps, chunk_frames)` yielding uint8 [F, H, W, 3] arrays:
    `hermes.video.VideoClip` for a video file)."""

    def __init__(self, source):
        self.source = source

    @property
    def name(self) -> str:
        if isinstance(self.source, np.ndarray):
            return f"array{list(self.source.shape)}"
        return str(self.source.name)

    def expected_chunks(self, fps: float, chunk_frames: int, max_frames: int | None) -> int | None:
        """Chunks the progress bar expects (from a clip's duration; None when it has none)."""
        if isinstance(self.source, np.ndarray):
            frames = self.source.shape[0]
        elif self.source.duration is None:
            return None
        else:
            frames = int(self.source.duration * fps) + 1
        if max_frames is not None:
            frames = min(frames, max_frames)
        return -(-frames // chunk_frames)

    def chunks(self, fps: float, chunk_frames: int, max_frames: int | None) -> Iterator[np.ndarray]:
        """uint8 [F, H, W, 3] chunks of at most chunk_frames frames, max_frames in all (None: every frame)."""
        left = math.inf if max_frames is None else max_frames
        if isinstance(self.source, np.ndarray):
            frames = self.source[:int(min(left, len(self.source)))]
            for start in range(0, len(frames), chunk_frames):
                yield frames[start:start + chunk_frames]
            return
        for frames in self.source.chunks(fps, chunk_frames):
            if left <= 0:
                return
            frames = frames[:int(min(left, len(frames)))]
            left -= len(frames)
            yield frames


def check_settings(*, fps, chunk_frames, questions, instant_ratio, short_ratio, max_frames=None, answer_tokens=0,
                   query_block=None) -> tuple[float, tuple[str, ...]]:
    """The settings of `profile_heads`, before any clip is read: ValueError naming the argument. Returns (fps,
    questions)."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps: expected a positive finite number, got {fps!r}")
    for name, value in (("chunk_frames", chunk_frames), ("max_frames", max_frames), ("query_block", query_block)):
        check_positive_int(name, value, allow_none=name != "chunk_frames")
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 0:
        raise ValueError(f"answer_tokens: expected an int >= 0, got {answer_tokens!r}")
    if isinstance(questions, str):
        questions = (questions,)
    if not isinstance(questions, Sequence) or not questions or \
            any(not isinstance(q, str) or not q.strip() for q in questions):
        raise ValueError(f"questions: expected one or more non-empty strings, got {questions!r}")
    class_counts(1, instant_ratio, short_ratio)  # the ratios alone: each in [0, 1], sum <= 1
    return float(fps), tuple(q.strip() for q in questions)


def check_inputs(videos, **settings) -> tuple[list[_Clip], float, tuple[str, ...]]:
    """Validate `profile_heads`' arguments before any model work: the settings (`check_settings`), then the clips:
    frame arrays uint8 [F >= 1, H, W, 3] or clip objects (`hermes.video.VideoClip` for a file, which checked its
    file when made). ValueError / TypeError naming the argument. Returns (clips, fps, questions)."""
    if isinstance(videos, np.ndarray) or hasattr(videos, "chunks"):
        videos = [videos]
    if isinstance(videos, (str, os.PathLike)) or not isinstance(videos, Sequence) or not videos:
        raise ValueError(f"videos: expected frame arrays or clips, got {videos!r}")
    fps, questions = check_settings(**settings)
    clips = []
    for video in videos:
        if isinstance(video, np.ndarray):
            if video.dtype != np.uint8 or video.ndim != 4 or video.shape[0] < 1 or video.shape[3] != 3:
                raise ValueError(f"videos: expected frame arrays uint8 [F >= 1, H, W, 3], got {video.dtype} "
                                 f"{list(video.shape)}")
        elif not all(hasattr(video, name) for name in ("name", "duration", "chunks")):
            hint = " (a video file: hermes.video.VideoClip(path))" if isinstance(video, (str, os.PathLike)) else ""
            raise TypeError(f"videos: expected a uint8 [F, H, W, 3] array or a clip{hint}, got "
                            f"{type(video).__name__}")
        clips.append(_Clip(video))
    return clips, fps, questions


class _Positions:
    """Positions of one clip as the stream lays them out: every segment starts at the largest position so far + 1
    (docs/hermes.md §2.7); a video chunk adds the family's relative offsets, text counts 0, 1, … on every axis."""

    def __init__(self, mrope: bool):
        self.mrope = mrope
        self.next = 0

    def take(self, count: int, rel: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """position_ids [1, count] (1D) or [3, 1, count] (M-RoPE) of the next segment."""
        if rel is None:
            rel = torch.arange(count, device=device)
            rel = rel.expand(3, count) if self.mrope else rel
        ids = self.next + rel.to(device)
        self.next = int(ids.max()) + 1
        return ids[:, None] if self.mrope else ids[None]


def _profile_clip(model, processor, family, clip: _Clip, sums: TADSums, *, fps: float, chunk_frames: int,
                  max_frames: int | None, questions: tuple[str, ...], answer_tokens: int, prefix_ids: list[int],
                  bar) -> dict:
    """Run one clip (prefix, chunks, then each question alone) and return its record with per-KV-head
    tad_v2v / tad_t2v float64 [L, Hkv] tensors (docs/cli.md#profiling-heads-for-h2svc)."""
    language_model = family.language_model(model)
    tokenizer = getattr(processor, "tokenizer", processor)
    embed = model.get_input_embeddings()
    device = embed.weight.device
    cache = DynamicCache(config=model.config)  # a hybrid model's linear-attention layers get their states
    layout = family.rotary(model)[1]
    positions = _Positions(mrope=layout is not None and layout.num_axes == 3)  # a 1D layout may be partial

    def forward(inputs: dict, rel: torch.Tensor | None = None, blocks: torch.Tensor | None = None,
                **extra) -> torch.Tensor:
        count = next(iter(inputs.values())).shape[1]
        ids = positions.take(count, rel, device)
        return language_model(**inputs, position_ids=ids, cache=cache, use_cache=True, h2svc_sums=sums,
                              h2svc_blocks=blocks, **extra).last_hidden_state

    def text(ids: list[int]) -> dict:
        # token ids, not their embeddings: a model with per-layer inputs (Gemma 4) computes them from the ids
        return {"input_ids": torch.tensor([ids], device=device)}

    sums.queries = None
    forward(text(prefix_ids))
    P, n, T_f, sampled = len(prefix_ids), 0, None, 0
    for frames in clip.chunks(fps, chunk_frames, max_frames):
        inputs = family.prepare_frames(processor, frames, fps, start=sampled / fps)
        count = family.memory_frames(inputs)
        chunk = family.encode_video(model, processor, inputs.pop("video"), 1, **inputs)
        tokens = chunk.embeds.shape[1]
        if tokens % count or (T_f is not None and tokens // count != T_f):
            raise ValueError(f"video: {clip.name}: a chunk of {count} frames gave {tokens} tokens; every frame of a "
                             f"clip must have the same token count (tokens per frame so far: {T_f})")
        T_f = tokens // count
        query_frames = n + torch.arange(tokens, device=chunk.embeds.device) // T_f
        sums.queries = Queries(P, n + count, T_f, query_frames)
        # Qwen3-VL: DeepStack; Gemma 4: per-layer inputs, and vision blocks for its sliding-window layers' masks
        forward({"inputs_embeds": chunk.embeds}, chunk.rel_positions, chunk.blocks, **chunk.lm_kwargs())
        n += count
        sampled += len(frames)
        bar.update()
    if n == 0:
        raise ValueError(f"video: {clip.name}: no frames sampled at {fps:g} fps")
    v2v = sums.take("v2v") / (n * T_f)

    video_length, video_next = cache.get_seq_length(), positions.next
    video_states = _uncroppable(cache)
    lm_head = model.get_output_embeddings()
    eos = tokenizer.eos_token_id
    t2v, text_queries = [], 0
    for question in questions:
        sums.queries = Queries(P, n, T_f, None)
        ids = list(tokenizer(family.question_text(question), add_special_tokens=False)["input_ids"])
        hidden, count = forward(text(ids)), len(ids)
        for _ in range(answer_tokens):  # greedy answer tokens, each fed back as one more text query
            token = int(lm_head(hidden[:, -1]).argmax(dim=-1))
            if token == eos:
                break
            hidden = forward(text([token]))
            count += 1
        t2v.append(sums.take("t2v") / count)
        text_queries += count
        _back_to_video(cache, video_length, video_states)
        positions.next = video_next

    num_kv_heads = cache_kv_heads(model.config)
    return {"source": clip.name, "frames": sampled, "memory_frames": n, "tokens_per_frame": T_f,
            "text_queries": text_queries, "tad_v2v": _per_kv_head(v2v, num_kv_heads),
            "tad_t2v": _per_kv_head(torch.stack(t2v).mean(dim=0), num_kv_heads)}


def _uncroppable(cache: DynamicCache) -> dict[int, tuple]:
    """Clones of what a crop cannot take back, by decoder layer: a hybrid model's linear-attention states (conv,
    recurrent), a sliding-window layer's window (keys, values and the count of tokens it has seen); {} without."""
    states = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
        elif getattr(layer, "is_sliding", False) and layer.is_initialized:
            states[i] = (layer.keys.clone(), layer.values.clone(), layer.cumulative_length)
    return states


def _back_to_video(cache: DynamicCache, video_length: int, states: dict) -> None:
    """Drop a question and its answer: the attention layers' keys cropped back to `video_length`, the states a crop
    cannot take back (`_uncroppable`) put back from `states` (a KV-shared layer's DummyLayer holds nothing)."""
    for i, layer in enumerate(cache.layers):
        if i in states and isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.conv_states[0].copy_(states[i][0])
            layer.recurrent_states[0].copy_(states[i][1])
        elif i in states:
            layer.keys, layer.values = states[i][0].clone(), states[i][1].clone()
            layer.cumulative_length = states[i][2]
        elif not isinstance(layer, DummyLayer):  # transformers 5: a negative count drops that many
            layer.crop(video_length - layer.get_seq_length())


def _per_kv_head(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[L, H] -> [L, Hkv]: the mean over each KV head's GQA group of consecutive query heads."""
    return per_query_head.unflatten(1, (num_kv_heads, -1)).mean(dim=2)


# ---------------------------------------------------------------------------------------------------------------
# the profiler
# ---------------------------------------------------------------------------------------------------------------

def profile_heads(model: torch.nn.Module, processor, videos, *, fps: float = 1.0, chunk_frames: int = 16,
                  questions: str | Sequence[str] = DEFAULT_QUESTIONS, instant_ratio: float = 0.1,
                  short_ratio: float = 0.4, max_frames: int | None = None, answer_tokens: int = 0,
                  system_prompt: str | None = None, query_block: int | None = None,
                  progress: bool = True) -> HeadProfile:
    """Profile the heads of a loaded LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL or Qwen3.5 model on sample clips and route
    them (docs/h2svc.md §2; the clip layout, the streamed reduction and the text queries:
    docs/cli.md#profiling-heads-for-h2svc).

    model, processor: as for HermesStream (`hermes.commands.load_model` gives both); the model in eval mode.
    videos:        clips: frames already sampled, uint8 [F, H, W, 3] RGB arrays, and/or clip objects that sample
                   their own at `fps` (`hermes.video.VideoClip(path)` decodes a file with PyAV, by timestamp).
    fps:           frames sampled per second of video (also Qwen2.5-VL's seconds per temporal grid step).
    chunk_frames:  frames per forward, as the stream's chunks (the last chunk of a clip may be shorter).
    questions:     asked, each alone, after every clip (T2V's text queries); default DEFAULT_QUESTIONS.
    instant_ratio, short_ratio: class shares for `classify_heads` (docs/h2svc.md §2; episodic gets the rest).
    max_frames:    at most this many sampled frames per clip (None: the whole clip).
    answer_tokens: greedy answer tokens fed back as further text queries (0: the question tokens only).
    system_prompt: text of the prefix's system turn (default: the family's, as the stream).
    query_block:   query rows per attention block (None: as many as fit BLOCK_BYTES of float32 probabilities).
    progress:      a tqdm bar on stderr over the chunks of all clips.

    Returns a HeadProfile: head_map int64 [L, Hkv], v2v / t2v / scores float64 [L, Hkv] (means over clips), the
    clips with their own metrics, the settings. Bad arguments raise ValueError/TypeError before any forward.
    """
    from tqdm import tqdm

    family = family_of(model)
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer is None or not callable(tokenizer):
        raise TypeError(f"processor: expected the model's processor or a tokenizer, got {type(processor).__name__}")
    clips, fps, questions = check_inputs(videos, fps=fps, chunk_frames=chunk_frames, questions=questions,
                                         instant_ratio=instant_ratio, short_ratio=short_ratio,
                                         max_frames=max_frames, answer_tokens=answer_tokens,
                                         query_block=query_block)
    text_config = model.config.get_text_config()
    # only the layers the caches hold are routed: a hybrid model's full-attention layers, Gemma 4's full-attention
    # layers that compute keys (its sliding-window and KV-shared layers run as the model runs them, unprofiled)
    decoder_layers = cache_layers(model.config)
    num_layers = len(decoder_layers)
    num_heads, num_kv_heads = text_config.num_attention_heads, cache_kv_heads(model.config)
    class_counts(num_layers * num_kv_heads, instant_ratio, short_ratio)
    if model.training:
        raise ValueError("model: in training mode; call model.eval() first (the profile runs without dropout)")
    prefix_ids = list(tokenizer(family.prefix_text(system_prompt), add_special_tokens=False)["input_ids"])

    expected = [clip.expected_chunks(fps, chunk_frames, max_frames) for clip in clips]
    total = None if None in expected else sum(expected)
    records = []
    bar = tqdm(total=total, unit="chunk", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        with torch.no_grad(), profiling_attention(model):
            for index, clip in enumerate(clips):
                bar.set_description(f"clip {index + 1}/{len(clips)}")
                sums = TADSums(num_layers, query_block, decoder_layers=decoder_layers)
                records.append(_profile_clip(
                    model, processor, family, clip, sums, fps=fps, chunk_frames=chunk_frames, max_frames=max_frames,
                    questions=questions, answer_tokens=answer_tokens, prefix_ids=prefix_ids, bar=bar))
    finally:
        bar.close()

    v2v = torch.stack([r["tad_v2v"] for r in records]).mean(dim=0)
    t2v = torch.stack([r["tad_t2v"] for r in records]).mean(dim=0)
    scores = head_scores(v2v, t2v)
    for record in records:  # JSON-ready
        record["tad_v2v"], record["tad_t2v"] = record["tad_v2v"].tolist(), record["tad_t2v"].tolist()
    settings = {"fps": fps, "chunk_frames": chunk_frames, "max_frames": max_frames, "questions": list(questions),
                "answer_tokens": answer_tokens, "system_prompt": system_prompt,
                "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "text_queries": TEXT_QUERIES}
    return HeadProfile(model_name=getattr(model.config, "name_or_path", "") or "", model_type=model.config.model_type,
                       num_layers=num_layers, num_kv_heads=num_kv_heads, num_heads=num_heads,
                       instant_ratio=instant_ratio, short_ratio=short_ratio,
                       head_map=classify_heads(scores, instant_ratio, short_ratio), v2v=v2v, t2v=t2v, scores=scores,
                       clips=records, settings=settings)


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------
