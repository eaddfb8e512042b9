"""`LiveSession(stream, source)`: a `HermesStream` fed chunk by chunk from a live source as it plays, never more than
`max_lag` behind it (late frames are dropped, oldest first, before they are encoded), with questions taken from any
thread and answered between chunks, and an event for every step: the model of time docs/live.md#time, the drop
rule docs/live.md#drop-rule, the events docs/live.md#events, questions docs/live.md#questions, the summary
docs/live.md#summary.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Callable, ClassVar, Iterator, Sequence

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from hermes.live.frames import LiveFrame, LiveSource, SourceEnded
from hermes_kernels.engine.checks import check_positive_int

WINDOW = 4096  # the summary's percentiles are over the last WINDOW samples of each kind: memory stays flat
POLL = 0.05  # seconds the loop waits on a silent source before it looks at questions and stop() again


# ---- events ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Event:
    """What `LiveSession.run` yields. `wall`: seconds on the session's clock since the session was made."""

    kind: ClassVar[str]

    def to_json(self) -> dict:
        """{"type": kind, field: value, ...} of plain JSON values (tuples as lists)."""
        out = {"type": self.kind}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclasses.dataclass(frozen=True)
class ChunkDone(Event):
    """A chunk is in the cache.

    index:        chunk number from 0.
    start, end:   video seconds of its first and last frame (the source's timestamps).
    frames:       frames in it (chunk_frames; the last chunk of an ended source may have fewer).
    lag:          seconds from the arrival of its last frame to now (how far behind the source the cache is);
                  None when the source does not set the pace (frames with arrived=None).
    dropped:      frames dropped so far in the session.
    decode_ms:    the family's prepare_frames (frames to model inputs).
    vision_ms:    the vision tower's forwards inside append_video; None for a model whose tower is not found.
    prefill_ms:   the rest of append_video but the step: the language model's prefill and guidance
                  (prefill+guidance), with the merging of the tower's output.
    compression_ms: the policy's in-place step (HERMES's compression, H2SVC's class-block step), timed inside the
                  cache (`StreamCacheBase.step_clock`); None when no step ran. decode + vision + prefill +
                  compression is the chunk's whole time.
    compressed:   the policy's step ran (HERMES compressed; H2SVC steps every chunk).
    cache_length: tokens in the cache; cache_bytes: bytes of its preallocated buffers.
    """

    kind: ClassVar[str] = "chunk"
    index: int
    start: float
    end: float
    frames: int
    lag: float | None
    dropped: int
    decode_ms: float
    vision_ms: float | None
    prefill_ms: float
    compression_ms: float | None
    compressed: bool
    cache_length: int
    cache_bytes: int
    wall: float


@dataclasses.dataclass(frozen=True)
class FramesDropped(Event):
    """Frames dropped as late since the last event of this kind: `count` of them, at video seconds `times`
    (increasing); `total` dropped so far in the session."""

    kind: ClassVar[str] = "dropped"
    count: int
    times: tuple[float, ...]
    total: int
    wall: float


@dataclasses.dataclass(frozen=True)
class Answer(Event):
    """An answer from the cache as it stood between two chunks.

    question, answer: the texts (the answer stripped).
    asked_at:      wall seconds (the session's clock, as `wall`) when it was asked: `ask()` called, or the session
                   asking an `ask_at` or `watch` question.
    seen:          video seconds seen: the end of the last chunk in the cache (0.0 before the first).
    first_token_s: seconds from asked_at to the first answer token; last_token_s: to the last one.
    watch:         the `watch` question re-asked after a chunk.
    changed:       a watch answer that differs from the previous one (the first counts); watch answers are yielded
                   only when changed, so it is True for every watch answer and False for every other one.
    """

    kind: ClassVar[str] = "answer"
    question: str
    answer: str
    asked_at: float
    seen: float
    first_token_s: float
    last_token_s: float
    watch: bool
    changed: bool
    wall: float


