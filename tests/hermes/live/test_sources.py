"""hermes.live.sources (docs/live.md#sources): MPEG-TS streamed to the end over TCP, UDP, HTTP and a pipe (in-process
and on a subprocess's standard input) with each frame's time and content checked; files as fast as they decode and
in real time; a disconnect, a reset, a stall, timestamps that stop advancing, a reconnect, corrupt packets; the
bounded queue; refusals in one line before anything opens; close() while a read blocks. All on 127.0.0.1, each
server started and stopped by its test, every wait bounded."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types

import av
import numpy as np
import pytest

from hermes import video
from hermes.live import sources
from hermes.live.frames import SourceEnded
from hermes.live.sources import FileSource, StreamSource, check_live_source, open_source
from hermes.video import VideoReader
from tests.hermes.live.servers import (HEIGHT, WIDTH, HttpServer, PipeWriter, TcpServer, UdpSender, frame_number,
                                       free_port, garble, ts_chunks, wait_until)
from tests.hermes.video_files import write_video
from tests.utils import REPO

FPS = 8  # frames per second the servers send; the sources sample at 4: every second frame


def drain(source, seconds: float = 20.0) -> tuple[list, str]:
    """Every frame `source` delivers until it ends, and why it ended; fails if it has not ended within `seconds`."""
    frames, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = source.get(timeout=0.5)
        except SourceEnded as end:
            return frames, end.reason
        if frame is not None:
            frames.append(frame)
    pytest.fail(f"the source did not end within {seconds} s ({len(frames)} frames)")


def check_every_second_frame(frames, count: int, size=(HEIGHT, WIDTH)) -> None:
    """Frames 0, 2, 4, ... of a FPS stream sampled at FPS / 2: sample numbers from 0, times k / 4 s from 0,
    each showing the frame it stands for, arrived (wall time) in order."""
    assert [f.index for f in frames] == list(range(count))
    assert [f.time for f in frames] == [k / 4 for k in range(count)]
    assert [frame_number(f.pixels) for f in frames] == list(range(0, 2 * count, 2))
    assert all(f.pixels.shape == (*size, 3) and f.pixels.dtype == np.uint8 for f in frames)
    arrivals = [f.arrived for f in frames]
    assert arrivals == sorted(arrivals) and all(isinstance(a, float) for a in arrivals)


def live(url: str, **kwargs):
    return open_source(url, live=True, fps=FPS // 2, **{"open_timeout": 10, "stall_timeout": 5, **kwargs})


# ---- streamed to the end -------------------------------------------------------------------------------------------
def test_tcp_stream_to_the_end():
    with TcpServer([(ts_chunks(24, FPS), "close")]) as server, live(server.url) as source:
        assert isinstance(source, StreamSource) and source.fps == 4.0 and source.frame_size == (HEIGHT, WIDTH)
        frames, reason = drain(source)
        assert source.stats() == dict(decoded=24, sampled=12, corrupt_packets=0, reconnects=0, overflow=0)
    assert reason == "end of stream"
    check_every_second_frame(frames, 12)


def test_udp_stream_to_the_end_stalls():
    """UDP has no end: after the last datagram the source stalls. Frames are scaled to what `keep` asks."""
    port = free_port(socket.SOCK_DGRAM)
    with UdpSender(ts_chunks(24, FPS), port), live(f"udp://127.0.0.1:{port}", keep=(24, 24),
                                                   stall_timeout=1) as source:
        assert source.frame_size == (24, 32)
        frames, reason = drain(source)
    assert reason == "stalled for 1 s"
    check_every_second_frame(frames, 12, size=(24, 32))


def test_http_stream_to_the_end():
    with HttpServer({"/live.ts": b"".join(ts_chunks(24, FPS))}) as server, live(server.url + "/live.ts") as source:
        frames, reason = drain(source)
    assert reason == "end of stream"
    check_every_second_frame(frames, 12)


def test_a_playlist_over_http_cannot_open_local_files(tmp_path):
    """An HLS playlist served over HTTP whose segment is a local file: the URL's protocols (http, tcp) do not
    include `file`, so the local frames never come out."""
    local = tmp_path / "local.ts"
    local.write_bytes(b"".join(ts_chunks(8, FPS)))
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile://{local}\n#EXT-X-ENDLIST\n".encode()
    with HttpServer({"/list.m3u8": playlist}) as server:
        with pytest.raises(ValueError, match=r"^live: cannot open --live 'http://.*/list\.m3u8': Invalid data"):
            live(server.url + "/list.m3u8")
        assert server.requested == ["/list.m3u8"]


@pytest.fixture
def stdin_pipe(monkeypatch):
    """A pipe in place of standard input (sys.stdin.buffer); yields the file descriptor of its write end."""
    read_end, write_end = os.pipe()
    with open(read_end, "rb") as pipe:
        monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=pipe))
        yield write_end


def test_a_pipe_read_through_standard_input(stdin_pipe):
    with PipeWriter(ts_chunks(24, FPS), stdin_pipe), live("-") as source:
        frames, reason = drain(source)
    assert reason == "end of stream"
    check_every_second_frame(frames, 12)


PIPE_READER = """
import json
from hermes.live.frames import SourceEnded
from hermes.live.sources import open_source
from tests.hermes.live.servers import frame_number
frames = []
with open_source("-", live=True, fps=4, open_timeout=30, stall_timeout=30) as source:
    while True:
        try:
            frame = source.get(timeout=30)
        except SourceEnded as end:
            reason = end.reason
            break
        frames.append([frame.time, frame_number(frame.pixels)])
