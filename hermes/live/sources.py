"""Live sources of sampled frames (docs/live.md#sources): a local file, as fast as it decodes or paced by its own
clock, and a network URL, a capture device or a container stream on standard input, each decoded by PyAV/FFmpeg in a
reader thread. A URL opens only the FFmpeg protocols its scheme needs; a file's or a pipe's name and bytes open
nothing but local files. Video time comes from the source's timestamps and never runs backwards, also across a
reconnect; an end, a disconnect, a stall and corrupt packets are told apart. Frames are bounded as files are
(docs/security.md#video).
"""
from __future__ import annotations

import collections
import math
import os
import re
import select
import stat
import sys
import threading
import time
import urllib.parse
from fractions import Fraction
from typing import Callable

import numpy as np

from hermes.live.frames import LiveFrame, LiveSource, SourceEnded
from hermes.video import VideoReader, _av, _rgb, as_fraction

# FFmpeg protocols a URL of each scheme may open, and no others (docs/live.md#sources)
PROTOCOLS = {
    "rtsp": "tcp,udp,rtp",  # RTSP is a demuxer: it talks over TCP; media come as RTP over UDP, or over that TCP link
    "rtmp": "rtmp,tcp",
    "srt": "srt",  # libsrt brings its own UDP sockets
    "udp": "udp",
    "tcp": "tcp",
    "http": "http,tcp",
    "https": "https,tls,tcp",  # HTTP over FFmpeg's TLS protocol over TCP
}
KINDS = f"a URL ({', '.join(PROTOCOLS)}), /dev/videoN or -"
QUEUED = 256  # sampled frames a source holds for its consumer (683 x 384 px frames: 200 MiB)
RETRY_WAIT = 1.0  # s before each reconnect
POLL = 0.1  # s between looks at close() while a pipe waits for data
CLOSE_WAIT = 1.0  # s close() waits for the reader thread to finish
_DEVICE = re.compile(r"/dev/video[0-9]+")
# what a model's processor keeps of a frame: (height, width), or a function of the source's size that returns it
Keep = tuple[int, int] | Callable[[int, int], tuple[int, int] | None] | None


def check_live_source(spec) -> str:
    """The kind of a live source, "url", "device" or "pipe", or ValueError: one line starting "live: " that names
    --live. Opens nothing, so a command line refuses a source before it loads weights.

    url:     a scheme of PROTOCOLS, written in lower case, then "://" and a host; no spaces or control characters.
    device:  /dev/videoN, an existing character device (a V4L2 capture device).
    pipe:    "-", a container stream (such as MPEG-TS) on standard input.
    """
    if spec == "-":
        return "pipe"
    if isinstance(spec, str) and _DEVICE.fullmatch(spec):
        try:
            mode = os.stat(spec).st_mode
        except OSError as err:
            raise ValueError(f"live: --live {spec}: no such capture device ({err.strerror})") from None
        if not stat.S_ISCHR(mode):
            raise ValueError(f"live: --live {spec} is not a capture device")
        return "device"
    if isinstance(spec, str) and spec.isprintable() and " " not in spec:
        scheme, separator, _ = spec.partition("://")
        try:
            host = urllib.parse.urlsplit(spec).netloc
        except ValueError:  # a malformed host ("[::1")
            host = ""
        if scheme in PROTOCOLS and separator and host:
            return "url"
    raise ValueError(f"live: --live expects {KINDS}, got {spec!r}")


def open_source(source: str, *, live: bool, fps: float, keep: Keep = None, realtime: bool = False,
                open_timeout: float = 10.0, stall_timeout: float = 10.0, reconnect: int = 0) -> LiveSource:
    """A started source of frames sampled at `fps` (frames per second of video time) and scaled to what a model's
    processor keeps (`keep` = (height, width), VideoReader.output_size; or a function of the source's own (height,
    width) that returns it, for a source whose size is known once it is open:
    `family.kept_size(processor, height, width)`).

    live=False: `source` is a local file (FileSource), played as fast as it decodes or, `realtime`, at its own speed.
    live=True: `source` is a URL, /dev/videoN or "-" (check_live_source; StreamSource): opened within `open_timeout`
    s, ended after `stall_timeout` s without a frame, reopened up to `reconnect` times (a URL only).
    A bad argument is a ValueError naming it; a refused or unopenable live source one line starting "live: ".
    """
    if isinstance(reconnect, bool) or not isinstance(reconnect, int) or reconnect < 0:
        raise ValueError(f"reconnect: expected a non-negative int, got {reconnect!r}")
    if not live:
        if reconnect:
            raise ValueError("reconnect: only a network source (--live URL) is reopened, not a file")
        return FileSource(source, fps=fps, keep=keep, realtime=realtime)
    if realtime:
        raise ValueError("realtime: plays a file at its own speed; a --live source sets its own")
    return StreamSource(source, fps=fps, keep=keep, open_timeout=open_timeout, stall_timeout=stall_timeout,
                        reconnect=reconnect)