@dataclasses.dataclass(frozen=True)
class Ended(Event):
    """The last event: why the session ended: the source's reason ("end of stream", "disconnected", ...), "stopped"
    (`stop()`), or "error: <type>: <message>" (run() then re-raises the error)."""

    kind: ClassVar[str] = "ended"
    reason: str
    wall: float


# ---- timing helpers -----------------------------------------------------------------------------------------------
class _FirstToken(BaseStreamer):
    """Notes the clock at the first generated token: `generate` puts the prompt ids first, then each new token."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.puts, self.first = clock, 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = self.clock()

    def end(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    # CUDA runs ahead of the host: a stage's time is only its own once the device has finished it
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TowerTimer:
    """Seconds the vision tower spends in forwards on the session's thread (another thread may share the model),
    through forward hooks on the tower module while the session runs."""

    def __init__(self, model: torch.nn.Module, clock: Callable[[], float]):
        inner = getattr(model, "model", model)
        self.tower = next((module for module in (getattr(inner, "visual", None), getattr(inner, "vision_tower", None))
                           if isinstance(module, torch.nn.Module)), None)
        self.clock, self.spent, self.began, self.thread, self.handles = clock, 0.0, None, None, []
        self.device = torch.device("cpu")

    def attach(self) -> None:
        if self.tower is None:
            return
        self.thread = threading.get_ident()
        self.device = next(self.tower.parameters(), torch.zeros(0)).device
        self.handles = [self.tower.register_forward_pre_hook(self._enter), self.tower.register_forward_hook(self._exit)]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _enter(self, module, args) -> None:
        if threading.get_ident() == self.thread:
            _sync(self.device)
            self.began = self.clock()

    def _exit(self, module, args, output) -> None:
        if threading.get_ident() == self.thread and self.began is not None:
            _sync(self.device)
            self.spent += self.clock() - self.began
            self.began = None

    def take(self) -> float | None:
        """Seconds spent since the last take (None without a tower)."""
        spent, self.spent = self.spent, 0.0
        return None if self.tower is None else spent


class _StepTimer:
    """Seconds the cache's in-place steps take, timed inside the cache on the session's clock while the session runs
    (`StreamCacheBase.step_clock`; the clock the stream had before is put back afterwards)."""

    def __init__(self, cache, clock: Callable[[], float]):
        self.cache, self.clock, self.before, self.steps, self.seconds = cache, clock, None, 0, 0.0

    def attach(self) -> None:
        self.before, self.cache.step_clock = self.cache.step_clock, self.clock
        self.steps, self.seconds = self.cache.stats()["steps"], self.cache.step_seconds

    def detach(self) -> None:
        self.cache.step_clock = self.before

    def take(self, steps: int) -> float | None:
        """Seconds of the steps since the last take, the cache's step count now being `steps`; None without one."""
        seconds, self.seconds = self.cache.step_seconds - self.seconds, self.cache.step_seconds
        stepped, self.steps = steps != self.steps, steps
        return seconds if stepped else None


class _Samples:
    """The last WINDOW values of one measure, in a ring allocated once, and the largest of all, for the summary."""

    def __init__(self):
        self.ring, self.count, self.largest = np.zeros(WINDOW), 0, None

    def add(self, value: float | None) -> None:
        if value is not None:
            self.ring[self.count % len(self.ring)] = value
            self.count += 1
            self.largest = value if self.largest is None else max(self.largest, value)

    def summary(self) -> dict:
        if not self.count:
            return {"p50": None, "p99": None, "max": None}
        p50, p99 = np.percentile(self.ring[:min(self.count, len(self.ring))], [50, 99])
        return {"p50": float(p50), "p99": float(p99), "max": self.largest}