print(json.dumps(dict(frames=frames, reason=reason)))
"""


def test_standard_input_of_a_process():
    """`-` in a process whose standard input another process writes MPEG-TS into, then closes."""
    done = subprocess.run([sys.executable, "-c", PIPE_READER], input=b"".join(ts_chunks(24, FPS)), cwd=REPO,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(done.stdout.decode().splitlines()[-1])
    assert result == dict(frames=[[k / 4, 2 * k] for k in range(12)], reason="end of stream")


# ---- files ---------------------------------------------------------------------------------------------------------
def expected_frames(path, fps: float, keep=None) -> tuple[list[float], np.ndarray]:
    """What --video gives: VideoReader's sampled times and frames."""
    with VideoReader(path) as reader:
        chunks = list(reader.chunks(fps, 1, keep))
    return [c.start for c in chunks], np.concatenate([c.frames for c in chunks])


def test_a_file_in_real_time_is_paced_by_its_clock(tmp_path):
    """A 2 s file sampled at 4 fps arrives over about 1.75 s of wall time (a loose lower bound), in order, with the
    frames and times --video gives."""
    path = write_video(tmp_path / "clip.mp4", [i / FPS for i in range(16)])
    start = time.monotonic()
    with open_source(path, live=False, fps=4, realtime=True) as source:
        frames, reason = drain(source)
    wall = time.monotonic() - start
    times, pixels = expected_frames(path, 4)
    assert reason == "end of stream" and [f.time for f in frames] == times == [k / 4 for k in range(8)]
    np.testing.assert_array_equal(np.stack([f.pixels for f in frames]), pixels)
    arrivals = [f.arrived for f in frames]
    assert arrivals == sorted(arrivals) and arrivals[-1] - arrivals[0] >= 0.8 * times[-1] and wall >= 0.8 * times[-1]


def test_a_file_as_fast_as_it_decodes_waits_for_its_reader(tmp_path, monkeypatch):
    """With room for 3 frames, the reader stops at 3 until they are taken; then every frame comes, none dropped,
    `arrived` None, scaled to `keep` as --video scales them."""
    monkeypatch.setattr(sources, "QUEUED", 3)
    path = write_video(tmp_path / "clip.mp4", [i / 4 for i in range(24)])
    with open_source(path, live=False, fps=4, keep=(16, 16)) as source:
        assert isinstance(source, FileSource) and source.frame_size == (16, 22)
        assert wait_until(lambda: source.stats()["sampled"] == 3, 10)
        time.sleep(0.3)
        assert source.stats()["sampled"] == 3
        frames, reason = drain(source)
        assert source.stats() == dict(decoded=24, sampled=24, corrupt_packets=0, reconnects=0, overflow=0)
    times, pixels = expected_frames(path, 4, keep=(16, 16))
    assert reason == "end of stream" and [f.time for f in frames] == times
    assert [f.index for f in frames] == list(range(24))
    np.testing.assert_array_equal(np.stack([f.pixels for f in frames]), pixels)
    assert {f.arrived for f in frames} == {None}


