"""`LiveSession` over an in-memory source on a fake clock (docs/live.md#time): a tiny Qwen3-VL slowed on purpose by a
hook that advances the clock, so lags, drops and latencies are exact and no test waits on real time. Covered: the
drop rule (whole frames, oldest first, lag bounded, answers and cache those of the kept frames fed directly), memory
flat, a source that does not set the pace, questions from another thread with latencies from the ask, ask_at in video
time, watch, a fault in append_video, KeyboardInterrupt, the source's end, stop(), the per-stage times of a chunk
(compression timed inside the cache), the events' JSON schema and the refusals."""
from __future__ import annotations

import dataclasses
import json
import threading
import tracemalloc

import numpy as np
import pytest
import torch

import hermes_kernels

from hermes.live import Answer, ChunkDone, Ended, FramesDropped, LiveFrame, LiveSession, SourceEnded
from hermes.commands import LoadedModel
from hermes.live import session as session_module
from hermes.live.command import processed_size
from hermes.models.gemma4 import Gemma4
from hermes.models.processing import Processor
from hermes.models.qwen3_vl import Qwen3_VL
from hermes.stream import HermesStream
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT
from scaffolding.models import tiny_gemma4, tiny_qwen3_vl
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

FPS = 1.0
CHUNK = 4  # frames per chunk: two temporal steps of 8 x 8 frames, 2 x 2 merged tokens each (32 tokens a chunk)
START = 100.0  # the fake clock's reading when a test begins (frame i of a paced source arrives at START + i)
SLOW = 10.0  # seconds a slowed chunk takes: 2.5 chunks of video, so about half the frames are dropped
QUESTION = "what is the person holding ?"


class FakeClock:
    """Seconds that pass only when a test says so (`advance`) or when a source waits for its next frame."""

    def __init__(self, now: float = START):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ListSource:
    """A `LiveSource` of a list of frames: a frame can be taken once the clock reaches its `arrived` (None: at once);
    a `get` that would wait moves the clock on to the arrival, or by its timeout. Once the list is exhausted the source
    stalls until the clock reads `ends_at` (None: it ends at once; `blocking`: in one get, past its timeout, as a
    blocking read may), then `on_end(source)` runs once and it raises SourceEnded(reason)."""

    def __init__(self, frames, clock, reason="end of stream", on_end=None, ends_at=None, blocking=False):
        self.frames, self.clock, self.reason, self.on_end = list(frames), clock, reason, on_end
        self.fps, self.frame_size, self.taken, self.closed, self.ends_at = FPS, (8, 8), 0, False, ends_at
        self.blocking = blocking

    def get(self, timeout=None):
        if self.taken == len(self.frames):
            if self.ends_at is not None and self.clock.now < self.ends_at:  # stalled until then
                self.clock.now = self.ends_at if self.blocking else min(self.ends_at, self.clock.now + timeout)
                if not self.blocking:
                    return None
            if self.on_end is not None:
                self.on_end, on_end = None, self.on_end
                on_end(self)
            raise SourceEnded(self.reason)
        frame = self.frames[self.taken]
        if frame.arrived is not None and frame.arrived > self.clock.now:
            if timeout is not None and frame.arrived - self.clock.now > timeout:
                self.clock.advance(timeout)
                return None
            self.clock.now = frame.arrived  # exactly: the lag bound is checked to the last bit
        self.taken += 1
        return frame

    def stats(self):
        return {"decoded": self.taken, "sampled": self.taken, "corrupt_packets": 0, "reconnects": 0}

    def close(self):
        self.closed = True


class EndlessSource(ListSource):
    """Frames without end, each there at once (arrived=None); after 400 of them it ends all the same, so a session
    that misses stop() fails its test instead of hanging it."""

    def __init__(self, clock):
        super().__init__([], clock, reason="400 frames")

    def get(self, timeout=None):
        if self.taken == 400:
            raise SourceEnded(self.reason)
        self.taken += 1
        return make_frame(self.taken - 1, arrived=None)


def make_frame(index: int, arrived: float | None) -> LiveFrame:
    pixels = np.random.default_rng(index).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return LiveFrame(index=index, time=index / FPS, pixels=pixels, arrived=arrived)


def live_frames(count: int, paced: bool = True) -> list[LiveFrame]:
    """`count` frames at 1 fps; paced: frame i arrives at START + i (a camera), else arrived=None (a file)."""
    return [make_frame(i, START + i / FPS if paced else None) for i in range(count)]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_vl(num_layers=2)


