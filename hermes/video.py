"""Decode a video file with PyAV and sample its frames at a fixed rate by timestamp (the input side of the CLI).

Sampling follows presentation time, never frame counts, so variable-frame-rate files come out evenly spaced.
Time 0 is the first decoded frame; the sample for time t_k = k / fps (k = 0, 1, ...) is the frame on screen at
t_k: the last frame whose timestamp is <= t_k. A 4 fps file sampled at 1 fps gives frames 0, 4, 8, ...; a gap
in the file longer than 1 / fps repeats the frame shown during it (the picture did not change); sampling ends
at the last frame's timestamp. Timestamps are compared as exact fractions (pts x time_base vs k / fps), so a
frame at exactly t_k is never lost to rounding. Frames whose timestamp does not increase (broken muxing) are
skipped.

Needs PyAV (`pip install -e ".[video]"`); importing this module does not.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from fractions import Fraction
from typing import Iterable, Iterator, TypeVar

import numpy as np

Payload = TypeVar("Payload")


@dataclasses.dataclass
class Chunk:
    """Consecutive sampled frames, the unit fed to the model.

    index:   chunk number from 0.
    frames:  uint8 [F, H, W, 3] RGB.
    times:   seconds from the first frame, one sample time k / fps per frame.
    sources: index of each frame in the decoded stream (0 = first decoded frame).
    """

    index: int
    frames: np.ndarray
    times: list[float]
    sources: list[int]

    @property
    def start(self) -> float:
        return self.times[0]

    @property
    def end(self) -> float:
        return self.times[-1]


def as_fraction(value: float | int | Fraction, name: str) -> Fraction:
    """A positive finite number as an exact fraction (floats: the nearest with denominator <= 10^6)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)) or not math.isfinite(value) or \
            value <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return Fraction(value).limit_denominator(10**6)


def sample_by_time(frames: Iterable[tuple[Fraction, Payload]], fps: float | Fraction) \
        -> Iterator[tuple[Fraction, int, Payload]]:
    """Yield (sample time t_k, frame index, payload) for the frame on screen at each t_k = k / fps.

    frames: (timestamp, payload) in presentation order; timestamps in seconds, exact (Fraction) or float. Sample
    times count from the first frame's timestamp. Lazy: a sample is yielded once the next frame (or the end)
    shows that no later frame starts at or before it.
    """
    step = 1 / as_fraction(fps, "fps")
    start = previous = None     # previous: (time from start, index, payload) of the frame on screen now
    k = 0
    for index, (time, payload) in enumerate(frames):
        time = Fraction(time)
        if start is None:
            start = time
        time -= start
        if previous is not None:
            if time <= previous[0]:
                continue
            while k * step < time:      # t_k falls in [previous frame's time, this frame's time)
                yield k * step, previous[1], previous[2]
                k += 1
        previous = (time, index, payload)
    if previous is not None and k * step <= previous[0]:
        yield k * step, previous[1], previous[2]


def _av():
    try:
        import av
    except ImportError as err:
        raise ImportError("video: decoding needs PyAV; install it with pip install -e \".[video]\"") from err
    return av


class VideoReader:
    """One video file opened with PyAV (a context manager); `chunks()` streams its sampled frames.

    Opening checks the file: a missing path raises FileNotFoundError, a file PyAV cannot read or one without a
    video stream raises ValueError; errors while decoding raise ValueError with the time reached. All messages
    start with "video:".
    """

    def __init__(self, path: str | os.PathLike):
        av = _av()
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"video: no such file: {self.path}")
        try:
            self.container = av.open(self.path)
        except av.error.FFmpegError as err:
            raise ValueError(f"video: cannot read {self.path}: {err}") from err
        if not self.container.streams.video:
            self.container.close()
            raise ValueError(f"video: {self.path} has no video stream")
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"

    def __enter__(self) -> "VideoReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.container.close()

    @property
    def duration(self) -> float | None:
        """Seconds, from the stream header (else the container's), or None when neither says."""
        if self.stream.duration is not None and self.stream.time_base is not None:
            return float(self.stream.duration * self.stream.time_base)
        if self.container.duration is not None:
            return self.container.duration / 1_000_000  # AV_TIME_BASE
        return None

    def decoded(self) -> Iterator[tuple[Fraction, object]]:
        """(timestamp in seconds, av.VideoFrame) in presentation order."""
        av = _av()
        reached = 0.0
        try:
            for frame in self.container.decode(self.stream):
                if frame.pts is None or frame.time_base is None:
                    raise ValueError(f"video: {self.path} has a frame without a timestamp after {reached:.2f} s; "
                                     "remux it (e.g. ffmpeg -i IN -c copy OUT.mp4)")
                time = frame.pts * Fraction(frame.time_base)
                reached = float(time)
                yield time, frame
        except av.error.FFmpegError as err:
            raise ValueError(f"video: decoding {self.path} failed after {reached:.2f} s: {err}") from err

    def chunks(self, fps: float, chunk_frames: int) -> Iterator[Chunk]:
        """Frames sampled at `fps` (see the module docstring) in chunks of `chunk_frames`; the last chunk holds
        what is left and may be shorter."""
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames: expected a positive int, got {chunk_frames!r}")
        frames, times, sources, index = [], [], [], 0
        for time, source, frame in sample_by_time(self.decoded(), fps):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(time))
            sources.append(source)
            if len(frames) == chunk_frames:
                yield Chunk(index, np.stack(frames), times, sources)
                frames, times, sources, index = [], [], [], index + 1
        if frames:
            yield Chunk(index, np.stack(frames), times, sources)


_CLOCK = re.compile(r"^(?:(\d+):)?(\d+):(\d+(?:\.\d*)?)$")


def parse_time(text: str) -> float:
    """Seconds from "90", "90s", "90.5s", "1:30" or "1:02:03" (h:m:s); ValueError otherwise."""
    value = text.strip()
    clock = _CLOCK.match(value)
    try:
        if clock:
            hours, minutes, seconds = clock.groups()
            if float(seconds) >= 60 or (hours is not None and int(minutes) >= 60):
                raise ValueError
            result = int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)
        else:
            result = float(value[:-1] if value.endswith("s") else value)
    except ValueError:
        result = None
    if result is None or not math.isfinite(result) or result < 0:
        raise ValueError(f"time: expected seconds (30, 30s, 12.5s) or [h:]m:s (1:30), got {text!r}")
    return result
