"""Decode a video file with PyAV and sample its frames at a fixed rate by timestamp (the input side of the CLI).

Sampling follows presentation time, never frame counts, so variable-frame-rate files come out evenly spaced
(`sample_by_time`). A file is untrusted input: frames are scaled at decode time to what the model's processor keeps,
and MAX_SIDE, MAX_PIXELS, MAX_CHUNK_BYTES and MAX_REPEATS bound what one file may ask; each refusal is one "video:"
line. Needs PyAV (`pip install -e ".[video]"`); importing this module does not. docs/cli.md#stream-a-video-file,
docs/security.md#video.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import re
from fractions import Fraction
from typing import Iterable, Iterator, TypeVar

import numpy as np

Payload = TypeVar("Payload")

# What one file may ask of the reader (docs/security.md#video)
MAX_SIDE = 8192  # px, either side of a decoded frame (8K UHD is 7680 x 4320)
MAX_PIXELS = 8192 * 4320  # px of one decoded frame; FFmpeg's decoders refuse larger ones before allocating them
MAX_CHUNK_BYTES = 2 ** 30  # bytes of one chunk's frames, uint8 RGB
MAX_REPEATS = 3600  # samples one decoded frame may fill: an hour's gap at 1 fps


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
    """Yield (sample time t_k, frame index, payload) for the frame on screen at each t_k = k / fps: the last frame
    whose timestamp is <= t_k.

    frames: (timestamp, payload) in presentation order; timestamps in seconds, exact (Fraction) or float. Sample
    times count from the first frame's timestamp (time 0). A 4 fps file sampled at 1 fps gives frames 0, 4, 8, ...;
    a gap longer than 1 / fps repeats the frame shown during it (the picture did not change); sampling ends at the
    last frame's timestamp. Times are compared as exact fractions, so a frame at exactly t_k is never lost to
    rounding. A frame whose timestamp does not come after the latest one (broken muxing) is skipped. Lazy: a sample
    is yielded once the next frame (or the end) shows that no later frame starts at or before it.
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

    Opening checks the file: a missing path raises FileNotFoundError; a file PyAV cannot read, one without a video
    stream, or one whose frames are of unknown size or over MAX_SIDE / MAX_PIXELS raises ValueError. Errors while
    decoding raise ValueError with the time reached. All messages start with "video:". `size` is the stream's
    (height, width).
    """

    file = None  # the Python file object FFmpeg reads the file through (None where a subclass opens no file)

    def __init__(self, path: str | os.PathLike):
        av = _av()
        self.path = os.fspath(path)
        limit = {"max_pixels": str(MAX_PIXELS)}  # also while PyAV probes the streams on opening
        try:
            self.container = self._open(av, limit)
        except av.error.FFmpegError as err:
            raise ValueError(f"video: cannot read {self.path}: {err}") from err
        try:
            if not self.container.streams.video:
                raise ValueError(f"video: {self.path} has no video stream")
            self.stream = self.container.streams.video[0]
            if self.stream.codec_context is None:  # a codec FFmpeg does not know
                raise ValueError(f"video: {self.path}: its video stream is in a format PyAV cannot decode")
            self.stream.thread_type = "AUTO"
            self.stream.codec_context.options = limit
            width, height = self.stream.codec_context.width, self.stream.codec_context.height
            if width < 1 or height < 1:
                raise ValueError(f"video: {self.path}: the size of its frames is unknown: no frame could be probed, "
                                 f"or they are over {MAX_PIXELS} px, which are not decoded")
            if max(width, height) > MAX_SIDE or width * height > MAX_PIXELS:
                raise ValueError(f"video: {self.path} declares {width} x {height} px frames; the reader decodes "
                                 f"at most {MAX_SIDE} px a side and {MAX_PIXELS} px a frame")
        except ValueError:
            self.close()
            raise
        self.size = (height, width)

    def __enter__(self) -> "VideoReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, av, options: dict[str, str]):
        """The container of the file at `path`, read through a Python file object: FFmpeg never reads the name
        as a URL or a protocol (`http://host/x.mp4` and `take:2.mp4` are files), and what the file holds (an HLS
        playlist, a concat list) may open other local files at most (`protocol_whitelist`). The live sources
        (`hermes.live.sources`) open theirs in their own way and reuse the checks."""
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"video: no such file: {self.path}")
        self.file = _LocalFile(self.path)
        try:
            return av.open(self.file, options=options, container_options={"protocol_whitelist": "file"},
                           metadata_errors="replace")
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.container.close()
        if self.file is not None:
            self.file.close()

    @property
    def duration(self) -> float | None:
        """Seconds, from the stream header (else the container's), or None when neither says."""
        if self.stream.duration is not None and self.stream.time_base is not None:
            return float(self.stream.duration * self.stream.time_base)
        if self.container.duration is not None:
            return self.container.duration / 1_000_000  # AV_TIME_BASE
        return None

    def output_size(self, keep: tuple[int, int] | None = None) -> tuple[int, int]:
        """(height, width) of the frames `chunks(..., keep=keep)` delivers: the stream's `size`, or when `keep`
        = (height, width) is smaller on both sides, the smallest size of the stream's aspect ratio that covers
        it (each side rounded up): what a model's processor keeps of a frame, and no more."""
        if keep is None:
            return self.size
        if not isinstance(keep, (tuple, list)) or len(keep) != 2 or \
                any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in keep):
            raise ValueError(f"keep: expected (height, width) as two positive ints, got {keep!r}")
        height, width = self.size
        scale = max(Fraction(keep[0], height), Fraction(keep[1], width))
        if scale >= 1:
            return self.size
        return math.ceil(height * scale), math.ceil(width * scale)

    def decoded(self, max_gap: float | Fraction | None = None) -> Iterator[tuple[Fraction, object]]:
        """(timestamp in seconds, av.VideoFrame) in presentation order; ValueError when no frame decodes at all, or
        when a timestamp comes more than `max_gap` seconds after the latest one before it."""
        av = _av()
        reached, latest = 0.0, None
        try:
            for frame in self.container.decode(self.stream):
                if frame.pts is None or frame.time_base is None:
                    raise ValueError(f"video: {self.path} has a frame without a timestamp after {reached:.2f} s; "
                                     "remux it (e.g. ffmpeg -i IN -c copy OUT.mp4)")
                time = frame.pts * Fraction(frame.time_base)
                if max_gap is not None and latest is not None and time - latest > max_gap:
                    raise ValueError(f"video: {self.path} jumps from {float(latest):.2f} s to {float(time):.2f} s, "
                                     f"a gap of over {float(max_gap):g} s that would repeat one frame over "
                                     f"{MAX_REPEATS} times; its timestamps are broken, or lower fps")
                latest = time if latest is None else max(latest, time)
                reached = float(time)
                yield time, frame
        except av.error.FFmpegError as err:
            raise ValueError(f"video: decoding {self.path} failed after {reached:.2f} s: {err}") from err
        if latest is None:
            raise ValueError(f"video: {self.path} has no video frames (none of its video stream decodes)")

    def chunks(self, fps: float, chunk_frames: int, keep: tuple[int, int] | None = None) -> Iterator[Chunk]:
        """Frames sampled at `fps` (`sample_by_time`) in chunks of `chunk_frames`, scaled to
        `output_size(keep)` as they are decoded; the last chunk holds what is left and may be shorter. The
        arguments are checked at the call: a chunk of chunk_frames frames over MAX_CHUNK_BYTES is a ValueError."""
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames: expected a positive int, got {chunk_frames!r}")
        step = 1 / as_fraction(fps, "fps")
        height, width = self.output_size(keep)
        size = chunk_frames * height * width * 3
        if size > MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_frames: {chunk_frames} frames of {width} x {height} px would hold "
                             f"{size / 2 ** 30:.1f} GiB, over the {MAX_CHUNK_BYTES / 2 ** 30:g} GiB one chunk may "
                             f"hold; lower chunk_frames")
        return self._chunks(fps, chunk_frames, MAX_REPEATS * step, (height, width))

    def _chunks(self, fps, chunk_frames: int, max_gap: Fraction, size: tuple[int, int]) -> Iterator[Chunk]:
        frames, times, sources, index = [], [], [], 0
        last = (None, None)  # (source, its RGB array): a frame sampled again is not converted again
        for time, source, frame in sample_by_time(self.decoded(max_gap), fps):
            if source != last[0]:
                last = (source, _rgb(frame, size))
            frames.append(last[1])
            times.append(float(time))
            sources.append(source)
            if len(frames) == chunk_frames:
                yield Chunk(index, np.stack(frames), times, sources)
                frames, times, sources, index = [], [], [], index + 1
        if frames:
            yield Chunk(index, np.stack(frames), times, sources)