def processor():
    twin = Qwen3_VL().pil_video_processor(tiny_image_processor("qwen3_vl"), tiny_video_processor_config("qwen3_vl"))
    return Processor(tokenizer=tiny_tokenizer(digits=True), video_processor=twin)


def make_stream(model) -> HermesStream:
    """Room for 2 chunks past the prefix (budget 64): HERMES compresses from the third chunk on."""
    return HermesStream(model, processor(), chunk_frames=CHUNK, frame_size=(8, 8), budget=64, room=160)


@pytest.fixture
def hooks(model):
    """hooks(module, fn): a forward pre-hook for this test only (removed afterwards)."""
    handles = []

    def add(module, fn):
        handles.append(module.register_forward_pre_hook(fn))

    yield add
    for handle in handles:
        handle.remove()


def on_chunk(hooks, model, fn):
    """fn(chunk index) inside every chunk's append_video (the vision tower runs once a chunk, never for answers)."""
    count = [0]

    def call(module, args):
        fn(count[0])
        count[0] += 1

    hooks(model.model.visual, call)


def slowed(hooks, model, clock, seconds=SLOW):
    """Every chunk costs `seconds` of the fake clock."""
    on_chunk(hooks, model, lambda index: clock.advance(seconds))


def in_thread(fn):
    """fn() on another thread, waited for."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return result[0]


def kept_chunks(events, frames) -> list[list[LiveFrame]]:
    """The frames of each ChunkDone in order: the frames not dropped, cut by the chunks' frame counts (each chunk's
    first and last time checked against its event)."""
    dropped = {t for e in events if isinstance(e, FramesDropped) for t in e.times}
    kept = [frame for frame in frames if frame.time not in dropped]
    chunks = []
    for event in (e for e in events if isinstance(e, ChunkDone)):
        chunk, kept = kept[:event.frames], kept[event.frames:]
        assert (chunk[0].time, chunk[-1].time) == (event.start, event.end)
        chunks.append(chunk)
    return chunks


def replay(model, events, frames, make=make_stream) -> HermesStream:
    """A fresh stream (`make(model)`) fed the session's kept chunks directly (prepare_frames with their true times),
    asked each answered question at the same point; its answers must be the session's."""
    stream = make(model)
    chunks = iter(kept_chunks(events, frames))
    for event in events:
        if isinstance(event, ChunkDone):
            chunk = next(chunks)
            times = [frame.time for frame in chunk]
            stream.append_video(**stream.family.prepare_frames(stream.processor, np.stack([f.pixels for f in chunk]),
                                                               FPS, start=times[0], times=times))
        elif isinstance(event, Answer):
            assert stream.ask(event.question, max_new_tokens=4).strip() == event.answer, event
    return stream


def contents(stream) -> dict:
    return {name: view.clone() for name, view in stream.cache.contents().items()}