# ---- the session ------------------------------------------------------------------------------------------------
class LiveSession:
    """A stream fed from a live source, chunk by chunk, as it plays.

    Args:
        stream:         a `HermesStream` of batch_size 1 (any policy); chunks are appended to what it holds.
        source:         a `LiveSource` (`hermes.live.open_source`); the session closes it when run() ends.
        chunk_frames:   frames per chunk (default: the most the stream was sized for, its chunk_tokens).
        max_lag:        seconds a frame may wait before it is encoded; later ones are dropped (default: one chunk's
                        duration, chunk_frames / fps; at least (chunk_frames - 1) / fps, the time a chunk takes to
                        arrive).
        ask_at:         (video seconds, question) pairs, each asked after the first chunk whose last frame is at or
                        past its time (the rest when the source ends).
        watch:          a question re-asked after every chunk; its answer is yielded when it changes.
        max_new_tokens: longest answer in tokens.
        clock:          seconds, monotonic: wall time for deadlines, lags and latencies; it must be the clock of the
                        frames' `arrived` (time.monotonic).

    `run()` yields the events; `ask(question)` (any thread) returns a future of its `Answer`; `stop()` (any thread)
    ends the loop after the current call; `summary()` (any time) the percentiles, rates and counts.
    """

    def __init__(self, stream, source: LiveSource, *, chunk_frames: int | None = None, max_lag: float | None = None,
                 ask_at: Sequence[tuple[float, str]] = (), watch: str | None = None, max_new_tokens: int = 64,
                 clock: Callable[[], float] = time.monotonic):
        if stream.batch_size != 1:
            raise ValueError(f"stream: a live session feeds one source; expected a stream of batch_size 1, got "
                             f"{stream.batch_size}")
        fps = getattr(source, "fps", None)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (0 < fps < math.inf):
            raise ValueError(f"source: expected a positive sampling rate source.fps, got {fps!r}")
        chunk_frames = _stream_chunk_frames(stream) if chunk_frames is None else chunk_frames
        check_positive_int("chunk_frames", chunk_frames)
        arriving = (chunk_frames - 1) / fps
        max_lag = chunk_frames / fps if max_lag is None else max_lag
        if isinstance(max_lag, bool) or not isinstance(max_lag, (int, float)) or not (arriving <= max_lag < math.inf):
            raise ValueError(f"max_lag: a chunk of {chunk_frames} frames at {fps:g} fps takes {arriving:g} s to "
                             f"arrive; expected at least that many seconds, got {max_lag!r}")
        schedule = sorted((_ask_at_item(item) for item in ask_at), key=lambda pair: pair[0])
        if watch is not None:
            watch = _question("watch", watch)
        check_positive_int("max_new_tokens", max_new_tokens)
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {clock!r}")
        self.stream, self.source, self.fps = stream, source, float(fps)
        self.chunk_frames, self.max_lag = chunk_frames, float(max_lag)
        self.max_new_tokens = max_new_tokens
        self._schedule, self._watch, self._clock = collections.deque(schedule), watch, clock
        self._origin = clock()
        self._lock = threading.Lock()  # guards the questions, the state and the samples
        self._stop = threading.Event()
        self._questions: collections.deque = collections.deque()  # (question, future, asked_at)
        self._state, self._reason, self._began, self._finished = "new", None, None, None
        self._buffer: collections.deque[LiveFrame] = collections.deque()
        self._late: list[float] = []  # times of frames dropped since the last FramesDropped event
        self._tower = _TowerTimer(stream.model, clock)
        self._device = stream.language_model.embed_tokens.weight.device
        self._chunks = self._kept = self._dropped = self._answers = self._asks = 0
        self._seen, self._watched = 0.0, None
        self._step_timer = _StepTimer(stream.cache, clock)
        self._samples = {name: _Samples() for name in ("lag", "decode_ms", "vision_ms", "prefill_ms",
                                                       "compression_ms", "first_token_s", "last_token_s")}

    # ---- any thread -------------------------------------------------------------------------------------------
    def ask(self, question: str) -> concurrent.futures.Future:
        """Queue `question` (any thread); the future's result is its `Answer`, given between chunks from the cache
        as it stands (a question asked before the first chunk waits for it). Once the session has ended the future
        fails with RuntimeError; a question the stream refuses fails its future alone (ValueError, e.g. no room), the
        session goes on."""
        question = _question("question", question)
        future: concurrent.futures.Future = concurrent.futures.Future()
        asked = self._clock()
        with self._lock:
            if self._state != "ended":
                self._questions.append((question, future, asked))
                return future
            reason = self._reason
        future.set_exception(RuntimeError(f"session: ended ({reason}); no more questions"))
        return future

    def stop(self) -> None:
        """End the loop after the current call (a chunk or an answer); questions not answered yet are cancelled.
        Any thread, e.g. a SIGINT handler."""
        self._stop.set()

    @property
    def buffered(self) -> int:
        """Frames taken from the source and waiting for their chunk (fewer than chunk_frames)."""
        return len(self._buffer)

    def summary(self) -> dict:
        """Where the session stands (any thread, during or after run()):

        chunks, frames (encoded), dropped, answers (yielded), watch_asks (watch questions asked); video_seconds
        (frames / fps: video encoded), wall_seconds (since run() began), realtime_factor (video_seconds per
        wall second; None before run()); lag (s), decode_ms, vision_ms, prefill_ms, compression_ms (over the chunks
        that stepped), first_token_s, last_token_s:
        {"p50", "p99", "max"} (percentiles over the last WINDOW values, max over all; None when there are none);
        ended: the last event's reason, "interrupted" after a KeyboardInterrupt, "closed" when the consumer left
        run(); None while it runs.
        """
        with self._lock:
            now = self._finished if self._finished is not None else self._clock()
            wall = 0.0 if self._began is None else now - self._began
            video = self._kept / self.fps
            out = {"chunks": self._chunks, "frames": self._kept, "dropped": self._dropped, "answers": self._answers,
                   "watch_asks": self._asks, "video_seconds": video, "wall_seconds": wall,
                   "realtime_factor": video / wall if wall > 0 else None}
            out.update({name: samples.summary() for name, samples in self._samples.items()})
            out["ended"] = self._reason
        return out

    # ---- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> Iterator[Event]:
        """The loop, as a generator of events; it runs on the consumer's thread, once. It ends with an `Ended` event
        when the source ends (the last frames encoded as a shorter chunk, the questions pending answered first) or on
        stop(); an exception in the stream is yielded as Ended and then re-raised, after the pending questions' futures
        got it. A KeyboardInterrupt, or closing the generator, cancels them and propagates (summary's ended:
        "interrupted", "closed"). The stream is left as the last whole chunk or answer left it: append_video and ask
        are all-or-nothing."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError("session: run() was called already; a session runs once")
            self._state, self._began = "running", self._clock()
        self._tower.attach()
        self._step_timer.attach()
        try:
            yield from self._loop()
        except Exception as error:
            reason = f"error: {type(error).__name__}: {error}"
            self._end(reason, error)
            yield Ended(reason, self._wall())
            raise
        except GeneratorExit:  # the consumer closed the generator (left its loop)
            self._end("closed", None)
            raise
        except BaseException:
            self._end("interrupted", None)
            raise
        finally:
            self._tower.detach()
            self._step_timer.detach()
            self.source.close()

    def _loop(self) -> Iterator[Event]:
        while True:
            yield from self._answer_questions()
            try:
                frames = yield from self._gather()
            except SourceEnded as ended:
                yield from self._source_ended(ended.reason)
                return
            if frames is None:
                yield from self._finish("stopped")
                return
            yield from self._chunk(frames)
            yield from self._after_chunk(frames[-1].time)

    def _source_ended(self, reason: str) -> Iterator[Event]:
        """The source's last frames as a shorter chunk, then every question still pending (ask_at ones, then asked
        ones, also those asked meanwhile), then the end."""
        self._drop_late()
        if self._buffer and not self._stop.is_set():
            frames = list(self._buffer)
            self._buffer.clear()
            yield from self._chunk(frames)
            yield from self._after_chunk(frames[-1].time)
        while self._schedule and not self._stop.is_set():
            yield self._scheduled(self._schedule.popleft()[1])
        while not self._stop.is_set():
            yield from self._answer_questions(final=True)
            with self._lock:
                if not self._questions:
                    break
        yield from self._finish("stopped" if self._stop.is_set() else reason)

    def _finish(self, reason: str) -> Iterator[Event]:
        self._end(reason, None)
        yield from self._flush_drops()
        yield Ended(reason, self._wall())

    def _gather(self) -> Iterator[Event]:
        """The next chunk's frames (a generator whose return value is them, None after stop()): the oldest frames
        that are not late, taken from the source one at a time; late ones are dropped, oldest first, and questions
        are answered while it waits. SourceEnded propagates with the frames still buffered."""
        while True:
            self._drop_late()
            if len(self._buffer) >= self.chunk_frames:
                return [self._buffer.popleft() for _ in range(self.chunk_frames)]
            if self._stop.is_set():
                return None
            frame = self.source.get(timeout=POLL)
            if frame is None:
                yield from self._flush_drops()
            else:
                self._buffer.append(frame)
            yield from self._answer_questions()

    def _drop_late(self) -> None:
        """Drop buffered frames that waited more than max_lag, oldest first (frames arrive in order, so the late ones
        are at the front); a frame with arrived=None is never late."""
        now = self._clock()
        while self._buffer and self._buffer[0].arrived is not None and now - self._buffer[0].arrived > self.max_lag:
            self._late.append(float(self._buffer.popleft().time))

    def _flush_drops(self) -> Iterator[Event]:
        if self._late:
            times, self._late = tuple(self._late), []
            with self._lock:
                self._dropped += len(times)
                total = self._dropped
            yield FramesDropped(len(times), times, total, self._wall())

    def _chunk(self, frames: list[LiveFrame]) -> Iterator[Event]:
        """Encode one chunk (a whole one or nothing: append_video is all-or-nothing) and yield its events."""
        times = [float(frame.time) for frame in frames]
        began = self._clock()
        inputs = self.stream.family.prepare_frames(self.stream.processor, np.stack([f.pixels for f in frames]),
                                                   self.fps, start=times[0], times=times)
        prepared = self._clock()
        self._tower.take()
        _sync(self._device)
        step = self.stream.append_video(**inputs)
        _sync(self._device)
        done = self._clock()
        vision = self._tower.take()
        stats = self.stream.stats()
        compression = self._step_timer.take(stats["steps"])
        lag = None if frames[-1].arrived is None else done - frames[-1].arrived
        yield from self._flush_drops()
        decode_ms, append_ms = 1e3 * (prepared - began), 1e3 * (done - prepared)
        vision_ms = None if vision is None else 1e3 * vision
        compression_ms = None if compression is None else 1e3 * compression
        prefill_ms = append_ms - (vision_ms or 0.0) - (compression_ms or 0.0)
        with self._lock:
            index, self._chunks = self._chunks, self._chunks + 1
            self._kept += len(frames)
            self._seen = times[-1]
            dropped = self._dropped
            for name, value in (("lag", lag), ("decode_ms", decode_ms), ("vision_ms", vision_ms),
                                ("prefill_ms", prefill_ms), ("compression_ms", compression_ms)):
                self._samples[name].add(value)
        yield ChunkDone(index, times[0], times[-1], len(frames), lag, dropped, decode_ms, vision_ms, prefill_ms,
                        compression_ms, step is not None, stats["length"], stats["bytes_allocated"], self._wall(done))

    def _after_chunk(self, end: float) -> Iterator[Event]:
        """What follows a chunk: the questions asked meanwhile, the ask_at questions it reached, the watch."""
        yield from self._answer_questions()
        while self._schedule and self._schedule[0][0] <= end and not self._stop.is_set():
            yield self._scheduled(self._schedule.popleft()[1])
        if self._watch is not None and not self._stop.is_set():
            answer = self._answer(self._watch, self._clock(), watch=True)
            with self._lock:
                self._asks += 1
            if answer.changed:
                self._count_answer()
                yield answer

    # ---- answers ------------------------------------------------------------------------------------------------
    def _answer_questions(self, final: bool = False) -> Iterator[Event]:
        """Answer the questions queued when it was called, oldest first (later ones wait for the next turn: a flood of
        questions cannot hold the chunks back by more than one turn). Before the first chunk is in the cache they wait
        for it, unless the source has ended (`final`)."""
        with self._lock:
            count = len(self._questions) if self._chunks or final else 0
        for _ in range(count):
            if self._stop.is_set():
                return
            with self._lock:
                question, future, asked = self._questions.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled by its asker
            try:
                answer = self._answer(question, asked)
            except Exception as error:  # this question's (e.g. no room for it): its future's, the session goes on
                future.set_exception(error)
                continue
            except BaseException:
                future.set_exception(RuntimeError("session: interrupted while answering"))
                raise
            future.set_result(answer)
            self._count_answer()
            yield answer

    def _scheduled(self, question: str) -> Answer:
        answer = self._answer(question, self._clock())
        self._count_answer()
        return answer

    def _count_answer(self) -> None:
        with self._lock:
            self._answers += 1

    def _answer(self, question: str, asked: float, watch: bool = False) -> Answer:
        """Ask the stream; the latencies run from `asked` (the clock when the question was asked)."""
        streamer = _FirstToken(self._clock)
        text = self.stream.ask(question, max_new_tokens=self.max_new_tokens, streamer=streamer).strip()
        done = self._clock()
        first = done if streamer.first is None else streamer.first
        changed = False
        if watch:
            changed, self._watched = text != self._watched, text
        with self._lock:
            self._samples["first_token_s"].add(first - asked)
            self._samples["last_token_s"].add(done - asked)
        return Answer(question, text, asked - self._origin, self._seen, first - asked, done - asked, watch, changed,
                      self._wall(done))

    # ---- state ------------------------------------------------------------------------------------------------
    def _wall(self, at: float | None = None) -> float:
        return (self._clock() if at is None else at) - self._origin

    def _end(self, reason: str, error: BaseException | None) -> None:
        """Mark the session ended: later ask() calls fail at once; queued questions get `error` (an exception in the
        stream) or are cancelled."""
        with self._lock:
            self._state, self._reason, self._finished = "ended", reason, self._clock()
            pending = list(self._questions)
            self._questions.clear()
        for _, future, _ in pending:
            if error is None:
                future.cancel()
            elif future.set_running_or_notify_cancel():
                future.set_exception(error)


def _stream_chunk_frames(stream) -> int:
    """The most frames a chunk of the stream holds: its chunk_tokens in whole H2SVC frames (temporal steps)."""
    setup = stream.setup
    try:
        per_frame = setup.family.tokens_per_frame(setup.model, setup.frame_size, setup.tokenizer)
    except ValueError as error:
        raise ValueError(f"chunk_frames: the stream's chunk size in frames is unknown ({error}); pass "
                         "chunk_frames") from error
    frames = setup.chunk_tokens // per_frame * setup.family.step_frames(setup.model)
    if frames < 1:
        raise ValueError(f"chunk_frames: the stream's chunks hold {setup.chunk_tokens} tokens, less than one frame's "
                         f"{per_frame}")
    return frames


def _question(name: str, question) -> str:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{name}: expected a non-empty string, got {question!r}")
    return question.strip()


def _ask_at_item(item) -> tuple[float, str]:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ValueError(f"ask_at: expected (video seconds, question) pairs, got {item!r}")
    when, question = item
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not (0 <= when < math.inf):
        raise ValueError(f"ask_at: expected video seconds >= 0, got {when!r}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"ask_at: expected a non-empty question, got {question!r}")
    return float(when), question.strip()


__all__ = ["Answer", "ChunkDone", "Ended", "Event", "FramesDropped", "LiveSession"]
