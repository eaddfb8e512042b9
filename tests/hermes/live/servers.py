"""Loopback sources of live video for test_sources.py: MPEG-TS of flat grey frames muxed by PyAV and served over TCP,
UDP or HTTP on 127.0.0.1 by a daemon thread that the test starts and stops (each server is a context manager), with
the faults a live source has: a disconnect, a reset, a stall, a second connection (garbled bytes: `garble`).

Frame i is flat grey at `level(i)`, so the frame a source delivered can be read back from its pixels
(`frame_number`) despite lossy coding; timestamps count from 0 in each stream `ts_chunks` makes, unless told not to.
"""
from __future__ import annotations

import fractions
import http.server
import io
import socket
import struct
import threading
import time

import av
import numpy as np

HEIGHT, WIDTH = 48, 64
STEP = 4  # grey levels from one frame to the next: frames 0..55 fit in 16..236
JOIN = 5.0  # s a stopping server's thread may take
DATAGRAM = 7 * 188  # bytes: seven TS packets, what an MPEG-TS sender puts in one UDP datagram


def level(index: int) -> int:
    """The grey level of frame `index` (0 <= index < 56)."""
    return 16 + STEP * index


def frame_number(pixels: np.ndarray) -> int:
    """The frame index a uint8 [H, W, 3] frame shows (inverse of `level`, from its median)."""
    return round((float(np.median(pixels)) - 16) / STEP)


def ts_chunks(count: int, fps: int, first: int = 0, start: int = 0) -> list[bytes]:
    """MPEG-TS (intra-coded MPEG-2 video, HEIGHT x WIDTH) of `count` frames, frame k showing level(first + k) with
    the timestamp (start + k) / fps seconds: the bytes the muxer wrote after each frame, the last item also holding
    what the flush wrote."""
    out = io.BytesIO()
    chunks = []
    with av.open(out, "w", format="mpegts") as container:
        stream = container.add_stream("mpeg2video", rate=fps)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = WIDTH, HEIGHT, "yuv420p", 1
        for k in range(count):
            frame = av.VideoFrame.from_ndarray(np.full((HEIGHT, WIDTH, 3), level(first + k), np.uint8), "rgb24")
            frame.pts, frame.time_base = start + k, fractions.Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
            chunks.append(out.getvalue())
            out.seek(0), out.truncate()
        for packet in stream.encode():
            container.mux(packet)
    chunks[-1] += out.getvalue()
    return chunks


def garble(chunks: list[bytes], at: int, length: int = 2 * 188, seed: int = 0) -> list[bytes]:
    """`chunks` with `length` random bytes in place of chunk `at`'s middle bytes (TS headers and frame data)."""
    data = bytearray(chunks[at])
    middle = len(data) // 2 - length // 2
    data[middle:middle + length] = np.random.default_rng(seed).bytes(length)
    return [*chunks[:at], bytes(data), *chunks[at + 1:]]


class _Server:
    """A daemon thread running `_serve` until `stop()`: entering starts it, leaving stops and joins it."""

    def __init__(self):
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(JOIN)
        assert not self.thread.is_alive(), "a test server did not stop"


class TcpServer(_Server):
    """Serves one connection per item of `connections` = [(chunks, ending), ...], in order: sends the chunks
    (`pace` s apart), then ends it: "close" (a clean end), "reset" (an abortive close: RST), or "stall" (sends
    nothing more and keeps it open until stopped, or `hold` s at most: a reader without a timeout cannot hang a
    test). Then the listening socket closes: later connects are refused. `accepted` counts the connections made."""

    def __init__(self, connections: list[tuple[list[bytes], str]], pace: float = 0.0, hold: float = 20.0):
        super().__init__()
        self.connections, self.pace, self.hold, self.accepted = connections, pace, hold, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        with self.listener:
            for chunks, ending in self.connections:
                peer = self._accept()
                if peer is None:
                    return
                with peer:
                    self.accepted += 1
                    self._send(peer, chunks, ending)

    def _accept(self) -> socket.socket | None:
        while not self.stopping.is_set():
            try:
                return self.listener.accept()[0]
            except TimeoutError:
                continue
        return None

    def _send(self, peer: socket.socket, chunks: list[bytes], ending: str) -> None:
        try:
            for chunk in chunks:
                peer.sendall(chunk)
                if self.stopping.wait(self.pace):
                    return
        except OSError:  # the reader went away (closed): nothing left to serve it
            return
        if ending == "stall":
            self.stopping.wait(self.hold)
        elif ending == "reset":
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # on, 0 s: close sends RST
        else:
            peer.shutdown(socket.SHUT_RDWR)


def udp_bound(port: int) -> bool:
    """Whether a socket on this machine listens on UDP `port` (Linux's /proc/net/udp; asking by binding the port
    would race with the reader binding it)."""
    with open("/proc/net/udp") as table:
        return any(line.split()[1].endswith(f":{port:04X}") for line in list(table)[1:])


class UdpSender(_Server):
    """Sends `chunks` to 127.0.0.1:`port` in DATAGRAM-byte datagrams, `pace` s apart, once a reader has bound the
    port (so it gets the stream from its start); then sends nothing (a UDP stream has no end: it stalls)."""

    def __init__(self, chunks: list[bytes], port: int, pace: float = 0.001):
        super().__init__()
        self.data, self.port, self.pace = b"".join(chunks), port, pace

    def _serve(self) -> None:
        while not udp_bound(self.port):
            if self.stopping.wait(0.02):
                return
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for start in range(0, len(self.data), DATAGRAM):
                sender.sendto(self.data[start:start + DATAGRAM], ("127.0.0.1", self.port))
                if self.stopping.wait(self.pace):
                    return


class PipeWriter(_Server):
    """Writes `chunks` into the pipe whose write end is the file descriptor `fd`, then closes it ("close": the end
    of the stream) or keeps it open without writing more until stopped ("stall")."""

    def __init__(self, chunks: list[bytes], fd: int, ending: str = "close"):
        super().__init__()
        self.chunks, self.fd, self.ending = chunks, fd, ending

    def _serve(self) -> None:
        with open(self.fd, "wb", buffering=0) as pipe:
            try:
                for chunk in self.chunks:
                    pipe.write(chunk)
            except BrokenPipeError:  # the reader closed its end
                return
            if self.ending == "stall":
                self.stopping.wait()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port nobody listens on (bound then released: a test binds it again at once)."""
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class HttpServer(_Server):
    """Serves `pages` = {path: bytes} over HTTP/1.1 on 127.0.0.1 (404 for any other path); `requested` lists the
    paths asked for."""

    def __init__(self, pages: dict[str, bytes]):
        super().__init__()
        self.requested: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requested.append(self.path)
                body = pages.get(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):  # quiet: the test reads `requested`
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _serve(self) -> None:
        self.httpd.serve_forever(poll_interval=0.05)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        super().stop()


def wait_until(condition, timeout: float) -> bool:
    """Poll `condition()` every 10 ms for up to `timeout` s; its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()