def same_contents(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


# ---- the drop rule ------------------------------------------------------------------------------------------------
def test_a_slow_model_drops_whole_frames_oldest_first_and_lag_stays_bounded(model, hooks):
    """Each chunk costs 10 s of a 1 fps camera (chunks of 4 frames, max_lag 4 s by default): frames are dropped,
    whole chunks are still encoded, every drop is older than the chunk that follows it, and every kept frame is in
    the cache within max_lag + its chunk's processing of arriving. The answers and the cache are those of a stream
    fed the kept frames directly; memory is flat (cache length and bytes fixed once the budget fills, fewer than a
    chunk of frames buffered)."""
    clock = FakeClock()
    slowed(hooks, model, clock)
    frames = live_frames(60)
    stream = make_stream(model)
    made = clock.now  # the session's wall 0
    session = LiveSession(stream, ListSource(frames, clock), ask_at=[(20.0, QUESTION), (41.0, "where is the cup ?")],
                          max_new_tokens=4, clock=clock)
    assert session.chunk_frames == CHUNK and session.max_lag == CHUNK / FPS
    events, buffered = [], []
    for event in session.run():
        events.append(event)
        buffered.append(session.buffered)
    chunks = [e for e in events if isinstance(e, ChunkDone)]
    drops = [e for e in events if isinstance(e, FramesDropped)]
    assert drops and sum(d.count for d in drops) == drops[-1].total == session.summary()["dropped"] > 20
    assert all(chunk.frames == CHUNK for chunk in chunks[:-1]) and 1 <= chunks[-1].frames <= CHUNK
    by_time = {frame.time: frame for frame in frames}
    for chunk, kept in zip(chunks, kept_chunks(events, frames)):
        done = made + chunk.wall
        processing = (chunk.decode_ms + chunk.vision_ms + chunk.prefill_ms + (chunk.compression_ms or 0.0)) / 1e3
        assert processing == pytest.approx(SLOW)
        assert all(done - frame.arrived <= session.max_lag + processing + 1e-9 for frame in kept), chunk
        assert chunk.lag == done - by_time[chunk.end].arrived
    for drop in drops:  # oldest first: everything dropped is older than the next chunk's frames
        following = next(c for c in chunks if c.wall >= drop.wall)
        assert list(drop.times) == sorted(drop.times) and max(drop.times) < following.start
    answers = [e for e in events if isinstance(e, Answer)]
    assert [a.question for a in answers] == [QUESTION, "where is the cup ?"]
    replayed = replay(model, events, frames)
    assert same_contents(contents(replayed), contents(stream))
    full = [c for c in chunks if c.compressed]
    assert len(full) >= 3 and len({(c.cache_length, c.cache_bytes) for c in full}) == 1
    assert max(buffered) < CHUNK and isinstance(events[-1], Ended) and events[-1].reason == "end of stream"


def gemma4_stream(model, policy: str = "hermes") -> HermesStream:
    """A Gemma 4 stream of chunks of 4 frames of 8 x 8, sized as the command sizes a live stream (the processed
    frames' size, read off the inputs of a blank chunk: 71 tokens a frame); HERMES over budget 200 compresses from the
    second chunk on; H2SVC with every class in both full layers, windows of 1, 2 and 4 frames (episodic evicting)."""
    family = Gemma4()
    twin = family.pil_video_processor(tiny_image_processor("gemma4"), tiny_video_processor_config("gemma4"))
    processor = Processor(tokenizer=tiny_tokenizer(digits=True, gemma=True), video_processor=twin)
    size = processed_size(LoadedModel(model, processor, family, path="", device=torch.device("cpu")), (8, 8), CHUNK,
                          FPS)
    settings = dict(budget=200) if policy == "hermes" else \
        dict(policy="h2svc", head_map=[[EPISODIC, INSTANT], [SHORT, EPISODIC]], instant_frames=1, short_frames=2,
             episodic_frames=4)
    return HermesStream(model, processor, chunk_frames=CHUNK, frame_size=size, room=400, **settings)


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_gemma4_drops_frames_and_its_cache_is_the_kept_frames_fed_directly(policy, hooks):
    """Gemma 4 (sliding windows at stream positions, vision blocks, KV-shared layers, " mm:ss " timestamps) slowed
    to 10 s a chunk of a 1 fps camera: frames are dropped, so the kept frames' timestamps have gaps; the cache (full
    layers, and the sliding layers' windows) and the answers equal a stream fed the kept frames directly; under H2SVC
    the cache also equals one fed them without the question."""
    model, clock = tiny_gemma4(), FakeClock()
    hooks(model.model.vision_tower, lambda module, args: clock.advance(SLOW))
    frames = live_frames(40)
    make = lambda model: gemma4_stream(model, policy)  # noqa: E731
    stream = make(model)
    session = LiveSession(stream, ListSource(frames, clock), ask_at=[(20.0, QUESTION)], max_new_tokens=4, clock=clock)
    events = list(session.run())
    chunks = [e for e in events if isinstance(e, ChunkDone)]
    assert sum(e.count for e in events if isinstance(e, FramesDropped)) > 10 and len(chunks) >= 3
    assert [e.question for e in events if isinstance(e, Answer)] == [QUESTION]
    assert any(name.startswith("sliding layer") for name in stream.cache.contents())
    if policy == "hermes":
        assert sum(c.compressed for c in chunks) >= 2
    replayed = replay(model, events, frames, make=make)
    assert same_contents(contents(replayed), contents(stream))
    if policy == "h2svc":  # HERMES's later steps read the last question and answer as guidance; H2SVC's read nothing
        unasked = replay(model, [e for e in events if not isinstance(e, Answer)], frames, make=make)
        assert same_contents(contents(unasked), contents(stream))  # the question left windows and full layers as were


def test_memory_of_the_session_stays_flat(model, hooks, monkeypatch):
    """Over 30 slowed chunks with drops, what session.py's own lines allocated and still hold (the frames it buffers,
    the drops not reported yet, the summary's samples: a ring of WINDOW each; tracemalloc) does not grow. The stream's
    calls are left out: torch's, transformers' and PIL's caches warm up over the first hundreds of chunks."""
    monkeypatch.setattr(session_module, "WINDOW", 4)
    clock = FakeClock()
    slowed(hooks, model, clock)
    session = LiveSession(make_stream(model), ListSource(live_frames(300), clock), clock=clock)
    tracemalloc.start()
    try:
        sizes = []
        for event in session.run():
            if isinstance(event, ChunkDone) and event.index in (10, 28):
                snapshot = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(True, session_module.__file__)])
                sizes.append(sum(trace.size for trace in snapshot.traces))
    finally:
        tracemalloc.stop()
    assert session.summary()["chunks"] >= 29 and session.summary()["dropped"] > 100
    assert sizes[1] - sizes[0] < 1024, sizes


