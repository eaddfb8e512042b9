"""`python -m bench.live`: a live session on a tiny model in real time, and what the real widths sustain on this CPU.

Measured: `LiveSession` over a tiny model (scaffolding.models) fed by a real-time source at 1, 2 and 4 fps, both
policies: the real-time factor and the lag percentiles of each run, and the same at 1 fps with every chunk slowed on
purpose (drops and bounded lag), drawn as lag over video time to a PNG.
Modelled: the highest frame rate each policy sustains at the widths of LLaVA-OV-0.5B and Qwen2.5-VL-3B, from the
per-chunk CPU costs `bench.stream_cost real` recorded (RECORDED, cited from RECORD) or `--measure` times again, beside
the uncompressed stream's, whose cost grows with the cache: the model and its assumptions are printed with the
table and explained in docs/benchmarks.md#live.

`SyntheticSource` (generated frames, no file or network) and `SimClock` (a wall clock that skips idle waits) are
reused by `python -m bench.soak --live` and the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fractions
import math
import os
import shlex
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hermes.live import ChunkDone, FramesDropped, LiveFrame, LiveSession, SourceEnded
from hermes.live.sources import QUEUED
from hermes.models import family_of
from hermes.models.processing import Processor
from hermes.stream import HermesStream
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl, tiny_qwen3_5
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer

from bench.report import commit_hash, device_name
from bench.widths import REAL_WIDTHS, RealWidth

# ---- tiny sessions --------------------------------------------------------------------------------------------------
FAMILIES = ("llava_ov", "qwen2_5_vl", "qwen3_5")  # the tiny models (scaffolding.models) of bench.live and bench.soak
BUILDERS = {"llava_ov": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_5": tiny_qwen3_5}
MODEL_TYPES = {"llava_ov": "llava_onevision", "qwen2_5_vl": "qwen2_5_vl", "qwen3_5": "qwen3_5"}
POLICIES = ("hermes", "h2svc")
CAMERA = (48, 64)  # (height, width) of the generated frames before the processor's resize
CHUNK_FRAMES = 4  # frames per chunk, as in the recorded real-width costs
# tiny sizes at which both policies step within a few chunks: HERMES compresses from the second or third chunk, every
# H2SVC class evicts from its ninth frame on
TINY_POLICY_ARGS = {"hermes": dict(budget=64), "h2svc": dict(instant_frames=2, short_frames=4, episodic_frames=8)}


@contextlib.contextmanager
def default_head_map():
    """Streams built inside do not warn that H2SVC's head map is the unprofiled default: random weights have no
    profile, and the default map is what these benchmarks measure."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="head_map: not profiled")
        yield