def test_a_file_that_fails_to_decode_ends_with_the_readers_error(tmp_path, monkeypatch):
    path = write_video(tmp_path / "clip.mp4", [i / 4 for i in range(8)])
    monkeypatch.setattr(video, "MAX_REPEATS", 1)  # one sample per decoded frame at most: 1 fps can't fill 8 fps
    with open_source(path, live=False, fps=8) as source:
        _, reason = drain(source)
    assert reason.startswith(f"video: {path} jumps from 0.00 s to 0.25 s")


# ---- the queue -----------------------------------------------------------------------------------------------------
def test_a_live_source_nobody_reads_keeps_the_newest_frames(monkeypatch):
    """Room for 4: of 12 sampled frames the 8 oldest are dropped and counted; the rest keep their numbers."""
    monkeypatch.setattr(sources, "QUEUED", 4)
    with TcpServer([(ts_chunks(24, FPS), "close")]) as server, live(server.url) as source:
        assert wait_until(lambda: source.stats()["sampled"] == 12, 10)
        frames, reason = drain(source)
        assert source.stats()["overflow"] == 8
    assert reason == "end of stream"
    assert [f.index for f in frames] == [8, 9, 10, 11] and [f.time for f in frames] == [2.0, 2.25, 2.5, 2.75]


# ---- faults --------------------------------------------------------------------------------------------------------
def delivered_a_prefix(frames, at_least: int) -> None:
    assert len(frames) >= at_least
    check_every_second_frame(frames, len(frames))


@pytest.mark.parametrize("ending,reason", [("close", "end of stream"), ("reset", "disconnected: Connection reset")])
def test_a_source_that_disconnects_midway(ending, reason):
    """The server ends the connection after 12 of 24 frames, cleanly or with a reset: the frames before it come,
    then the end."""
    with TcpServer([(ts_chunks(24, FPS)[:12], ending)], pace=0.05) as server, live(server.url) as source:
        frames, ended = drain(source)
    assert ended.startswith(reason)
    delivered_a_prefix(frames, 4)


def test_a_source_that_stalls():
    """The server sends 12 frames at once, then nothing, and keeps the connection open: stalled about 1 s later."""
    with TcpServer([(ts_chunks(24, FPS)[:12], "stall")]) as server, live(server.url, stall_timeout=1) as source:
        frames, reason = drain(source)
        ended = time.monotonic()
    assert reason == "stalled for 1 s" and ended - frames[0].arrived >= 0.5
    delivered_a_prefix(frames, 4)


def test_timestamps_that_stop_advancing_stall_while_packets_flow():
    """After 8 frames stamped from 10 s, the server sends 24 frames stamped from 0 over 2.4 s: packets keep coming
    (FFmpeg's read timeout never fires) but none comes after the latest frame, so the source stalls after 1 s.
    Only frames of the first 8 come out."""
    chunks = ts_chunks(8, FPS, start=10 * FPS) + ts_chunks(24, FPS, first=8)
    with TcpServer([(chunks, "close")], pace=0.1) as server, live(server.url, stall_timeout=1) as source:
        frames, reason = drain(source)
    assert reason == "stalled for 1 s" and len(frames) >= 2
    assert all(0 <= f.time < 1 and frame_number(f.pixels) < 8 for f in frames)