def test_a_gap_in_the_source_s_own_times_reaches_the_model(model):
    """Frames at 0-5 s and from 12 s on (a source that lost 6 s): the chunk across the gap is stamped with its true
    times, as a stream fed them with times= holds, which differs from one fed evenly spaced times."""
    clock = FakeClock()
    frames = [dataclasses.replace(frame, time=frame.time + 6.0 * (frame.index >= 6))
              for frame in live_frames(12, paced=False)]
    stream = make_stream(model)
    events = list(LiveSession(stream, ListSource(frames, clock), clock=clock).run())
    assert [(e.start, e.end) for e in events if isinstance(e, ChunkDone)] == [(0.0, 3.0), (4.0, 13.0), (14.0, 17.0)]
    assert same_contents(contents(replay(model, events, frames)), contents(stream))
    even = make_stream(model)
    for chunk in kept_chunks(events, frames):
        even.append_video(**even.family.prepare_frames(even.processor, np.stack([f.pixels for f in chunk]), FPS,
                                                       start=chunk[0].time))
    assert not same_contents(contents(even), contents(stream))


@pytest.mark.parametrize("blocking", [False, True])
def test_frames_left_when_a_stalled_source_ends_are_dropped_when_late(model, blocking):
    """A 1 fps camera that stalls after 10 frames and ends 20 s later: its last 2 frames, buffered for a chunk that
    never filled, are dropped as late rather than encoded, as they turn late while the session polls or, when the
    source blocks through the whole stall in one get, once it ends."""
    clock = FakeClock()
    source = ListSource(live_frames(10), clock, reason="stalled for 20 s", ends_at=START + 29.0, blocking=blocking)
    events = list(LiveSession(make_stream(model), source, clock=clock).run())
    assert [e.index for e in events if isinstance(e, ChunkDone)] == [0, 1]
    assert [t for e in events if isinstance(e, FramesDropped) for t in e.times] == [8.0, 9.0]
    assert events[-1].reason == "stalled for 20 s"


def test_a_source_that_does_not_set_the_pace_is_never_late(model, hooks):
    """Frames with arrived=None (a file read as fast as it decodes) behind a slowed model: every frame encoded,
    nothing dropped, no lag reported."""
    clock = FakeClock()
    slowed(hooks, model, clock)
    events = list(LiveSession(make_stream(model), ListSource(live_frames(18, paced=False), clock), clock=clock).run())
    chunks = [e for e in events if isinstance(e, ChunkDone)]
    assert [c.frames for c in chunks] == [4, 4, 4, 4, 2] and not any(isinstance(e, FramesDropped) for e in events)
    assert all(c.lag is None and c.dropped == 0 for c in chunks)