class _LocalFile(io.FileIO):
    """A local file opened for FFmpeg to read through PyAV. A seek that fails (a corrupt index pointing before
    the start) returns FFmpeg's error code, -errno, as FFmpeg's own file protocol does: raised, PyAV would pass
    the OSError through instead of an av.error.FFmpegError."""

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        try:
            return super().seek(offset, whence)
        except OSError as err:
            return -err.errno


class VideoClip:
    """A video file as a clip for the H2SVC profiler (`hermes.policies.h2svc.profile.profile_heads`): checked when
    made (FileNotFoundError / ValueError "video: ..."), opened anew for each pass over its frames."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        with VideoReader(self.name) as reader:
            self.duration = reader.duration

    def chunks(self, fps: float, chunk_frames: int) -> Iterator[np.ndarray]:
        """uint8 [F, H, W, 3] RGB frames sampled at `fps`, `chunk_frames` at a time (`VideoReader.chunks`)."""
        with VideoReader(self.name) as reader:
            for chunk in reader.chunks(fps, chunk_frames):
                yield chunk.frames


def _rgb(frame, size: tuple[int, int]) -> np.ndarray:
    """uint8 [height, width, 3] RGB of an av.VideoFrame at `size` = (height, width): scaled by swscale (bicubic,
    which averages over the source when shrinking) only when its size differs."""
    if (frame.height, frame.width) == size:
        return frame.to_ndarray(format="rgb24")
    return frame.to_ndarray(format="rgb24", height=size[0], width=size[1], interpolation="BICUBIC")


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