def test_reconnect_continues_the_video_time(monkeypatch):
    """Two connections, each stamped from 0: with reconnect=1 the second's first frame comes 1/4 s after the last
    frame of the first (1.375 s), and time goes on from there."""
    monkeypatch.setattr(sources, "RETRY_WAIT", 0.05)
    connections = [(ts_chunks(12, FPS), "close"), (ts_chunks(12, FPS, first=12), "close")]
    with TcpServer(connections) as server, live(server.url, reconnect=1) as source:
        frames, reason = drain(source)
        assert source.stats()["reconnects"] == 1 and server.accepted == 2
    assert reason == "end of stream"
    times, numbers = [f.time for f in frames], [frame_number(f.pixels) for f in frames]
    assert times[:6] == [k / 4 for k in range(6)] and numbers[:6] == [0, 2, 4, 6, 8, 10]
    assert times[6:] == [1.625 + k / 8 for k in (0, 1, 3, 5, 7, 9, 11)] and numbers[6:] == [12, 13, 15, 17, 19, 21, 23]
    assert [f.index for f in frames] == list(range(13))


def test_reconnect_gives_up_after_its_retries(monkeypatch):
    monkeypatch.setattr(sources, "RETRY_WAIT", 0.05)
    with TcpServer([(ts_chunks(8, FPS), "close")]) as server, live(server.url, reconnect=2, open_timeout=1) as source:
        _, reason = drain(source)
        assert source.stats()["reconnects"] == 0
    assert reason == f"end of stream; reconnecting failed: live: cannot open --live '{server.url}': Connection refused"


def test_corrupt_packets_are_skipped_and_counted():
    """Bytes garbled in the middle of the stream: the packets they hit are counted and skipped; the frames after
    them come, to the end."""
    with TcpServer([(garble(ts_chunks(24, FPS), 12), "close")]) as server, live(server.url) as source:
        frames, reason = drain(source)
        assert source.stats()["corrupt_packets"] >= 1
    numbers = [frame_number(f.pixels) for f in frames]
    assert reason == "end of stream" and numbers[-1] >= 21 and numbers == sorted(set(numbers))
    assert [f.time for f in frames] == sorted({f.time for f in frames})


def test_a_packet_the_decoder_refuses_is_skipped_and_counted(monkeypatch):
    """The decoder raises an FFmpeg error on the 6th and 7th packets (injected): both are counted and skipped, and
    the frames after them come, to the end."""
    decode, packets = av.packet.Packet.decode, []

    def refusing(packet):
        packets.append(packet.pts)
        if len(packets) in (6, 7):
            raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")
        return decode(packet)

    monkeypatch.setattr(av.packet.Packet, "decode", refusing)
    with TcpServer([(ts_chunks(24, FPS), "close")]) as server, live(server.url) as source:
        frames, reason = drain(source)
        assert source.stats()["corrupt_packets"] == 2 and source.stats()["decoded"] == 22
    numbers = [frame_number(f.pixels) for f in frames]
    assert reason == "end of stream" and numbers[-1] == 22 and numbers == sorted(set(numbers))


def test_declared_frame_sizes_are_bounded_as_for_files(monkeypatch):
    monkeypatch.setattr(video, "MAX_SIDE", WIDTH - 1)
    with TcpServer([(ts_chunks(8, FPS), "close")]) as server:
        with pytest.raises(ValueError, match=rf"^video: {server.url} declares 64 x 48 px frames; the reader decodes "
                                             r"at most 63 px a side"):
            live(server.url)