# ---- questions ------------------------------------------------------------------------------------------------------
def test_questions_from_another_thread_are_answered_between_chunks(model, hooks):
    """During chunk 2 another thread asks (1 s into the chunk, 2 s before the tower is done), then three threads ask
    two questions each at once: every answer comes right after chunk 2, before chunk 3. The first question's
    latencies run from its ask() call: 2 s plus the language model's forwards up to its first token (each forward
    10 ms here), the last token two forwards later. The tower's own 250 ms are the chunks' vision_ms."""
    clock = FakeClock()
    asked = {}

    def during_chunk(index):
        if index == 2:
            clock.advance(1.0)
            asked["at"] = clock.now
            asked["future"] = in_thread(lambda: session.ask(f"  {QUESTION} "))
            clock.advance(2.0)
            threads = [threading.Thread(target=lambda: asked.setdefault("more", []).extend(
                session.ask(q) for q in ("where is the cup ?", "what is the man doing ?"))) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)

    on_chunk(hooks, model, during_chunk)
    hooks(model.model.visual.blocks[0], lambda module, args: clock.advance(0.25))
    hooks(model.model.language_model, lambda module, args: clock.advance(0.01))
    stream = make_stream(model)
    made = clock.now  # the session's wall 0
    session = LiveSession(stream, ListSource(live_frames(20, paced=False), clock), max_new_tokens=3, clock=clock)
    events = list(session.run())
    answer = asked["future"].result(timeout=0)
    kinds = [(type(e).__name__, getattr(e, "index", None)) for e in events]
    at = events.index(answer)
    assert kinds[at - 1] == ("ChunkDone", 2) and kinds[at + 1:at + 8] == [("Answer", None)] * 6 + [("ChunkDone", 3)]
    assert {future.result(timeout=0) for future in asked["more"]} == set(events[at + 1:at + 7])
    assert answer.question == QUESTION and not answer.watch and answer.seen == 11.0
    assert answer.asked_at == asked["at"] - made and answer.first_token_s >= 2.0 + 0.01 - 1e-9
    assert answer.last_token_s == pytest.approx(answer.first_token_s + 0.02)
    assert all(e.vision_ms == pytest.approx(250) and e.decode_ms == 0 for e in events if isinstance(e, ChunkDone))
    summary = session.summary()
    assert summary["answers"] == 7 and summary["vision_ms"]["p99"] == pytest.approx(250)


def test_a_question_asked_before_the_first_chunk_waits_for_it(model):
    """Asked before run(), a question is answered once the first chunk is in (seen 3 s), not from the empty cache.
    Leaving run()'s loop ends the session ("closed"): a question still queued is cancelled, the source closed."""
    clock = FakeClock()
    session = LiveSession(make_stream(model), ListSource(live_frames(12, paced=False), clock), max_new_tokens=2,
                          clock=clock)
    early = session.ask(QUESTION)
    events = session.run()
    assert isinstance(next(events), ChunkDone) and next(events) == early.result(timeout=0)
    assert early.result().seen == 3.0
    queued = session.ask(QUESTION)
    events.close()
    assert queued.cancelled() and session.summary()["ended"] == "closed" and session.source.closed


def test_ask_at_is_in_video_time(model, hooks):
    """With drops, chunk k no longer ends at 4k + 3 s: a question for 10 s is asked after the first chunk whose last
    frame is at or past 10 s (a time that was dropped), one for 200 s when the source ends."""
    clock = FakeClock()
    slowed(hooks, model, clock)
    session = LiveSession(make_stream(model), ListSource(live_frames(40), clock),
                          ask_at=[(200.0, "where is the cup ?"), (10.0, QUESTION)], max_new_tokens=2, clock=clock)
    events = list(session.run())
    chunks = [e for e in events if isinstance(e, ChunkDone)]
    reached = next(c for c in chunks if c.end >= 10.0)
    assert reached.index == 1 and reached.start > 8.0  # frames 4-8 were dropped
    answers = [e for e in events if isinstance(e, Answer)]
    assert [(a.question, a.seen) for a in answers] == [(QUESTION, reached.end), ("where is the cup ?", chunks[-1].end)]
    assert events.index(answers[0]) == events.index(reached) + 1
    assert events.index(answers[1]) > events.index(chunks[-1])


def test_watch_yields_only_when_the_answer_changes(model, monkeypatch):
    """The watch question re-asked after each of 8 chunks, the stream answering "no", "no", "no", "yes", "yes", "no",
    "no", "yes": alerts after chunks 0, 3, 5 and 7 only (the first answer counts as a change)."""
    clock = FakeClock()
    stream = make_stream(model)
    script = iter(["no", "no", "no ", "yes", "yes", "no", "no", "yes"])
    asked = []

    def ask(question, max_new_tokens, streamer):
        asked.append(question)
        return next(script)

    monkeypatch.setattr(stream, "ask", ask)
    session = LiveSession(stream, ListSource(live_frames(32, paced=False), clock), watch="is the door open ?",
                          clock=clock)
    events = list(session.run())
    alerts = [(events[events.index(e) - 1].index, e.answer) for e in events if isinstance(e, Answer)]
    assert alerts == [(0, "no"), (3, "yes"), (5, "no"), (7, "yes")]
    assert all(e.watch and e.changed for e in events if isinstance(e, Answer))
    assert asked == ["is the door open ?"] * 8 and session.summary()["watch_asks"] == 8