def tiny_stream(family: str, policy: str, max_positions: int = 4096, **policy_args) -> HermesStream:
    """A stream of batch 1 over the tiny `family` model (random weights) with its processor's torchvision-free twin,
    chunks of CHUNK_FRAMES frames of what the processor keeps of a CAMERA frame, 160 slots of room, lazy re-indexing
    from max_positions - max_positions / 4 on. `policy_args` override TINY_POLICY_ARGS[policy]."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    model = BUILDERS[family](max_positions=max_positions)
    model_type = MODEL_TYPES[family]
    twin = family_of(model).pil_video_processor(tiny_image_processor(model_type),
                                                tiny_video_processor_config(model_type))
    processor = Processor(tokenizer=tiny_tokenizer(digits=family == "qwen3_5"), video_processor=twin)
    frame_size = family_of(model).kept_size(processor, *CAMERA)
    args = dict(TINY_POLICY_ARGS[policy], margin=max_positions // 4, **policy_args)
    with default_head_map():
        return HermesStream(model, processor, policy=policy, chunk_frames=CHUNK_FRAMES, frame_size=frame_size,
                            room=160, **args)


# ---- a synthetic live source ----------------------------------------------------------------------------------------
def pattern(index: int, size: tuple[int, int]) -> np.ndarray:
    """Generated frame `index`: uint8 [H, W, 3] RGB, a gradient whose colour drifts with the index and a white square
    that moves with it, so that consecutive frames differ (H2SVC's curvature sees motion)."""
    height, width = size
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[..., 0] = (np.arange(width) * 255 // max(width - 1, 1) + 5 * index) % 256
    image[..., 1] = (np.arange(height)[:, None] * 255 // max(height - 1, 1) + 3 * index) % 256
    image[..., 2] = (7 * index) % 256
    side = max(1, min(height, width) // 4)
    top, left = (index * 2) % (height - side + 1), (index * 3) % (width - side + 1)
    image[top:top + side, left:left + side] = 255
    return image


class SimClock:
    """Simulated wall seconds for a session run faster than real time. Real time that passes while the process works
    counts `scale` times (scale 1: the model as fast as it runs here; 100: a model a hundred times slower); a wait for
    the next frame skips ahead at once (`wait_until`), so idle time costs nothing. Give it to the session as its
    `clock` and to the source; any thread may read it."""

    def __init__(self, scale: float = 1.0, start: float = 0.0):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
            raise ValueError(f"scale: expected a positive number, got {scale!r}")
        self.scale, self._now, self._real = float(scale), float(start), time.perf_counter()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._advance()

    def wait_until(self, when: float) -> None:
        """Skip ahead to simulated second `when` (nothing happens if it has passed)."""
        with self._lock:
            self._now = max(self._advance(), when)

    def sleep(self, seconds: float) -> None:
        """Skip `seconds` ahead: work that takes that long in simulated time and no time here."""
        with self._lock:
            self._now = self._advance() + seconds

    def _advance(self) -> float:
        real = time.perf_counter()
        self._now += (real - self._real) * self.scale
        self._real = real
        return self._now


class SyntheticSource:
    """A `LiveSource` (hermes.live.frames) of `seconds` of generated video (`pattern`) sampled at `fps`, paced like a
    camera: sample k is due `k / fps` seconds after the source was made and `arrived` is stamped with that moment, as
    a reader thread would stamp it when sampling. No thread runs: `get` hands out what is due by now.

    clock:      None: real time (time.monotonic, the session's default clock), `get` sleeps until the next frame;
                a `SimClock`: its time, `get` skips ahead to the next frame (give the session the same clock).
    frame_size: (height, width) of every frame's pixels.
    Like `hermes.live.open_source`'s sources it holds at most QUEUED frames due and not taken (past that the oldest
    is dropped and counted as "overflow"), ends with "end of stream" after its last frame, and with "closed" once
    closed. Not thread-safe: one consumer.
    """

    def __init__(self, fps: float, frame_size: tuple[int, int], seconds: float, clock: SimClock | None = None):
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (0 < fps < math.inf):
            raise ValueError(f"fps: expected a positive number, got {fps!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
            raise ValueError(f"seconds: expected a positive number, got {seconds!r}")
        self.fps, self.frame_size = float(fps), tuple(frame_size)
        self.frames = math.ceil(seconds * self.fps)  # samples at 0, 1/fps, ... below `seconds`
        self._clock = time.monotonic if clock is None else clock
        self._wait_until = self._sleep_until if clock is None else clock.wait_until
        self._closed = threading.Event()
        self._start = self._clock()
        self._next = self._overflow = 0

    def due(self, index: int) -> float:
        """Clock reading at which sample `index` is taken."""
        return self._start + index / self.fps

    def get(self, timeout: float | None = None) -> LiveFrame | None:
        """The oldest frame due and not taken; waits up to `timeout` seconds for the next one (None: until it is due),
        else returns None. SourceEnded after the last frame, or once closed."""
        if self._closed.is_set():
            raise SourceEnded("closed")
        if self._next >= self.frames:
            raise SourceEnded("end of stream")
        now = self._clock()
        if self.due(self._next) > now:
            if timeout is not None and self.due(self._next) - now > timeout:
                self._wait_until(now + timeout)
                return None
            self._wait_until(self.due(self._next))
            if self._closed.is_set():  # closed while it waited
                raise SourceEnded("closed")
            now = max(now, self.due(self._next))
        # frames due by now beyond QUEUED: a reader thread would have dropped the oldest
        due = min(self.frames, math.floor((now - self._start) * self.fps) + 1)
        if due - self._next > QUEUED:
            self._overflow += due - QUEUED - self._next
            self._next = due - QUEUED
        index, self._next = self._next, self._next + 1
        return LiveFrame(index=index, time=index / self.fps, pixels=pattern(index, self.frame_size),
                         arrived=self.due(index))

    def stats(self) -> dict:
        """Counters so far: frames "decoded" and "sampled" (handed out or dropped), "corrupt_packets" and
        "reconnects" (0), "overflow"."""
        return {"decoded": self._next, "sampled": self._next, "corrupt_packets": 0, "reconnects": 0,
                "overflow": self._overflow}

    def close(self) -> None:
        """End the source; a real-time wait in another thread returns at once. Idempotent."""
        self._closed.set()

    def _sleep_until(self, when: float) -> None:
        self._closed.wait(max(0.0, when - time.monotonic()))


def write_clip(path: Path, seconds: float, rate: int = 8, size: tuple[int, int] = CAMERA) -> Path:
    """An MPEG-4 file of `seconds` of `pattern` frames at `rate` frames per second, `size` = (height, width)."""
    import av  # the live sources' decoder; only the file source needs it here

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width, stream.pix_fmt = *size, "yuv420p"
        for index in range(math.ceil(seconds * rate)):
            frame = av.VideoFrame.from_ndarray(pattern(index, size), format="rgb24")
            frame.pts, frame.time_base = index, fractions.Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ---- one real-time run ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LiveRun:
    """One session: its settings, the chunks and drops it reported, and its summary (LiveSession.summary).

    slow:    seconds each chunk was made to take on top of its own work (a sleep in append_video, so in prefill_ms).
    chunks:  (end in video s, lag s) of every chunk; drops: video s of every dropped frame; overflow: frames the
             source's queue dropped (QUEUED).
    """

    family: str
    policy: str
    fps: float
    seconds: float
    slow: float
    max_lag: float
    chunks: list[tuple[float, float]]
    drops: list[float]
    overflow: int
    summary: dict

    def line(self) -> str:
        s, lag = self.summary, self.summary["lag"]
        stage = " ".join(f"{s[name]['p50']:6.1f}" if s[name]["p50"] is not None else "   n/a"
                         for name in ("decode_ms", "vision_ms", "prefill_ms", "compression_ms"))
        return (f"{self.family:10s} {self.policy:6s} {self.fps:4g} {self.slow:5g} | {s['video_seconds']:6.1f} "
                f"{s['wall_seconds']:6.1f} {s['realtime_factor']:5.3f} | {s['chunks']:4d} {s['dropped']:4d} "
                f"{self.overflow:4d} | {lag['p50']:6.3f} {lag['p99']:6.3f} {lag['max']:6.3f} | {stage}")


RUN_HEADER = ("family     policy  fps  slow | video   wall   RTF   | chunk drop ovfl | lag p50  p99    max   | "
              "p50 ms: decode vision prefill compress")


def slowed(stream: HermesStream, seconds: float, sleep: Callable[[float], None] = time.sleep) -> HermesStream:
    """`stream` with every append_video taking `seconds` longer (`sleep` after it; a SimClock's sleep for simulated
    time): a model slowed on purpose. The session books the time to prefill_ms (the rest of append_video)."""
    append = stream.append_video

    def slow_append(*args, **kwargs):
        result = append(*args, **kwargs)
        sleep(seconds)
        return result

    stream.append_video = slow_append
    return stream


def live_run(family: str, policy: str, fps: float, seconds: float, *, slow: float = 0.0, clip: Path | None = None,
             stream: HermesStream | None = None) -> LiveRun:
    """Play `seconds` of video at `fps` in real time into a tiny `family` stream (`tiny_stream`, or `stream`) through
    a `LiveSession` with its defaults (max_lag one chunk), every chunk `slow` seconds slower; the source is `clip`
    played at its own speed (open_source(..., live=False, realtime=True)) or, None, a real-time `SyntheticSource`."""
    stream = stream or tiny_stream(family, policy)
    if slow:
        slowed(stream, slow)
    if clip is None:
        source = SyntheticSource(fps, stream.frame_size, seconds)
    else:
        from hermes.live import open_source
        source = open_source(str(clip), live=False, fps=fps, realtime=True,
                             keep=stream.family.kept_size(stream.processor, *CAMERA))
    session = LiveSession(stream, source, chunk_frames=CHUNK_FRAMES)
    chunks, drops = [], []
    for event in session.run():
        if isinstance(event, ChunkDone):
            chunks.append((event.end, event.lag))
        elif isinstance(event, FramesDropped):
            drops.extend(event.times)
    return LiveRun(family, policy, float(fps), float(seconds), float(slow), session.max_lag, chunks, drops,
                   source.stats()["overflow"], session.summary())


# ---- the sustain model ----------------------------------------------------------------------------------------------
RECORD = "bench/results/2026-12-01-cpu-stream-cost-real-widths.md"


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    """CPU milliseconds (one thread) of one chunk of `frames` video frames (`chunk_tokens` tokens) at a real width,
    HERMES at budget 6000, each the fastest of a few chunks.

    cache:     tokens cached before the timed chunk (prefix + budget).
    alone_ms:  the chunk's prefill alone: vision tower + language model, no guidance, no compression;
    vision_ms: the vision tower's part of it.
    hermes_ms: the whole HERMES append_video (prefill with the guidance prompts fused, then compression).
    h2svc_ms:  the whole H2SVC append_video with every class memory full; None where not measured.
    short:     (cache tokens, alone_ms) at a short cache (after the first chunk); None where not measured.
    origin:    where the numbers come from.
    """

    width: str
    frames: int
    chunk_tokens: int
    cache: int
    alone_ms: float
    vision_ms: float
    hermes_ms: float
    h2svc_ms: float | None = None
    short: tuple[int, float] | None = None
    origin: str = RECORD


# the lines of RECORD: "prefill alone" (vision), "fused ... =" total, cache before the chunk, chunk tokens
RECORDED = {
    "llava-ov-0.5b": ChunkCost("llava-ov-0.5b", frames=4, chunk_tokens=784, cache=6014, alone_ms=8155.17,
                               vision_ms=5311.67, hermes_ms=8898.95),
    "qwen2.5-vl-3b": ChunkCost("qwen2.5-vl-3b", frames=4, chunk_tokens=392, cache=6015, alone_ms=12322.50,
                               vision_ms=4732.49, hermes_ms=13405.58),
}
PRESETS = {"llava-ov-0.5b": "llava_ov", "qwen2.5-vl-3b": "qwen2_5_vl"}  # H2SVCConfig preset of each width
TOKENS_PER_FRAME = 196  # tokens of one H2SVC frame at both widths (bench/widths.py)
BUDGET = 6000


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The language model's sizes the cost model reads: layers, hidden width, query and KV heads, head dim, MLP."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int

    @classmethod
    def of(cls, width: RealWidth) -> "Geometry":
        text = width.config().text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
                   head_dim, text.intermediate_size)

    def weight_flops(self) -> int:
        """FLOPs of one token through the decoder's weights: 2 per multiply-add of the q, k, v, o projections and
        the gated MLP's three matrices, every layer (norms, rotary and biases are elementwise: left out)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.mlp)

    def key_flops(self) -> int:
        """FLOPs one token spends on one cached key: q.k and p.v over every query head of every layer, 2 each."""
        return 4 * self.layers * self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-chunk CPU ms of one width: an uncompressed chunk costs `fixed_ms + per_token_ms * N` with N tokens cached
    before it (the chunk's attention over the cache grows with N; the vision tower, the weights and the chunk's
    attention to itself do not); HERMES costs `hermes_ms` whatever the video's length, H2SVC `h2svc_ms`.

    prefix:      tokens the cache holds before the first chunk; chunk_tokens, frames: one chunk's tokens and frames.
    slope:       how per_token_ms was found; h2svc: how h2svc_ms was found.
    """

    width: str
    fixed_ms: float
    per_token_ms: float
    prefix: int
    chunk_tokens: int
    frames: int
    hermes_ms: float
    h2svc_ms: float
    slope: str
    h2svc: str

    def uncompressed_ms(self, cached: int) -> float:
        """Modelled ms of an uncompressed chunk with `cached` tokens before it."""
        return self.fixed_ms + self.per_token_ms * cached

    def chunk_seconds(self, fps: float) -> float:
        """Seconds of video one chunk spans at `fps`: the time the model has for it."""
        return self.frames / fps

    def sustained_fps(self, cost_ms: float) -> float:
        """The highest frame rate at which a chunk costing `cost_ms` takes no longer than it lasts."""
        return self.frames / (cost_ms / 1e3)

    def behind_chunk(self, fps: float) -> int:
        """Index (from 0) of the first uncompressed chunk that costs more than it lasts at `fps`: the smallest k with
        fixed + per_token * (prefix + k * chunk_tokens) > 1e3 * frames / fps."""
        room = 1e3 * self.chunk_seconds(fps) - self.uncompressed_ms(self.prefix)
        if room < 0:
            return 0
        return math.floor(room / (self.per_token_ms * self.chunk_tokens)) + 1

    def behind_minute(self, fps: float) -> float:
        """Video minute at which the uncompressed stream falls behind at `fps`: the start of `behind_chunk`, when its
        cache holds that many minutes of video."""
        return self.behind_chunk(fps) * self.chunk_seconds(fps) / 60

    def uncompressed_fps(self, minutes: float) -> float:
        """The highest frame rate the uncompressed stream sustains over `minutes` of video: every whole chunk of
        the video costs no more than it lasts (bisection to 1e-4 fps; the condition only gets harder as fps grows)."""
        def keeps_up(fps: float) -> bool:
            chunks = math.floor(60 * minutes * fps / self.frames)
            return chunks <= self.behind_chunk(fps)

        low, high = 0.0, self.sustained_fps(self.uncompressed_ms(self.prefix))
        while high - low > 1e-4:
            middle = (low + high) / 2
            low, high = (middle, high) if keeps_up(middle) else (low, middle)
        return low


def h2svc_tokens(width: str, prefix: int) -> float:
    """Mean tokens one (layer, KV head) row of a full H2SVC cache holds: prefix + its class's window x 196, averaged
    over the rows of the width's preset with the default (unprofiled) head map."""
    from hermes_kernels.policies.h2svc.config import H2SVCConfig

    geometry = Geometry.of(REAL_WIDTHS[width])
    config = H2SVCConfig.preset(PRESETS[width], geometry.layers, geometry.kv_heads, prefix,
                                tokens_per_frame=TOKENS_PER_FRAME)
    counts = torch.bincount(config.head_classes.flatten(), minlength=3).tolist()
    frames = sum(count * window for count, window in zip(counts, config.windows)) / sum(counts)
    return prefix + frames * TOKENS_PER_FRAME


def cost_model(cost: ChunkCost) -> CostModel:
    """The model of one width from its chunk costs. per_token_ms: with a second measured point (`cost.short`), the
    slope of alone_ms between the two cache lengths; else the language model's measured ms (alone - vision) split by
    FLOPs: the share of its FLOPs that the chunk spends per cached key (Geometry.key_flops per token) among all of
    them (weights, plus the keys each token sees: the cache and, causally, (T + 1) / 2 of the chunk's own T), i.e.
    the assumption that attention runs at the weights' FLOP rate. fixed_ms = alone_ms - per_token_ms * cache.
    h2svc_ms: measured, else the uncompressed formula at the mean tokens an H2SVC row holds (`h2svc_tokens`; no
    guidance pass), its own step (features, STCE, moves) not included."""
    prefix = cost.cache - BUDGET
    if cost.short is not None:
        short_cache, short_ms = cost.short
        per_token = (cost.alone_ms - short_ms) / (cost.cache - short_cache)
        slope = (f"measured: prefill alone {short_ms:.0f} ms at {short_cache} cached tokens, {cost.alone_ms:.0f} ms "
                 f"at {cost.cache}")
    else:
        geometry = Geometry.of(REAL_WIDTHS[cost.width])
        keys = cost.cache + (cost.chunk_tokens + 1) / 2
        share = geometry.key_flops() / (geometry.weight_flops() + geometry.key_flops() * keys)
        per_token = (cost.alone_ms - cost.vision_ms) * share
        slope = (f"FLOP split of the LM's {cost.alone_ms - cost.vision_ms:.0f} ms: {geometry.key_flops()} FLOPs per "
                 f"token per cached key against {geometry.weight_flops()} in weights and "
                 f"{geometry.key_flops()} x {keys:.1f} keys seen")
    fixed = cost.alone_ms - per_token * cost.cache
    if cost.h2svc_ms is not None:
        h2svc_ms, h2svc = cost.h2svc_ms, "measured"
    else:
        tokens = h2svc_tokens(cost.width, prefix)
        h2svc_ms = fixed + per_token * tokens
        h2svc = f"modelled: uncompressed cost at its rows' mean {tokens:.0f} tokens, its step not included"
    return CostModel(cost.width, fixed, per_token, prefix, cost.chunk_tokens, cost.frames, cost.hermes_ms, h2svc_ms,
                     slope, h2svc)


def sustain_report(models: list[CostModel], fps_list: tuple[float, ...], minutes: tuple[float, ...]) -> list[str]:
    """The table of the highest sustained frame rates per width and policy, the uncompressed stream's for videos of
    `minutes`, and the video minute at which it falls behind at each fps of `fps_list`."""
    head = " | ".join(f"unc. {m:g} min" for m in minutes)
    lines = [f"{'width':14s} | HERMES fps | H2SVC fps | {head}"]
    for model in models:
        rates = " | ".join(f"{model.uncompressed_fps(m):{len(f'unc. {m:g} min')}.3f}" for m in minutes)
        lines.append(f"{model.width:14s} | {model.sustained_fps(model.hermes_ms):10.3f} | "
                     f"{model.sustained_fps(model.h2svc_ms):9.3f} | {rates}")
    lines += ["", "uncompressed: video minute at which a chunk costs more than it lasts (0: from the first chunk)",
              f"{'width':14s} | " + " | ".join(f"{fps:>7g} fps" for fps in fps_list)]
    for model in models:
        lines.append(f"{model.width:14s} | " + " | ".join(f"{model.behind_minute(fps):11.1f}" for fps in fps_list))
    return lines


# ---- --measure ------------------------------------------------------------------------------------------------------
def measure(width: RealWidth, *, budget: int = BUDGET, frames: int = CHUNK_FRAMES, steps: int = 3,
            clock: Callable[[], float] = time.process_time) -> ChunkCost:
    """Time one width's chunks as `bench.stream_cost real` does (random weights, the tiny tokenizer, `clock` = the
    process's CPU time): the prefill alone after the first chunk and once HERMES compresses at `budget`, the whole
    HERMES append_video then, and the whole H2SVC append_video once its episodic memory is full; each the fastest of
    `steps` chunks. Minutes at the real widths."""
    from hermes.cache import prefill

    generator = torch.Generator().manual_seed(0)
    model = width.build()
    extra = {} if width.frame_size is None else {"frame_size": width.frame_size}
    room = 2 * TOKENS_PER_FRAME * frames

    def chunk() -> dict:
        return width.frames(frames, generator)

    def alone(stream: HermesStream) -> tuple[float, float]:
        length, inputs = stream.cache.length, chunk()
        began = clock()
        with torch.no_grad():
            encoded = stream.family.encode_video(stream.model, None, **inputs, batch_size=1)
            vision = clock() - began
            prefill(stream.language_model, stream.cache, encoded)
        spent = clock() - began
        stream.cache.truncate(length)
        return 1e3 * spent, 1e3 * vision

    def appended(stream: HermesStream) -> float:
        inputs = chunk()
        began = clock()
        stream.append_video(**inputs)
        return 1e3 * (clock() - began)

    hermes = HermesStream(model, tiny_tokenizer(), budget=budget, chunk_frames=frames, room=room, **extra)
    hermes.append_video(**chunk())
    short = (hermes.cache.length, min(alone(hermes)[0] for _ in range(steps)))
    while hermes.last_step is None:
        hermes.append_video(**chunk())
    cache = hermes.cache.length
    alone_ms, vision_ms = min(alone(hermes) for _ in range(steps))
    hermes_ms = min(appended(hermes) for _ in range(steps))
    chunk_tokens = hermes.chunk_tokens
    del hermes
    with default_head_map():
        h2svc = HermesStream(model, tiny_tokenizer(), policy="h2svc", chunk_frames=frames, room=room, **extra)
    full = h2svc.policy.cfg.episodic_frames * h2svc.family.step_frames(model)  # video frames that fill it
    for _ in range(math.ceil(full / frames) + 1):
        h2svc.append_video(**chunk())
    h2svc_ms = min(appended(h2svc) for _ in range(steps))
    return ChunkCost(width.name, frames, chunk_tokens, cache, alone_ms, vision_ms, hermes_ms, h2svc_ms, short,
                     origin=f"measured by this run ({clock.__name__}, fastest of {steps})")


# ---- the picture ----------------------------------------------------------------------------------------------------
def plot_lag(panels: dict[str, list[LiveRun]], path: Path, title: str) -> Path | None:
    """Lag per chunk against video time, one panel per entry of `panels` ({panel title: runs}), a line per run
    (policy), its dropped frames marked as a row of crosses just above the time axis (a row per run, so that equal
    drops of two runs both show); in a panel of slowed runs max_lag and max_lag + slow dashed (a panel of runs that
    keep up is scaled to their lags instead). Writes `path`; None (with a printed note) without matplotlib, imported
    here only."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; skipping the PNG")
        return None
    colours = {"hermes": "#1e88e5", "h2svc": "#e53935"}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], panels.items()):
        bounds = {}
        for run in runs:
            if run.slow:
                bounds.update({run.max_lag: "max_lag", run.max_lag + run.slow: "max_lag + slow"})
        top = max([lag for run in runs for _, lag in run.chunks] + list(bounds))
        for row, run in enumerate(runs):
            colour = colours.get(run.policy)
            ends, lags = zip(*run.chunks) if run.chunks else ((), ())
            ax.plot(ends, lags, "o-", color=colour, markersize=4, label=f"{run.policy}: lag of each chunk")
            if run.drops:
                ax.plot(run.drops, [(row + 1) * 0.04 * top] * len(run.drops), "x", color=colour, markersize=7,
                        label=f"{run.policy}: {len(run.drops)} frames dropped (at their video time)")
        for value, label in bounds.items():
            ax.axhline(value, color="black", linestyle="--", linewidth=0.8)
            ax.annotate(f"{label} {value:g} s", (0.01, value), xycoords=("axes fraction", "data"), fontsize=8,
                        va="bottom")
        ax.set_ylim(0.0, 1.3 * top)  # room for the legend above the lines
        ax.set_xlabel("video time (s) at the end of the chunk")
        ax.set_ylabel("lag (s) since its last frame arrived")
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- the command ----------------------------------------------------------------------------------------------------
def load() -> str:
    """The host's 1-minute load average, or "n/a"."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def measured_part(args) -> dict[tuple[float, float, str], LiveRun]:
    """The real-time runs of `main`, a line each: every --fps and policy as the model runs, then the first fps slowed
    by --slow; {(slow, fps, policy): run}."""
    print(f"\nmeasured: LiveSession on the tiny {args.family} model in real time, {args.seconds:g} s of video a run, "
          f"chunks of {CHUNK_FRAMES} frames, max_lag one chunk; source: {args.source}")
    print("  video/wall: seconds encoded / since run() began; RTF video per wall second; chunk, drop, ovfl: chunks, "
          "frames dropped by the session, by the source's queue; lag (s) from a chunk's last frame's arrival; the "
          "stages' p50 in ms")
    print(RUN_HEADER)
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        clip = None
        if args.source == "file":
            clip = write_clip(Path(folder) / "clip.mp4", args.seconds, rate=max(8, math.ceil(2 * max(args.fps))))
        for slow, fps_list in ((0.0, args.fps), (args.slow, args.fps[:1] if args.slow else [])):
            for fps in fps_list:
                for policy in args.policies:
                    run = live_run(args.family, policy, fps, args.seconds, slow=slow, clip=clip)
                    runs[slow, fps, policy] = run
                    print(run.line(), flush=True)
    return runs


def modelled_part(costs: list[ChunkCost], fps_list: tuple[float, ...], minutes: tuple[float, ...]) -> None:
    """The sustain part of `main`: each width's costs, the model made of them and how, then the table."""
    models = [cost_model(cost) for cost in costs]
    print(f"\nmodelled: the highest frame rate sustained at real widths on one thread of this CPU, chunks of "
          f"{CHUNK_FRAMES} frames, HERMES budget {BUDGET}")
    for cost, model in zip(costs, models):
        print(f"  {cost.width}: {cost.origin}: prefill alone {cost.alone_ms:.0f} ms (vision {cost.vision_ms:.0f}) "
              f"with {cost.cache} tokens cached, HERMES chunk {cost.hermes_ms:.0f} ms")
        print(f"    uncompressed chunk = {model.fixed_ms:.0f} ms + {model.per_token_ms:.4f} ms x cached tokens "
              f"(+{model.per_token_ms * model.chunk_tokens:.0f} ms a chunk); slope: {model.slope}")
        print(f"    H2SVC chunk {model.h2svc_ms:.0f} ms: {model.h2svc}")
    print("  a policy sustains fps when its chunk costs no more than the chunk lasts (frames / fps); the uncompressed "
          "stream's cost grows by a chunk's tokens every chunk")
    for line in sustain_report(models, fps_list, minutes):
        print(f"  {line}" if line else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="llava_ov", help="the tiny model (default llava_ov)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--fps", nargs="+", type=float, default=[1.0, 2.0, 4.0], help="sampling rates of the runs")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of video per run (default 20)")
    parser.add_argument("--slow", type=float, default=6.0,
                        help="seconds added to every chunk in the slowed runs at the first fps (0: none; default 6)")
    parser.add_argument("--source", choices=("file", "synthetic"), default="file",
                        help="file: a generated MPEG-4 clip played at its own speed (the default); synthetic: "
                             "SyntheticSource in real time")
    parser.add_argument("--png", type=Path, default=None,
                        help="where to draw the lag over time (default bench/out/live-lag.png; git ignores it)")
    parser.add_argument("--measure", action="store_true",
                        help="time the real widths again (minutes each) instead of the recorded costs")
    parser.add_argument("--widths", nargs="+", choices=list(REAL_WIDTHS), default=list(REAL_WIDTHS))
    parser.add_argument("--sustain-fps", nargs="+", type=float, default=[0.1, 0.25, 0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--minutes", nargs="+", type=float, default=[1.0, 10.0, 60.0],
                        help="video lengths for the uncompressed stream's sustained rate")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models are latency-bound; the recorded costs are one thread's too
    started = time.perf_counter()
    print(f"# python -m bench.live {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit_hash()}, "
          f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average before {load()}")
    runs = measured_part(args)
    fps = args.fps[0]
    panels = {f"tiny {args.family}, {fps:g} fps, as it runs (max_lag {CHUNK_FRAMES / fps:g} s)":
              [runs[0.0, fps, p] for p in args.policies]}
    if args.slow:
        panels[f"the same, every chunk slowed by {args.slow:g} s"] = [runs[args.slow, fps, p] for p in args.policies]
    png = args.png or Path(__file__).parent / "out" / "live-lag.png"
    drawn = plot_lag(panels, png, f"lag over time, {device_name(torch.device('cpu'))}, load {load()}, commit "
                                  f"{commit_hash()}")
    if drawn:
        print(f"lag over time: {drawn}")
    costs = [measure(REAL_WIDTHS[name]) if args.measure else RECORDED[name] for name in args.widths]
    modelled_part(costs, tuple(args.sustain_fps), tuple(args.minutes))
    print(f"\n# {time.perf_counter() - started:.0f} s wall, load average after {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