class _Source:
    """What both sources share: the reader thread, the queue between it and `get`, the counters, close()."""

    def __init__(self, fps: float, paced: bool):
        self.fps = float(fps)
        self.frame_size: tuple[int, int] = (0, 0)  # set by the source once it is open
        self._paced = paced
        self._frames: collections.deque[LiveFrame] = collections.deque()
        self._changed = threading.Condition()  # guards _frames, _ended and _counts
        self._ended: str | None = None
        self._counts = dict.fromkeys(("decoded", "sampled", "corrupt_packets", "reconnects", "overflow"), 0)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hermes-live-{type(self).__name__}", daemon=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, timeout: float | None = None) -> LiveFrame | None:
        """The oldest frame not taken yet, waiting up to `timeout` s (None: until one comes), else None; SourceEnded
        once the source ended and every frame was taken."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._frames or self._ended is not None, timeout):
                return None
            if self._frames:
                frame = self._frames.popleft()
                self._changed.notify_all()  # a reader may wait for room
                return frame
            raise SourceEnded(self._ended)

    def stats(self) -> dict[str, int]:
        """Counters so far: frames "decoded" and "sampled", "corrupt_packets" skipped, "reconnects" made, frames
        dropped by a full queue ("overflow")."""
        with self._changed:
            return dict(self._counts)

    def close(self) -> None:
        """Stop the reader (frames not taken are dropped; SourceEnded("closed") from now on unless the source had
        ended) and wait up to CLOSE_WAIT s for it to release the source. Idempotent."""
        self._closing.set()
        with self._changed:
            self._frames.clear()
            self._ended = self._ended or "closed"
            self._changed.notify_all()
        self._thread.join(CLOSE_WAIT)

    def _read(self) -> str:
        """Decode, sample and `_put` frames until the source ends (run by the reader thread); why it ended."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            reason = self._read()
        except Exception as err:  # a reader that fails must still end the source: get() would wait for ever
            reason = f"reader failed: {type(err).__name__}: {err}"
        with self._changed:
            self._ended = self._ended or reason
            self._changed.notify_all()

    def _count(self, name: str, number: int = 1) -> None:
        with self._changed:
            self._counts[name] += number

    def _put(self, time_: float, pixels: np.ndarray, arrived: float | None) -> None:
        """Queue a sampled frame: a paced source drops the oldest past QUEUED frames, any other waits for room."""
        with self._changed:
            if not self._paced:
                self._changed.wait_for(lambda: len(self._frames) < QUEUED or self._closing.is_set())
            if self._closing.is_set():
                return
            if len(self._frames) >= QUEUED:
                self._frames.popleft()
                self._counts["overflow"] += 1
            self._frames.append(LiveFrame(self._counts["sampled"], time_, pixels, arrived))
            self._counts["sampled"] += 1
            self._changed.notify_all()


class _CountingReader(VideoReader):
    """A VideoReader that calls `counted()` for each frame it decodes."""

    def __init__(self, path, counted):
        self.counted = counted
        super().__init__(path)

    def decoded(self, max_gap=None):
        for item in super().decoded(max_gap):
            self.counted()
            yield item


class FileSource(_Source):
    """A local video file as a live source: VideoReader's frames, times, checks and "video:" errors, the frames
    --video gives (sampled at k / fps by `sample_by_time`, scaled to output_size(keep)).

    realtime=False: frames as fast as they decode, `arrived` None. The reader waits while QUEUED frames wait, so
        nothing is dropped.
    realtime=True: paced by the file's own clock as a camera is: the frame for video time t is sampled at the wall
        time the reader started + t, `arrived` = time.monotonic() then; past QUEUED waiting frames the oldest is
        dropped and counted ("overflow").
    The source ends with "end of stream", or with the reader's "video:" error as its reason (a decoding failure,
    timestamps that jump too far).
    """

    def __init__(self, path, *, fps: float, keep: Keep = None, realtime: bool = False):
        super().__init__(fps, paced=realtime)
        self._reader = _CountingReader(path, lambda: self._count("decoded"))
        try:
            keep = _kept(keep, self._reader)
            self._chunks = self._reader.chunks(fps, 1, keep)  # checks fps and keep
            self.frame_size = self._reader.output_size(keep)
        except ValueError:
            self._reader.close()
            raise
        self._thread.start()

    def _read(self) -> str:
        start = time.monotonic()
        with self._reader:
            try:
                for chunk in self._chunks:
                    if self._closing.wait(max(0.0, start + chunk.start - time.monotonic()) if self._paced else 0):
                        return "closed"
                    self._put(chunk.start, chunk.frames[0], time.monotonic() if self._paced else None)
            except ValueError as err:
                return str(err)
        return "end of stream"