# ---- faults ---------------------------------------------------------------------------------------------------------
def test_a_fault_in_append_video_leaves_the_cache_as_before_and_fails_pending_questions(model, hooks):
    """The second decoder layer raises during chunk 3's prefill (after the first layer wrote its keys), with a
    question pending: the stream holds what it held after chunk 2, the question's future gets the error, the last
    event says why and run() re-raises it; the stream goes on afterwards."""
    clock = FakeClock()
    state = {"chunk": None}
    on_chunk(hooks, model, lambda index: state.update(chunk=index))
    stream = make_stream(model)

    def fault(module, args):
        if state["chunk"] == 3:
            state["future"] = session.ask(QUESTION)
            raise RuntimeError("injected fault")

    hooks(model.model.language_model.layers[1], fault)
    session = LiveSession(stream, ListSource(live_frames(24, paced=False), clock), max_new_tokens=4, clock=clock)
    events, before = [], None
    with pytest.raises(RuntimeError, match="injected fault"):
        for event in session.run():
            events.append(event)
            if isinstance(event, ChunkDone) and event.index == 2:
                before = contents(stream)
    assert [e.index for e in events if isinstance(e, ChunkDone)] == [0, 1, 2]
    assert events[-1] == Ended("error: RuntimeError: injected fault", events[-1].wall)
    assert same_contents(contents(stream), before) and not stream.cache.undefined
    with pytest.raises(RuntimeError, match="injected fault"):
        state["future"].result(timeout=0)
    assert session.summary()["ended"] == events[-1].reason and session.source.closed
    late = session.ask(QUESTION)
    with pytest.raises(RuntimeError, match=r"^session: ended \(error: RuntimeError: injected fault\)"):
        late.result(timeout=0)
    state["chunk"] = None
    stream.append_video(**stream.family.prepare_frames(stream.processor, np.stack([f.pixels for f in live_frames(4)]),
                                                       FPS, start=12.0))


@pytest.mark.parametrize("where", ["chunk", "answer"])
def test_keyboard_interrupt_leaves_the_stream_consistent(model, hooks, monkeypatch, where):
    """Ctrl-C inside chunk 3's prefill with a question queued (cancelled), or inside the answer to a question asked
    during chunk 2 (its future fails): run() raises KeyboardInterrupt, the cache holds what it held after chunk 2,
    the summary is still there, and the stream answers afterwards."""
    clock = FakeClock()
    state = {"chunk": None, "answering": False}
    stream = make_stream(model)
    original_ask = stream.ask

    def ask(*args, **kwargs):
        state["answering"] = True
        try:
            return original_ask(*args, **kwargs)
        finally:
            state["answering"] = False

    monkeypatch.setattr(stream, "ask", ask)

    def during_chunk(index):
        state["chunk"] = index
        if index == {"chunk": 3, "answer": 2}[where]:
            state["future"] = session.ask(QUESTION)

    def interrupt(module, args):
        if (where == "chunk" and state["chunk"] == 3) or (where == "answer" and state["answering"]):
            raise KeyboardInterrupt

    on_chunk(hooks, model, during_chunk)
    hooks(model.model.language_model.layers[1], interrupt)
    session = LiveSession(stream, ListSource(live_frames(24, paced=False), clock), max_new_tokens=4, clock=clock)
    before = None
    with pytest.raises(KeyboardInterrupt):
        for event in session.run():
            if isinstance(event, ChunkDone) and event.index == 2:
                before = contents(stream)
    assert same_contents(contents(stream), before) and not stream.cache.undefined
    future = state["future"]
    assert future.cancelled() if where == "chunk" else isinstance(future.exception(timeout=0), RuntimeError)
    summary = session.summary()
    assert summary["chunks"] == 3 and summary["ended"] == "interrupted" and session.source.closed
    state.update(chunk=None, answering=False)
    assert isinstance(original_ask(QUESTION, max_new_tokens=2), str)