# ---- refusals ------------------------------------------------------------------------------------------------------
@pytest.fixture
def nothing_opens(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a refused source reached av.open")

    monkeypatch.setattr(av, "open", refuse)


@pytest.mark.parametrize("spec", ["ftp://x/y.ts", "file:///etc/hostname", "clip.mp4", "/tmp", "tcp://", "tcp:x",
                                  "TCP://127.0.0.1:9", "http://[::1", "tcp://a b:9", "tcp://x\nsecond line", "", 5])
def test_an_unlisted_source_is_refused_in_one_line(spec, nothing_opens):
    message = f"live: --live expects a URL (rtsp, rtmp, srt, udp, tcp, http, https), /dev/videoN or -, got {spec!r}"
    for refused in (lambda: check_live_source(spec), lambda: open_source(spec, live=True, fps=1)):
        with pytest.raises(ValueError) as error:
            refused()
        assert str(error.value) == message and "\n" not in message


def test_a_missing_device_is_refused(nothing_opens):
    with pytest.raises(ValueError, match=r"^live: --live /dev/video99: no such capture device \(No such file"):
        open_source("/dev/video99", live=True, fps=1)
    assert check_live_source("-") == "pipe" and check_live_source("rtsp://cam.local/1") == "url"


@pytest.mark.parametrize("kwargs,message", [
    (dict(live=True, realtime=True), "realtime: plays a file at its own speed"),
    (dict(live=True, reconnect=-1), "reconnect: expected a non-negative int, got -1"),
    (dict(live=True, reconnect=True), "reconnect: expected a non-negative int, got True"),
    (dict(live=True, fps=0), "fps: expected a positive finite number, got 0"),
    (dict(live=True, open_timeout=0), "open_timeout: expected a positive finite number, got 0"),
    (dict(live=True, stall_timeout=float("inf")), "stall_timeout: expected a positive finite number, got inf"),
    (dict(live=False, reconnect=1), "reconnect: only a network source (--live URL) is reopened, not a file"),
])
def test_bad_arguments_are_named_before_anything_opens(kwargs, message, nothing_opens):
    with pytest.raises(ValueError) as error:
        open_source("tcp://127.0.0.1:9", **{"fps": 1, **kwargs})
    assert str(error.value).startswith(message)


def test_reconnect_is_for_urls_only(nothing_opens):
    with pytest.raises(ValueError, match=r"^reconnect: only a network source \(--live URL\) is reopened, not '-'$"):
        open_source("-", live=True, fps=1, reconnect=1)


@pytest.mark.parametrize("server", ["none", "silent"])
def test_a_source_that_does_not_open_in_time_is_one_line(server):
    """A closed port is refused at once; a server that accepts and sends nothing, after --open-timeout."""
    silent = TcpServer([([], "stall")])
    url = silent.url if server == "silent" else f"tcp://127.0.0.1:{free_port()}"
    why = "did not open within --open-timeout 1 s" if server == "silent" else "Connection refused"
    start = time.monotonic()
    with silent, pytest.raises(ValueError) as error:
        live(url, open_timeout=1)
    assert str(error.value) == f"live: cannot open --live '{url}': {why}" and time.monotonic() - start < 10


@pytest.mark.parametrize("scheme", ["rtsp", "rtmp", "https"])
def test_each_schemes_protocols_reach_its_transport(scheme):
    """A protocol missing from protocol_whitelist reads "Invalid argument" before any connection; these schemes get
    as far as connecting (to a closed port)."""
    url = f"{scheme}://127.0.0.1:{free_port()}/live"
    with pytest.raises(ValueError, match=rf"^live: cannot open --live '{url}': Connection refused$"):
        live(url, open_timeout=2)


# ---- close ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tcp", "pipe"])
def test_close_while_a_read_blocks(kind, request):
    """The source sends 8 frames and then nothing (stall timeout 30 s): close() returns within 2 s, the frames not
    taken are dropped and get() says the source is closed; the reader thread ends once its read returns (a pipe's at
    once, a socket's when the server closes it)."""
    chunks = ts_chunks(24, FPS)[:8]
    if kind == "pipe":
        server, spec = PipeWriter(chunks, request.getfixturevalue("stdin_pipe"), "stall"), "-"
    else:
        server = TcpServer([(chunks, "stall")])
        spec = server.url
    before = set(threading.enumerate())
    with server:
        source = live(spec, stall_timeout=30)
        readers = set(threading.enumerate()) - before - {server.thread}
        assert wait_until(lambda: source.stats()["sampled"] == 2, 10)  # all the muxer and demuxer let out
        time.sleep(0.5)  # the reader now waits in a read
        assert source.get(timeout=1) is not None
        start = time.monotonic()
        source.close()
        assert time.monotonic() - start < 2
        with pytest.raises(SourceEnded, match="^closed$"):
            source.get(timeout=1)
        source.close()
        if kind == "pipe":
            assert wait_until(lambda: not any(t.is_alive() for t in readers), 2)
    assert wait_until(lambda: not any(t.is_alive() for t in readers), 5)