class _Pipe:
    """Standard input as the file FFmpeg reads a piped stream from. A read waits for data in steps of POLL s, so
    that it sees close() (and returns b"", the end) and gives up after `wait` s without a byte, raising
    TimeoutError (PyAV passes it through): the open timeout while opening, the stall timeout after."""

    def __init__(self, file, closing: threading.Event):
        self.fd, self.closing, self.wait = file.fileno(), closing, 0.0

    def read(self, size: int) -> bytes:
        deadline = time.monotonic() + self.wait
        while not self.closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no data for {self.wait:g} s")
            if select.select([self.fd], [], [], min(left, POLL))[0]:
                return os.read(self.fd, size)
        return b""


class _LiveReader(VideoReader):
    """VideoReader's checks (a video stream; its declared size within MAX_SIDE and MAX_PIXELS; decoders limited to
    MAX_PIXELS) and scaling (output_size) over a live source opened by URL, device or pipe instead of a file. An
    open that fails, or takes over `open_timeout` s, is one line naming --live (and --open-timeout)."""

    def __init__(self, spec: str, kind: str, pipe: _Pipe | None, open_timeout: float, stall_timeout: float):
        self.kind, self.pipe, self.timeouts = kind, pipe, (open_timeout, stall_timeout)
        super().__init__(spec)
        self.stream.thread_type = "SLICE"  # frame threads hold back a frame per thread; slice threads none

    def _open(self, av, options: dict[str, str]):
        # a frame rate is not probed: probing it reads 20 frames before the first comes out (20 s at 1 fps)
        settings = dict(options=options, container_options={"fpsprobesize": "0"}, metadata_errors="replace")
        try:
            if self.kind == "url":
                settings["container_options"]["protocol_whitelist"] = PROTOCOLS[self.path.partition("://")[0]]
                return av.open(self.path, timeout=self.timeouts, **settings)
            if self.kind == "device":
                return av.open(self.path, format="v4l2", timeout=self.timeouts, **settings)
            settings["container_options"]["protocol_whitelist"] = "file"  # what a stream names opens nothing remote
            self.pipe.wait = self.timeouts[0]
            container = av.open(self.pipe, **settings)
            self.pipe.wait = self.timeouts[1]
            return container
        except (av.error.FFmpegError, OSError) as err:
            why = f"did not open within --open-timeout {self.timeouts[0]:g} s" \
                if isinstance(err, (av.error.ExitError, TimeoutError)) else _why(err)
            raise ValueError(f"live: cannot open --live {self.path!r}: {why}") from err


def _kept(keep: Keep, reader: VideoReader) -> tuple[int, int] | None:
    """`keep` as (height, width) or None for an open reader: a function of its size called on it."""
    return keep(*reader.size) if callable(keep) else keep


def _why(err: Exception) -> str:
    """An FFmpeg or OS error in words, without the URL PyAV appends."""
    return getattr(err, "strerror", None) or str(err)