@pytest.mark.parametrize("count", [10, 8])
def test_the_source_s_end_encodes_its_last_frames_and_answers_what_is_pending(model, count):
    """A source that disconnects after 10 frames (or 8, two whole chunks): the last 2 frames are a shorter chunk; a
    question asked as it ends and an ask_at question past its end are answered before the end; the last event gives
    the source's reason."""
    clock = FakeClock()
    futures = []
    source = ListSource(live_frames(count), clock, reason="disconnected",
                        on_end=lambda source: futures.append(in_thread(lambda: session.ask(QUESTION))))
    session = LiveSession(make_stream(model), source, ask_at=[(500.0, "where is the cup ?")], max_new_tokens=2,
                          clock=clock)
    events = list(session.run())
    assert [(type(e).__name__, getattr(e, "frames", None)) for e in events] == [
        ("ChunkDone", 4), ("ChunkDone", 4)] + [("ChunkDone", 2)] * (count == 10) + [
        ("Answer", None), ("Answer", None), ("Ended", None)]
    assert futures[0].result(timeout=0) in events and events[-1].reason == "disconnected"
    assert {e.question for e in events if isinstance(e, Answer)} == {QUESTION, "where is the cup ?"}
    assert session.summary()["ended"] == "disconnected" and source.closed


def test_stop_from_another_thread_ends_after_the_current_chunk(model, hooks):
    """stop() called from another thread during chunk 2 of an endless source: chunk 2 completes, nothing more is
    encoded or answered, a question still queued is cancelled, the last event says "stopped"."""
    clock = FakeClock()
    futures = []

    def during_chunk(index):
        if index == 2:
            futures.append(session.ask(QUESTION))
            in_thread(session.stop)

    on_chunk(hooks, model, during_chunk)
    session = LiveSession(make_stream(model), EndlessSource(clock), clock=clock)
    events = list(session.run())
    assert [type(e).__name__ for e in events] == ["ChunkDone"] * 3 + ["Ended"] and events[-1].reason == "stopped"
    assert futures[0].cancelled() and session.summary()["ended"] == "stopped" and session.source.closed


# ---- per-stage times ------------------------------------------------------------------------------------------------
STEP = 0.5  # seconds of the fake clock a compression step takes


def test_the_stages_add_up_to_the_chunk_and_compression_is_the_step_alone(model, hooks, monkeypatch):
    """On the fake clock the tower takes 250 ms, each language-model forward 10 ms and HERMES's compression step
    500 ms: per chunk vision_ms is the tower's, compression_ms the step's (None for the first two chunks, which fit
    the budget uncompressed), prefill_ms the forwards' (prefill+guidance), and the stages add up to the whole chunk.
    The session puts the cache's own step clock back when it ends."""
    clock = FakeClock()
    forwards = [0]
    stream = make_stream(model)
    step = hermes_kernels.compress_stacks

    def slow_step(*args, **kwargs):
        clock.advance(STEP)
        return step(*args, **kwargs)

    def forward(module, args):
        forwards[0] += 1
        clock.advance(0.01)

    monkeypatch.setattr(hermes_kernels, "compress_stacks", slow_step)
    hooks(model.model.visual.blocks[0], lambda module, args: clock.advance(0.25))  # inside the tower's timing
    hooks(model.model.language_model, forward)
    session = LiveSession(stream, ListSource(live_frames(20, paced=False), clock), clock=clock)
    chunks = []
    for event in session.run():
        if isinstance(event, ChunkDone):
            chunks.append((event, forwards[0]))
            forwards[0] = 0
    assert [event.compressed for event, _ in chunks] == [False, False, True, True, True]
    for event, count in chunks:
        assert event.vision_ms == pytest.approx(250) and event.decode_ms == 0
        assert event.compression_ms == (pytest.approx(1e3 * STEP) if event.compressed else None)
        assert event.prefill_ms == pytest.approx(10 * count) and count >= 1
        whole = 250 + 10 * count + (1e3 * STEP if event.compressed else 0)
        assert event.decode_ms + event.vision_ms + event.prefill_ms + (event.compression_ms or 0) == \
            pytest.approx(whole)
    assert session.summary()["compression_ms"]["p50"] == pytest.approx(1e3 * STEP)
    assert stream.cache.step_clock is None


def test_compression_ms_on_the_real_clock_is_the_step_s_time(model):
    """On time.monotonic: a chunk that compressed reports the step's milliseconds (> 0, within the chunk's
    append_video time, which the stream's cache counts as step_seconds too); one that did not reports None."""
    stream = make_stream(model)
    session = LiveSession(stream, ListSource(live_frames(16, paced=False), FakeClock()))
    chunks = [event for event in session.run() if isinstance(event, ChunkDone)]
    assert [c.compression_ms is None for c in chunks] == [True, True, False, False]
    assert all(0 < c.compression_ms < c.prefill_ms + c.compression_ms for c in chunks[2:])
    assert 1e3 * stream.cache.step_seconds == pytest.approx(sum(c.compression_ms for c in chunks[2:]))


# ---- the events and the refusals ------------------------------------------------------------------------------------
SCHEMA = {
    "chunk": {"index": int, "start": float, "end": float, "frames": int, "lag": (float, type(None)), "dropped": int,
              "decode_ms": float, "vision_ms": (float, type(None)), "prefill_ms": float,
              "compression_ms": (float, type(None)), "compressed": bool,
              "cache_length": int, "cache_bytes": int, "wall": float},
    "dropped": {"count": int, "times": list, "total": int, "wall": float},
    "answer": {"question": str, "answer": str, "asked_at": float, "seen": float, "first_token_s": float,
               "last_token_s": float, "watch": bool, "changed": bool, "wall": float},
    "ended": {"reason": str, "wall": float},
}


def test_every_event_s_json_has_the_documented_keys_and_types(model, hooks):
    """A slowed session with a watch, an ask_at and a question: every event's to_json has "type" and exactly its
    kind's keys, each of its type (a dropped event's times are floats), and survives json.dumps."""
    clock = FakeClock()
    slowed(hooks, model, clock)
    session = LiveSession(make_stream(model), ListSource(live_frames(30), clock), ask_at=[(5.0, QUESTION)],
                          watch="is the door open ?", max_new_tokens=2, clock=clock)
    session.ask("where is the cup ?")
    seen = set()
    for event in session.run():
        record = json.loads(json.dumps(event.to_json()))
        kind = record.pop("type")
        seen.add(kind)
        assert record.keys() == SCHEMA[kind].keys(), kind
        for key, value in record.items():
            assert isinstance(value, SCHEMA[kind][key]) and not (isinstance(value, bool) and SCHEMA[kind][key] in
                                                                  (int, float)), (kind, key, value)
        if kind == "dropped":
            assert all(isinstance(t, float) for t in record["times"]) and len(record["times"]) == record["count"]
    assert seen == set(SCHEMA)
    assert [field.name for field in dataclasses.fields(ChunkDone)] == list(SCHEMA["chunk"])


def test_refusals_name_the_argument_before_anything_runs(model):
    clock = FakeClock()
    stream = make_stream(model)
    source = ListSource(live_frames(8), clock)
    bad = [({"max_lag": 2.9}, r"^max_lag: a chunk of 4 frames at 1 fps takes 3 s to arrive; expected at least"),
           ({"max_lag": float("inf")}, r"^max_lag: "), ({"chunk_frames": 0}, r"^chunk_frames"),
           ({"ask_at": [(-1.0, QUESTION)]}, r"^ask_at: expected video seconds >= 0"),
           ({"ask_at": [(1.0, " ")]}, r"^ask_at: expected a non-empty question"),
           ({"ask_at": ["10s:what"]}, r"^ask_at: expected \(video seconds, question\) pairs"),
           ({"watch": ""}, r"^watch: expected a non-empty string"), ({"max_new_tokens": 0}, r"^max_new_tokens")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            LiveSession(stream, source, clock=clock, **kwargs)
    with pytest.raises(ValueError, match=r"^stream: a live session feeds one source; expected a stream of "
                                         r"batch_size 1, got 2"):
        LiveSession(HermesStream(model, processor(), batch_size=2, chunk_frames=CHUNK, frame_size=(8, 8), budget=64),
                    source, clock=clock)
    source.fps = 0
    with pytest.raises(ValueError, match=r"^source: expected a positive sampling rate source.fps, got 0"):
        LiveSession(stream, source, clock=clock)
    source.fps = FPS
    session = LiveSession(stream, source, clock=clock)
    with pytest.raises(ValueError, match=r"^question: expected a non-empty string"):
        session.ask("  ")
    assert source.taken == 0 and stream.cache.length == len(stream.prefix_ids)
    list(session.run())
    with pytest.raises(RuntimeError, match=r"^session: run\(\) was called already"):
        next(session.run())


def test_the_chunk_defaults_to_what_the_stream_was_sized_for(model):
    """chunk_frames from the stream's chunk_tokens (whole temporal steps); max_lag one chunk's duration."""
    clock = FakeClock()
    for frames, want in ((4, 4), (6, 6), (5, 6)):
        stream = HermesStream(model, processor(), chunk_frames=frames, frame_size=(8, 8), budget=64)
        session = LiveSession(stream, ListSource([], clock), clock=clock)
        assert (session.chunk_frames, session.max_lag) == (want, want / FPS)