class StreamSource(_Source):
    """A live source: a network URL, a capture device or a container stream on standard input (check_live_source),
    sampled at `fps` while it plays; `arrived` = time.monotonic() when a frame was sampled.

    Time: a frame's own timestamp (pts * time_base) from the first frame's (0). A frame is sampled as soon as its
    time reaches the next sample time k / fps (no wait for the frame after it; no repeats across a gap), the next
    sample time then being the first k / fps after it. A frame whose time does not come after the latest one is
    skipped, as is a frame without a timestamp. After a reconnect the new connection's first frame comes 1 / fps
    after the last one before it and its timestamps count from there: time never runs backwards.
    Faults, each SourceEnded's reason: "end of stream" (the source ended); "disconnected: WHY" (a read failed);
    "stalled for N s" (no frame after the latest for `stall_timeout` s: FFmpeg's read timeout, a pipe's, or packets
    that bring none). A URL is reopened after any of them, RETRY_WAIT s later, while `reconnect` retries are left.
    A packet the demuxer marks corrupt or the decoder refuses is skipped and counted ("corrupt_packets").
    Queue: at most QUEUED frames wait; past that the oldest is dropped and counted ("overflow"), so a consumer
    that never reads holds bounded memory.
    close(): the reader stops at its next packet. A read that blocks returns within `stall_timeout` s (FFmpeg's
    read timeout; a pipe's read within POLL s) and the reader then releases the source; close() waits for it at
    most CLOSE_WAIT s.
    """

    def __init__(self, spec: str, *, fps: float, keep: Keep = None, open_timeout: float = 10.0,
                 stall_timeout: float = 10.0, reconnect: int = 0):
        self._kind = check_live_source(spec)
        if reconnect and self._kind != "url":
            raise ValueError(f"reconnect: only a network source (--live URL) is reopened, not {spec!r}")
        self._step = 1 / as_fraction(fps, "fps")
        self._timeouts = tuple(float(as_fraction(value, name)) for value, name in
                               ((open_timeout, "open_timeout"), (stall_timeout, "stall_timeout")))
        super().__init__(fps, paced=True)
        self._spec, self._reconnect = spec, reconnect
        self._pipe = _Pipe(sys.stdin.buffer, self._closing) if self._kind == "pipe" else None
        self._next, self._latest = Fraction(0), None  # video time of the next sample, of the latest frame
        reader = self._open()
        try:
            self.frame_size = reader.output_size(_kept(keep, reader))
        except ValueError:
            reader.close()
            raise
        self._first_reader = reader
        self._thread.start()

    def _open(self) -> _LiveReader:
        return _LiveReader(self._spec, self._kind, self._pipe, *self._timeouts)

    def _read(self) -> str:
        reader, retries = self._first_reader, self._reconnect
        while True:
            with reader:
                ended = self._follow(reader)
            reader, failure = None, None
            while reader is None and retries and not self._closing.is_set():
                retries -= 1
                if self._closing.wait(RETRY_WAIT):
                    break
                try:
                    reader = self._open()
                except ValueError as err:
                    failure = err
            if reader is None:
                return ended if failure is None else f"{ended}; reconnecting failed: {failure}"
            self._count("reconnects")

    def _follow(self, reader: _LiveReader) -> str:
        """Sample one connection until it ends; why it ended."""
        av = _av()
        stalled = f"stalled for {self._timeouts[1]:g} s"
        origin = None  # (this connection's first timestamp, the video time it stands for)
        # when a frame last came after the latest one: packets of other streams, packets that decode to nothing and
        # frames that do not advance keep no stalled source alive
        heard = time.monotonic()
        try:
            for packet in _packets(reader.container):
                if self._closing.is_set():
                    return "closed"
                for frame in self._decode(packet) if packet.stream_index == reader.stream.index else ():
                    stamp = frame.pts * Fraction(frame.time_base)
                    if origin is None:
                        origin = (stamp, Fraction(0) if self._latest is None else self._latest + self._step)
                    if self._sample(stamp - origin[0] + origin[1], frame):
                        heard = time.monotonic()
                if time.monotonic() - heard > self._timeouts[1]:
                    return stalled
        except (av.error.ExitError, TimeoutError):  # FFmpeg's read timeout (its interrupt), a pipe's
            return stalled
        except (av.error.FFmpegError, OSError) as err:
            return f"disconnected: {_why(err)}"
        return "end of stream"

    def _decode(self, packet) -> list:
        """The frames of `packet` that carry a timestamp; none for a corrupt packet (counted)."""
        av = _av()
        if packet.is_corrupt:  # the demuxer saw data missing (MPEG-TS: a continuity counter that jumps)
            self._count("corrupt_packets")
            return []
        try:
            frames = packet.decode()
        except av.error.FFmpegError:  # the decoder refused the packet; the next ones may decode
            self._count("corrupt_packets")
            return []
        self._count("decoded", len(frames))
        return [frame for frame in frames if frame.pts is not None]

    def _sample(self, time_: Fraction, frame) -> bool:
        """Sample the frame at video time `time_` if it is due; whether it came after the latest frame."""
        if self._latest is not None and time_ <= self._latest:  # not after the latest frame: never on screen
            return False
        self._latest = time_
        if time_ >= self._next:
            self._next = (math.floor(time_ / self._step) + 1) * self._step
            self._put(float(time_), _rgb(frame, self.frame_size), time.monotonic())
        return True


def _packets(container):
    """The packets of every stream of `container` (PyAV's demux), up to its end. PyAV 18 ends a stream in which a
    new elementary stream appeared (an MPEG-TS program change, or a garbled one) by flushing that stream through
    an index it does not hold: the IndexError it raises then is the end."""
    packets = container.demux()
    while True:
        try:
            packet = next(packets)
        except (StopIteration, IndexError):
            return
        yield packet
